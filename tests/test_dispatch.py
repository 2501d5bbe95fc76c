"""MoE dispatch (maxlm/layers/dispatch.py) at the layer: dropless sorted dispatch equals dense dispatch,
expert parallelism equals one device on any mesh, capacity drops exactly what it should, and the
compiled program really moves tokens (all-to-all) and does k/E of dense dispatch's expert FLOPs. The
ragged exchange of TPU/GPU runs here through an emulation of ragged_all_to_all, itself checked against
the op's documented semantics."""

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
    # compiled, each as one program: op by op, each op would be compiled on its own
    y, stats = jax.jit(lambda x, p, valid: moe.moe(x, p, m, valid))(x, p, valid)
    _, _, idx, w = jax.jit(lambda x, r: moe.route(x, r, m))(x, p["router"])
    want = reference_keep(np.asarray(idx), np.asarray(valid), 4)
    assert float(stats["dropped"]) == (np.asarray(valid)[..., None] & ~want).sum() > 0
    expected = jax.jit(lambda x, p, idx, w, mask: sum(
        jnp.einsum("bl,bld->bld", w[..., k] * mask[..., k], expert_out(x, p, idx[..., k])) for k in range(2)))(
        x, p, idx, w, jnp.asarray(want, jnp.float32))
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
    pytest.param(["mesh.data=2", "mesh.fsdp=2", "mesh.expert=2"], marks=pytest.mark.slow),
])
def test_expert_parallel_equals_one_device(one_device, mesh):
    """The layer's value and gradients on expert = 1, 2, 4, 8 (and expert x fsdp x tensor, the experts'
    hidden units split; and x data, whose replicas' gradients shard_map sums) equal one device's, float32,
    1e-5: the experts' embed dimension gathered and its gradient reduce-scattered inside the layer
    (dispatch.gather_embed) in float32, model.expert_grad_dtype's default."""
    got, _ = on_mesh(mesh)
    np.testing.assert_allclose(got[0], one_device[0], rtol=1e-5)
    assert_close(got[1], one_device[1])


def test_expert_grads_summed_in_bfloat16_differ_by_its_rounding_only(one_device):
    """model.expert_grad_dtype=bfloat16 on expert=2 x fsdp=4 (float32 compute): the forward, the input's
    and the router's gradients are float32's (1e-5); the experts' weight gradients, each device's share
    rounded to bfloat16 and summed over fsdp in it, differ from one device's by more than float32 could
    (2^-12 of the tensor's largest) and by no more than bfloat16's rounding of the shares and of their sum
    allows (2 x 2^-8 of the largest; measured 2.9e-3 to 3.5e-3)."""
    (val, (g_p, g_x)), _ = on_mesh(["mesh.fsdp=4", "mesh.expert=2"], ["model.expert_grad_dtype=bfloat16"])
    np.testing.assert_allclose(val, one_device[0], rtol=1e-5)
    ref_p, ref_x = one_device[1]
    assert_close(g_x, ref_x)
    assert_close({k: g_p[k] for k in ref_p if k not in dispatch.EMBED_DIM},
                 {k: ref_p[k] for k in ref_p if k not in dispatch.EMBED_DIM})
    for k in dispatch.EMBED_DIM:
        scale = float(np.abs(ref_p[k]).max())
        err = float(np.abs(np.asarray(g_p[k]) - ref_p[k]).max())
        assert 2 ** -12 * scale < err <= 2 * 2 ** -8 * scale, (k, err / scale)


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


@pytest.mark.malformed
def test_experts_split_where_tokens_are_not_is_refused():
    """Expert parallelism needs the tokens split over the experts' mesh axes; a rule table that keeps
    them whole there is refused in one line, at trace time, before anything runs."""
    rules = ('sharding_rules=[[batch, [data, fsdp]], [length, null], [embed, fsdp], [vocab, tensor], [heads, tensor], '
             '[kv_heads, tensor], [head_dim, null], [mlp, tensor], [layers, null], [experts, expert]]')
    with pytest.raises(ConfigError, match="add them to the `batch` rule") as e:
        on_mesh(["mesh.fsdp=4", "mesh.expert=2", rules])
    assert "\n" not in str(e.value)


# --- The exchange: one layout for the padded and the ragged all-to-all -------------------------------

