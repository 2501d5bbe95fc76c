"""Flash attention for TPU: JAX's splash attention (Pallas Mosaic) behind maxlm's attention semantics.

Three entry points:
- `flash_attention`: causal self-attention, differentiable (splash's own custom_vjp).
- `block_forward` / `block_backward`: one (query chunk, key chunk) block of ring attention (context
  parallelism). Queries sit `offset` positions after the keys' first position; the forward also returns
  the float32 log-sum-exp so the ring can merge partial outputs, and the backward takes the ring's
  merged (global) o and lse, FlashAttention style. The ring's custom_vjp owns differentiation: neither
  block function is differentiable itself.

Why it is built this way:
- Splash already has tuned forward, dq and dkv kernels with a custom_vjp, block skipping for masks known
  ahead of time, segment ids and logit soft-capping, so maxlm only supplies the glue: the causal or
  sliding-window mask (static, so fully masked blocks are never visited), the score scale (applied to q
  outside the kernel, so autodiff carries it into dq), batching (vmap) and padding.
- A block's offset is splash's own mask offset (`CausalMask`/`LocalMask` shift the diagonal by it), so
  blocks beside the diagonal keep block skipping; a block no query can see is answered without a kernel.
- Splash's backward rule takes its residuals (o, logsumexp) as arguments, so `block_backward` calls that
  rule with the ring's global o and lse (`_splash_backward`, the one private entry point used).
- Splash's MHA kernel maps query head h to kv head h // G in its index maps, so GQA/MQA reads each K/V
  head in place: repeated K/V is never built, and neither pass holds an L x L tensor.
- Splash wants [heads, L, D] per example; the model's [B, L, H, D] is transposed at the boundary.
- L is padded to a block multiple at the end with segment id -1, which no real query or key carries, so
  pad keys stay invisible at any offset; pad rows are sliced away (their zero cotangent contributes
  nothing to dk/dv).
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
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

from maxlm.sharding import device_kind

_LANES = 128
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# Splash's forward leaves a row that sees nothing at lse = mask_value + log(n) (or -inf where no block of
# the row ran) with o the mean of the masked values (or NaN); any real lse is far above this.
_UNSEEN_LSE = splash.DEFAULT_MASK_VALUE / 2


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class Tiles(NamedTuple):
    """Splash's block sizes: query and key rows per block of the forward, dkv and dq kernels."""
    q: int
    kv: int
    q_dkv: int
    kv_dkv: int
    q_dq: int
    kv_dq: int


# Tiles by (device kind, head_dim): bigger query blocks cut the number of passes over K and V; key blocks
# bound the float32 scores a block holds in VMEM (q x kv x 4 bytes, under libtpu's default 16 MiB of scoped
# VMEM at 1024 x 512 without raising its limit). The rows are MaxText's published llama3-8b-8192 recipes
# for v5p ("TPU v5") and v6e ("TPU v6 lite"); what each costs is in benchmarks/RESULTS.md ("Splash tiles").
# Every other chip and head_dim takes DEFAULT_TILES, MaxText's own defaults.
TILES = {("TPU v5", 128): Tiles(1024, 512, 2048, 512, 2048, 512),
         ("TPU v6 lite", 128): Tiles(1024, 512, 2048, 512, 2048, 512)}
DEFAULT_TILES = Tiles(512, 512, 512, 512, 512, 512)


def _fit(length: int, want: int) -> int:
    """The largest of want, want/2, ... 128 that divides `length` (a multiple of 128): no padding beyond the
    next multiple of 128."""
    b = want
    while b > _LANES and length % b:
        b //= 2
    return b if length % b == 0 else _LANES


def tiles(L: int, head_dim: int, block_q: int | None = None, block_k: int | None = None) -> tuple[Tiles, int]:
    """(the tiles, the padded length) for L tokens: `block_q`/`block_k`, if given, set every kernel's query or
    key blocks (the ring's blocks and the tests choose theirs); the rest come from TILES for this chip."""
    t = Tiles(*(_fit(_round_up(L, _LANES), b) for b in TILES.get((device_kind(), head_dim), DEFAULT_TILES)))
    if block_q:
        t = t._replace(q=block_q, q_dkv=block_q, q_dq=block_q)
    if block_k:
        t = t._replace(kv=block_k, kv_dkv=block_k, kv_dq=block_k)
    return t, _round_up(L, math.lcm(*t))


