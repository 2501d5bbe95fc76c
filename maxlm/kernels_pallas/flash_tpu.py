"""Flash attention for TPU: JAX's splash attention (Pallas Mosaic) behind maxlm's attention semantics.

Why it is built this way:
- Splash already has tuned forward, dq and dkv kernels with a custom_vjp, block skipping for masks known
  ahead of time, segment ids and logit soft-capping, so maxlm only supplies the glue: the causal or
  sliding-window mask (static, so fully masked blocks are never visited), the score scale (applied to q
  outside the kernel, so autodiff carries it into dq), batching (vmap) and padding.
- Splash's MHA kernel maps query head h to kv head h // G in its index maps, so GQA/MQA reads each K/V
  head in place: repeated K/V is never built, and neither pass holds an L x L tensor.
- Splash wants [heads, L, D] per example; the model's [B, L, H, D] is transposed at the boundary.
- L is padded to a block multiple at the end: causality alone keeps every real query off the pad keys,
  and pad rows are sliced away (their zero cotangent contributes nothing to dk/dv).
- head_dim is not padded: Mosaic compiles the 64-wide tiles as they are (checked for v5p/v6e), and 128 and
  256 are lane multiples already.
- The backward uses separate dq and dkv kernels rather than splash's fused one, whose dq partials are
  [L / block_k, H, L, D] float32.
- The kernel is built at each trace (the model traces it once per layer scan): its mask info becomes
  constants of that trace, so it cannot be cached across traces, and the numpy work is small
  ((L / block)^2 blocks).
- Splash's pallas_calls declare no varying mesh axes, so the caller's shard_map needs check_vma=False.
- interpret=True hands `pltpu.InterpretParams()` to every pallas_call, so forward and backward both run
  in TPU interpret mode on CPU without a context manager around the caller's trace.
"""

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

_LANES = 128
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def default_block(length: int) -> int:
    """Largest of 512/256/128 dividing `length` (a multiple of 128): big tiles keep the v5p/v6e MXUs busy
    and amortise per-step overhead, and a divisor adds no padding beyond the next multiple of 128."""
    return next(b for b in (512, 256, _LANES) if length % b == 0)


def _kernel(heads: int, length: int, window: int, softcap: float, block_q: int, block_k: int,
            interpret: bool):
    shape = (length, length)
    mask = masks.LocalMask(shape, (window - 1, 0), 0) if window > 0 else masks.CausalMask(shape)
    blocks = splash.BlockSizes(
        block_q=block_q, block_kv=block_k, block_kv_compute=block_k,
        block_q_dkv=block_q, block_kv_dkv=block_k, block_kv_dkv_compute=block_k,
        block_q_dq=block_q, block_kv_dq=block_k)
    return splash.make_splash_mha(
        masks.MultiHeadMask([mask] * heads), block_sizes=blocks, head_shards=1, q_seq_shards=1,
        attn_logits_soft_cap=softcap or None, interpret=pltpu.InterpretParams() if interpret else False)


def _check(q_BLHD, k_BLKD, v_BLKD, seg_BL, window, block_q, block_k):
    if q_BLHD.ndim != 4 or k_BLKD.shape != v_BLKD.shape or k_BLKD.ndim != 4:
        raise ValueError(f"flash_attention: expected q [B, L, H, D] and k, v [B, L, K, D] of one shape; got "
                         f"q {q_BLHD.shape}, k {k_BLKD.shape}, v {v_BLKD.shape}")
    B, L, H, D = q_BLHD.shape
    if k_BLKD.shape[:2] != (B, L) or k_BLKD.shape[3] != D:
        raise ValueError(f"flash_attention: k/v {k_BLKD.shape} must match q {q_BLHD.shape} in batch, length "
                         f"and head_dim (self-attention only)")
    if H % k_BLKD.shape[2]:
        raise ValueError(f"flash_attention: {H} query heads are not a multiple of {k_BLKD.shape[2]} kv heads; "
                         f"set num_heads to a multiple of num_kv_heads")
    dts = {jnp.dtype(x.dtype) for x in (q_BLHD, k_BLKD, v_BLKD)}
    if len(dts) != 1 or not dts <= set(_DTYPES):
        raise ValueError(f"flash_attention: q, k, v dtypes {sorted(map(str, dts))} unsupported; cast all three "
                         f"to float32 or bfloat16")
    if seg_BL.shape != (B, L) or not jnp.issubdtype(seg_BL.dtype, jnp.integer):
        raise ValueError(f"flash_attention: segment ids {seg_BL.dtype}{list(seg_BL.shape)} must be integer "
                         f"[B, L] = [{B}, {L}]")
    if window < 0:
        raise ValueError(f"flash_attention: window {window} is negative; use 0 for full causal attention")
    if getattr(getattr(jax.typeof(q_BLHD), "mat", None), "varying", None):
        raise ValueError("flash_attention: call it inside jax.shard_map(..., check_vma=False); splash's Pallas "
                         "kernels do not declare how their outputs vary over mesh axes")
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if b is not None and (b <= 0 or b % _LANES):
            raise ValueError(f"flash_attention: {name}={b} must be a positive multiple of {_LANES}")


def flash_attention(q_BLHD, k_BLKD, v_BLKD, seg_BL, *, window: int = 0, softcap: float = 0.0,
                    scale: float = 0.0, interpret: bool = False, block_q: int | None = None,
                    block_k: int | None = None) -> jax.Array:
    """Causal GQA attention over packed segments (0 = padding) with an optional sliding `window` and score
    soft-cap; same semantics as `maxlm.layers.attention.reference_attention`. Call per device shard (inside
    shard_map): Mosaic kernels cannot be partitioned automatically. Returns o [B, L, H, D] in q's dtype."""
    _check(q_BLHD, k_BLKD, v_BLKD, seg_BL, window, block_q, block_k)
    B, L, H, D = q_BLHD.shape
    bq = block_q or default_block(_round_up(L, _LANES))
    bk = block_k or default_block(_round_up(L, _LANES))
    Lp = _round_up(L, math.lcm(bq, bk))
    kernel = _kernel(H, Lp, int(window), float(softcap), bq, bk, bool(interpret))

    q_BLHD = (q_BLHD.astype(jnp.float32) * (scale or D ** -0.5)).astype(q_BLHD.dtype)
    pad = ((0, 0), (0, Lp - L), (0, 0), (0, 0))
    q_BHLD, k_BKLD, v_BKLD = (jnp.pad(x, pad).transpose(0, 2, 1, 3) for x in (q_BLHD, k_BLKD, v_BLKD))
    seg_BL = jnp.pad(seg_BL.astype(jnp.int32), ((0, 0), (0, Lp - L)), constant_values=-1)
    one = lambda q_HLD, k_KLD, v_KLD, seg_L: kernel(q_HLD, k_KLD, v_KLD, splash.SegmentIds(seg_L, seg_L))  # noqa: E731
    # vmap makes batch a grid axis of one kernel; TPU interpret mode (jax 0.11) mis-sizes that grid for
    # B > 1, so interpret runs examples one after another instead.
    batched = jax.vmap(one) if not interpret or B == 1 else lambda *xs: jax.lax.map(lambda x: one(*x), xs)
    o_BHLD = batched(q_BHLD, k_BKLD, v_BKLD, seg_BL)
    return o_BHLD.transpose(0, 2, 1, 3)[:, :L].astype(q_BLHD.dtype)
