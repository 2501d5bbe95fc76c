"""MoE dispatch (maxlm/layers/dispatch.py) at the layer: dropless sorted dispatch equals dense dispatch,
expert parallelism equals one device on any mesh, capacity drops exactly what it should, and the
compiled program really moves tokens (all-to-all) and does k/E of dense dispatch's expert FLOPs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import mesh as mesh_lib, models, sharding
from maxlm.config import ConfigError
from maxlm.config import load
from maxlm.layers import dispatch, moe
from maxlm.models import params as P_

MOE = ["model.family=mixtral", "model.d_model=32", "model.d_ff=48", "model.n_layers=1"]


def layer(E=8, K=2, extra=(), seed=0):
    """One MoE layer's model config and float32 params (the layers axis stripped)."""
    cfg = load("configs/tiny.yml", MOE + [f"model.n_experts={E}", f"model.experts_per_token={K}", *extra])
    specs = jax.tree.map(lambda s: s._replace(shape=s.shape[1:], axes=s.axes[1:]),
                         models.get("mixtral").param_specs(cfg.model)["layers"], is_leaf=P_.is_param)
    specs = {k: v for k, v in specs.items() if k not in ("wq", "wk", "wv", "wo", "attn_norm", "mlp_norm")}
    return cfg, specs, P_.init(specs, jax.random.key(seed))


def inputs(B=4, L=16, D=32, seed=1):
    x = jax.random.normal(jax.random.key(seed), (B, L, D), jnp.float32)
    valid = np.ones((B, L), bool)
    valid[1, 11:] = False  # right padding: its tokens are not dispatched
    return x, jnp.asarray(valid)


def loss(fn, valid):
    # sin: a gradient that depends on each output; only valid tokens count, as in training.
    return lambda p, x: jnp.sum(jnp.sin(fn(p, x)) * valid[..., None])


def assert_close(a, b, tol=1e-5):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        scale = max(float(np.abs(y).max()), 1e-30)
        assert float(np.abs(np.asarray(x) - np.asarray(y)).max()) <= tol * scale, jax.tree_util.keystr(path)


@pytest.mark.parametrize("extra", [
    [],                                                    # Mixtral: softmax, renormalised top-k
    ["model.router_renorm=false"],                         # Qwen3-MoE with norm_topk_prob false
    ["model.router_score=sigmoid", "model.shared_experts=2"],  # DeepSeek-V3-style scores and shared experts
])
@pytest.mark.parametrize("E, K", [pytest.param(8, 2, marks=pytest.mark.slow), (16, 4)])
def test_dropless_equals_dense_dispatch(E, K, extra):
    """Outputs and gradients (params and input) within 1e-5 of dense dispatch, float32. The router is
    rigged so that experts 0 and 1 tie on every token (top_k must break the tie the same way in both),
    and a selection bias makes most tokens choose expert 2: many rows in one group, others nearly empty."""
    cfg, _, p = layer(E, K, extra)
    p["router"] = p["router"].at[:, 1].set(p["router"][:, 0])
    p["router_bias"] = jnp.zeros(E).at[2].set(0.05)
    x, valid = inputs()
    m = cfg.model
    sparse = loss(lambda p, x: moe.moe(x, p, m, valid)[0], valid)
    dense = loss(lambda p, x: moe.dense_reference(x, p, m), valid)
    _, _, idx_BLK, _ = moe.route(x, p["router"], m, p["router_bias"])
    assert int(jnp.sum(idx_BLK == 2)) > x.shape[0] * x.shape[1] // 2  # the skew is there
    assert_close(jax.jit(sparse)(p, x), jax.jit(dense)(p, x))
    assert_close(jax.jit(jax.grad(sparse, argnums=(0, 1)))(p, x), jax.jit(jax.grad(dense, argnums=(0, 1)))(p, x))


def test_plan_sorts_by_expert_in_padded_blocks():
    e_A = jnp.array([3, 0, 3, 1, 4, 3, 0], jnp.int32)  # 4 = not computed (n_experts)
    pl = dispatch.plan(e_A, 4, block=2)
    assert pl.groups_E.tolist() == [2, 2, 0, 4]  # counts 2, 1, 0, 3 padded to multiples of 2
    assert pl.rows == 7 + 4 * 1 + 1  # A + E * (block - 1), rounded up to a block
    dest = np.asarray(pl.dest_A)
    assert dest[4] == pl.rows  # the uncomputed one goes nowhere
    assert dest[[1, 6, 3, 0, 2, 5]].tolist() == [0, 1, 2, 4, 5, 6]  # by expert, in order within one
    assert np.asarray(pl.block_N)[:4].tolist() == [0, 1, 3, 3]


