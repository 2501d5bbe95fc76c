"""TPU flash attention: splash kernels in TPU interpret mode against the float64 reference, the ring-attention
block API (block_forward / block_backward) against it too, and real Mosaic lowering compiled ahead of time
for v5p and v6e topologies (libtpu, no TPU needed)."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs, value_and_vjp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxlm.kernels_pallas.flash_tpu import block_backward, block_forward, flash_attention
from maxlm.layers.attention import reference_attention

try:
    from jax import enable_x64 as x64
except ImportError:  # older jax
    from jax.experimental import enable_x64 as x64
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
# (B, L, H, K, D, window, softcap, dtype): L off the 128 grid in most, every head_dim and GQA shape once.
CASES = {
    "f32-gqa-d64-batch2": (2, 200, 4, 2, 64, 0, 0.0, "float32"),
    "bf16-mqa-d128-window-softcap": (1, 256, 2, 1, 128, 48, 5.0, "bfloat16"),
    "f32-mha-d256-window-softcap": (1, 130, 2, 2, 256, 32, 5.0, "float32"),
    "f32-mha-d192": (1, 130, 2, 2, 192, 0, 0.0, "float32"),  # DeepSeek-V3's query/key width, not a power of two
}
SLOW_CASES = {
    "bf16-gqa-d64-window": (1, 300, 4, 2, 64, 100, 0.0, "bfloat16"),
    "f32-mqa-d128-softcap": (1, 250, 2, 1, 128, 0, 5.0, "float32"),
}


def _segments(rng, L):
    """Three to five packed documents, then a run of padding (0)."""
    cuts = np.sort(rng.choice(np.arange(1, L), size=rng.integers(2, 5), replace=False))
    seg_L = np.searchsorted(cuts, np.arange(L), side="right").astype(np.int32) + 1
    seg_L[L - rng.integers(1, L // 8):] = 0
    return seg_L


@functools.cache
def _run(name):
    """Kernel output and (dq, dk, dv) for a random cotangent, plus the float64 reference of both."""
    B, L, H, K, D, window, softcap, dtype = {**CASES, **SLOW_CASES}[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    q, k, v, do = (jnp.asarray(rng.standard_normal(s), dtype)
                   for s in ((B, L, H, D), (B, L, K, D), (B, L, K, D), (B, L, H, D)))
    seg = jnp.asarray(np.stack([_segments(rng, L) for _ in range(B)]))
    kw = dict(window=window, softcap=softcap)

    @jax.jit
    def kernel(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, seg, interpret=True, **kw), q, k, v)
        return o, *vjp(do)

    got = [np.asarray(x.astype(jnp.float32), np.float64) for x in kernel(q, k, v, do)]
    with x64(True):
        q64, k64, v64, do64 = (jnp.asarray(np.asarray(x.astype(jnp.float32)), jnp.float64) for x in (q, k, v, do))
        want = [np.asarray(x) for x in value_and_vjp(lambda q, k, v: reference_attention(q, k, v, seg, seg, **kw), do64, q64, k64, v64)]
    return got, want, (q64, k64, v64, seg, kw)


def _rel(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


def _check(name):
    got, want, _ = _run(name)
    tol = TOL[{**CASES, **SLOW_CASES}[name][-1]]
    for what, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape and np.isfinite(g).all(), f"{what}: non-finite values or shape {g.shape}"
        assert _rel(g, w) <= tol, f"{what}: max|delta|/max|ref| = {_rel(g, w):.2e} > {tol}"


@pytest.mark.parametrize("name", CASES)
def test_forward_and_grads_match_float64_reference(name):
    _check(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_CASES)
def test_forward_and_grads_match_float64_reference_more(name):
    _check(name)


def test_window_segments_and_softcap_each_change_the_output():
    got, _, (q, k, v, seg, kw) = _run("f32-mha-d256-window-softcap")
    with x64(True):
        one = jnp.ones_like(seg)
        for off, s, kw_off in (("window", seg, dict(kw, window=0)), ("softcap", seg, dict(kw, softcap=0.0)),
                               ("segments", one, kw)):
            assert _rel(got[0], np.asarray(reference_attention(q, k, v, s, s, **kw_off))) > 1e-2, f"{off} off"


@pytest.mark.malformed
@pytest.mark.parametrize("shapes, dtype, match", [
    (((1, 128, 3, 64), (1, 128, 2, 64)), jnp.float32, "multiple of 2 kv heads"),
    (((1, 128, 2, 64), (1, 128, 2, 64)), jnp.float16, "float32 or bfloat16"),
    (((1, 128, 2, 64), (1, 64, 2, 64)), jnp.float32, "must match q"),
])
def test_bad_inputs_raise_one_line(shapes, dtype, match):
    q, k = (jnp.zeros(s, dtype) for s in shapes)
    with pytest.raises(ValueError, match=match) as e:
        flash_attention(q, k, k, jnp.ones(q.shape[:2], jnp.int32), interpret=True)
    assert "\n" not in str(e.value)


def test_shard_map_with_check_vma_says_to_turn_it_off():
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    attend = jax.shard_map(functools.partial(flash_attention, interpret=True), mesh=mesh, in_specs=P("data"),
                           out_specs=P("data"))
    q = jax.ShapeDtypeStruct((2, 128, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"check_vma=False"):
        jax.jit(attend).trace(q, q, q, jax.ShapeDtypeStruct((2, 128), jnp.int32))


# --- ring-attention blocks: block_forward / block_backward ---------------------------------------------------

# (L, H, K, D, offset, window, softcap, scale, dtype, block): keys at positions [0, L), queries at
# [offset, offset + L), segment ids cut from one packed sequence covering both.
BLOCK_CASES = {
    "f32-mqa-offset0": (256, 2, 1, 64, 0, 0, 0.0, 0.0, "float32", None),
    "bf16-mha-d128-half-softcap": (256, 2, 2, 128, 128, 0, 5.0, 0.0, "bfloat16", None),
    "f32-mqa-full-offL-padded": (200, 2, 1, 64, 200, 0, 0.0, 0.1, "float32", None),
    # the last 128-row query block sees nothing at all (splash leaves NaN there), the first one partly
    "f32-mha-window-dead-rows": (256, 2, 2, 64, 200, 32, 0.0, 0.0, "float32", 128),
}


def _seq(rng, shapes, dtype):
    return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]


def _f64(*xs):
    return [jnp.asarray(np.asarray(x.astype(jnp.float32)), jnp.float64) for x in xs]


def _lse64(q, k, qseg, kseg, offset, window, softcap, scale):
    """Float64 log-sum-exp [B, H, L] of each row's visible scores (-inf where none), and seen [B, L]."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    (B, L, H, D), K = q.shape, k.shape[2]
    s = np.einsum("blhd,bshd->bhls", q, np.repeat(k, H // K, axis=2)) * (scale or D ** -0.5)
    s = softcap * np.tanh(s / softcap) if softcap else s
    d = offset + np.arange(L)[:, None] - np.arange(L)[None]
    seen = (np.asarray(qseg)[:, :, None] == np.asarray(kseg)[:, None, :]) & (d >= 0) & ((d < window) | (window <= 0))
    s = np.where(seen[:, None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return np.log(np.exp(s - m).sum(-1)) + m[..., 0], seen.any(-1)


# TPU interpret mode is slow: the fast suite keeps the case with dead rows (the trickiest), the rest are slow.
@pytest.mark.parametrize("name", [n if n == "f32-mha-window-dead-rows" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in BLOCK_CASES])
def test_block_forward_and_backward_match_float64_reference(name):
    """o and lse against float64; block_backward with the block's own o and lse against the float64 vjp, the
    cotangent kept off rows that see nothing (the reference spreads such a row over every key)."""
    L, H, K, D, offset, window, softcap, scale, dtype, block = BLOCK_CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    q, k, v, do = _seq(rng, ((1, L, H, D), (1, L, K, D), (1, L, K, D), (1, L, H, D)), dtype)
    seg = _segments(rng, offset + L)
    qseg, kseg = jnp.asarray(seg[None, offset:]), jnp.asarray(seg[None, :L])
    kw = dict(window=window, softcap=softcap, scale=scale)
    opts = dict(kw, offset=offset, interpret=True, block_q=block, block_k=block)

    @jax.jit
    def kernel(q, k, v, do):
        o, lse = block_forward(q, k, v, qseg, kseg, **opts)
        return o, lse, block_backward(q, k, v, qseg, kseg, o, lse, do, **opts)

    o, lse, grads = kernel(q, k, v, do)
    assert o.dtype == q.dtype and lse.dtype == jnp.float32 and lse.shape == (1, H, L)
    with x64(True):
        q64, k64, v64, do64 = _f64(q, k, v, do)
        lse_want, seen = _lse64(q64, k64, qseg, kseg, offset, **kw)
        o_want, *grads_want = value_and_vjp(lambda q, k, v: reference_attention(q, k, v, qseg, kseg, q_offset=offset, **kw),
                                   jnp.where(seen[:, :, None, None], do64, 0.0), q64, k64, v64)
    assert (~seen).any() == (offset > 0), "cases at offset > 0 should hold rows that see nothing"
    o_want = np.where(seen[:, :, None, None], o_want, 0.0)
    for what, g, w in zip(("o", "dq", "dk", "dv"), (o, *grads), (o_want, *grads_want)):
        g = np.asarray(g.astype(jnp.float32), np.float64)
        assert np.isfinite(g).all() and _rel(g, np.asarray(w)) <= TOL[dtype], f"{what}: {_rel(g, w):.2e}"
    lse = np.asarray(lse)
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_want)), "lse: -inf rows differ"
    got, want = lse[np.isfinite(lse_want)], lse_want[np.isfinite(lse_want)]
    assert np.abs(got - want).max() <= 10 * TOL[dtype], f"lse: max|delta| = {np.abs(got - want).max():.2e}"


def test_block_out_of_window_sees_nothing_and_runs_no_kernel():
    L, H, D = 128, 2, 64
    q = jnp.ones((1, L, H, D), jnp.bfloat16)
    seg = jnp.ones((1, L), jnp.int32)
    jaxpr = str(jax.make_jaxpr(functools.partial(block_forward, offset=L, window=1, interpret=True))(q, q, q, seg, seg))
    assert "pallas_call" not in jaxpr
    o, lse = block_forward(q, q, q, seg, seg, offset=L, window=1, interpret=True)
    assert o.dtype == q.dtype and lse.dtype == jnp.float32 and lse.shape == (1, H, L)
    assert (o == 0).all() and np.isneginf(np.asarray(lse)).all()
    grads = block_backward(q, q, q, seg, seg, o, lse, q, offset=L, window=1, interpret=True)
    assert all((g == 0).all() and g.shape == q.shape for g in grads)


def _merge(o_a, lse_a, o_b, lse_b):
    """The ring's merge of two partial outputs of the same rows through their log-sum-exp."""
    lse = jnp.logaddexp(lse_a, lse_b)
    w = lambda lse_x: jnp.exp(lse_x - lse).transpose(0, 2, 1)[..., None]  # noqa: E731
    return w(lse_a) * o_a.astype(jnp.float32) + w(lse_b) * o_b.astype(jnp.float32), lse


# (L, H, K, D, window, softcap, dtype): each chunk of the 2L sequence has length L.
RING_CASES = {
    "f32-gqa": (128, 4, 2, 64, 0, 0.0, "float32"),
    "bf16-mqa-d128-window-softcap": (128, 2, 1, 128, 160, 5.0, "bfloat16"),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if "bf16" in n else n for n in RING_CASES])
def test_two_chunk_ring_matches_whole_sequence(name):
    """Two devices' worth of ring attention: chunk 1's queries see chunk 1; chunk 2's see chunk 1 (offset L)
    and chunk 2 (offset 0), merged by lse; every block's backward gets its rows' merged o and lse, and the
    summed block gradients equal the gradient of attention over the whole sequence."""
    L, H, K, D, window, softcap, dtype = RING_CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    q, k, v, do = _seq(rng, ((1, 2 * L, H, D), (1, 2 * L, K, D), (1, 2 * L, K, D), (1, 2 * L, H, D)), dtype)
    seg = jnp.asarray(_segments(rng, 2 * L)[None])
    kw = dict(window=window, softcap=softcap, interpret=True)
    halves = lambda x: (x[:, :L], x[:, L:])  # noqa: E731

    @jax.jit
    def ring(q, k, v, do):
        (q1, q2), (k1, k2), (v1, v2), (s1, s2), (do1, do2) = map(halves, (q, k, v, seg, do))
        blocks = {(1, 1): (q1, k1, v1, s1, s1, 0), (2, 1): (q2, k1, v1, s2, s1, L),
                  (2, 2): (q2, k2, v2, s2, s2, 0)}
        fwd = {ij: block_forward(*b[:5], offset=b[5], **kw) for ij, b in blocks.items()}
        o1, lse1 = fwd[1, 1]
        o2, lse2 = _merge(*fwd[2, 1], *fwd[2, 2])
        o2 = o2.astype(q.dtype)
        row = {1: (o1, lse1, do1), 2: (o2, lse2, do2)}
        bwd = {ij: block_backward(*b[:5], *row[ij[0]], offset=b[5], **kw) for ij, b in blocks.items()}
        dq = jnp.concatenate([bwd[1, 1][0], bwd[2, 1][0] + bwd[2, 2][0]], axis=1)
        dk = jnp.concatenate([bwd[1, 1][1] + bwd[2, 1][1], bwd[2, 2][1]], axis=1)
        dv = jnp.concatenate([bwd[1, 1][2] + bwd[2, 1][2], bwd[2, 2][2]], axis=1)
        return jnp.concatenate([o1, o2], axis=1), dq, dk, dv

    got = [np.asarray(x.astype(jnp.float32), np.float64) for x in ring(q, k, v, do)]
    with x64(True):
        q64, k64, v64, do64 = _f64(q, k, v, do)
        want = [np.asarray(x) for x in value_and_vjp(lambda q, k, v: reference_attention(q, k, v, seg, seg, window=window,
                                                                                softcap=softcap), do64, q64, k64, v64)]
    for what, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        assert np.isfinite(g).all() and _rel(g, w) <= TOL[dtype], f"{what}: {_rel(g, w):.2e} > {TOL[dtype]}"


def test_block_backward_with_own_residuals_is_flash_attention_grad():
    rng = np.random.default_rng(3)
    q, k, v, do = _seq(rng, ((1, 200, 4, 64), (1, 200, 2, 64), (1, 200, 2, 64), (1, 200, 4, 64)), "float32")
    seg = jnp.asarray(_segments(rng, 200)[None])
    kw = dict(window=64, softcap=5.0, interpret=True)

    @jax.jit
    def both(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, seg, **kw), q, k, v)
        o_b, lse = block_forward(q, k, v, seg, seg, **kw)
        return o, vjp(do), o_b, block_backward(q, k, v, seg, seg, o_b, lse, do, **kw)

    o, want, o_b, got = both(q, k, v, do)
    np.testing.assert_allclose(o_b, o, atol=1e-6)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5)