def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """jax.lax.ragged_all_to_all from ops XLA:CPU has (it has no ragged all-to-all): every device's operand
    and slice table gathered, then each receiver takes its slices' rows, as the docstring's pseudocode
    does (slice i = sender s's slice me * per + j; a later slice wins where two overlap). Differentiable
    through all_gather and gathers, so the layer's gradients run through it too."""
    n = jax.lax.axis_size(axis_name)
    per, me = input_offsets.shape[0] // n, jax.lax.axis_index(axis_name)
    assert per * n == input_offsets.shape[0], "the slice count must be divisible by the axis size"
    table = jax.lax.all_gather(jnp.stack([input_offsets, send_sizes, output_offsets]), axis_name)  # [n, 3, N]
    mine = jax.lax.dynamic_slice_in_dim(table, me * per, per, axis=2)  # what each sender sends me
    src_off, dst_off = mine[:, 0].reshape(-1), mine[:, 2].reshape(-1)
    src = jnp.repeat(jnp.arange(n), per)
    row = jnp.arange(output.shape[0])
    in_NR = (row >= dst_off[:, None]) & (row < (dst_off + recv_sizes)[:, None])
    i_R = in_NR.shape[0] - 1 - jnp.argmax(in_NR[::-1], axis=0)  # the last slice covering the row
    got = jax.lax.all_gather(operand, axis_name)[src[i_R], jnp.clip(src_off[i_R] + row - dst_off[i_R], 0,
                                                                    operand.shape[0] - 1)]
    hit = jnp.any(in_NR, axis=0).reshape(-1, *(1,) * (output.ndim - 1))
    return jnp.where(hit, got, output)


def expert_mesh(n: int):
    return mesh_lib.make_mesh({"expert": n}, jax.devices()[:n])


def run_per_device(mesh, fn, *args):
    """fn on each device of the `expert` axis, each taking its row of every arg (stacked over devices)."""
    spec = jax.sharding.PartitionSpec("expert")
    f = jax.shard_map(lambda *a: jax.tree.map(lambda y: y[None], fn(*(x[0] for x in a))), mesh=mesh,
                      in_specs=(spec,) * len(args), out_specs=spec)
    return jax.device_get(jax.jit(f)(*args))


