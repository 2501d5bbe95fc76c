import jax
import jax.numpy as jnp

from maxlm.layers.norm import rms_norm
from maxlm.layers.rope import apply_rope
from maxlm.sharding import constrain


def reference_attention(q_BLHD, k_BSKD, v_BSKD, seg_BL, seg_BS, *, q_offset=0, window=0, softcap=0.0,
                        scale=0.0) -> jax.Array:
    """Plain XLA causal softmax attention with GQA, packed-sequence masking, a sliding window and
    score soft-capping.

    Query i sits at key slot `q_offset + i` (the KV cache's write index when decoding). It sees key s
    when their segment ids match (0 is padding), s is not after it, and, with `window` > 0, s is one
    of its last `window` slots. `window` may be traced (per-layer in a scan). Query heads are grouped
    over their shared K/V head (H = K*G), so repeated K/V is never built. Scores and softmax run in
    float32, or float64 for float64 inputs: the kernel tests use this function as their exact reference.
    """
    B, L, H, Dh = q_BLHD.shape
    S, K = k_BSKD.shape[1], k_BSKD.shape[2]
    q_BLKGD = q_BLHD.reshape(B, L, K, H // K, Dh)
    acc = jnp.promote_types(q_BLHD.dtype, jnp.float32)
    s_BKGLS = jnp.einsum("blkgd,bskd->bkgls", q_BLKGD, k_BSKD, preferred_element_type=acc)
    s_BKGLS = s_BKGLS * (scale or Dh ** -0.5)
    if softcap:
        s_BKGLS = softcap * jnp.tanh(s_BKGLS / softcap)
    qi_L1 = q_offset + jnp.arange(L)[:, None]
    d_LS = qi_L1 - jnp.arange(S)[None, :]
    mask_BLS = (seg_BL[:, :, None] == seg_BS[:, None, :]) & (d_LS >= 0)[None]
    mask_BLS &= ((d_LS < window) | (window <= 0))[None]
    s_BKGLS = jnp.where(mask_BLS[:, None, None], s_BKGLS, -1e30)
    p_BKGLS = jax.nn.softmax(s_BKGLS, axis=-1)
    o_BLKGD = jnp.einsum("bkgls,bskd->blkgd", p_BKGLS.astype(v_BSKD.dtype), v_BSKD)
    return o_BLKGD.reshape(B, L, H, Dh)


def _proj(x_BLD, w, b, dt):
    y = jnp.einsum("bld,d...->bl...", x_BLD, w.astype(dt))
    return y if b is None else y + b.astype(dt)


def self_attention(p: dict, x_BLD, ctx, m, window=0, norm_offset: float = 0.0):
    """Project, position and attend; returns (out_BLD, (k, v) as written to the cache or None).

    The parameter tree decides the variant: `bq`/`bk`/`bv`/`bo` add biases (GPT-2), `q_norm`/`k_norm`
    normalise each head before RoPE (Qwen3). `ctx` carries RoPE angles (None: no RoPE), segment ids,
    and the layer's KV cache slice (None when not decoding).
    """
    dt = x_BLD.dtype
    q_BLHD = _proj(x_BLD, p["wq"], p.get("bq"), dt)
    k_BLKD = _proj(x_BLD, p["wk"], p.get("bk"), dt)
    v_BLKD = _proj(x_BLD, p["wv"], p.get("bv"), dt)
    if "q_norm" in p:
        q_BLHD = rms_norm(q_BLHD, p["q_norm"], m.norm_eps, norm_offset)
        k_BLKD = rms_norm(k_BLKD, p["k_norm"], m.norm_eps, norm_offset)
    if ctx.rope is not None:
        q_BLHD, k_BLKD = apply_rope(q_BLHD, *ctx.rope), apply_rope(k_BLKD, *ctx.rope)
    q_BLHD = constrain(q_BLHD, ("batch", "length", "heads", "head_dim"))
    k_BLKD = constrain(k_BLKD, ("batch", "length", "kv_heads", "head_dim"))
    v_BLKD = constrain(v_BLKD, ("batch", "length", "kv_heads", "head_dim"))
    kv = None
    if ctx.cache_kv is None:
        k_BSKD, v_BSKD, seg_BS, offset = k_BLKD, v_BLKD, ctx.seg_BL, 0
    else:  # decoding: write this step's keys at the cache index and attend over the whole cache
        at = (0, ctx.cache_index, 0, 0)
        k_BSKD = jax.lax.dynamic_update_slice(ctx.cache_kv[0], k_BLKD.astype(ctx.cache_kv[0].dtype), at)
        v_BSKD = jax.lax.dynamic_update_slice(ctx.cache_kv[1], v_BLKD.astype(ctx.cache_kv[1].dtype), at)
        seg_BS, offset, kv = ctx.cache_seg, ctx.cache_index, (k_BSKD, v_BSKD)
    o_BLHD = reference_attention(q_BLHD, k_BSKD.astype(dt), v_BSKD.astype(dt), ctx.seg_BL, seg_BS, q_offset=offset,
                                 window=window, softcap=m.attn_softcap, scale=m.attn_scale)
    out_BLD = jnp.einsum("blhk,hkd->bld", o_BLHD, p["wo"].astype(dt))
    if "bo" in p:
        out_BLD = out_BLD + p["bo"].astype(dt)
    return out_BLD, kv
