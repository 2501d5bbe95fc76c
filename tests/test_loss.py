"""maxlm.layers.loss: the chunked cross-entropy equals the plain one (loss and both gradients), never
holds [B, L, V] float32 logits, and gives the one-device result on a sharded mesh."""

import math
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT
from jax.sharding import NamedSharding, PartitionSpec as P

from maxlm import mesh as mesh_lib, sharding
from maxlm.layers import loss

sys.path.insert(0, str(ROOT / "benchmarks"))
import hlo_count  # noqa: E402

RULES = (("batch", ("data", "fsdp", "expert")), ("length", "context"), ("embed", "fsdp"), ("vocab", "tensor"))


def inputs(B, L, D, V, dtype=jnp.float32, mask="bool", seed=0):
    """x, w, targets, mask (bool, int or float weights, a quarter zero) and a loss cotangent g. numpy's
    generator: jax.random would compile a dozen eager ops per test."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((B, L, D), np.float32)).astype(dtype)
    w = jnp.asarray(rng.standard_normal((D, V), np.float32))
    t = jnp.asarray(rng.integers(0, V, (B, L), np.int32))
    keep = rng.random((B, L)) < 0.75
    weights = (keep * rng.uniform(0.5, 2.0, (B, L))).astype(np.float32)
    m = {"bool": keep, "int": keep.astype(np.int32), "float": weights}[mask]
    return x, w, t, jnp.asarray(m), jnp.asarray(rng.standard_normal((B, L), np.float32))


def loss_and_grads(fn, x, w, t, m, g):
    """fn's loss [B, L] and the gradients of sum(g * loss) w.r.t. x and w."""
    out, vjp = jax.vjp(lambda x, w: fn(x, w, t, m), x, w)
    return (out, *vjp(g))