def _mask(length: int, offset: int, window: int) -> masks.Mask:
    """Query i sees key j iff 0 <= offset + i - j (< window): splash's offset shifts the diagonal alike."""
    shape = (length, length)
    if window > 0:
        return masks.LocalMask(shape, (window - 1, 0), offset)
    return masks.FullMask(shape) if offset >= length - 1 else masks.CausalMask(shape, offset)


def _sees_nothing(length: int, offset: int, window: int) -> bool:
    """The nearest pair (query 0, key L - 1) is still `window` or more apart."""
    return window > 0 and offset - (length - 1) >= window


def _kernel(heads: int, length: int, window: int, softcap: float, t: Tiles, interpret: bool, offset: int = 0,
            save_residuals: bool = False):
    blocks = splash.BlockSizes(
        block_q=t.q, block_kv=t.kv, block_kv_compute=t.kv, block_q_dkv=t.q_dkv, block_kv_dkv=t.kv_dkv,
        block_kv_dkv_compute=t.kv_dkv, block_q_dq=t.q_dq, block_kv_dq=t.kv_dq)
    return splash.make_splash_mha(
        masks.MultiHeadMask([_mask(length, offset, window)] * heads), block_sizes=blocks, head_shards=1,
        q_seq_shards=1, attn_logits_soft_cap=softcap or None, save_residuals=save_residuals,
        interpret=pltpu.InterpretParams() if interpret else False)


def _splash_backward(kernel, q_HLD, k_KLD, v_KLD, seg, o_HLD, lse_HL, do_HLD):
    """Splash's custom_vjp backward rule (its dq and dkv kernels) on residuals we supply, so the ring's
    global o and lse stand in for the block's own. Written against jax 0.11.2, where the rule is
    `_splash_attention_bwd(<the kernel's 8 static kwargs>, res, do)` with res = (q, k, v, segment_ids,
    sinks, o, logsumexp, dq_mask_info, dkv_mask_info), and returns cotangents for (fwd, dq, dkv mask
    infos, q, k, v, segment_ids, sinks). A renamed argument fails here loudly rather than silently.
    (_splash_attention's collapse of partial mask blocks only reshapes dynamic masks; ours are static.)"""
    res = (q_HLD, k_KLD, v_KLD, seg, None, o_HLD, lse_HL, kernel.dq_mask_info, kernel.dkv_mask_info)
    _, _, _, dq_HLD, dk_KLD, dv_KLD, _, _ = splash._splash_attention_bwd(**kernel.kwargs, res=res, do=do_HLD)
    return dq_HLD, dk_KLD, dv_KLD


def _check(q_BLHD, k_BLKD, v_BLKD, segs_BL, window, block_q, block_k, offset=0):
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
    for seg_BL in segs_BL:
        if seg_BL.shape != (B, L) or not jnp.issubdtype(seg_BL.dtype, jnp.integer):
            raise ValueError(f"flash_attention: segment ids {seg_BL.dtype}{list(seg_BL.shape)} must be integer "
                             f"[B, L] = [{B}, {L}]")
    if window < 0:
        raise ValueError(f"flash_attention: window {window} is negative; use 0 for full causal attention")
    if not isinstance(offset, int) or offset < 0:
        raise ValueError(f"flash_attention: offset {offset!r} must be a static Python int >= 0")
    if getattr(getattr(jax.typeof(q_BLHD), "mat", None), "varying", None):
        raise ValueError("flash_attention: call it inside jax.shard_map(..., check_vma=False); splash's Pallas "
                         "kernels do not declare how their outputs vary over mesh axes")
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if b is not None and (b <= 0 or b % _LANES):
            raise ValueError(f"flash_attention: {name}={b} must be a positive multiple of {_LANES}")


def _scaled(q_BLHD, scale: float):
    return (q_BLHD.astype(jnp.float32) * (scale or q_BLHD.shape[-1] ** -0.5)).astype(q_BLHD.dtype)


