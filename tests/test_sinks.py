"""Attention sinks (gpt-oss): XLA's attention against transformers' formula, and every other path (each
kernel's block pair through sink_attention, the ring, KV-cache decoding, a model under a mesh) against
XLA's in float64, the sink gradients included."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import value_and_vjp
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from maxlm.layers import attention, ring
from maxlm.layers.sinks import sink_attention

B, L, H, K, D = 2, 32, 4, 2, 16


def _inputs(seed=0, L=L, D=D):
    rs = np.random.RandomState(seed)
    q, do = (jnp.asarray(rs.randn(B, L, H, D)) for _ in range(2))
    k, v = (jnp.asarray(rs.randn(B, L, K, D)) for _ in range(2))
    seg = jnp.asarray(np.sort(rs.randint(1, 4, size=(B, L)), axis=1).astype(np.int32))
    sinks = jnp.asarray(rs.randn(H) * 2)
    return q, k, v, seg, sinks, do


def test_reference_with_sinks_is_transformers_formula():
    """gpt-oss's eager attention: the sink concatenated to the scores, the row max subtracted, softmax, the
    sink's column dropped (numpy, float64)."""
    with jax.enable_x64(True):
        q, k, v, seg, sinks, _ = map(np.asarray, _inputs())
        got = np.asarray(attention.reference_attention(*map(jnp.asarray, (q, k, v, seg, seg)), window=5,
                                                       sinks=jnp.asarray(sinks)))
    kk, vv = np.repeat(k, H // K, axis=2), np.repeat(v, H // K, axis=2)
    s = np.einsum("blhd,bshd->bhls", q, kk) * D ** -0.5
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    visible = (seg[:, None, :, None] == seg[:, None, None, :]) & (j <= i) & (i - j < 5)
    s = np.where(visible, s, -np.inf)
    logits = np.concatenate([s, np.broadcast_to(sinks[None, :, None, None], (B, H, L, 1))], axis=-1)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True))[..., :-1]
    want = np.einsum("bhls,bshd->blhd", p, vv)
    np.testing.assert_allclose(got, want, atol=1e-12)
    # and the sink matters: without it the rows sum to one
    assert np.abs(np.asarray(attention.reference_attention(*map(jnp.asarray, (q, k, v, seg, seg)), window=5)) - got).max() > 1e-2


def _value_and_grads(fn, q, k, v, seg, sinks, do):
    return list(value_and_vjp(lambda q, k, v, s: fn(q, k, v, seg, s), do, q, k, v, sinks))


def _reference(q, k, v, seg, sinks, window, softcap):
    return attention.reference_attention(q, k, v, seg, seg, window=window, softcap=softcap, sinks=sinks)


def _float64_reference(q, k, v, seg, sinks, do, window, softcap):
    """XLA's reference and its gradients in float64 on the same values (numpy): the kernels' oracle."""
    with jax.enable_x64(True):
        q, k, v, sinks, do = (jnp.asarray(np.asarray(a), jnp.float64) for a in (q, k, v, sinks, do))
        out = _value_and_grads(functools.partial(_reference, window=window, softcap=softcap), q, k, v,
                               jnp.asarray(np.asarray(seg)), sinks, do)
        return [np.asarray(a) for a in out]


def _assert_close_f32(got, want):
    for name, a, b in zip(("o", "dq", "dk", "dv", "dsinks"), got, want):
        assert float(np.max(np.abs(np.asarray(a, np.float64) - b))) <= 2e-5 * max(float(np.max(np.abs(b))), 1.0), name


def _blocks(name):
    if name == "xla":
        return attention.block_forward, attention.block_backward
    from maxlm.kernels_pallas import flash_gpu, flash_mgpu, flash_tpu
    kernels = {"triton": flash_gpu, "tpu": flash_tpu, "mosaic": flash_mgpu}[name]
    return (functools.partial(kernels.block_forward, interpret=True),
            functools.partial(kernels.block_backward, interpret=True))


@pytest.mark.parametrize("name, window, softcap", [
    ("xla", 5, 0.0), ("xla", 0, 3.0), ("triton", 5, 2.0), ("tpu", 0, 0.0),
    pytest.param("mosaic", 5, 2.0, marks=pytest.mark.slow),  # the Mosaic GPU interpreter: about a minute
])
def test_every_kernel_takes_sinks_through_its_blocks(name, window, softcap):
    """Output, dq, dk, dv and d sinks equal XLA's reference in float64 (XLA's blocks run float64 too, to
    1e-12; the kernels float32, to their tests' tolerance)."""
    fn = functools.partial(sink_attention, _blocks(name), window=window, softcap=softcap)
    if name == "xla":
        with jax.enable_x64(True):
            q, k, v, seg, sinks, do = _inputs()
            got = _value_and_grads(fn, q, k, v, seg, sinks, do)
            want = _value_and_grads(functools.partial(_reference, window=window, softcap=softcap), q, k, v, seg, sinks, do)
            for name_, a, b in zip(("o", "dq", "dk", "dv", "dsinks"), got, want):
                assert float(jnp.max(jnp.abs(a - b))) <= 1e-12 * max(float(jnp.max(jnp.abs(b))), 1.0), name_
        assert np.abs(np.asarray(want[-1])).min() > 1e-3  # the sinks' gradient is not trivially zero (float64: numpy)
        return
    q, k, v, seg, sinks, do = _inputs()  # float32
    _assert_close_f32(_value_and_grads(fn, q, k, v, seg, sinks, do),
                      _float64_reference(q, k, v, seg, sinks, do, window, softcap))