@pytest.mark.malformed
@pytest.mark.parametrize("offset, lse_shape, match", [(-1, (1, 2, 128), "offset -1"), (0, (1, 128, 2), "lse")])
def test_block_bad_inputs_raise_one_line(offset, lse_shape, match):
    q, seg = jnp.zeros((1, 128, 2, 64)), jnp.ones((1, 128), jnp.int32)
    with pytest.raises(ValueError, match=match) as e:
        block_backward(q, q, q, seg, seg, q, jnp.zeros(lse_shape), q, offset=offset, interpret=True)
    assert "\n" not in str(e.value)


# --- real Mosaic lowering, compiled for TPU topologies on this CPU machine ---------------------------------

needs_libtpu = needs(
    bool(os.environ.get("TPU_LIBRARY_PATH")),
    reason="TPU_LIBRARY_PATH unset: compiling for TPU needs libtpu (`make test` sets it)")


@pytest.fixture
def no_persistent_cache():
    """The suite's compile cache cannot load executables built for a topology without its client; jax
    memoises whether the cache is on, hence the resets."""
    from jax._src import compilation_cache
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", was)
    compilation_cache.reset_cache()


@functools.cache
def _mesh(topology):
    from jax.experimental import topologies
    return Mesh(np.array(topologies.get_topology_desc(topology, "tpu").devices), ("data",))


