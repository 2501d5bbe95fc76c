import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from maxlm import mesh as mesh_lib, recipe as recipe_lib, sharding
from maxlm.config import ConfigError, load
from maxlm.state import StateSpec


def _setup(*overrides):
    cfg = load("configs/tiny.yml", list(overrides))
    m = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, 8))
    return cfg, m, sharding.rules(cfg)


def test_rule_table_maps_logical_to_mesh_axes():
    cfg, m, rules = _setup("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    assert sharding.spec(("batch", "length", "vocab"), rules) == P(("data", "fsdp", "expert"), "context", "tensor")
    assert sharding.spec(("layers", "embed", "heads", "head_dim"), rules) == P("stage", ("fsdp", "expert", "context"),
                                                                                "tensor", None)
    # An expert's weights hold `expert` on their experts axis: embed falls back to its second rule.
    assert sharding.spec(("layers", "experts", "embed", "mlp"), rules) == P("stage", "expert", ("fsdp", "context"), "tensor")
    # A norm's scale, one small vector per layer, is whole on every device but for its layer axis.
    assert sharding.param_spec((4, 64), ("layers", "embed"), rules) == P("stage", None)
    assert sharding.param_spec((4, 64, 256), ("layers", "embed", "mlp"), rules) == P("stage", ("fsdp", "expert", "context"),
                                                                                      "tensor")


def test_user_rules_override_the_table():
    cfg, m, rules = _setup("sharding_rules=[[batch, [data, fsdp, expert]], [length, null], [embed, null], "
                           "[vocab, null], [heads, null], [kv_heads, null], [head_dim, null], [mlp, null], [layers, null]]")
    ss = StateSpec(recipe_lib.build(cfg, m), m, rules)
    assert ss.shardings.params["layers"]["wq"].spec == P(None, None, None, None)


@pytest.mark.malformed
def test_unknown_logical_axis_is_an_error():
    _, _, rules = _setup()
    with pytest.raises(ConfigError, match="logical axis `heads` has no entry"):
        sharding.spec(("heads",), tuple(r for r in rules if r[0] != "heads"))


def test_constrain_is_a_noop_without_a_mesh():
    x = jnp.ones((4, 4))
    assert sharding.constrain(x, ("batch", None)) is x


def test_constrain_shards_inside_use():
    cfg, m, rules = _setup("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    f = jax.jit(lambda x: sharding.constrain(x * 2, ("batch", "length", "vocab")))
    with sharding.use(m, rules):
        y = f(jnp.ones((8, 4, 8)))
    assert y.sharding.is_equivalent_to(NamedSharding(m, P(("data", "fsdp", "expert"), "context", "tensor")), 3)
    assert y.addressable_shards[0].data.shape == (2, 4, 4)


def test_state_is_created_sharded_and_optimizer_follows_params():
    cfg, m, rules = _setup("mesh.fsdp=4", "mesh.tensor=2")
    ss = StateSpec(recipe_lib.build(cfg, m), m, rules)
    state = ss.init_fn(0)()
    wq = state.params["layers"]["wq"]
    assert wq.sharding.spec == P("stage", ("fsdp", "expert", "context"), "tensor", None)
    # Each device holds 1/8 of wq: created in place, not gathered to one device first.
    assert wq.addressable_shards[0].data.shape == (4, 64, 4, 32)
    adam = state.opt_state[1][0]
    for moment in (adam.mu, adam.nu):
        assert jax.tree.map(lambda a: a.sharding, moment) == jax.tree.map(lambda a: a.sharding, state.params)
    for leaf in jax.tree.leaves(state):
        assert len(leaf.sharding.device_set) == 8, "a state leaf lives on a subset of devices"


def test_init_values_do_not_depend_on_the_mesh():
    a = _setup("mesh.fsdp=8")
    b = _setup("mesh.data=2", "mesh.fsdp=1", "mesh.tensor=4")
    pa = jax.device_get(StateSpec(recipe_lib.build(*a[:2]), *a[1:]).init_fn(0)().params)
    pb = jax.device_get(StateSpec(recipe_lib.build(*b[:2]), *b[1:]).init_fn(0)().params)
    jax.tree.map(np.testing.assert_array_equal, pa, pb)