def _to_kernel(x_BLHD, Lp: int):
    """[B, L, H, D] -> zero-padded [B, H, Lp, D]."""
    return jnp.pad(x_BLHD, ((0, 0), (0, Lp - x_BLHD.shape[1]), (0, 0), (0, 0))).transpose(0, 2, 1, 3)


def _from_kernel(x_BHLD, L: int, dtype):
    return x_BHLD.transpose(0, 2, 1, 3)[:, :L].astype(dtype)


def _pad_seg(seg_BL, Lp: int):
    return jnp.pad(seg_BL.astype(jnp.int32), ((0, 0), (0, Lp - seg_BL.shape[1])), constant_values=-1)


def _batched(one, interpret: bool, B: int):
    # vmap makes batch a grid axis of one kernel; TPU interpret mode (jax 0.11) mis-sizes that grid for
    # B > 1, so interpret runs examples one after another instead.
    return jax.vmap(one) if not interpret or B == 1 else lambda *xs: jax.lax.map(lambda x: one(*x), xs)


def flash_attention(q_BLHD, k_BLKD, v_BLKD, seg_BL, sinks_H=None, *, window: int = 0, softcap: float = 0.0,
                    scale: float = 0.0, interpret: bool = False, block_q: int | None = None,
                    block_k: int | None = None) -> jax.Array:
    """Causal GQA attention over packed segments (0 = padding) with an optional sliding `window` and score
    soft-cap; same semantics as `maxlm.layers.attention.reference_attention`. Call per device shard (inside
    shard_map): Mosaic kernels cannot be partitioned automatically. Returns o [B, L, H, D] in q's dtype.
    `sinks_H` (gpt-oss) goes to splash's own `sinks` argument, which its backward differentiates."""
    _check(q_BLHD, k_BLKD, v_BLKD, (seg_BL,), window, block_q, block_k)
    B, L, H, D = q_BLHD.shape
    t, Lp = tiles(L, D, block_q, block_k)
    kernel = _kernel(H, Lp, int(window), float(softcap), t, bool(interpret))
    q_BHLD, k_BKLD, v_BKLD = (_to_kernel(x, Lp) for x in (_scaled(q_BLHD, scale), k_BLKD, v_BLKD))
    sinks_H = None if sinks_H is None else sinks_H.astype(jnp.float32)
    one = lambda q_HLD, k_KLD, v_KLD, seg_L: kernel(q_HLD, k_KLD, v_KLD, splash.SegmentIds(seg_L, seg_L), sinks_H)  # noqa: E731
    o_BHLD = _batched(one, interpret, B)(q_BHLD, k_BKLD, v_BKLD, _pad_seg(seg_BL, Lp))
    return _from_kernel(o_BHLD, L, q_BLHD.dtype)


def block_forward(q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, *, offset: int = 0, window: int = 0,
                  softcap: float = 0.0, scale: float = 0.0, interpret: bool = False, block_q: int | None = None,
                  block_k: int | None = None) -> tuple[jax.Array, jax.Array]:
    """One ring-attention block: query i at position `offset + i` sees key j at position j iff their
    segment ids match and 0 <= offset + i - j (< window when window > 0). Returns o [B, L, H, D] (normalised,
    q's dtype) and lse [B, H, L] (float32, natural log; -inf with o = 0 for a row that sees nothing).
    Not differentiable: the ring's custom_vjp calls `block_backward`."""
    _check(q_BLHD, k_BLKD, v_BLKD, (qseg_BL, kseg_BL), window, block_q, block_k, offset)
    B, L, H, D = q_BLHD.shape
    if _sees_nothing(L, offset, window):
        return jnp.zeros_like(q_BLHD), jnp.full((B, H, L), -jnp.inf, jnp.float32)
    t, Lp = tiles(L, D, block_q, block_k)
    kernel = _kernel(H, Lp, int(window), float(softcap), t, bool(interpret), offset, save_residuals=True)
    q_BHLD, k_BKLD, v_BKLD = (_to_kernel(x, Lp) for x in (_scaled(q_BLHD, scale), k_BLKD, v_BLKD))

    def one(q_HLD, k_KLD, v_KLD, qseg_L, kseg_L):
        o_HLD, (lse_HL,) = kernel(q_HLD, k_KLD, v_KLD, splash.SegmentIds(qseg_L, kseg_L))
        return o_HLD, lse_HL

    o_BHLD, lse_BHL = _batched(one, interpret, B)(q_BHLD, k_BKLD, v_BKLD, _pad_seg(qseg_BL, Lp),
                                                  _pad_seg(kseg_BL, Lp))
    seen_BHL = lse_BHL[:, :, :L] > _UNSEEN_LSE
    o_BLHD = jnp.where(seen_BHL.transpose(0, 2, 1)[..., None], _from_kernel(o_BHLD, L, jnp.float32), 0)
    return o_BLHD.astype(q_BLHD.dtype), jnp.where(seen_BHL, lse_BHL[:, :, :L], -jnp.inf)


