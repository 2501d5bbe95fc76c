"""TPU flash attention: splash kernels in TPU interpret mode against the float64 reference, and real Mosaic
lowering compiled ahead of time for v5p and v6e topologies (libtpu, no TPU needed)."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxlm.kernels_pallas.flash_tpu import flash_attention
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
        o, vjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, seg, seg, **kw), q64, k64, v64)
        want = [np.asarray(x) for x in (o, *vjp(do64))]
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


# --- real Mosaic lowering, compiled for TPU topologies on this CPU machine ---------------------------------

needs_libtpu = pytest.mark.skipif(
    not os.environ.get("TPU_LIBRARY_PATH"),
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


def _compile(topology, D, window, L=2048, H=8, K=2):
    mesh = _mesh(topology)
    attend = jax.shard_map(functools.partial(flash_attention, window=window), mesh=mesh,
                           in_specs=P("data"), out_specs=P("data"), check_vma=False)
    loss = lambda q, k, v, seg: attend(q, k, v, seg).astype(jnp.float32).sum()  # noqa: E731
    B, sh = 2 * mesh.size, NamedSharding(mesh, P("data"))
    args = [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d in (
        ((B, L, H, D), jnp.bfloat16), ((B, L, K, D), jnp.bfloat16), ((B, L, K, D), jnp.bfloat16), ((B, L), jnp.int32))]
    fwd = jax.jit(attend).lower(*args).compile()
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    scores_bytes = (B // mesh.size) * H * L * L * 4  # 512 MiB; v5p's backward holds ~52 MiB of temporaries
    for c, kernels in ((fwd, 1), (bwd, 3)):  # forward; forward with residuals, dq, dkv
        assert c.as_text().count("tpu_custom_call") == kernels
        assert c.memory_analysis().temp_size_in_bytes < scores_bytes // 4
    return fwd, bwd


@needs_libtpu
@pytest.mark.parametrize("topology, D, window", [
    ("v5p:2x2x1", 128, 256), ("v6e:2x2", 128, 0), ("v5p:2x2x1", 64, 0), ("v6e:2x2", 256, 256)])
def test_compiles_for_tpu(topology, D, window, no_persistent_cache):
    _compile(topology, D, window)