def reference_keep(e_BLK, valid_BL, C):
    """Capacity by hand: slot-major, then position; padding takes no room."""
    B, L, K = e_BLK.shape
    keep = np.zeros((B, L, K), bool)
    for b in range(B):
        used = {}
        for k in range(K):
            for i in range(L):
                e = int(e_BLK[b, i, k])
                if valid_BL[b, i] and used.get(e, 0) < C:
                    keep[b, i, k], used[e] = True, used.get(e, 0) + 1
    return keep


def test_capacity_drops_exactly_and_counts_them():
    # A constructed routing: in row 0 every token's first choice is expert 0, so with capacity 3 its
    # first 3 tokens keep it and 5 are dropped; second choices (slot 1) queue behind all first choices.
    e_BLK = np.stack([np.stack([np.zeros(8), np.arange(8) % 2 + 1], -1),
                      np.stack([np.arange(8) % 4, (np.arange(8) + 1) % 4], -1)]).astype(np.int32)
    valid = np.ones((2, 8), bool)
    valid[1, 6:] = False
    keep = np.asarray(dispatch.capacity_keep(jnp.asarray(e_BLK), jnp.asarray(valid), 4, 3))
    np.testing.assert_array_equal(keep, reference_keep(e_BLK, valid, 3))
    assert (~keep[0, :, 0]).sum() == 5 and keep[0, :3, 0].all()

    # Through the layer: capacity_factor 0.5 of E=4, K=2, L=16 is 4 per expert per sequence. The drop
    # count is exactly the hand count, and dropped assignments add nothing to the output.
    cfg, _, p = layer(4, 2, ["model.capacity_factor=0.5"])
    x, valid = inputs(L=16)
    m = cfg.model
    assert moe.capacity(m, 16) == 4
    y, stats = moe.moe(x, p, m, valid)
    _, _, idx, w = moe.route(x, p["router"], m)
    want = reference_keep(np.asarray(idx), np.asarray(valid), 4)
    assert float(stats["dropped"]) == (np.asarray(valid)[..., None] & ~want).sum() > 0
    mask = jnp.asarray(want, jnp.float32)
    zeroed = {**p}
    expected = sum(jnp.einsum("bl,bld->bld", w[..., k] * mask[..., k], expert_out(x, zeroed, idx[..., k]))
                   for k in range(2))
    np.testing.assert_allclose(np.asarray(y)[np.asarray(valid)], np.asarray(expected)[np.asarray(valid)], atol=1e-6)


def expert_out(x_BLD, p, e_BL):
    """Each token through expert e_BL alone (a reference for the capacity test)."""
    g = jnp.einsum("bld,bldf->blf", x_BLD, p["w_gate"][e_BL])
    u = jnp.einsum("bld,bldf->blf", x_BLD, p["w_up"][e_BL])
    return jnp.einsum("blf,blfd->bld", jax.nn.silu(g) * u, p["w_down"][e_BL])


def on_mesh(mesh_overrides, extra=(), E=8, K=2, B=8, L=16):
    """(value and gradients, compiled fwd+bwd) of the layer on an 8-device mesh."""
    cfg, specs, p = layer(E, K, [*extra, *mesh_overrides])
    x, _ = inputs(B=B, L=L)
    valid = jnp.ones((B, L), bool).at[1, 11:].set(False)
    m, rules = cfg.model, sharding.rules(cfg)
    mesh = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, 8), jax.devices())
    f = jax.value_and_grad(loss(lambda p, x: moe.moe(x, p, m, valid)[0], valid), argnums=(0, 1))
    with sharding.use(mesh, rules):
        p = jax.device_put(p, sharding.param_shardings(specs, mesh, rules))
        x = jax.device_put(x, sharding.named(mesh, ("batch", "length", None), rules))
        compiled = jax.jit(f).lower(p, x).compile()
        return jax.device_get(compiled(p, x)), compiled


@pytest.fixture(scope="module")
def one_device():
    cfg, _, p = layer()
    x, _ = inputs(B=8)
    valid = jnp.ones((8, 16), bool).at[1, 11:].set(False)
    return jax.device_get(jax.jit(jax.value_and_grad(
        loss(lambda p, x: moe.moe(x, p, cfg.model, valid)[0], valid), argnums=(0, 1)))(p, x))


