"""The train state, and its shapes and shardings for one mesh, derived from a built recipe's param specs
without allocating."""

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from maxlm import sharding, transforms
from maxlm.models import params as P_
from maxlm.transforms import Extra


@flax.struct.dataclass
class TrainState:
    step: jax.Array       # optimizer steps taken (skipped ones included: they consumed their batch)
    params: Any           # the trained parameters, and nothing else (LoRA: the adapters)
    opt_state: Any
    rng: jax.Array        # raw uint32 key data. A layer that draws random numbers (LoRA dropout) uses
                          # fold_in(rng, step), which resume then reproduces bitwise.
    extras: dict = flax.struct.field(default_factory=dict)  # the transforms' state beside the params, by name
                          # (maxlm.transforms): checkpointed (FP8 scaling, the router bias) or rebuilt at every
                          # start (frozen weights)


class StateSpec:
    """Everything the trainer needs to build, compile against and shard the state for one mesh."""

    def __init__(self, recipe, mesh, rule_table):
        self.recipe, self.mesh, self.rule_table = recipe, mesh, rule_table
        # The layer stacks' storage order: natural unless the schedule is a circular pipeline.
        self.layout = recipe.schedule.layout
        self._to_natural = None
        self.base_specs, self.transforms, self.specs, self.tx = recipe.base_specs, recipe.transforms, recipe.specs, recipe.tx
        self.extra_specs = transforms.extras(self.transforms)
        self.n_params = P_.count(self.base_specs)
        self.n_trained = P_.count(self.specs)
        param_sh = sharding.param_shardings(self.specs, mesh, rule_table)
        replicated = NamedSharding(mesh, P())
        abstract_params = P_.abstract(self.specs)
        abstract_opt = jax.eval_shape(self.tx.init, abstract_params)
        # Optimizer moments shard exactly like the params they track; counters are replicated.
        opt_sh = optax.tree_utils.tree_map_params(self.tx, lambda _, s: s, abstract_opt, param_sh,
                                                  transform_non_params=lambda _: replicated)
        # The model's float32 params (what init_from loads): the trained params, or LoRA's base.
        self.base_shardings = sharding.param_shardings(self.base_specs, mesh, rule_table)
        self.shardings = TrainState(step=replicated, params=param_sh, opt_state=opt_sh, rng=replicated,
                                    extras={k: self._extra_shardings(e) for k, e in self.extra_specs.items()})
        self.abstract = TrainState(
            step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated), params=_placed(abstract_params, param_sh),
            opt_state=_placed(abstract_opt, opt_sh), rng=jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated),
            extras={k: self._extra_abstract(e) for k, e in self.extra_specs.items()})
        # What a checkpoint holds: the state without the extras every start rebuilds.
        self.saved = self.to_save(self.abstract)
        self.abstract_batch = recipe.batch.abstract(mesh, rule_table)  # each field, placed

    def _extra_shardings(self, e: Extra):
        return sharding.param_shardings(e.specs, self.mesh, self.rule_table)

    def _extra_abstract(self, e: Extra):
        abstract = P_.abstract(e.specs)
        if e.dtypes is not None:
            abstract = jax.tree.map(lambda a, d: jax.ShapeDtypeStruct(a.shape, d), abstract, e.dtypes)
        return _placed(abstract, self._extra_shardings(e))

    def model_params(self, state: TrainState):
        """The params the model runs with outside the train step (eval, the sample): the trained params
        with every transform's state attached (FP8 reads its scaling state, no update; LoRA adds no dropout).
        Works on the abstract state and the shardings too."""
        return transforms.attach(self.transforms, state.params, state.extras)

    def natural_params(self, state: TrainState):
        """model_params in natural layer order, for what runs the model outside the schedule (generation,
        the lm-eval harness). Under a circular pipeline that moves the weights: a KV-cache decode over
        stages gathers every layer to every stage anyway."""
        params = self.model_params(state)
        reshard = self.reshard()
        return params if reshard is None else reshard(params)

    def reshard(self):
        """The one compiled program that puts model_params in natural layer order, or None when they are
        stored so (every schedule but the circular pipeline)."""
        if self.layout.natural_order:
            return None
        if self._to_natural is None:  # compiled once: the harness asks every eval.harness.every steps
            self._to_natural = jax.jit(self.layout.natural, out_shardings=self.model_params(self.shardings))
        return self._to_natural

    # ---- what a checkpoint holds ----

    def to_save(self, state: TrainState) -> TrainState:
        """The part of the state a checkpoint holds: without the extras every start rebuilds."""
        return state.replace(extras={k: v for k, v in state.extras.items() if self.extra_specs[k].saved})

    @staticmethod
    def on_disk(state: TrainState) -> dict:
        """A (saved part of a) TrainState, or its abstract form, as a checkpoint stores it: layout 1 keeps
        step, params, opt_state and rng at the top, and beside them each checkpointed extra under its own
        name, with a slot for each of transforms.CHECKPOINT_SLOTS (None when the run does not keep it)."""
        return {"step": state.step, "params": state.params, "opt_state": state.opt_state, "rng": state.rng,
                **dict.fromkeys(transforms.CHECKPOINT_SLOTS), **state.extras}

    @staticmethod
    def from_disk(tree: dict, like: TrainState) -> TrainState:
        core = ("step", "params", "opt_state", "rng")
        return like.replace(**{k: tree[k] for k in core}, extras={k: tree[k] for k in like.extras})

    def save(self, ck, step: int, state: TrainState, data_state: dict, meta: dict) -> float:
        """Start `ck`'s async save of the state after `step` (checkpoint.Checkpointer.save)."""
        return ck.save(step, self.on_disk(self.to_save(state)), data_state, meta)

    def check(self, ck, step: int, like: TrainState | None = None) -> dict:
        """Refuse a checkpoint step that does not hold `like` (default this run's saved state), from its
        metadata alone; return the metadata."""
        return ck.check(step, self.on_disk(self.saved if like is None else like))

    def restore(self, ck, step: int, like: TrainState | None = None) -> tuple:
        """(state, data_state, meta) of a checkpoint step holding `like` (default this run's saved state;
        `saved_under` for another run's), on this run's shardings and in its layout."""
        like = self.saved if like is None else like
        tree, data_state, meta = ck.restore(step, self.on_disk(like))
        return self.layout.move(self.from_disk(tree, like), self.layout.saved(meta["config"])), data_state, meta

    def saved_under(self, saved_transforms) -> TrainState:
        """What a checkpoint written under `saved_transforms` (recipe.saved_transforms: FP8 or the router
        bias may have been switched on or off at a resume) holds, placed as this run would place it."""
        extras = {k: e for k, e in transforms.extras(saved_transforms).items() if e.saved}
        return self.saved.replace(extras={k: self._extra_abstract(e) for k, e in extras.items()})

    def resumed(self, state: TrainState, saved_transforms) -> tuple[TrainState, list[str]]:
        """A state restored from a checkpoint written under `saved_transforms`, made this run's: an extra the
        checkpoint lacks starts fresh, one this run does not keep is dropped; each transform says so."""
        was = {t.name: t for t in saved_transforms}
        now = {t.name: t for t in self.transforms}
        notes = [t.resumed(on=True) for n, t in now.items() if n not in was] + \
                [t.resumed(on=False) for n, t in was.items() if n not in now]
        fresh = [k for k, e in self.extra_specs.items() if e.saved and k not in state.extras]
        extras = {k: v for k, v in state.extras.items() if k in self.extra_specs}
        if fresh:
            extras.update(jax.jit(lambda: {k: P_.init(self.extra_specs[k].specs, jax.random.key(0)) for k in fresh},
                                  out_shardings={k: self.shardings.extras[k] for k in fresh})())
        return state.replace(extras=extras), [n for n in notes if n]

    # ---- a fresh state ----

    def init_fn(self, seed: int):
        """A jitted init that creates every array directly in its final sharding (the model's params drawn
        from `seed`: the base, under LoRA)."""
        def init():
            key = jax.random.key(seed)
            return self._state(key, P_.init(self.base_specs, key))
        return jax.jit(init, out_shardings=self.shardings)

    def from_params_fn(self, seed: int):
        """A jitted init around given parameters (init_from): fresh optimizer state, no random draw of
        parameters that would be thrown away (under LoRA they are the base, and the adapters are drawn)."""
        def init(params):
            return self._state(jax.random.key(seed), params)
        return jax.jit(init, in_shardings=(self.base_shardings,),
                       out_shardings=self.shardings, donate_argnums=0)

    def rebuilt_fn(self, seed: int):
        """For a resume: the extras that are never checkpointed (frozen weights), built from `init_fn(seed)`'s
        parameters (called without arguments) or from given ones (init_from), exactly as the run started."""
        names = [k for k, e in self.extra_specs.items() if not e.saved]

        def rebuilt(params=None):
            base = P_.init(self.base_specs, jax.random.key(seed)) if params is None else params
            base = self.layout.store(base)
            return {k: self._rebuild(self.extra_specs[k], base) for k in names}
        return jax.jit(rebuilt, out_shardings={k: self.shardings.extras[k] for k in names})

    @staticmethod
    def _rebuild(e: Extra, base):
        return jax.tree.map(lambda x, d: x.astype(d), base, e.dtypes)

    def _state(self, key, base) -> TrainState:
        """`base` (the model's params, natural order) laid out in the schedule's layout, with everything
        drawn from `key` around it."""
        params = base = self.layout.store(base)
        if self.specs is not self.base_specs:  # the adapters, from a key of their own
            params = self.layout.store(P_.init(self.specs, jax.random.fold_in(key, 1 << 29)))
        extras = {k: P_.init(e.specs, key) if e.saved else self._rebuild(e, base) for k, e in self.extra_specs.items()}
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params),
                          rng=jax.random.key_data(jax.random.fold_in(key, 1 << 30)), extras=extras)


def _placed(abstract, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
