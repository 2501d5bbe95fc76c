"""The train state's shapes and shardings, derived from the model's param specs without allocating."""

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from maxlm import models, pipeline, sharding, transforms
from maxlm.models import params as P_
from maxlm.optim import optimizer
from maxlm.step import BATCH_KEYS, TrainState
from maxlm.transforms import Extra


class StateSpec:
    """Everything the trainer needs to build, compile against and shard the state for one mesh."""

    def __init__(self, cfg, mesh, rule_table):
        self.mesh, self.rule_table = mesh, rule_table
        # The layer stacks' storage order (stages, chunks per stage): natural unless circular (maxlm.pipeline).
        self.order = (mesh.shape.get("stage", 1), cfg.pipeline_repeats)
        self._to_natural = None
        self.base_specs = models.get(cfg.model.family).param_specs(cfg.model)
        self.transforms = transforms.build(cfg, self.base_specs)
        self.extra_specs = transforms.extras(self.transforms)
        self.specs = transforms.trained_specs(self.transforms, self.base_specs)  # LoRA: only the adapters
        self.n_params = P_.count(self.base_specs)
        self.n_trained = P_.count(self.specs)
        self.tx = optimizer(cfg, self.specs)
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
        self.saved = self.abstract.replace(extras={k: v for k, v in self.abstract.extras.items() if self.extra_specs[k].saved})
        self.batch_sharding = sharding.named(mesh, ("batch", "length"), rule_table)
        B, L = cfg.global_batch_size, cfg.seq_len
        self.abstract_batch = {k: jax.ShapeDtypeStruct((B, L), jnp.int32, sharding=self.batch_sharding)
                               for k in BATCH_KEYS}

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
        """model_params in natural layer order, for what runs the model outside the pipeline's schedule
        (generation, the lm-eval harness). Under a circular pipeline that moves the weights: a KV-cache
        decode over stages gathers every layer to every stage anyway."""
        params = self.model_params(state)
        if self.order[1] == 1:
            return params
        if self._to_natural is None:  # compiled once: the harness asks every eval.harness.every steps
            self._to_natural = jax.jit(lambda p: pipeline.reorder(p, self.order, (self.order[0], 1)),
                                       out_shardings=self.model_params(self.shardings))
        return self._to_natural(params)

    def to_save(self, state: TrainState) -> TrainState:
        """The part of the state a checkpoint holds: without the extras every start rebuilds."""
        return state.replace(extras={k: v for k, v in state.extras.items() if self.extra_specs[k].saved})

    def saved_under(self, saved_cfg):
        """What a checkpoint written under `saved_cfg` holds (the transforms it ran may differ from this
        run's: FP8 or the router bias switched on or off at a resume), placed as this run would place it."""
        extras = {k: e for k, e in transforms.extras(transforms.build(saved_cfg, self.base_specs)).items() if e.saved}
        return self.saved.replace(extras={k: self._extra_abstract(e) for k, e in extras.items()})

    def resumed(self, state: TrainState, saved_cfg) -> tuple[TrainState, list[str]]:
        """A state restored from a checkpoint written under `saved_cfg`, made this run's: an extra the
        checkpoint lacks starts fresh, one this run does not keep is dropped; each transform says so."""
        was = {t.name: t for t in transforms.build(saved_cfg, self.base_specs)}
        now = {t.name: t for t in self.transforms}
        notes = [t.resumed(on=True) for n, t in now.items() if n not in was] + \
                [t.resumed(on=False) for n, t in was.items() if n not in now]
        fresh = [k for k, e in self.extra_specs.items() if e.saved and k not in state.extras]
        extras = {k: v for k, v in state.extras.items() if k in self.extra_specs}
        if fresh:
            extras.update(jax.jit(lambda: {k: P_.init(self.extra_specs[k].specs, jax.random.key(0)) for k in fresh},
                                  out_shardings={k: self.shardings.extras[k] for k in fresh})())
        return state.replace(extras=extras), [n for n in notes if n]

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
            base = pipeline.reorder(base, (self.order[0], 1), self.order)
            return {k: self._rebuild(self.extra_specs[k], base) for k in names}
        return jax.jit(rebuilt, out_shardings={k: self.shardings.extras[k] for k in names})

    @staticmethod
    def _rebuild(e: Extra, base):
        return jax.tree.map(lambda x, d: x.astype(d), base, e.dtypes)

    def _state(self, key, base) -> TrainState:
        """`base` (the model's params, natural order) laid out in storage order, with everything drawn
        from `key` around it."""
        params = base = pipeline.reorder(base, (self.order[0], 1), self.order)
        if self.specs is not self.base_specs:  # the adapters, from a key of their own
            params = pipeline.reorder(P_.init(self.specs, jax.random.fold_in(key, 1 << 29)), (self.order[0], 1), self.order)
        extras = {k: P_.init(e.specs, key) if e.saved else self._rebuild(e, base) for k, e in self.extra_specs.items()}
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params),
                          rng=jax.random.key_data(jax.random.fold_in(key, 1 << 30)), extras=extras)


def _placed(abstract, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
