"""The Triton flash-attention kernel, run in Pallas' generic interpret mode on CPU, against the float64
reference: forward and dq/dk/dv over random shapes and features, the block-skipping bounds, and the
O(L) memory of the backward. On a GPU (MAXLM_TEST_PLATFORMS=cuda) the same tests run the compiled Triton
kernels instead."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm.kernels_pallas import flash_gpu
from maxlm.kernels_pallas.flash_gpu import flash_attention
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
        seg = jnp.asarray(seg)
        o, vjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, seg, seg, **kw), q, k, v)
        return [np.asarray(x) for x in (o, *vjp(do))]


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


@pytest.mark.parametrize("window", [0, 1, 5, 40])
@pytest.mark.parametrize("bq,bk", [(16, 16), (32, 16), (16, 64)])
def test_block_bounds_visit_exactly_the_blocks_with_visible_pairs(window, bq, bk):
    Lp = 128
    c = flash_gpu._Cfg(1.0, 0.0, window, bq, bk, 4, 2, True)
    pos = np.arange(Lp)
    d = pos[:, None] - pos[None, :]
    vis = (d >= 0) & ((d < window) if window else True)
    need = vis.reshape(Lp // bq, bq, Lp // bk, bk).any(axis=(1, 3))  # [query block, key block]
    for i in range(Lp // bq):
        lo, hi = (int(x) for x in flash_gpu._key_blocks(jnp.int32(i), c))
        assert np.array_equal(np.arange(Lp // bk)[lo:hi], np.flatnonzero(need[i])), (i, lo, hi)
    for j in range(Lp // bk):
        lo, hi = (int(x) for x in flash_gpu._query_blocks(jnp.int32(j), c, Lp // bq))
        assert np.array_equal(np.arange(Lp // bq)[lo:hi], np.flatnonzero(need[:, j])), (j, lo, hi)


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
    bad = {"head_dim": (q[..., :48], k[..., :48], v[..., :48], seg),
           "not a multiple": (q[:, :, :3], k, v, seg),
           "dtypes": (q.astype(jnp.float16), k.astype(jnp.float16), v.astype(jnp.float16), seg),
           "shapes disagree": (q, k[:, :7], v[:, :7], seg)}
    for msg, args in bad.items():
        with pytest.raises(ValueError, match=msg):
            flash_attention(*args, interpret=INTERPRET)
    with pytest.raises(ValueError, match="block_q"):
        flash_attention(q, k, v, seg, interpret=INTERPRET, block_q=24)


def test_default_config_is_printable_and_valid():
    for D in (64, 128, 256):
        for dt in (jnp.float32, jnp.bfloat16):
            cfg = flash_gpu.default_config(D, dt)
            assert set(cfg) == {"block_q", "block_k", "num_warps", "num_stages"}
            assert all(flash_gpu._pow2_at_least_16(cfg[b]) for b in ("block_q", "block_k"))


@pytest.mark.parametrize("D, dtype", [(64, jnp.bfloat16), (128, jnp.bfloat16), (256, jnp.bfloat16), (128, jnp.float32)])
def test_lowers_through_triton_for_an_h100(D, dtype):
    """Forward and backward lower through Pallas' real Triton lowering for an H100 (an abstract device: no
    GPU needed), so every op the kernels use is one Triton supports. Compiling the Triton IR to PTX and
    the numbers on the GPU are left to benchmarks/gpu_check.sh."""
    from jax._src import mesh as mesh_lib
    h100 = mesh_lib.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="cuda")
    B, L, H, K = 2, 1000, 8, 2
    args = [jax.ShapeDtypeStruct(s, d) for s, d in (((B, L, H, D), dtype), ((B, L, K, D), dtype), ((B, L, K, D), dtype),
                                                    ((B, L), jnp.int32))]
    def loss(q, k, v, seg):
        return flash_attention(q, k, v, seg, window=256, softcap=30.0).astype(jnp.float32).sum()
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100)):
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("__gpu$xla.gpu.triton") == 3  # forward (with residuals), dq, dk/dv
