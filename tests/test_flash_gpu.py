"""The Triton flash-attention kernel, run in Pallas' generic interpret mode on CPU, against the float64
reference: forward and dq/dk/dv over random shapes and features, the block-level ring-attention API
(offset query chunks, lse merging, backward from the global o/lse), the block-skipping bounds, and the
O(L) memory of the backward. On a GPU (MAXLM_TEST_PLATFORMS=cuda) the same tests run the compiled Triton
kernels instead; tests/test_gpu_compile.py compiles them for H100, H200 and B200 on any machine."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm.kernels_pallas import flash_gpu
from maxlm.kernels_pallas.flash_gpu import block_backward, block_forward, flash_attention
from maxlm.layers.attention import reference_attention

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
INTERPRET = jax.default_backend() != "gpu"


@functools.partial(jax.jit, static_argnames=("kw",))
def _kernel(q, k, v, seg, do, kw):
    o, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, seg, interpret=INTERPRET, **dict(kw)), q, k, v)
    return (o, *vjp(do))


def _reference(q, k, v, seg, do, **kw):
    with jax.enable_x64(True):
        q, k, v, do = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, do))
        return [np.asarray(x) for x in _reference64(q, k, v, jnp.asarray(seg), do, tuple(kw.items()))]


@functools.partial(jax.jit, static_argnames=("kw",))  # one compile, not an eager compile per float64 op
def _reference64(q, k, v, seg, do, kw):
    o, vjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, seg, seg, **dict(kw)), q, k, v)
    return (o, *vjp(do))


def _rel(got, want) -> float:
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), "kernel produced NaN/inf"
    # The floor only matters where the exact gradient is ~0 (L=1: softmax over one key has no score gradient).
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 0.1))


def _inputs(rs, B, L, H, K, D, dtype, docs=3, pad=0):
    q, do = (jnp.asarray(rs.randn(B, L, H, D), dtype) for _ in range(2))
    k, v = (jnp.asarray(rs.randn(B, L, K, D), dtype) for _ in range(2))
    seg = np.sort(rs.randint(1, docs + 1, size=(B, L)), axis=1).astype(np.int32)
    if pad:  # trailing padding, as the packer writes it
        seg[:, L - pad:] = 0
    return q, k, v, jnp.asarray(seg), do


def _cases(n=10):
    for i in range(n):
        rs = np.random.RandomState(300 + i)
        D = (64, 128, 64, 256, 128)[i % 5]
        L = int(rs.choice([1, 7, 16, 33, 64, 100, 129, 200] if D < 256 else [5, 31, 64]))
        H, K = ((4, 4), (4, 2), (4, 1))[i % 3]
        window = int(rs.choice([0, 3, 5, 24])) if i % 4 else 0
        softcap = float(rs.choice([0.0, 2.0, 5.0]))
        blocks = () if i == 7 else (("block_q", int(rs.choice([16, 32]))), ("block_k", int(rs.choice([16, 32]))))
        kw = (("window", window), ("softcap", softcap)) + blocks
        yield i, 300 + i, dict(B=1 + i % 2, L=L, H=H, K=K, D=D, dtype=(jnp.float32, jnp.bfloat16)[i % 2],
                          docs=int(rs.randint(1, 5)), pad=int(rs.randint(0, L // 3 + 1))), kw


@pytest.mark.parametrize("i,seed,shape,kw", [pytest.param(*c, marks=[pytest.mark.slow] if c[0] >= 6 else [])
                                             for c in _cases()], ids=lambda x: str(x) if isinstance(x, int) else "")
def test_forward_and_gradients_match_float64_reference(i, seed, shape, kw):
    q, k, v, seg, do = _inputs(np.random.RandomState(seed), **shape)
    got = _kernel(q, k, v, seg, do, kw)
    feat = {n: x for n, x in kw if n in ("window", "softcap")}
    want = _reference(q, k, v, seg, do, **feat)
    errs = [_rel(g, w) for g, w in zip(got, want)]
    assert got[0].dtype == q.dtype and got[0].shape == q.shape
    assert max(errs) <= TOL[shape["dtype"]], f"o/dq/dk/dv rel errors {errs} for {shape} {kw}"


def test_each_feature_changes_the_result():
    # A kernel that ignored the window, the segments or the softcap would match one of these instead.
    q, k, v, seg, do = _inputs(np.random.RandomState(1), 1, 96, 4, 2, 64, jnp.float32, docs=2)
    kw = dict(window=9, softcap=2.0)
    got = _kernel(q, k, v, seg, do, tuple(kw.items()) + (("block_q", 16), ("block_k", 32)))
    assert max(_rel(g, w) for g, w in zip(got, _reference(q, k, v, seg, do, **kw))) <= 1e-5
    one_doc = jnp.ones_like(seg)
    for other in (_reference(q, k, v, seg, do, softcap=2.0), _reference(q, k, v, seg, do, window=9),
                  _reference(q, k, v, one_doc, do, **kw)):
        assert min(_rel(g, w) for g, w in zip(got, other)) > 1e-2


@pytest.mark.parametrize("offset", [0, 8, 37, 128, 300])
@pytest.mark.parametrize("window", [0, 1, 5, 40])
@pytest.mark.parametrize("bq,bk", [(16, 16), (32, 16), (16, 64)])
def test_block_bounds_visit_exactly_the_blocks_with_visible_pairs(offset, window, bq, bk):
    Lp = 128
    n_q, n_k = Lp // bq, Lp // bk
    c = flash_gpu._Cfg(1.0, 0.0, window, bq, bk, 4, 2, flash_gpu.Tile(bq, bk, 4, 2), True, offset)
    d = offset + np.arange(Lp)[:, None] - np.arange(Lp)[None, :]
    vis = (d >= 0) & ((d < window) if window else True)
    need = vis.reshape(n_q, bq, n_k, bk).any(axis=(1, 3))  # [query block, key block]
    for n, n_other, need_n, (lo, hi) in (
            (n_q, n_k, need, flash_gpu._key_blocks(jnp.arange(n_q), c, n_k)),
            (n_k, n_q, need.T, flash_gpu._query_blocks(jnp.arange(n_k), c, n_q))):
        lo, hi = (np.broadcast_to(np.asarray(x), (n,)) for x in (lo, hi))
        assert (0 <= lo).all() and (hi <= n_other).all()  # clipped: a loop never reads outside the chunk
        for b in range(n):
            assert np.array_equal(np.arange(lo[b], hi[b]), np.flatnonzero(need_n[b])), (b, lo[b], hi[b])


@functools.partial(jax.jit, static_argnames=("kw",))
def _block_forward(q, k, v, qseg, kseg, kw):
    return block_forward(q, k, v, qseg, kseg, interpret=INTERPRET, **dict(kw))


def _block_reference(q, k, v, qseg, kseg, **kw):
    """float64 o and natural-log lse of one chunk pair; rows that see no key get o = 0 and lse = -inf
    (reference_attention would give them the mean of v)."""
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v))
        return [np.asarray(x) for x in _block_reference64(q, k, v, jnp.asarray(qseg), jnp.asarray(kseg),
                                                          tuple(kw.items()))]


@functools.partial(jax.jit, static_argnames=("kw",))  # one compile, not an eager compile per float64 op
def _block_reference64(q, k, v, qseg, kseg, kw):
    kw = dict(kw)
    offset, window, softcap = kw.get("offset", 0), kw.get("window", 0), kw.get("softcap", 0.0)
    o = reference_attention(q, k, v, qseg, kseg, q_offset=offset, window=window, softcap=softcap)
    B, L, H, D = q.shape
    K = k.shape[2]
    s = jnp.einsum("blkgd,bskd->bkgls", q.reshape(B, L, K, H // K, D), k) * D ** -0.5
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    d = offset + np.arange(L)[:, None] - np.arange(L)[None, :]
    vis = (qseg[:, :, None] == kseg[:, None, :]) & (d >= 0) & ((d < window) if window else True)
    lse = jax.nn.logsumexp(jnp.where(vis[:, None, None], s, -jnp.inf), axis=-1).reshape(B, H, L)
    return jnp.where((lse == -jnp.inf).transpose(0, 2, 1)[..., None], 0.0, o), lse


def _chunk_inputs(rs, B, L, H, K, D, dtype, n, docs):
    """q, k, v, seg for a sequence of n * L positions (sorted segments, so documents cross chunks)."""
    q, k, v, seg, _ = _inputs(rs, B, n * L, H, K, D, dtype, docs=docs)
    return q, k, v, seg


@pytest.mark.parametrize("offset,window,softcap,dtype", [
    pytest.param(0, 0, 5.0, jnp.float32, marks=pytest.mark.slow),  # flash_attention's (the ring test has it too)
    (13, 7, 2.0, jnp.float32),    # a fraction of L, with a window
    pytest.param(40, 0, 2.0, jnp.float32, marks=pytest.mark.slow),  # offset L: every pair visible (segments aside)
    (40, 21, 0.0, jnp.bfloat16),  # window reaching only the first rows: the rest see nothing
    (60, 20, 0.0, jnp.float32),   # window that does not reach the chunk: every row sees nothing
])
def test_block_forward_matches_float64_reference_at_offsets(offset, window, softcap, dtype):
    L, H, K = 40, 4, 2  # L not a block multiple; GQA
    q, k, v, seg = _chunk_inputs(np.random.RandomState(offset + window), 2, L, H, K, 16, dtype, n=3, docs=3)
    args = q[:, offset:offset + L], k[:, :L], v[:, :L], seg[:, offset:offset + L], seg[:, :L]
    kw = dict(offset=offset, window=window, softcap=softcap)
    o, lse = _block_forward(*args, tuple(kw.items()) + (("block_q", 16), ("block_k", 16)))
    o_want, lse_want = _block_reference(*args, **kw)
    assert o.dtype == q.dtype and o.shape == args[0].shape and lse.dtype == jnp.float32 and lse.shape == (2, H, L)
    o, lse = np.asarray(o, np.float64), np.asarray(lse, np.float64)
    unseen = lse_want == -np.inf
    assert np.array_equal(lse == -np.inf, unseen) and not np.isnan(lse).any()
    assert _rel(o, o_want) <= TOL[dtype] and (unseen.all() or _rel(lse[~unseen], lse_want[~unseen]) <= TOL[dtype])
    assert (o[unseen.transpose(0, 2, 1)] == 0).all()
    if offset == 60:
        assert unseen.all()
    elif offset == 40 and window:
        assert unseen.any() and not unseen.all()


@functools.partial(jax.jit, static_argnames=("kw",))
def _block_backward(q, k, v, qseg, kseg, o, lse, do, kw):
    return block_backward(q, k, v, qseg, kseg, o, lse, do, interpret=INTERPRET, **dict(kw))


def _ring_of_two(q, k, v, seg, do, L, kw):
    """What ring attention does on two chunks of length L: query chunk a attends K/V chunk b <= a at
    offset (a - b) * L; partials merge through their lse, and each pair's block_backward gets the merged,
    global o and lse. Returns the merged o, lse (natural log) and the summed dq, dk, dv over 2L. Pairs
    (0, 0) and (1, 1) share one compile of each jitted block call."""
    ch = [tuple(x[:, a * L:(a + 1) * L] for x in (q, k, v, seg, do)) for a in range(2)]
    pairs = [(0, 0), (1, 0), (1, 1)]
    kw_ab = {(a, b): kw + (("offset", (a - b) * L), ("block_q", 16), ("block_k", 16)) for a, b in pairs}
    part = {(a, b): _block_forward(ch[a][0], ch[b][1], ch[b][2], ch[a][3], ch[b][3], kw_ab[a, b]) for a, b in pairs}
    o, lse = [part[0, 0][0]], [part[0, 0][1]]
    lse1 = jnp.logaddexp(part[1, 0][1], part[1, 1][1])  # every real row sees itself: lse1 finite
    w = [jnp.exp(part[1, b][1] - lse1).transpose(0, 2, 1)[..., None] for b in range(2)]
    o.append(w[0] * part[1, 0][0] + w[1] * part[1, 1][0])
    lse.append(lse1)
    dq, dk, dv = [0, 0], [0, 0], [0, 0]
    for a, b in pairs:
        g = _block_backward(ch[a][0], ch[b][1], ch[b][2], ch[a][3], ch[b][3], o[a], lse[a], ch[a][4], kw_ab[a, b])
        dq[a], dk[b], dv[b] = dq[a] + g[0], dk[b] + g[1], dv[b] + g[2]
    cat = functools.partial(jnp.concatenate, axis=1)
    return cat(o), jnp.concatenate(lse, axis=2), cat(dq), cat(dk), cat(dv)


@pytest.mark.parametrize("window,softcap", [(29, 3.0), pytest.param(0, 0.0, marks=pytest.mark.slow)])
def test_block_backward_from_the_global_lse_sums_to_the_gradient(window, softcap):
    """The contract ring attention relies on: block_forward partials merged through lse give the whole
    attention, and block_backward per chunk pair, fed the merged o and lse, sums to its gradient."""
    L, H, K, D = 40, 4, 2, 16  # L not a block multiple; the window (29 < L) cuts the off-diagonal pair
    q, k, v, seg = _chunk_inputs(np.random.RandomState(7 + window), 2, L, H, K, D, jnp.float32, n=2, docs=3)
    do = jnp.asarray(np.random.RandomState(8).randn(*q.shape), jnp.float32)
    kw = dict(window=window, softcap=softcap)
    o, lse, *grads = _ring_of_two(q, k, v, seg, do, L, tuple(kw.items()))
    o_want, *grads_want = _reference(q, k, v, seg, do, **kw)
    assert _rel(o, o_want) <= 1e-5
    assert _rel(lse, _block_reference(q, k, v, seg, seg, **kw)[1]) <= 1e-5
    errs = [_rel(g, w) for g, w in zip(grads, grads_want)]
    assert max(errs) <= 1e-5, f"dq/dk/dv rel errors {errs}"


def _square_vars(jaxpr, L):
    """Every variable, in the jaxpr and all the jaxprs nested in it (kernels included), with two dims == L."""
    found = []
    for eqn in jaxpr.eqns:
        found += [v.aval.shape for v in eqn.outvars if sum(d == L for d in getattr(v.aval, "shape", ())) >= 2]
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    found += _square_vars(sub, L)
    return found


def test_forward_and_backward_never_build_an_L_by_L_tensor():
    L = 512
    q, k, v, seg, _ = _inputs(np.random.RandomState(2), 1, L, 4, 2, 64, jnp.bfloat16)

    def loss(attn, q, k, v):
        return jnp.sum(attn(q, k, v).astype(jnp.float32) ** 2)

    flash = functools.partial(flash_attention, seg_BL=seg, interpret=INTERPRET, block_q=64, block_k=64, window=100)
    jaxpr = jax.make_jaxpr(jax.grad(functools.partial(loss, flash), argnums=(0, 1, 2)))(q, k, v).jaxpr
    assert _square_vars(jaxpr, L) == []
    ref = functools.partial(reference_attention, seg_BL=seg, seg_BS=seg)  # the check itself must see an L x L
    assert _square_vars(jax.make_jaxpr(jax.grad(functools.partial(loss, ref), argnums=(0, 1, 2)))(q, k, v).jaxpr, L)


def test_rejects_unsupported_input_with_a_clear_error():
    q, k, v, seg, _ = _inputs(np.random.RandomState(3), 1, 8, 4, 2, 64, jnp.float32)
    wide = jnp.zeros((1, 8, 4, 512), jnp.float32)
    bad = {"head_dim 512 is over 256": (wide, wide[:, :, :2], wide[:, :, :2], seg),
           "not a multiple": (q[:, :, :3], k, v, seg),
           "dtypes": (q.astype(jnp.float16), k.astype(jnp.float16), v.astype(jnp.float16), seg),
           "shapes disagree": (q, k[:, :7], v[:, :7], seg)}
    for msg, args in bad.items():
        with pytest.raises(ValueError, match=msg):
            flash_attention(*args, interpret=INTERPRET)
    with pytest.raises(ValueError, match="block_q"):
        flash_attention(q, k, v, seg, interpret=INTERPRET, block_q=24)
    with pytest.raises(ValueError, match="offset"):
        block_forward(q, k, v, seg, seg, offset=-1, interpret=INTERPRET)
    with pytest.raises(ValueError, match="unknown tile"):
        block_forward(q, k, v, seg, seg, interpret=INTERPRET, block_m=16)
    lse = jnp.zeros((1, 4, 8), jnp.float32)
    with pytest.raises(ValueError, match="lse"):
        block_backward(q, k, v, seg, seg, q, lse[:, :2], q, interpret=INTERPRET)


def test_the_tile_table_covers_every_head_dim_and_dtype_it_accepts():
    """Each padded head_dim x dtype has a (forward, backward) row of power-of-two blocks; what has no row is
    refused by `unsupported` (tests/test_gpu_compile.py compiles every row for H100, H200 and B200)."""
    for D in (1, 16, 48, 64, 96, 100, 128, 192, 256):
        for dt in (jnp.float32, jnp.bfloat16):
            assert flash_gpu.unsupported(D, dt) is None
            for t in flash_gpu.tiles(D, dt):
                assert all(flash_gpu._pow2_at_least_16(b) for b in t[:2]) and t.num_warps in (4, 8)
    assert flash_gpu.padded_head_dim(96) == 128 and flash_gpu.padded_head_dim(8) == 16
    assert "over 256" in flash_gpu.unsupported(320, jnp.bfloat16)
    assert "not float16" in flash_gpu.unsupported(64, jnp.float16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_head_dim_96_runs_zero_padded_with_the_table_tiles(dtype):
    """head_dim 96 (Phi-3) runs at 128 with zero columns: the scale stays 96 ** -0.5 and no gradient leaks
    into the pad. The table's bf16 backward tile (64 x 64) differs from its forward (128 x 64), so this
    also checks a backward on other blocks than the forward's residuals were made with."""
    q, k, v, seg, do = _inputs(np.random.RandomState(96), 1, 150, 4, 2, 96, dtype, docs=2, pad=20)
    got = _kernel(q, k, v, seg, do, (("window", 70),))
    want = _reference(q, k, v, seg, do, window=70)
    assert all(g.shape == w.shape for g, w in zip(got, want))
    errs = [_rel(g, w) for g, w in zip(got, want)]
    assert max(errs) <= TOL[dtype], f"o/dq/dk/dv rel errors {errs}"


def test_block_api_pads_head_dim_too():
    L, H, K, D = 40, 4, 2, 24
    q, k, v, seg = _chunk_inputs(np.random.RandomState(24), 1, L, H, K, D, jnp.float32, n=2, docs=2)
    do = jnp.asarray(np.random.RandomState(25).randn(*q.shape), jnp.float32)
    o, lse, *grads = _ring_of_two(q, k, v, seg, do, L, (("window", 50),))
    o_want, *grads_want = _reference(q, k, v, seg, do, window=50)
    assert o.shape == q.shape and _rel(o, o_want) <= 1e-5
    assert max(_rel(g, w) for g, w in zip(grads, grads_want)) <= 1e-5