@pytest.mark.parametrize("mesh", [
    pytest.param(["mesh.fsdp=8"], marks=pytest.mark.slow),
    ["mesh.fsdp=4", "mesh.expert=2"],
    pytest.param(["mesh.fsdp=2", "mesh.expert=4"], marks=pytest.mark.slow),
    ["mesh.fsdp=1", "mesh.expert=8"],
    ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"],
])
def test_expert_parallel_equals_one_device(one_device, mesh):
    """The layer's value and gradients on expert = 1, 2, 4, 8 (and expert x fsdp x tensor, the experts'
    hidden units split) equal one device's, float32, 1e-5."""
    got, _ = on_mesh(mesh)
    np.testing.assert_allclose(got[0], one_device[0], rtol=1e-5)
    assert_close(got[1], one_device[1])


def expert_flops(compiled) -> float:
    return compiled.cost_analysis()["flops"]


def test_the_work_moves_and_scales_with_k():
    """Equal values could come from GSPMD gathering everything, so the compiled program is checked.
    With experts split 4 ways (x fsdp 2) and a capacity, each device exchanges rows by all-to-all over the
    expert axis alone and does about k/E of dense dispatch's FLOPs (E=16, k=2: 1/8; capacity 1.25 and
    the router's own work on top). Dropless, the exchange buffers are sized for the worst case (every
    assignment to one device), and on XLA:CPU the blocked matmul computes the whole buffer: n_shards x
    k/E = 1/2."""
    E, K = 16, 2
    cfg, specs, p = layer(E, K, ["mesh.fsdp=2", "mesh.expert=4"])
    B, L = 8, 64
    x = jax.random.normal(jax.random.key(1), (B, L, 32))
    valid = jnp.ones((B, L), bool)
    mesh = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, 8), jax.devices())
    rules = sharding.rules(cfg)

    def compiled(fn, extra=()):
        m = load("configs/tiny.yml", MOE + [f"model.n_experts={E}", f"model.experts_per_token={K}", *extra]).model
        f = jax.value_and_grad(loss(lambda p, x: fn(x, p, m), valid), argnums=(0, 1))
        with sharding.use(mesh, rules):
            pp = jax.device_put(p, sharding.param_shardings(specs, mesh, rules))
            xx = jax.device_put(x, sharding.named(mesh, ("batch", "length", None), rules))
            return jax.jit(f).lower(pp, xx).compile()

    sparse = lambda x, p, m: moe.moe(x, p, m, valid)[0]
    dense = expert_flops(compiled(moe.dense_reference))
    capped = compiled(sparse, ["model.capacity_factor=1.25"])
    hlo = capped.as_text()
    groups = [line for line in hlo.splitlines() if " all-to-all(" in line]
    assert len(groups) >= 4 and all(g.split(" metadata=")[0].endswith("{'expert'},") for g in groups), groups[:1]
    assert 0.10 < expert_flops(capped) / dense < 0.25, expert_flops(capped) / dense
    dropless = expert_flops(compiled(sparse)) / dense
    assert 0.35 < dropless < 0.75, dropless  # 4 x 2/16 = 1/2: the worst case's buffers

    # One device, dropless: k/E, plus block padding and the router.
    one = lambda fn: jax.jit(jax.value_and_grad(loss(lambda p, x: fn(x, p, cfg.model), valid), argnums=(0, 1))) \
        .lower(p, x).compile()
    assert 0.12 < expert_flops(one(sparse)) / expert_flops(one(moe.dense_reference)) < 0.2


def test_experts_split_where_tokens_are_not_is_refused():
    """Expert parallelism needs the tokens split over the experts' mesh axes; a rule table that keeps
    them whole there is refused in one line, at trace time, before anything runs."""
    rules = ('sharding_rules=[[batch, [data, fsdp]], [length, null], [embed, fsdp], [vocab, tensor], [heads, tensor], '
             '[kv_heads, tensor], [head_dim, null], [mlp, tensor], [layers, null], [experts, expert]]')
    with pytest.raises(ConfigError, match="add them to the `batch` rule") as e:
        on_mesh(["mesh.fsdp=4", "mesh.expert=2", rules])
    assert "\n" not in str(e.value)