@pytest.mark.parametrize("C, window", [pytest.param(2, 0, marks=pytest.mark.slow), (4, 12)])
def test_the_ring_merges_the_sink_once(C, window):
    """Over C devices the sink joins each row's merged softmax once (a per-chunk merge would count it C
    times, and a per-device d sinks would need its sum): everything equals the unsplit reference."""
    with jax.enable_x64(True):
        q, k, v, seg, sinks, do = _inputs(seed=C)
        mesh = Mesh(np.array(jax.devices()[:C]), ("context",), axis_types=(AxisType.Auto,))
        body = functools.partial(ring.ring_attention, (attention.block_forward, attention.block_backward),
                                 axis="context", size=C, window=window)
        f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "context"),) * 4 + (P(),), out_specs=P(None, "context"),
                          check_vma=False)
        zz = functools.partial(ring.to_zigzag, C=C)
        split = lambda q, k, v, seg, s: ring.from_zigzag(f(zz(q), zz(k), zz(v), zz(seg), s), C)  # noqa: E731
        got = _value_and_grads(split, q, k, v, seg, sinks, do)
        want = _value_and_grads(functools.partial(_reference, window=window, softcap=0.0), q, k, v, seg, sinks, do)
        for name_, a, b in zip(("o", "dq", "dk", "dv", "dsinks"), got, want):
            np.testing.assert_allclose(a, b, atol=1e-11, err_msg=name_)


def test_splash_takes_sinks_itself():
    """On TPU without a ring, the sinks go to splash's own `sinks` argument (interpret mode here)."""
    from maxlm.kernels_pallas import flash_tpu
    q, k, v, seg, sinks, do = _inputs()  # float32
    fn = lambda q, k, v, seg, s: flash_tpu.flash_attention(q, k, v, seg, s, window=5, interpret=True)  # noqa: E731
    _assert_close_f32(_value_and_grads(fn, q, k, v, seg, sinks, do), _float64_reference(q, k, v, seg, sinks, do, 5, 0.0))


def test_kernel_with_sinks_under_a_mesh_sums_the_sink_gradient_over_shards():
    """attend_fn's per-device kernel (data x tensor: batch and heads split) gives the unsplit gradients."""
    from maxlm import mesh as mesh_lib, sharding
    from maxlm.config import load
    cfg = load(None, ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=2", "model.n_heads=4", "model.n_kv_heads=2",
                      "model.head_dim=16", "model.attn_sinks=true", "attention=flash", "dtype=float32"])
    m = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, 4), jax.devices()[:4])
    q, k, v, seg, sinks, do = _inputs()  # float32
    with sharding.use(m, sharding.rules(cfg)):
        attend = attention.attend_fn("flash", cfg.model, "float32")
        got = jax.jit(lambda *a: _value_and_grads(lambda q, k, v, seg, s: attend(q, k, v, seg, window=0, softcap=0.0,
                                                                                 scale=0.0, sinks=s), *a))(
            q, k, v, seg, sinks, do)
    _assert_close_f32(got, _float64_reference(q, k, v, seg, sinks, do, 0, 0.0))


def test_a_model_with_sinks_trains_them():
    """The sinks are parameters [layers, heads], start at 0 (a logit of 0 is already in every softmax),
    get a gradient, and are not weight-decayed."""
    from maxlm import models
    from maxlm.config import load
    from maxlm.models import params as P_
    from maxlm.optim import decay_mask
    m = load(None, ["model.attn_sinks=true", "model.n_layers=2", "dtype=float32"]).model
    specs = models.get("llama").param_specs(m)
    assert specs["layers"]["sinks"].shape == (2, m.n_heads) and not decay_mask(specs)["layers"]["sinks"]
    params = P_.init(specs, jax.random.key(0))
    toks = jax.random.randint(jax.random.key(1), (2, 16), 0, m.vocab_size)
    pos, seg = jnp.broadcast_to(jnp.arange(16), (2, 16)), jnp.ones((2, 16), jnp.int32)
    loss = lambda p: models.apply(p, toks, pos, seg, m, jnp.float32).logits.std()  # noqa: E731
    g = jax.jit(jax.grad(loss))(params)["layers"]["sinks"]
    assert g.shape == (2, m.n_heads) and float(jnp.abs(g).min()) > 0
