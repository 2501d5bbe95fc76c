"""Causal flash attention for GPUs (Pallas, Triton backend), and the block-level pieces of ring attention.

FlashAttention-2 in three kernels. The forward is gridded over (batch, head, query block); it streams
key blocks through an online softmax in float32 (base 2, so the hot loop uses exp2) and writes the
output plus one logsumexp per row, the only residual besides q, k, v and o, so memory stays O(L).
The backward recomputes probabilities block by block: a dq kernel laid out like the forward, and a
dk/dv kernel gridded over (batch, kv head, key block) that loops over the G query heads sharing that
kv head, so GQA accumulates in registers without atomics and K/V are never repeated (the BlockSpec
index_maps pick kv head h // G). Loop bounds come from the causal diagonal and the static window,
so fully masked blocks are never visited and a window makes the work O(L * window). Any L works: the
wrapper pads to a block multiple and gives pads segment id -1, so no real row sees them.

Query row i may sit at position `offset + i` while key j sits at j (a static offset >= 0): that is
one step of ring attention (context parallelism), a device's query chunk against an earlier K/V chunk.
`block_forward` returns that pair's output and natural-log logsumexp (-inf for rows that see no key),
which the ring merges; `block_backward` takes the merged, global output and logsumexp and returns the
pair's dq, dk, dv (FlashAttention-2: p = exp(s - lse), ds = p * (dp - rowsum(o * do))).
`flash_attention` is offset 0 under a custom_vjp over the same pieces.
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
    offset: int = 0  # query row i sits at position offset + i, key j at j


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


def _key_blocks(i, c: _Cfg, n_k):
    """Key blocks that query block i can see: up to its newest query's diagonal, no older than the
    window from its oldest query, clipped to the n_k blocks there are (an empty range visits none)."""
    q0 = c.offset + i * c.bq  # >= 0, so lax.div (which truncates toward zero) is a floor here
    hi = jnp.minimum(lax.div(q0 + c.bq + c.bk - 1, c.bk), n_k)
    lo = jnp.minimum(lax.div(jnp.maximum(q0 - c.window + 1, 0), c.bk), n_k) if c.window else 0
    return lo, hi


def _query_blocks(j, c: _Cfg, n_q):
    """Query blocks that see key block j: from the diagonal on, and only while the window reaches it,
    clipped to the n_q blocks there are. Row indices are positions - offset, so may be negative: clip
    before dividing, as lax.div truncates toward zero."""
    lo = jnp.minimum(lax.div(jnp.maximum(j * c.bk - c.offset, 0), c.bq), n_q)
    if not c.window:
        return lo, n_q
    # the last row that sees key block j is (j + 1) * bk - 1 + window - 1 - offset; + bq counts its block
    hi = lax.div(jnp.maximum(j * c.bk + c.bk + c.window - 2 - c.offset + c.bq, 0), c.bq)
    return lo, jnp.minimum(hi, n_q)


def _fwd_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, o_ref, lse_ref, *, c: _Cfg):
    i = pl.program_id(2)
    q_QD, qseg_Q = q_ref[...], qseg_ref[...]
    qpos_Q = c.offset + i * c.bq + jnp.arange(c.bq)

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
    acc_QD, m_Q, l_Q = lax.fori_loop(*_key_blocks(i, c, k_ref.shape[0] // c.bk), body, init)
    seen_Q = l_Q > 0  # false for rows that see no key (offset / window / segments): o = 0, lse = +inf
    o_ref[...] = (acc_QD / jnp.where(seen_Q, l_Q, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen_Q, m_Q + jnp.log2(jnp.where(seen_Q, l_Q, 1.0)), jnp.inf)


def _dq_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref, dq_ref, *, c: _Cfg):
    i = pl.program_id(2)
    q_QD, do_QD, qseg_Q = q_ref[...], do_ref[...], qseg_ref[...]
    lse_Q, delta_Q = lse_ref[...], delta_ref[...]
    qpos_Q = c.offset + i * c.bq + jnp.arange(c.bq)

    def body(j, dq_QD):
        ks = pl.ds(j * c.bk, c.bk)
        k_KD = k_ref[ks, :]
        s_QK, t_QK = _scores(q_QD, k_KD, qpos_Q, j * c.bk + jnp.arange(c.bk), qseg_Q, kseg_ref[ks], c)
        p_QK = jnp.exp2(s_QK - lse_Q[:, None])
        ds_QK = p_QK * (_mm(do_QD, v_ref[ks, :], 1, 1) - delta_Q[:, None])
        if c.softcap:
            ds_QK = ds_QK * (1.0 - t_QK * t_QK)
        return dq_QD + _mm(ds_QK.astype(k_KD.dtype), k_KD, 1, 0)

    dq_QD = lax.fori_loop(*_key_blocks(i, c, k_ref.shape[0] // c.bk), body, jnp.zeros(q_QD.shape, jnp.float32))
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
        s_QK, t_QK = _scores(q_QD, k_KD, c.offset + i * c.bq + jnp.arange(c.bq), kpos_K, qseg_ref[qs], kseg_K, c)
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


def _forward(c: _Cfg, q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL):
    """Padded inputs -> (o_BLHD, lse_BHL in log2 units, +inf for rows that see no key)."""
    B, Lp, H, D = q_BLHD.shape
    G = H // k_BLKD.shape[2]
    return _call(_fwd_kernel, c, (B, H, Lp // c.bq), _row_specs(c, Lp, D, G),
                 [pl.BlockSpec((None, c.bq, None, D), lambda b, h, i: (b, i, h, 0)),
                  pl.BlockSpec((None, None, c.bq), lambda b, h, i: (b, h, i))],
                 [jax.ShapeDtypeStruct(q_BLHD.shape, q_BLHD.dtype), jax.ShapeDtypeStruct((B, H, Lp), jnp.float32)],
                 q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL)


def _backward(c: _Cfg, q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, o_BLHD, lse_BHL, do_BLHD):
    """Padded inputs, the (global) o and log2 lse -> (dq, dk, dv). Rows with lse = +inf get p = 0."""
    B, Lp, H, D = q_BLHD.shape
    K = k_BLKD.shape[2]
    G = H // K
    if D >= 128:
        # The dk/dv loop pipelines a q and a dO tile per stage besides its resident k and v: at head_dim 128
        # in bf16 (128 x 64 tiles) three stages ask 248,832 bytes of shared memory, over an H100's 232,448.
        c = dataclasses.replace(c, num_stages=min(c.num_stages, 2))
    do_BLHD = do_BLHD.astype(q_BLHD.dtype)
    # rowsum(dO * O) is elementwise and O(L): XLA fuses it, no kernel needed.
    delta_BHL = jnp.einsum("blhd,blhd->bhl", o_BLHD.astype(jnp.float32), do_BLHD.astype(jnp.float32))
    row = [pl.BlockSpec((None, c.bq, None, D), lambda b, h, i: (b, i, h, 0))]
    stat = [pl.BlockSpec((None, None, c.bq), lambda b, h, i: (b, h, i))] * 2
    dq_BLHD = _call(_dq_kernel, c, (B, H, Lp // c.bq), _row_specs(c, Lp, D, G) + row + stat, row[0],
                    jax.ShapeDtypeStruct(q_BLHD.shape, q_BLHD.dtype),
                    q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, do_BLHD, lse_BHL, delta_BHL)
    # (batch, kv head, key block): all G query heads of kv head kh, every query row (the kernel bounds them).
    heads = pl.BlockSpec((None, Lp, G, D), lambda b, kh, j: (b, 0, kh, 0))
    kv = pl.BlockSpec((None, c.bk, None, D), lambda b, kh, j: (b, j, kh, 0))
    stat = pl.BlockSpec((None, G, Lp), lambda b, kh, j: (b, kh, 0))
    dk_BLKD, dv_BLKD = _call(
        _dkv_kernel, c, (B, K, Lp // c.bk),
        [heads, kv, kv, pl.BlockSpec((None, Lp), lambda b, kh, j: (b, 0)),
         pl.BlockSpec((None, c.bk), lambda b, kh, j: (b, j)), heads, stat, stat], [kv, kv],
        [jax.ShapeDtypeStruct(k_BLKD.shape, k_BLKD.dtype)] * 2,
        q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, do_BLHD, lse_BHL, delta_BHL)
    return dq_BLHD, dk_BLKD, dv_BLKD


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(c, q_BLHD, k_BLKD, v_BLKD, seg_BL):
    return _forward(c, q_BLHD, k_BLKD, v_BLKD, seg_BL, seg_BL)[0]


def _attend_fwd(c, q_BLHD, k_BLKD, v_BLKD, seg_BL):
    o_BLHD, lse_BHL = _forward(c, q_BLHD, k_BLKD, v_BLKD, seg_BL, seg_BL)
    return o_BLHD, (q_BLHD, k_BLKD, v_BLKD, seg_BL, o_BLHD, lse_BHL)


def _attend_bwd(c, res, do_BLHD):
    q_BLHD, k_BLKD, v_BLKD, seg_BL, o_BLHD, lse_BHL = res
    return (*_backward(c, q_BLHD, k_BLKD, v_BLKD, seg_BL, seg_BL, o_BLHD, lse_BHL, do_BLHD), None)


_attend.defvjp(_attend_fwd, _attend_bwd)


def _pow2_at_least_16(n) -> bool:
    return isinstance(n, int) and n >= 16 and n & (n - 1) == 0


_TILES = ("block_q", "block_k", "num_warps", "num_stages")


def _pad_L(x, Lp, axis=1, fill=0):
    """Pad the length axis to Lp with `fill`."""
    if x.shape[axis] == Lp:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, Lp - x.shape[axis])
    return jnp.pad(x, widths, constant_values=fill)


def _setup(name, q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, *, offset, window, softcap, scale, interpret, tiles):
    """Check the inputs, pick the tiles; returns the config and q, k, v, qseg, kseg padded to a block multiple."""
    if q_BLHD.ndim != 4 or k_BLKD.ndim != 4 or k_BLKD.shape != v_BLKD.shape:
        raise ValueError(f"{name}: want q [B,L,H,D], k and v [B,L,K,D]; got {q_BLHD.shape}, {k_BLKD.shape}, "
                         f"{v_BLKD.shape}")
    B, L, H, D = q_BLHD.shape
    K = k_BLKD.shape[2]
    if k_BLKD.shape != (B, L, K, D) or tuple(qseg_BL.shape) != (B, L) or tuple(kseg_BL.shape) != (B, L):
        raise ValueError(f"{name}: shapes disagree: q {q_BLHD.shape}, k/v {k_BLKD.shape}, seg {qseg_BL.shape} / "
                         f"{kseg_BL.shape}; k/v need q's batch, length and head_dim, seg must be [B, L]")
    if H % K:
        raise ValueError(f"{name}: {H} query heads are not a multiple of {K} kv heads; use H = K * G")
    if not _pow2_at_least_16(D) or D > 256:
        raise ValueError(f"{name}: head_dim {D} unsupported; use a power of two in [16, 256] (64/128/256)")
    if q_BLHD.dtype not in (jnp.float32, jnp.bfloat16) or not q_BLHD.dtype == k_BLKD.dtype == v_BLKD.dtype:
        raise ValueError(f"{name}: dtypes {q_BLHD.dtype}/{k_BLKD.dtype}/{v_BLKD.dtype} unsupported; cast "
                         "q, k, v to one of float32, bfloat16")
    if window < 0 or softcap < 0:
        raise ValueError(f"{name}: window {window} and softcap {softcap} must be >= 0 (0 switches them off)")
    if not isinstance(offset, int) or offset < 0:  # static: it shapes the loop bounds of every kernel
        raise ValueError(f"{name}: offset {offset!r} must be a Python int >= 0")
    if set(tiles) - set(_TILES):
        raise ValueError(f"{name}: unknown tile options {sorted(set(tiles) - set(_TILES))}; use {_TILES}")
    d = default_config(D, q_BLHD.dtype) | {n: x for n, x in tiles.items() if x}  # None / 0: the default
    bq, bk = d["block_q"], d["block_k"]
    if not (_pow2_at_least_16(bq) and _pow2_at_least_16(bk)):
        raise ValueError(f"{name}: block_q {bq} / block_k {bk} must be powers of two >= 16 (Triton tiles)")
    # Blocks never exceed the (power-of-two rounded) sequence: short inputs need not pad to 128.
    fit = max(16, pl.next_power_of_2(L))
    bq, bk = min(bq, fit), min(bk, fit)
    c = _Cfg(float(scale or D ** -0.5), float(softcap), int(window), bq, bk, d["num_warps"], d["num_stages"],
             bool(interpret), offset)
    # Pads get segment -1, which no real row has, so real rows never see pad keys even when, with an
    # offset, pad keys sit before real queries; pad rows are sliced off (and see nothing in block_backward).
    Lp = -(-L // max(bq, bk)) * max(bq, bk)
    q_BLHD, k_BLKD, v_BLKD = (_pad_L(x, Lp) for x in (q_BLHD, k_BLKD, v_BLKD))
    qseg_BL, kseg_BL = (_pad_L(s.astype(jnp.int32), Lp, fill=-1) for s in (qseg_BL, kseg_BL))
    return c, q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL


def flash_attention(q_BLHD, k_BLKD, v_BLKD, seg_BL, *, window: int = 0, softcap: float = 0.0, scale: float = 0.0,
                    interpret: bool = False, block_q: int | None = None, block_k: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None) -> jax.Array:
    """Causal GQA self-attention over packed segments; same semantics as `reference_attention`
    (query i sees key j iff seg[i] == seg[j], j <= i and, with window > 0, i - j < window)."""
    L = q_BLHD.shape[1]
    tiles = dict(block_q=block_q, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    c, q_BLHD, k_BLKD, v_BLKD, seg_BL, _ = _setup(
        "flash_attention", q_BLHD, k_BLKD, v_BLKD, seg_BL, seg_BL, offset=0, window=window, softcap=softcap,
        scale=scale, interpret=interpret, tiles=tiles)
    return _attend(c, q_BLHD, k_BLKD, v_BLKD, seg_BL)[:, :L]


def block_forward(q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, *, offset: int = 0, window: int = 0,
                  softcap: float = 0.0, scale: float = 0.0, interpret: bool = False, **tiles):
    """One (query chunk, K/V chunk) pair of ring attention, forward: (o_BLHD, lse_BHL).

    Query i sits at position offset + i, key j at j; i sees j iff qseg[i] == kseg[j], j <= offset + i and,
    with window > 0, offset + i - j < window. o is normalised over this chunk's keys only; lse_BHL is the
    float32 natural-log logsumexp of the (scaled, soft-capped) scores a row sees, -inf (and o = 0) for
    a row that sees none, so chunks merge as o = sum_c exp(lse_c - lse) o_c with lse = logaddexp_c lse_c
    (a row no chunk reaches has lse = -inf there: guard the exp against -inf - -inf).
    Not differentiable itself: the ring's custom_vjp calls block_backward. `tiles`: flash_attention's
    block_q, block_k, num_warps, num_stages."""
    L = q_BLHD.shape[1]
    c, *args = _setup("block_forward", q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, offset=offset, window=window,
                      softcap=softcap, scale=scale, interpret=interpret, tiles=tiles)
    o_BLHD, lse_BHL = _forward(c, *args)
    # internal lse is log2 with +inf for unseen rows (so the backward's exp2(s - lse) is 0 there)
    return o_BLHD[:, :L], jnp.where(lse_BHL[:, :, :L] == jnp.inf, -jnp.inf, lse_BHL[:, :, :L] / LOG2E)


def block_backward(q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, o_BLHD, lse_BHL, do_BLHD, *, offset: int = 0,
                   window: int = 0, softcap: float = 0.0, scale: float = 0.0, interpret: bool = False, **tiles):
    """One chunk pair of ring attention, backward: (dq_BLHD, dk_BLKD, dv_BLKD) of this pair's share of the
    attention whose GLOBAL output is o_BLHD and global natural-log logsumexp lse_BHL (both over all the
    K/V chunks, as merged by the ring): p = exp(s - lse), dv = p^T do, ds = p * (do v^T - rowsum(o * do)),
    dq = ds k * scale, dk = ds^T q * scale. Rows whose lse is +-inf contribute nothing. Summed over the
    chunks, these are the gradients of the whole attention. Masking and arguments as block_forward."""
    c, *args = _setup("block_backward", q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, offset=offset, window=window,
                      softcap=softcap, scale=scale, interpret=interpret, tiles=tiles)
    B, L, H, _ = q_BLHD.shape
    if o_BLHD.shape != q_BLHD.shape or do_BLHD.shape != q_BLHD.shape or tuple(lse_BHL.shape) != (B, H, L):
        raise ValueError(f"block_backward: o {o_BLHD.shape} and do {do_BLHD.shape} must be q's shape "
                         f"{q_BLHD.shape}, lse {lse_BHL.shape} must be {(B, H, L)}")
    Lp = args[0].shape[1]
    lse_BHL = lse_BHL.astype(jnp.float32)
    lse_BHL = _pad_L(jnp.where(jnp.isfinite(lse_BHL), lse_BHL * LOG2E, jnp.inf), Lp, axis=2, fill=jnp.inf)
    dq_BLHD, dk_BLKD, dv_BLKD = _backward(c, *args, _pad_L(o_BLHD, Lp), lse_BHL, _pad_L(do_BLHD, Lp))
    return dq_BLHD[:, :L], dk_BLKD[:, :L], dv_BLKD[:, :L]
