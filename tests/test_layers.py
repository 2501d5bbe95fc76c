import jax.numpy as jnp
import numpy as np

from maxlm.layers.attention import reference_attention
from maxlm.layers.norm import rms_norm
from maxlm.layers.rope import apply_rope, rope_angles

rng = np.random.default_rng(0)


def test_rms_norm_matches_numpy_and_computes_in_float32():
    x = rng.normal(size=(2, 3, 16)).astype(np.float32)
    w = rng.normal(size=16).astype(np.float32)
    want = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-5), want, rtol=1e-5, atol=1e-6)
    y = rms_norm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w), 1e-5)
    assert y.dtype == jnp.bfloat16


def test_rope_scores_depend_only_on_relative_position():
    q = jnp.asarray(rng.normal(size=(1, 1, 1, 32)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 1, 32)), jnp.float32)

    def score(pq, pk):
        sq, cq = rope_angles(jnp.array([[pq]]), 32, 10000.0)
        sk, ck = rope_angles(jnp.array([[pk]]), 32, 10000.0)
        return float(jnp.sum(apply_rope(q, sq, cq) * apply_rope(k, sk, ck)))

    assert abs(score(5, 2) - score(103, 100)) < 1e-4
    assert abs(score(5, 2) - score(5, 4)) > 1e-3


def _naive(q, k, v, seg, causal=True):
    B, L, H, D = q.shape
    G = H // k.shape[2]
    k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    s = np.einsum("blhd,bshd->bhls", q, k) / np.sqrt(D)
    mask = (seg[:, :, None] == seg[:, None, :])
    if causal:
        mask &= np.tril(np.ones((L, L), bool))[None]
    s = np.where(mask[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhls,bshd->blhd", p, v)


def test_attention_gqa_and_segments_match_naive():
    B, L, H, K, D = 2, 12, 6, 2, 8
    q = rng.normal(size=(B, L, H, D))
    k = rng.normal(size=(B, L, K, D))
    v = rng.normal(size=(B, L, K, D))
    seg = np.array([[1] * 5 + [2] * 7, [1] * 12])
    got = reference_attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), jnp.asarray(seg), jnp.asarray(seg))
    np.testing.assert_allclose(got, _naive(q, k, v, seg), rtol=1e-5, atol=1e-5)


def test_attention_never_crosses_segments_or_looks_ahead():
    B, L, H, D = 1, 10, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(B, L, H, D)), jnp.float32) for _ in range(3))
    seg = jnp.array([[1] * 4 + [2] * 6])
    base = reference_attention(q, k, v, seg, seg)
    # Changing document 1 leaves document 2 unchanged; changing the future leaves the past unchanged.
    k2, v2 = k.at[:, :4].set(0.0), v.at[:, :4].set(7.0)
    np.testing.assert_array_equal(reference_attention(q, k2, v2, seg, seg)[:, 4:], base[:, 4:])
    k3, v3 = k.at[:, 7:].set(3.0), v.at[:, 7:].set(-1.0)
    np.testing.assert_array_equal(reference_attention(q, k3, v3, seg, seg)[:, :7], base[:, :7])
    assert not np.allclose(reference_attention(q, k3, v3, seg, seg)[:, 7:], base[:, 7:])