def rel(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("softcap, chunks, mask, temperature", [(0.0, None, "bool", 1.0), (0.0, (3, 5), "float", 0.7),
                                                                (5.0, (2, 4), "int", 1.0), (5.0, (13, 37), "bool", 1.6)])
def test_matches_reference(softcap, chunks, mask, temperature):
    # L = 13, V = 37 divide no chunk count: (3, 5) and (2, 4) pad tokens and vocab; (13, 37) is one token
    # x one column per step; None is the automatic plan (one chunk at this size). A temperature divides the
    # (capped) logits: a sampler's distribution.
    x, w, t, m, g = inputs(2, 13, 8, 37, mask=mask)
    kw = dict(softcap=softcap, temperature=temperature)
    ours = jax.jit(lambda *a: loss_and_grads(lambda *b: loss.cross_entropy(*b, **kw, chunks=chunks), *a))
    ref = jax.jit(lambda *a: loss_and_grads(lambda *b: loss.reference(*b, **kw), *a))
    got, want = ours(x, w, t, m, g), ref(x, w, t, m, g)
    assert float(jnp.max(jnp.abs(got[0] * (m == 0)))) == 0.0  # masked tokens: exactly zero
    for name, a, b in zip(("loss", "dx", "dw"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel(a, b) < 1e-6, (name, rel(a, b))
    if temperature != 1.0:  # the reference's own temperature is the direct formula's
        z = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        z = (softcap * np.tanh(z / softcap) if softcap else z) / temperature
        lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
        direct = (lse - np.take_along_axis(z, np.asarray(t)[..., None], -1)[..., 0]) * np.asarray(m, np.float64)
        np.testing.assert_allclose(want[0], direct, rtol=1e-5, atol=1e-5)


def test_bfloat16_activations():
    x, w, t, m, g = inputs(2, 24, 16, 300, dtype=jnp.bfloat16)
    run = lambda fn: jax.jit(lambda *a: loss_and_grads(fn, *a))(x, w, t, m, g)  # noqa: E731
    got = run(lambda *b: loss.cross_entropy(*b, softcap=30.0, chunks=(4, 8)))
    want = run(lambda *b: loss.reference(*b, softcap=30.0))
    assert got[0].dtype == jnp.float32 and got[1].dtype == jnp.bfloat16 and got[2].dtype == jnp.float32
    for name, a, b in zip(("loss", "dx", "dw"), got, want):
        assert rel(a, b) < 2e-2, (name, rel(a, b))


def test_tied_embedding_transpose():
    x, w, t, m, g = inputs(2, 8, 8, 40)
    embed_VD = w.T
    f = lambda fn: jax.jit(jax.grad(lambda e: jnp.sum(g * fn(x, e.T, t, m))))(embed_VD)  # noqa: E731
    assert rel(f(lambda *a: loss.cross_entropy(*a, chunks=(2, 4))), f(loss.reference)) < 1e-6


def shapes_in(hlo: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\b[a-z]+\d*\[([\d,]*)\]", hlo)]


def test_never_materialises_logits():
    B, L, D, V = 2, 64, 16, 512
    x, w, t, m, _ = inputs(B, L, D, V)

    def biggest(fn) -> int:
        step = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(fn(x, w, t, m)), argnums=(0, 1)))
        return max(math.prod(s) for s in shapes_in(step.lower(x, w).compile().as_text()))

    assert biggest(loss.reference) >= B * L * V  # the check can fail: the plain loss shows the array
    assert biggest(lambda *a: loss.cross_entropy(*a, softcap=30.0, chunks=(4, 8))) < B * L * V


def test_plan_bounds_chunks():
    for B, L, V, devices in [(1, 2048, 32000, 1), (8, 8192, 256000, 8), (1, 8192, 256000, 1), (4, 512, 50257, 1),
                             (256, 8192, 262144, 256), (2, 16, 100, 1)]:
        n, nv = loss.plan(B, L, V, devices)
        assert n & (n - 1) == 0 and nv & (nv - 1) == 0 and n <= L and n * nv <= loss._MAX_STEPS
        assert -(-V // nv) >= min(V, loss._MIN_COLS)
        fits = B * -(-L // n) * -(-V // nv) * 4 <= loss._BUDGET_BYTES * devices
        assert fits or n == L or n * nv * 2 > loss._MAX_STEPS, (B, L, V, n, nv)
    assert loss.plan(2, 16, 100) == (1, 1)


def test_sharded_mesh_matches_one_device():
    mesh = mesh_lib.make_mesh({"data": 1, "fsdp": 2, "tensor": 2, "expert": 1, "context": 2}, jax.devices())
    B, L, D, V = 4, 32, 16, 96
    x, w, t, m, g = inputs(B, L, D, V)
    fn = lambda *a: loss_and_grads(lambda *b: loss.cross_entropy(*b, softcap=5.0, chunks=(2, 4)), *a)  # noqa: E731
    one = jax.jit(fn)(x, w, t, m, g)
    tokens, table = P(("data", "fsdp", "expert"), "context"), P("fsdp", "tensor")
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in
            ((x, P(*tokens, None)), (w, table), (t, tokens), (m, tokens), (g, tokens))]
    with sharding.use(mesh, RULES):
        step = jax.jit(fn)
        got = step(*args)
        hlo = step.lower(*args).compile().as_text()
    for name, a, b in zip(("loss", "dx", "dw"), got, one):
        assert rel(a, b) < 1e-6, (name, rel(a, b))
    # Strided chunks stay local: the only all-gather is the table over fsdp (D x V/tensor), as a plain
    # matmul needs; no sequence is gathered.
    gathered = [math.prod(shapes_in(line.split("all-gather(")[0])[0])
                for line in hlo.splitlines() if " all-gather(" in line]
    assert gathered and all(n <= D * V // 2 for n in gathered), gathered
    # Each vocab chunk's dw is reduced once, as a reduce-scatter over fsdp (the table's layout), after its
    # token chunks are summed locally: 4 a step, not one all-reduce per (token chunk, vocab chunk) step.
    # The rest of a chunk's token axes (context) is an all-reduce of its [D, V/4/tensor] block, also 4 a step.
    assert hlo_count.collectives(hlo)["reduce-scatter"]["ops"] == 4
    runs = hlo_count.runs(comps := hlo_count.computations(hlo))
    chunk_sums = sum(runs[name] for name, lines in comps.items() if name != "ENTRY" for line in lines
                     if re.search(rf"= f32\[{D},{V // 4 // 2}\]\S* all-reduce\(", line))
    assert chunk_sums == 4
