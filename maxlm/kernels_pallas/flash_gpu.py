"""Causal flash attention for GPUs (Pallas, Triton backend): forward, and backward through a custom_vjp.

FlashAttention-2 in three kernels. The forward is gridded over (batch, head, query block); it streams
key blocks through an online softmax in float32 (base 2, so the hot loop uses exp2) and writes the
output plus one logsumexp per row, the only residual besides q, k, v and o, so memory stays O(L).
The backward recomputes probabilities block by block: a dq kernel laid out like the forward, and a
dk/dv kernel gridded over (batch, kv head, key block) that loops over the G query heads sharing that
kv head, so GQA accumulates in registers without atomics and K/V are never repeated (the BlockSpec
index_maps pick kv head h // G). Loop bounds come from the causal diagonal and the static window,
so fully masked blocks are never visited and a window makes the work O(L * window). Any L works: the
wrapper pads to a block multiple (pads sit after every real key, so causality hides them).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

LOG2E = 1.4426950408889634
M_INIT = -1e30  # finite running-max start: with -inf, a fully masked block would give -inf - -inf = NaN


def default_config(head_dim: int, dtype) -> dict:
    """H100 starting points (untuned guesses): the score tile and the q/k/v tiles must fit the
    register file, so larger heads and float32 get smaller blocks."""
    wide = head_dim > 128 or jnp.dtype(dtype) == jnp.float32
    return dict(block_q=64 if wide else 128, block_k=32 if head_dim > 128 else 64,
                num_warps=4 if head_dim <= 64 else 8, num_stages=2 if wide else 3)


@dataclasses.dataclass(frozen=True)
class _Cfg:
    scale: float
    softcap: float
    window: int
    bq: int
    bk: int
    num_warps: int
    num_stages: int
    interpret: bool


def _mm(a, b, ca, cb):
    # float32 inputs would run as TF32 on the tensor cores by default; HIGHEST keeps them exact (IEEE).
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)


def _scores(q_QD, k_KD, qpos_Q, kpos_K, qseg_Q, kseg_K, c: _Cfg):
    """Masked scores in log2 units, and tanh of the capped scores (the softcap derivative needs it)."""
    s_QK = _mm(q_QD, k_KD, 1, 1) * c.scale
    t_QK = None
    if c.softcap:
        t_QK = jnp.tanh(s_QK / c.softcap)
        s_QK = c.softcap * t_QK
    d_QK = qpos_Q[:, None] - kpos_K[None, :]
    mask_QK = (qseg_Q[:, None] == kseg_K[None, :]) & (d_QK >= 0)
    if c.window:
        mask_QK &= d_QK < c.window
    return jnp.where(mask_QK, s_QK * LOG2E, -jnp.inf), t_QK


def _key_blocks(i, c: _Cfg):
    """Key blocks that query block i can see: up to the diagonal, and no older than the window."""
    hi = lax.div(i * c.bq + c.bq + c.bk - 1, c.bk)
    lo = lax.div(jnp.maximum(i * c.bq - c.window + 1, 0), c.bk) if c.window else 0
    return lo, hi


def _query_blocks(j, c: _Cfg, n_q):
    """Query blocks that see key block j: from the diagonal on, and only while the window reaches it."""
    lo = lax.div(j * c.bk, c.bq)
    hi = jnp.minimum(lax.div(j * c.bk + c.bk + c.window - 2, c.bq) + 1, n_q) if c.window else n_q
    return lo, hi


def _fwd_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, o_ref, lse_ref, *, c: _Cfg):
    i = pl.program_id(2)
    q_QD, qseg_Q = q_ref[...], qseg_ref[...]
    qpos_Q = i * c.bq + jnp.arange(c.bq)

    def body(j, carry):
        acc_QD, m_Q, l_Q = carry
        ks = pl.ds(j * c.bk, c.bk)
        s_QK, _ = _scores(q_QD, k_ref[ks, :], qpos_Q, j * c.bk + jnp.arange(c.bk), qseg_Q, kseg_ref[ks], c)
        m_new_Q = jnp.maximum(m_Q, s_QK.max(axis=1))
        alpha_Q = jnp.exp2(m_Q - m_new_Q)
        p_QK = jnp.exp2(s_QK - m_new_Q[:, None])
        acc_QD = alpha_Q[:, None] * acc_QD + _mm(p_QK.astype(v_ref.dtype), v_ref[ks, :], 1, 0)
        return acc_QD, m_new_Q, alpha_Q * l_Q + p_QK.sum(axis=1)

    init = (jnp.zeros(q_QD.shape, jnp.float32), jnp.full((c.bq,), M_INIT, jnp.float32), jnp.zeros((c.bq,), jnp.float32))
    acc_QD, m_Q, l_Q = lax.fori_loop(*_key_blocks(i, c), body, init)
    seen_Q = l_Q > 0  # always true for real rows (each query sees itself); guards against 0/0 anyway
    o_ref[...] = (acc_QD / jnp.where(seen_Q, l_Q, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen_Q, m_Q + jnp.log2(jnp.where(seen_Q, l_Q, 1.0)), jnp.inf)


def _dq_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref, dq_ref, *, c: _Cfg):
    i = pl.program_id(2)
    q_QD, do_QD, qseg_Q = q_ref[...], do_ref[...], qseg_ref[...]
    lse_Q, delta_Q = lse_ref[...], delta_ref[...]
    qpos_Q = i * c.bq + jnp.arange(c.bq)

    def body(j, dq_QD):
        ks = pl.ds(j * c.bk, c.bk)
        k_KD = k_ref[ks, :]
        s_QK, t_QK = _scores(q_QD, k_KD, qpos_Q, j * c.bk + jnp.arange(c.bk), qseg_Q, kseg_ref[ks], c)
        p_QK = jnp.exp2(s_QK - lse_Q[:, None])
        ds_QK = p_QK * (_mm(do_QD, v_ref[ks, :], 1, 1) - delta_Q[:, None])
        if c.softcap:
            ds_QK = ds_QK * (1.0 - t_QK * t_QK)
        return dq_QD + _mm(ds_QK.astype(k_KD.dtype), k_KD, 1, 0)

    dq_QD = lax.fori_loop(*_key_blocks(i, c), body, jnp.zeros(q_QD.shape, jnp.float32))
    dq_ref[...] = (dq_QD * c.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, c: _Cfg):
    j = pl.program_id(2)
    k_KD, v_KD, kseg_K = k_ref[...], v_ref[...], kseg_ref[...]
    kpos_K = j * c.bk + jnp.arange(c.bk)
    lo, hi = _query_blocks(j, c, q_ref.shape[0] // c.bq)

    def body(g, i, carry):
        dk_KD, dv_KD = carry
        qs = pl.ds(i * c.bq, c.bq)
        q_QD, do_QD = q_ref[qs, g, :], do_ref[qs, g, :]
        s_QK, t_QK = _scores(q_QD, k_KD, i * c.bq + jnp.arange(c.bq), kpos_K, qseg_ref[qs], kseg_K, c)
        p_QK = jnp.exp2(s_QK - lse_ref[g, qs][:, None])
        dv_KD = dv_KD + _mm(p_QK.astype(do_QD.dtype), do_QD, 0, 0)
        ds_QK = p_QK * (_mm(do_QD, v_KD, 1, 1) - delta_ref[g, qs][:, None])
        if c.softcap:
            ds_QK = ds_QK * (1.0 - t_QK * t_QK)
        return dk_KD + _mm(ds_QK.astype(q_QD.dtype), q_QD, 0, 0), dv_KD

    zeros_KD = jnp.zeros(k_KD.shape, jnp.float32)
    dk_KD, dv_KD = lax.fori_loop(0, q_ref.shape[1], lambda g, cr: lax.fori_loop(lo, hi, functools.partial(body, g), cr),
                                 (zeros_KD, zeros_KD))
    dk_ref[...] = (dk_KD * c.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_KD.astype(dv_ref.dtype)


def _call(kernel, c: _Cfg, grid, in_specs, out_specs, out_shape, *args):
    return pl.pallas_call(functools.partial(kernel, c=c), grid=grid, in_specs=in_specs, out_specs=out_specs,
                          out_shape=out_shape, interpret=c.interpret, name=kernel.__name__.strip("_"),
                          compiler_params=plgpu.CompilerParams(num_warps=c.num_warps, num_stages=c.num_stages))(*args)


def _row_specs(c: _Cfg, Lp, D, G):
    """Specs for the (batch, head, query block) grid: this query block of head h, all keys of kv head h // G."""
    return [pl.BlockSpec((None, c.bq, None, D), lambda b, h, i: (b, i, h, 0)),
            pl.BlockSpec((None, Lp, None, D), lambda b, h, i: (b, 0, h // G, 0)),
            pl.BlockSpec((None, Lp, None, D), lambda b, h, i: (b, 0, h // G, 0)),
            pl.BlockSpec((None, c.bq), lambda b, h, i: (b, i)),
            pl.BlockSpec((None, Lp), lambda b, h, i: (b, 0))]


def _forward(c: _Cfg, q_BLHD, k_BLKD, v_BLKD, seg_BL):
    B, Lp, H, D = q_BLHD.shape
    G = H // k_BLKD.shape[2]
    return _call(_fwd_kernel, c, (B, H, Lp // c.bq), _row_specs(c, Lp, D, G),
                 [pl.BlockSpec((None, c.bq, None, D), lambda b, h, i: (b, i, h, 0)),
                  pl.BlockSpec((None, None, c.bq), lambda b, h, i: (b, h, i))],
                 [jax.ShapeDtypeStruct(q_BLHD.shape, q_BLHD.dtype), jax.ShapeDtypeStruct((B, H, Lp), jnp.float32)],
                 q_BLHD, k_BLKD, v_BLKD, seg_BL, seg_BL)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(c, q_BLHD, k_BLKD, v_BLKD, seg_BL):
    return _forward(c, q_BLHD, k_BLKD, v_BLKD, seg_BL)[0]


def _attend_fwd(c, q_BLHD, k_BLKD, v_BLKD, seg_BL):
    o_BLHD, lse_BHL = _forward(c, q_BLHD, k_BLKD, v_BLKD, seg_BL)
    return o_BLHD, (q_BLHD, k_BLKD, v_BLKD, seg_BL, o_BLHD, lse_BHL)


def _attend_bwd(c, res, do_BLHD):
    q_BLHD, k_BLKD, v_BLKD, seg_BL, o_BLHD, lse_BHL = res
    B, Lp, H, D = q_BLHD.shape
    K = k_BLKD.shape[2]
    G = H // K
    do_BLHD = do_BLHD.astype(q_BLHD.dtype)
    # rowsum(dO * O) is elementwise and O(L): XLA fuses it, no kernel needed.
    delta_BHL = jnp.einsum("blhd,blhd->bhl", o_BLHD.astype(jnp.float32), do_BLHD.astype(jnp.float32))
    row = [pl.BlockSpec((None, c.bq, None, D), lambda b, h, i: (b, i, h, 0))]
    stat = [pl.BlockSpec((None, None, c.bq), lambda b, h, i: (b, h, i))] * 2
    dq_BLHD = _call(_dq_kernel, c, (B, H, Lp // c.bq), _row_specs(c, Lp, D, G) + row + stat, row[0],
                    jax.ShapeDtypeStruct(q_BLHD.shape, q_BLHD.dtype),
                    q_BLHD, k_BLKD, v_BLKD, seg_BL, seg_BL, do_BLHD, lse_BHL, delta_BHL)
    # (batch, kv head, key block): all G query heads of kv head kh, every query row (the kernel bounds them).
    heads = pl.BlockSpec((None, Lp, G, D), lambda b, kh, j: (b, 0, kh, 0))
    kv = pl.BlockSpec((None, c.bk, None, D), lambda b, kh, j: (b, j, kh, 0))
    stat = pl.BlockSpec((None, G, Lp), lambda b, kh, j: (b, kh, 0))
    dk_BLKD, dv_BLKD = _call(
        _dkv_kernel, c, (B, K, Lp // c.bk),
        [heads, kv, kv, pl.BlockSpec((None, Lp), lambda b, kh, j: (b, 0)),
         pl.BlockSpec((None, c.bk), lambda b, kh, j: (b, j)), heads, stat, stat], [kv, kv],
        [jax.ShapeDtypeStruct(k_BLKD.shape, k_BLKD.dtype)] * 2,
        q_BLHD, k_BLKD, v_BLKD, seg_BL, seg_BL, do_BLHD, lse_BHL, delta_BHL)
    return dq_BLHD, dk_BLKD, dv_BLKD, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def _pow2_at_least_16(n) -> bool:
    return isinstance(n, int) and n >= 16 and n & (n - 1) == 0


def flash_attention(q_BLHD, k_BLKD, v_BLKD, seg_BL, *, window: int = 0, softcap: float = 0.0, scale: float = 0.0,
                    interpret: bool = False, block_q: int | None = None, block_k: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None) -> jax.Array:
    """Causal GQA self-attention over packed segments; same semantics as `reference_attention`
    (query i sees key j iff seg[i] == seg[j], j <= i and, with window > 0, i - j < window)."""
    if q_BLHD.ndim != 4 or k_BLKD.ndim != 4 or k_BLKD.shape != v_BLKD.shape:
        raise ValueError(f"flash_attention: want q [B,L,H,D], k and v [B,L,K,D]; got {q_BLHD.shape}, {k_BLKD.shape}, "
                         f"{v_BLKD.shape}")
    B, L, H, D = q_BLHD.shape
    K = k_BLKD.shape[2]
    if k_BLKD.shape != (B, L, K, D) or tuple(seg_BL.shape) != (B, L):
        raise ValueError(f"flash_attention: shapes disagree: q {q_BLHD.shape}, k/v {k_BLKD.shape}, seg {seg_BL.shape}; "
                         "k/v need q's batch, length and head_dim, seg must be [B, L]")
    if H % K:
        raise ValueError(f"flash_attention: {H} query heads are not a multiple of {K} kv heads; use H = K * G")
    if not _pow2_at_least_16(D) or D > 256:
        raise ValueError(f"flash_attention: head_dim {D} unsupported; use a power of two in [16, 256] (64/128/256)")
    if q_BLHD.dtype not in (jnp.float32, jnp.bfloat16) or not q_BLHD.dtype == k_BLKD.dtype == v_BLKD.dtype:
        raise ValueError(f"flash_attention: dtypes {q_BLHD.dtype}/{k_BLKD.dtype}/{v_BLKD.dtype} unsupported; cast "
                         "q, k, v to one of float32, bfloat16")
    if window < 0 or softcap < 0:
        raise ValueError(f"flash_attention: window {window} and softcap {softcap} must be >= 0 (0 switches them off)")
    d = default_config(D, q_BLHD.dtype)
    bq, bk = block_q or d["block_q"], block_k or d["block_k"]
    if not (_pow2_at_least_16(bq) and _pow2_at_least_16(bk)):
        raise ValueError(f"flash_attention: block_q {bq} / block_k {bk} must be powers of two >= 16 (Triton tiles)")
    # Blocks never exceed the (power-of-two rounded) sequence: short inputs need not pad to 128.
    fit = max(16, pl.next_power_of_2(L))
    bq, bk = min(bq, fit), min(bk, fit)
    c = _Cfg(float(scale or D ** -0.5), float(softcap), int(window), bq, bk, num_warps or d["num_warps"],
             num_stages or d["num_stages"], bool(interpret))
    Lp = -(-L // max(bq, bk)) * max(bq, bk)
    pad = ((0, 0), (0, Lp - L))
    if Lp != L:  # pad queries get their own segment (-1); they come after every real key, so no real row sees them
        q_BLHD, k_BLKD, v_BLKD = (jnp.pad(x, pad + ((0, 0), (0, 0))) for x in (q_BLHD, k_BLKD, v_BLKD))
        seg_BL = jnp.pad(seg_BL, pad, constant_values=-1)
    return _attend(c, q_BLHD, k_BLKD, v_BLKD, seg_BL.astype(jnp.int32))[:, :L]