def block_backward(q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, o_BLHD, lse_BHL, do_BLHD, *, offset: int = 0,
                   window: int = 0, softcap: float = 0.0, scale: float = 0.0, interpret: bool = False,
                   block_q: int | None = None, block_k: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of one block (masking as `block_forward`) given the output o and log-sum-exp lse of the
    whole row (the ring's merge): p = exp(s - lse), dv = p^T do, ds = p (do v^T - rowsum(o do)), dq = ds k
    scale, dk = ds^T q scale. With the block's own o and lse this is the gradient of flash_attention at
    offset 0. Returns (dq [B, L, H, D], dk, dv [B, L, K, D]) in their inputs' dtypes."""
    _check(q_BLHD, k_BLKD, v_BLKD, (qseg_BL, kseg_BL), window, block_q, block_k, offset)
    B, L, H, D = q_BLHD.shape
    if o_BLHD.shape != q_BLHD.shape or do_BLHD.shape != q_BLHD.shape or lse_BHL.shape != (B, H, L):
        raise ValueError(f"block_backward: o {o_BLHD.shape} and do {do_BLHD.shape} must be q's "
                         f"{q_BLHD.shape}, lse {lse_BHL.shape} must be [B, H, L] = {[B, H, L]}")
    if _sees_nothing(L, offset, window):
        return jnp.zeros_like(q_BLHD), jnp.zeros_like(k_BLKD), jnp.zeros_like(v_BLKD)
    t, Lp = tiles(L, D, block_q, block_k)
    kernel = _kernel(H, Lp, int(window), float(softcap), t, bool(interpret), offset)
    # do in q's dtype as splash's own backward gets it (its kernels feed it to the MXU with k and v).
    q_BHLD, k_BKLD, v_BKLD, o_BHLD, do_BHLD = (_to_kernel(x, Lp) for x in (
        _scaled(q_BLHD, scale), k_BLKD, v_BLKD, o_BLHD, do_BLHD.astype(q_BLHD.dtype)))
    # Rows that see nothing (lse -inf) and pad rows get lse +inf: p = exp(s - lse) must be 0 there, and the
    # kernel's masked s is a large finite negative, which -inf would turn into exp(+inf).
    lse_BHL = jnp.pad(lse_BHL.astype(jnp.float32), ((0, 0), (0, 0), (0, Lp - L)), constant_values=jnp.inf)
    lse_BHL = jnp.where(lse_BHL == -jnp.inf, jnp.inf, lse_BHL)

    def one(q_HLD, k_KLD, v_KLD, qseg_L, kseg_L, o_HLD, lse_HL, do_HLD):
        seg = splash.SegmentIds(qseg_L, kseg_L)
        return _splash_backward(kernel, q_HLD, k_KLD, v_KLD, seg, o_HLD, lse_HL, do_HLD)

    dq_BHLD, dk_BKLD, dv_BKLD = _batched(one, interpret, B)(
        q_BHLD, k_BKLD, v_BKLD, _pad_seg(qseg_BL, Lp), _pad_seg(kseg_BL, Lp), o_BHLD, lse_BHL, do_BHLD)
    # q was scaled before the kernel, so the chain rule scales dq (dk = ds^T (q scale) has it already).
    dq_BHLD = dq_BHLD.astype(jnp.float32) * (scale or D ** -0.5)
    return (_from_kernel(dq_BHLD, L, q_BLHD.dtype), _from_kernel(dk_BKLD, L, k_BLKD.dtype),
            _from_kernel(dv_BKLD, L, v_BLKD.dtype))
