"""The train state's shapes and shardings, derived from the model's param specs without allocating."""

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from maxlm import models, sharding
from maxlm.models import params as P_
from maxlm.step import BATCH_KEYS, TrainState, optimizer


class StateSpec:
    """Everything the trainer needs to build, compile against and shard the state for one mesh."""

    def __init__(self, cfg, mesh, rule_table):
        self.specs = models.get(cfg.model.family).param_specs(cfg.model)
        self.n_params = P_.count(self.specs)
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
        self.shardings = TrainState(step=replicated, params=param_sh, opt_state=opt_sh, rng=replicated,
                                    router_bias=bias_sh)
        self.abstract = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params, opt_state=abstract_opt,
                       rng=jax.ShapeDtypeStruct((2,), jnp.uint32),
                       router_bias=jax.ShapeDtypeStruct(self.bias_shape, jnp.float32) if self.bias_shape else None),
            self.shardings)
        self.batch_sharding = sharding.named(mesh, ("batch", "length"), rule_table)
        B, L = cfg.global_batch_size, cfg.seq_len
        self.abstract_batch = {k: jax.ShapeDtypeStruct((B, L), jnp.int32, sharding=self.batch_sharding)
                               for k in BATCH_KEYS}

    def init_fn(self, seed: int):
        """A jitted init that creates every array directly in its final sharding."""
        def init():
            key = jax.random.key(seed)
            params = P_.init(self.specs, key)
            return self._state(key, params)
        return jax.jit(init, out_shardings=self.shardings)

    def from_params_fn(self, seed: int):
        """A jitted init around given parameters (init_from): fresh optimizer state, no random draw of
        parameters that would be thrown away."""
        def init(params):
            return self._state(jax.random.key(seed), params)
        return jax.jit(init, in_shardings=(self.shardings.params,), out_shardings=self.shardings, donate_argnums=0)

    def _state(self, key, params) -> TrainState:
        bias = jnp.zeros(self.bias_shape, jnp.float32) if self.bias_shape else None
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params),
                          rng=jax.random.key_data(jax.random.fold_in(key, 1 << 30)), router_bias=bias)