def pseudocode(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    """ragged_all_to_all's docstring, as written, over numpy arrays stacked over devices."""
    n, N = input_offsets.shape
    per, result = N // n, output.copy()
    oo_ = output_offsets.reshape(n, n, per).transpose(1, 0, 2).reshape(n, N)  # all_to_all(output_offsets)
    for r in range(n):
        for i in range(N):
            s, k = i // per, r * per + i % per  # from sender s, its slice k
            sent = operand[s, input_offsets[s, k]:input_offsets[s, k] + send_sizes[s, k]]
            result[r, oo_[r, i]:oo_[r, i] + recv_sizes[r, i]] = sent
    return result


def test_the_emulation_follows_ragged_all_to_all_docs():
    """The emulation that stands in for jax.lax.ragged_all_to_all on CPU gives the docstring's example
    result, and the docstring's pseudocode's on a random case with two slices per device."""
    ex = [np.array(a, np.int32) for a in ([[1, 2, 2], [3, 4, 0]], [[0] * 4] * 2, [[0, 1], [0, 1]], [[1, 2], [1, 1]],
                                          [[0, 0], [1, 2]], [[1, 1], [2, 1]])]
    got = run_per_device(expert_mesh(2), lambda *a: emulated_ragged_all_to_all(*a, axis_name="expert"), *ex)
    np.testing.assert_array_equal(got, [[1, 3, 0, 0], [2, 2, 4, 0]])
    np.testing.assert_array_equal(pseudocode(*ex), got)

    n, per, rows, M = 4, 2, 24, 32
    rng = np.random.default_rng(0)
    send = rng.integers(0, 4, (n, n * per))  # sender s's slice k goes to device k // per
    in_off = np.stack([np.cumsum(send[s]) - send[s] + np.arange(n * per) // 3 for s in range(n)])  # with gaps
    recv = send.reshape(n, n, per).transpose(1, 0, 2).reshape(n, n * per)  # recv[r, s*per+j] = send[s, r*per+j]
    at_dst = np.stack([np.cumsum(recv[r]) - recv[r] + np.arange(n * per) % 2 for r in range(n)])  # gaps too
    out_off = at_dst.reshape(n, n, per).transpose(1, 0, 2).reshape(n, n * per)  # where the sender's slices land
    operand = rng.normal(size=(n, rows, 3)).astype(np.float32)
    output = np.full((n, M, 3), -1.0, np.float32)
    args = [operand, output, *(a.astype(np.int32) for a in (in_off, send, out_off, recv))]
    assert in_off.max() + send.max() <= rows and at_dst.max() + recv.max() <= M
    got = run_per_device(expert_mesh(n), lambda *a: emulated_ragged_all_to_all(*a, axis_name="expert"), *args)
    np.testing.assert_array_equal(got, pseudocode(*args))


def expected_exchange(shard_SA, slot: int, recv_rows: int):
    """By hand: every receiver's buffer of global assignment ids (s * A + a; -1 empty) and the ids each
    sender drops. Padded: each sender's first `slot` rows for r in block s of r's buffer. Ragged: senders'
    rows for r packed in sender order, the first recv_rows kept."""
    n, A = shard_SA.shape
    bufs, dropped = np.full((n, n * slot if slot else recv_rows), -1), set()
    for r in range(n):
        at = 0
        for s in range(n):
            mine = [s * A + a for a in range(A) if shard_SA[s, a] == r]
            keep = mine[:slot] if slot else mine[:max(0, recv_rows - at)]
            start = s * slot if slot else at
            bufs[r, start:start + len(keep)], at = keep, at + len(keep)
            dropped |= set(mine[len(keep):])
    return bufs, dropped


@pytest.mark.parametrize("slot, recv_rows, drops", [(3, 0, True), (12, 0, False), (0, 12, True), (0, 20, True),
                                                    (0, 96, False)])
def test_layout_places_rows_as_the_exchange_does(slot, recv_rows, drops):
    """`dispatch.layout`, the one function that sizes and places both exchanges, on 8 devices with random
    destinations (some none): through the padded all-to-all (slot > 0) each receiver's buffer holds every
    sender's rows in the sender's block, in order; through the ragged one (the emulation) packed by sender,
    the first recv_rows kept. What does not fit is dropped, exactly those, and the sizes and offsets agree
    between sender and receiver as ragged_all_to_all requires."""
    n, A = 8, 12
    shard_SA = np.random.default_rng(1).choice(n + 1, (n, A), p=[0.3] + [0.6 / (n - 1)] * (n - 1) + [0.1])
    ragged = None if slot else emulated_ragged_all_to_all

    def device(shard_A):
        _, count_S = dispatch.rank(shard_A, n)
        lay = dispatch.layout(shard_A, jax.lax.all_gather(count_S, "expert"), jax.lax.axis_index("expert"), slot,
                              recv_rows)
        ids_S = jnp.full((lay.send_rows,), -1).at[lay.slot_A].set(
            jax.lax.axis_index("expert") * A + jnp.arange(A), mode="drop")
        return dispatch._there(ids_S, -1, lay, ("expert",), ragged), tuple(lay)[:-2]  # the arrays

    got, lay = run_per_device(expert_mesh(n), device, jnp.asarray(shard_SA, jnp.int32))
    lay = dispatch.Layout(*lay, None, None)
    want, dropped = expected_exchange(shard_SA, slot, recv_rows)
    np.testing.assert_array_equal(got, want)
    assert set(np.flatnonzero(lay.dropped_A)) == dropped
    assert bool(dropped) == drops  # 12 rows and 96 are the worst cases: 12 assignments, 8 x 12
    np.testing.assert_array_equal(lay.send_sizes_S, lay.recv_sizes_S.T)  # s's size for r is r's from s
    np.testing.assert_array_equal(lay.output_offsets_S, lay.recv_offsets_S.T)
    np.testing.assert_array_equal(lay.input_offsets_S, lay.home_offsets_S.T)
    assert (lay.recv_offsets_S + lay.recv_sizes_S).max() <= (n * slot or recv_rows)


def dense_keeping(x_BLD, p, m, keep_BLK):
    """moe.dense_reference with only the kept assignments combined: the reference when rows are dropped."""
    _, _, idx_BLK, w_BLK = moe.route(x_BLD, p["router"], m)
    comb_BLE = jnp.einsum("blk,blke->ble", w_BLK * keep_BLK, jax.nn.one_hot(idx_BLK, m.n_experts))
    g_BLEF = jnp.einsum("bld,edf->blef", x_BLD, p["w_gate"])
    u_BLEF = jnp.einsum("bld,edf->blef", x_BLD, p["w_up"])
    return jnp.einsum("blef,efd,ble->bld", jax.nn.silu(g_BLEF) * u_BLEF, p["w_down"], comb_BLE)


def ragged_keep(idx_BLK, valid_BL, n_groups: int, n_ep: int, E_loc: int, recv_rows: int) -> np.ndarray:
    """Which assignments the ragged exchange keeps, by hand: the batch is split into n_groups x n_ep
    blocks (expert the innermost batch axis), and in each group every receiver takes its senders' rows in
    sender order, then token and slot order, until recv_rows."""
    B, L, K = idx_BLK.shape
    keep = np.asarray(valid_BL)[..., None].repeat(K, -1)
    blocks = np.arange(B).reshape(n_groups, n_ep, -1)
    for g in range(n_groups):
        used = np.zeros(n_ep, int)
        for s in range(n_ep):
            for b in blocks[g, s]:
                for i in range(L):
                    for k in range(K):
                        r = idx_BLK[b, i, k] // E_loc
                        if keep[b, i, k]:
                            keep[b, i, k], used[r] = used[r] < recv_rows, used[r] + 1
    return keep


@pytest.mark.parametrize("mesh, slack", [
    (["mesh.fsdp=1", "mesh.expert=8"], 0.0),
    (["mesh.fsdp=1", "mesh.expert=8"], 1.5),
    (["mesh.fsdp=1", "mesh.data=2", "mesh.expert=4"], 1.0),
    (["mesh.fsdp=1", "mesh.tensor=2", "mesh.expert=4"], 1.0),
])
def test_ragged_exchange_equals_dense_dispatch_with_its_drops(monkeypatch, mesh, slack):
    """The ragged path run on CPU (the emulation in RAGGED_ALL_TO_ALL), end to end: with the load skewed
    onto expert 2, the layer's value and gradients on the mesh equal dense dispatch's with exactly the
    assignments a full receive buffer drops left out, and the layer's `dropped` counts them. slack 0 (the
    worst case) drops nothing; the others drop, the receive buffer being model.ep_slack x T_loc x k rows."""
    monkeypatch.setitem(dispatch.RAGGED_ALL_TO_ALL, "cpu", emulated_ragged_all_to_all)
    E, K, B, L = 8, 2, 8, 16
    cfg, specs, p = layer(E, K, [*mesh, f"model.ep_slack={slack}"])
    p["router"] = p["router"].at[:, 2].add(0.3)  # with x's mean shifted, most tokens pick expert 2
    x = inputs(B=B, L=L)[0] + 1.0
    valid = jnp.ones((B, L), bool).at[1, 11:].set(False)
    m, rules = cfg.model, sharding.rules(cfg)
    mesh_ = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, 8), jax.devices())
    n_ep, groups = mesh_.shape["expert"], mesh_.shape["data"]
    B_loc = B // (n_ep * groups)
    recv = dispatch.exchange_rows(B_loc, L, K, E // n_ep, n_ep, 0, slack)[1]
    assert recv == (B_loc * L * K * slack if slack else n_ep * B_loc * L * min(K, E // n_ep))
    _, _, idx, _ = moe.route(x, p["router"], m)
    keep = ragged_keep(np.asarray(idx), valid, groups, n_ep, E // n_ep, recv)
    assert (keep.sum() == np.asarray(valid).sum() * K) == (slack == 0), keep.sum()

    def f(p, x):
        y, stats = moe.moe(x, p, m, valid)
        return jnp.sum(jnp.sin(y) * valid[..., None]), stats["dropped"]
    with sharding.use(mesh_, rules):
        pp = jax.device_put(p, sharding.param_shardings(specs, mesh_, rules))
        xx = jax.device_put(x, sharding.named(mesh_, ("batch", "length", None), rules))
        (val, dropped), grads = jax.device_get(jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(pp, xx))
    ref = loss(lambda p, x: dense_keeping(x, p, m, jnp.asarray(keep, jnp.float32)), valid)
    assert float(dropped) == (np.asarray(valid)[..., None] & ~keep).sum()
    np.testing.assert_allclose(val, jax.jit(ref)(p, x), rtol=1e-5)
    assert_close(grads, jax.jit(jax.grad(ref, argnums=(0, 1)))(p, x))


def test_describe_names_the_exchange_and_its_slack():
    assert "padded all-to-all" in dispatch.describe("cpu", 8, 2.0) and "ep_slack does not apply" in \
        dispatch.describe("cpu", 8, 2.0)
    assert "ragged all-to-all, each receive buffer 2.0 x a balanced load" in dispatch.describe("tpu", 8, 2.0)
    assert "never dropping" in dispatch.describe("gpu", 8, 0.0)
    assert "all-to-all" not in dispatch.describe("tpu", 1, 2.0)