def _args(mesh, L, H, K, D, *extra):
    """Batch-sharded abstract q, k, v, segment ids (then `extra` (shape, dtype)s), two examples per device."""
    B, sh = 2 * mesh.size, NamedSharding(mesh, P("data"))
    return B, [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d in (
        ((B, L, H, D), jnp.bfloat16), ((B, L, K, D), jnp.bfloat16), ((B, L, K, D), jnp.bfloat16), ((B, L), jnp.int32),
        *((s(B), d) for s, d in extra))]


def _compile(topology, D, window, L=2048, H=8, K=2):
    mesh = _mesh(topology)
    attend = jax.shard_map(functools.partial(flash_attention, window=window), mesh=mesh,
                           in_specs=P("data"), out_specs=P("data"), check_vma=False)
    loss = lambda q, k, v, seg: attend(q, k, v, seg).astype(jnp.float32).sum()  # noqa: E731
    B, args = _args(mesh, L, H, K, D)
    fwd = jax.jit(attend).lower(*args).compile()
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    scores_bytes = (B // mesh.size) * H * L * L * 4  # 512 MiB; v5p's backward holds ~52 MiB of temporaries
    for c, kernels in ((fwd, 1), (bwd, 3)):  # forward; forward with residuals, dq, dkv
        assert c.as_text().count("tpu_custom_call") == kernels
        assert c.memory_analysis().temp_size_in_bytes < scores_bytes // 4
    return fwd, bwd


@needs_libtpu
@pytest.mark.parametrize("topology, D, window", [  # v5p windowed and not, v6e at the widest (192 below)
    ("v5p:2x2x1", 128, 256), ("v5p:2x2x1", 64, 0), ("v6e:2x2", 256, 256)])
def test_compiles_for_tpu(topology, D, window, no_persistent_cache):
    _compile(topology, D, window)


@needs_libtpu
def test_deepseek_v3_head_width_compiles_for_tpu(no_persistent_cache):
    """MLA's query/key width, 192, is no power of two: splash compiles it as it is (its backward then holds
    68 MB of temporaries at L=2048, more than the bound above allows for 8 heads, hence the longer L)."""
    _compile("v5p:2x2x1", 192, 0, L=4096)


@needs_libtpu
@pytest.mark.slow  # 20-30 s of Mosaic compiles
def test_ring_blocks_compile_for_tpu(no_persistent_cache, L=2048, H=8, K=2, D=128):
    """block_forward and block_backward off the diagonal (offset L/2, sliding window), one kernel each for
    the forward and two (dq, dkv) for the backward, and no [L, L] temporaries."""
    mesh = _mesh("v5p:2x2x1")
    kw = dict(offset=L // 2, window=L)
    fwd = jax.shard_map(lambda q, k, v, seg: block_forward(q, k, v, seg, seg, **kw), mesh=mesh,
                        in_specs=P("data"), out_specs=P("data"), check_vma=False)
    bwd = jax.shard_map(lambda q, k, v, seg, o, lse, do: block_backward(q, k, v, seg, seg, o, lse, do, **kw),
                        mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False)
    B, args = _args(mesh, L, H, K, D, (lambda B: (B, L, H, D), jnp.bfloat16), (lambda B: (B, H, L), jnp.float32),
                    (lambda B: (B, L, H, D), jnp.bfloat16))
    scores_bytes = (B // mesh.size) * H * L * L * 4
    for c, kernels in ((jax.jit(fwd).lower(*args[:4]).compile(), 1), (jax.jit(bwd).lower(*args).compile(), 2)):
        assert c.as_text().count("tpu_custom_call") == kernels
        assert c.memory_analysis().temp_size_in_bytes < scores_bytes // 4


def test_tiles_follow_the_chip_and_head_dim(monkeypatch):
    from maxlm.kernels_pallas import flash_tpu as ft
    monkeypatch.setattr(ft, "device_kind", lambda: "TPU v5")
    assert ft.tiles(8192, 128) == (ft.Tiles(1024, 512, 2048, 512, 2048, 512), 8192)  # MaxText's v5p recipe
    assert ft.tiles(1000, 128) == (ft.Tiles(1024, 512, 1024, 512, 1024, 512), 1024)  # capped by the length
    assert ft.tiles(8320, 128) == (ft.Tiles(*[128] * 6), 8320)  # 65 x 128: no block beyond 128 divides it
    assert ft.tiles(8192, 64) == (ft.DEFAULT_TILES, 8192)       # no row for this head_dim
    assert ft.tiles(8192, 128, block_q=256)[0] == ft.Tiles(256, 512, 256, 512, 256, 512)  # the ring's own
    monkeypatch.setattr(ft, "device_kind", lambda: "TPU v4")
    assert ft.tiles(8192, 128)[0] == ft.DEFAULT_TILES


@needs_libtpu
def test_the_chip_is_read_from_the_topology_inside_shard_map():
    from maxlm.kernels_pallas import flash_tpu as ft
    mesh, seen = _mesh("v5p:2x2x1"), []
    f = jax.shard_map(lambda x: seen.append(ft.device_kind()) or x, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    jax.jit(f).trace(jax.ShapeDtypeStruct((mesh.size,), jnp.float32, sharding=NamedSharding(mesh, P("data"))))
    assert seen == ["TPU v5"]
