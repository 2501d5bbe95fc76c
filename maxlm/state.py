"""The train state's shapes and shardings, derived from the model's param specs without allocating."""

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from maxlm import fp8, lora, models, sharding
from maxlm.models import params as P_
from maxlm.step import BATCH_KEYS, TrainState, optimizer


class StateSpec:
    """Everything the trainer needs to build, compile against and shard the state for one mesh."""

    def __init__(self, cfg, mesh, rule_table):
        self.base_specs = models.get(cfg.model.family).param_specs(cfg.model)
        # The trained params: the model's, or under LoRA only the adapters (the base is then `frozen`).
        self.specs = lora.specs(self.base_specs, cfg.lora) if cfg.lora.rank else self.base_specs
        self.n_params = P_.count(self.base_specs)
        self.n_trained = P_.count(self.specs)
        self.lora_scale = lora.scale_of(cfg.lora) if cfg.lora.rank else None
        self.has_frozen = bool(cfg.lora.rank) or cfg.objective == "dpo"
        self.tx = optimizer(cfg, self.specs)
        param_sh = sharding.param_shardings(self.specs, mesh, rule_table)
        replicated = NamedSharding(mesh, P())
        abstract_params = P_.abstract(self.specs)
        abstract_opt = jax.eval_shape(self.tx.init, abstract_params)
        # Optimizer moments shard exactly like the params they track; counters are replicated.
        opt_sh = optax.tree_utils.tree_map_params(self.tx, lambda _, s: s, abstract_opt, param_sh,
                                                  transform_non_params=lambda _: replicated)
        m = cfg.model
        # Loss-free balancing's bias: tiny, replicated, and absent (None) unless the run uses it.
        self.bias_shape = (m.n_layers, m.n_experts) if m.n_experts and m.router_bias_rate else None
        bias_sh = replicated if self.bias_shape else None
        # Frozen weights: matrices and tables in `dtype` (they get no update, so float32 buys nothing), norm
        # gains and biases in float32 as the trained model has them.
        self.frozen_dtypes = jax.tree.map(lambda s: jnp.dtype(cfg.dtype if P_.is_drawn(s) else jnp.float32),
                                          self.base_specs, is_leaf=P_.is_param)
        # The model's float32 params (what init_from loads): the trained params, or LoRA's base.
        self.base_shardings = sharding.param_shardings(self.base_specs, mesh, rule_table)
        frozen_sh = self.base_shardings if self.has_frozen else None
        abstract_frozen = jax.tree.map(lambda a, d: jax.ShapeDtypeStruct(a.shape, d), P_.abstract(self.base_specs),
                                       self.frozen_dtypes) if self.has_frozen else None
        # FP8's scaling state: small, laid out by the same rules (its `layers` axis like the weights'). Its
        # layout is known either way, so a resume can switch quantization on or off (`saved_under`).
        self._fp8_all = fp8.specs(self.base_specs)
        self._fp8_sh = sharding.param_shardings(self._fp8_all, mesh, rule_table)
        self.fp8_specs = self._fp8_all if cfg.quantization == "fp8" else None
        fp8_sh = self._fp8_sh if self.fp8_specs else None
        self.shardings = TrainState(step=replicated, params=param_sh, opt_state=opt_sh, rng=replicated,
                                    router_bias=bias_sh, frozen=frozen_sh, lora_scale=self.lora_scale, fp8=fp8_sh)
        self.abstract = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params, opt_state=abstract_opt,
                       rng=jax.ShapeDtypeStruct((2,), jnp.uint32),
                       router_bias=jax.ShapeDtypeStruct(self.bias_shape, jnp.float32) if self.bias_shape else None,
                       frozen=abstract_frozen, lora_scale=self.lora_scale,
                       fp8=P_.abstract(self.fp8_specs) if self.fp8_specs else None),
            self.shardings)
        # What a checkpoint holds: the state without the frozen weights, which every start rebuilds.
        self.saved = self.abstract.replace(frozen=None)
        self.batch_sharding = sharding.named(mesh, ("batch", "length"), rule_table)
        B, L = cfg.global_batch_size, cfg.seq_len
        self.abstract_batch = {k: jax.ShapeDtypeStruct((B, L), jnp.int32, sharding=self.batch_sharding)
                               for k in BATCH_KEYS}

    def saved_under(self, quantization: str):
        """What a checkpoint written with `quantization` holds (this run's may differ: FP8 switched on or
        off at a resume), placed as this run would place it."""
        if (quantization == "fp8") == (self.fp8_specs is not None):
            return self.saved
        fp8_abs = None
        if quantization == "fp8":
            fp8_abs = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                   P_.abstract(self._fp8_all), self._fp8_sh)
        return self.saved.replace(fp8=fp8_abs)

    def fp8_init_fn(self):
        """A fresh FP8 scaling state (scales 1, empty histories), for a resume that switches FP8 on."""
        return jax.jit(lambda: P_.init(self.fp8_specs, jax.random.key(0)), out_shardings=self._fp8_sh)

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

    def frozen_fn(self, seed: int):
        """For a resume: the frozen weights of `init_fn(seed)` (called without arguments) or of given
        parameters (init_from), exactly as the run started with them."""
        def frozen(params=None):
            return self._frozen(P_.init(self.base_specs, jax.random.key(seed)) if params is None else params)
        return jax.jit(frozen, out_shardings=self.shardings.frozen)

    def _frozen(self, base):
        return jax.tree.map(lambda x, d: x.astype(d), base, self.frozen_dtypes) if self.has_frozen else None

    def _state(self, key, base) -> TrainState:
        bias = jnp.zeros(self.bias_shape, jnp.float32) if self.bias_shape else None
        params = base
        if self.lora_scale is not None:  # the adapters, from a key of their own
            params = P_.init(self.specs, jax.random.fold_in(key, 1 << 29))
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params),
                          rng=jax.random.key_data(jax.random.fold_in(key, 1 << 30)), router_bias=bias,
                          frozen=self._frozen(base), lora_scale=self.lora_scale,
                          fp8=P_.init(self.fp8_specs, key) if self.fp8_specs else None)
