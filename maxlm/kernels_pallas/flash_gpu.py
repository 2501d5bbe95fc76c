"""Causal flash attention for GPUs (Pallas, Triton backend), and the block-level pieces of ring attention.

FlashAttention-2 in three kernels. The forward is gridded over (batch, head, query block); it streams
key blocks through an online softmax in float32 (base 2, so the hot loop uses exp2) and writes the
output plus one logsumexp per row, the only residual besides q, k, v and o, so memory stays O(L).
The backward recomputes probabilities block by block: a dq kernel laid out like the forward, and a
dk/dv kernel gridded over (batch, kv head, key block) that loops over the G query heads sharing that
kv head, so GQA accumulates in registers without atomics and K/V are never repeated (the BlockSpec
index_maps pick kv head h // G). Loop bounds come from the causal diagonal and the static window,
so fully masked blocks are never visited and a window makes the work O(L * window). Any L works: the
wrapper pads to a block multiple and gives pads segment id -1, so no real row sees them. Any head_dim up
to 256 works: q, k, v are zero-padded to the power of two the tiles are built for (TILES).

Query row i may sit at position `offset + i` while key j sits at j (a static offset >= 0): that is
one step of ring attention (context parallelism), a device's query chunk against an earlier K/V chunk.
`block_forward` returns that pair's output and natural-log logsumexp (-inf for rows that see no key),
which the ring merges; `block_backward` takes the merged, global output and logsumexp and returns the
pair's dq, dk, dv (FlashAttention-2: p = exp(s - lse), ds = p * (dp - rowsum(o * do))).
`flash_attention` is offset 0 under a custom_vjp over the same pieces.
"""
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

LOG2E = 1.4426950408889634
M_INIT = -1e30  # finite running-max start: with -inf, a fully masked block would give -inf - -inf = NaN


class Tile(NamedTuple):
    block_q: int
    block_k: int
    num_warps: int
    num_stages: int  # software-pipelining depth of the key (forward, dq) or query (dk/dv) loop


# The (forward, backward) tiles per (head_dim, dtype). Every row compiles for sm_90a (H100/H200, 232,448
# bytes of shared memory per block) and sm_100a (B200), forward and backward, causal, windowed and
# soft-capped: benchmarks/flash_compile.py walks them all through ptxas, in tests/test_gpu_compile.py.
# They are starting points that fit, not tuned on a GPU (docs/attention.md). The score tile and the
# q/k/v tiles must fit the register file, so larger heads and float32 get smaller blocks. The dk/dv
# loop pipelines a q and a dO tile per stage besides its resident k and v tiles, so the backward gets
# fewer stages and, on sm_100a at head_dim 128, a 64-row query tile (128 rows and 2 stages ask 247,360
# bytes there; 3 stages ask 248,832 on an H100). Other head dims run zero-padded to the next row (96 as
# 128); beyond 256 there is no row, and attention=auto picks xla.
TILES = {
    (16, "bfloat16"): (Tile(128, 64, 4, 3), Tile(128, 64, 4, 3)),
    (32, "bfloat16"): (Tile(128, 64, 4, 3), Tile(128, 64, 4, 3)),
    (64, "bfloat16"): (Tile(128, 64, 4, 3), Tile(128, 64, 4, 3)),
    (128, "bfloat16"): (Tile(128, 64, 8, 3), Tile(64, 64, 8, 2)),
    (256, "bfloat16"): (Tile(64, 32, 8, 2), Tile(64, 32, 8, 2)),
    (16, "float32"): (Tile(64, 64, 4, 2), Tile(64, 64, 4, 2)),
    (32, "float32"): (Tile(64, 64, 4, 2), Tile(64, 64, 4, 2)),
    (64, "float32"): (Tile(64, 64, 4, 2), Tile(64, 64, 4, 2)),
    (128, "float32"): (Tile(64, 64, 8, 2), Tile(64, 64, 8, 2)),
    (256, "float32"): (Tile(64, 32, 8, 2), Tile(64, 32, 8, 2)),
}
MAX_HEAD_DIM = 256


def padded_head_dim(head_dim: int) -> int:
    """The head_dim the kernels run at: Triton tiles are powers of two >= 16, so q, k and v are zero-padded
    up to one (which leaves scores and the real output columns unchanged)."""
    return max(16, pl.next_power_of_2(head_dim))


def unsupported(head_dim: int, dtype) -> str | None:
    """Why the GPU kernels cannot take this head_dim and dtype, or None if they can."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return f"the GPU flash kernels run bfloat16 and float32, not {jnp.dtype(dtype)}"
    if head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} is over {MAX_HEAD_DIM}, the largest the GPU flash kernels have tiles for"
    return None


def tiles(head_dim: int, dtype) -> tuple[Tile, Tile]:
    """The (forward, backward) tiles for head_dim (padded) and dtype."""
    return TILES[(padded_head_dim(head_dim), jnp.dtype(dtype).name)]


def describe_tiles(head_dim: int, dtype) -> str:
    return "; ".join(f"{name} {t.block_q}x{t.block_k}, {t.num_warps} warps, {t.num_stages} stages"
                     for name, t in zip(("forward", "backward"), tiles(head_dim, dtype)))


@dataclasses.dataclass(frozen=True)
class _Cfg:
    scale: float
    softcap: float
    window: int
    bq: int
    bk: int
    num_warps: int
    num_stages: int
    bwd: Tile      # the backward's tiles
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


def key_range(q0, rows: int, bk: int, window: int, n_k: int):
    """Key blocks of bk that query rows at positions q0 .. q0 + rows - 1 can see: up to the newest row's
    diagonal, no older than the window from the oldest row, clipped to the n_k blocks there are (an empty
    range visits none). q0 >= 0, so lax.div (which truncates toward zero) is a floor here."""
    hi = jnp.minimum(lax.div(q0 + rows + bk - 1, bk), n_k)
    lo = jnp.minimum(lax.div(jnp.maximum(q0 - window + 1, 0), bk), n_k) if window else 0
    return lo, hi


def query_range(k0, bk: int, offset: int, bq: int, window: int, n_q: int):
    """Query blocks of bq that see the keys at k0 .. k0 + bk - 1: from the diagonal on, and only while the
    window reaches them, clipped to the n_q blocks there are. Row indices are positions - offset, so may
    be negative: clip before dividing, as lax.div truncates toward zero."""
    lo = jnp.minimum(lax.div(jnp.maximum(k0 - offset, 0), bq), n_q)
    if not window:
        return lo, n_q
    # the last row that sees these keys is k0 + bk - 1 + window - 1 - offset; + bq counts its block
    hi = lax.div(jnp.maximum(k0 + bk + window - 2 - offset + bq, 0), bq)
    return lo, jnp.minimum(hi, n_q)


def _key_blocks(i, c: _Cfg, n_k):
    return key_range(c.offset + i * c.bq, c.bq, c.bk, c.window, n_k)


def _query_blocks(j, c: _Cfg, n_q):
    return query_range(j * c.bk, c.bk, c.offset, c.bq, c.window, n_q)


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
    c = dataclasses.replace(c, bq=c.bwd.block_q, bk=c.bwd.block_k, num_warps=c.bwd.num_warps,
                            num_stages=c.bwd.num_stages)
    do_BLHD = do_BLHD.astype(q_BLHD.dtype)
    args = (q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, do_BLHD, lse_BHL, delta(o_BLHD, do_BLHD))
    return (_dq(c, *args), *_dkv(c, *args))


def _dq(c: _Cfg, q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, do_BLHD, lse_BHL, delta_BHL):
    B, Lp, H, D = q_BLHD.shape
    G = H // k_BLKD.shape[2]
    row = [pl.BlockSpec((None, c.bq, None, D), lambda b, h, i: (b, i, h, 0))]
    stat = [pl.BlockSpec((None, None, c.bq), lambda b, h, i: (b, h, i))] * 2
    return _call(_dq_kernel, c, (B, H, Lp // c.bq), _row_specs(c, Lp, D, G) + row + stat, row[0],
                 jax.ShapeDtypeStruct(q_BLHD.shape, q_BLHD.dtype),
                 q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, do_BLHD, lse_BHL, delta_BHL)


def _dkv(c: _Cfg, q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, do_BLHD, lse_BHL, delta_BHL):
    B, Lp, H, D = q_BLHD.shape
    K = k_BLKD.shape[2]
    G = H // K
    # (batch, kv head, key block): all G query heads of kv head kh, every query row (the kernel bounds them).
    heads = pl.BlockSpec((None, Lp, G, D), lambda b, kh, j: (b, 0, kh, 0))
    kv = pl.BlockSpec((None, c.bk, None, D), lambda b, kh, j: (b, j, kh, 0))
    stat = pl.BlockSpec((None, G, Lp), lambda b, kh, j: (b, kh, 0))
    return _call(
        _dkv_kernel, c, (B, K, Lp // c.bk),
        [heads, kv, kv, pl.BlockSpec((None, Lp), lambda b, kh, j: (b, 0)),
         pl.BlockSpec((None, c.bk), lambda b, kh, j: (b, j)), heads, stat, stat], [kv, kv],
        [jax.ShapeDtypeStruct(k_BLKD.shape, k_BLKD.dtype)] * 2,
        q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, do_BLHD, lse_BHL, delta_BHL)


def self_attention_vjp(forward, backward):
    """attend(c, q, k, v, seg) -> o: self-attention as a custom_vjp over a kernel set's
    forward(c, q, k, v, qseg, kseg) -> (o, lse) and backward(c, q, k, v, qseg, kseg, o, lse, do) -> (dq, dk, dv),
    keeping only q, k, v, seg, o and the lse for the backward (this file's kernels and flash_mgpu's)."""
    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def attend(c, q_BLHD, k_BLKD, v_BLKD, seg_BL):
        return forward(c, q_BLHD, k_BLKD, v_BLKD, seg_BL, seg_BL)[0]

    def attend_fwd(c, q_BLHD, k_BLKD, v_BLKD, seg_BL):
        o_BLHD, lse_BHL = forward(c, q_BLHD, k_BLKD, v_BLKD, seg_BL, seg_BL)
        return o_BLHD, (q_BLHD, k_BLKD, v_BLKD, seg_BL, o_BLHD, lse_BHL)

    def attend_bwd(c, res, do_BLHD):
        q_BLHD, k_BLKD, v_BLKD, seg_BL, o_BLHD, lse_BHL = res
        return (*backward(c, q_BLHD, k_BLKD, v_BLKD, seg_BL, seg_BL, o_BLHD, lse_BHL, do_BLHD), None)

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


def delta(o_BLHD, do_BLHD):
    """rowsum(dO * O) per (batch, head, row), the backward's softmax term: elementwise and O(L), so XLA
    fuses it and no kernel is needed."""
    return jnp.einsum("blhd,blhd->bhl", o_BLHD.astype(jnp.float32), do_BLHD.astype(jnp.float32))


def check_shapes(name, q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL) -> None:
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


_attend = self_attention_vjp(_forward, _backward)


def _pow2_at_least_16(n) -> bool:
    return isinstance(n, int) and n >= 16 and n & (n - 1) == 0


_TILES = Tile._fields


def pad_L(x, Lp, axis=1, fill=0):
    """Pad the length axis to Lp with `fill`."""
    if x.shape[axis] == Lp:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, Lp - x.shape[axis])
    return jnp.pad(x, widths, constant_values=fill)


def _setup(name, q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, *, offset, window, softcap, scale, interpret, overrides):
    """Check the inputs, pick the tiles; returns the config and q, k, v, qseg, kseg padded to a block multiple."""
    check_shapes(name, q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL)
    B, L, H, D = q_BLHD.shape
    if not q_BLHD.dtype == k_BLKD.dtype == v_BLKD.dtype or unsupported(D, q_BLHD.dtype):
        raise ValueError(f"{name}: dtypes {q_BLHD.dtype}/{k_BLKD.dtype}/{v_BLKD.dtype}, head_dim {D}: "
                         f"{unsupported(D, q_BLHD.dtype) or 'q, k, v differ'}; cast q, k, v to one of float32, "
                         f"bfloat16 (or use attention=xla beyond head_dim {MAX_HEAD_DIM})")
    if window < 0 or softcap < 0:
        raise ValueError(f"{name}: window {window} and softcap {softcap} must be >= 0 (0 switches them off)")
    if not isinstance(offset, int) or offset < 0:  # static: it shapes the loop bounds of every kernel
        raise ValueError(f"{name}: offset {offset!r} must be a Python int >= 0")
    if set(overrides) - set(_TILES):
        raise ValueError(f"{name}: unknown tile options {sorted(set(overrides) - set(_TILES))}; use {_TILES}")
    given = {n: x for n, x in overrides.items() if x}  # None / 0: the table's; a given tile is for both directions
    if not all(_pow2_at_least_16(given.get(b, 16)) for b in ("block_q", "block_k")):
        raise ValueError(f"{name}: block_q {given.get('block_q')} / block_k {given.get('block_k')} must be powers "
                         f"of two >= 16 (Triton tiles)")
    # Blocks never exceed the (power-of-two rounded) sequence: short inputs need not pad to 128.
    fit = max(16, pl.next_power_of_2(L))
    fwd, bwd = (t._replace(**given) for t in tiles(D, q_BLHD.dtype))
    fwd, bwd = (t._replace(block_q=min(t.block_q, fit), block_k=min(t.block_k, fit)) for t in (fwd, bwd))
    c = _Cfg(float(scale or D ** -0.5), float(softcap), int(window), fwd.block_q, fwd.block_k, fwd.num_warps,
             fwd.num_stages, bwd, bool(interpret), offset)
    # Pads get segment -1, which no real row has, so real rows never see pad keys even when, with an
    # offset, pad keys sit before real queries; pad rows are sliced off (and see nothing in block_backward).
    # Every block is a power of two, so a multiple of the largest is a multiple of each.
    block = max(*fwd[:2], *bwd[:2])
    Lp = -(-L // block) * block
    q_BLHD, k_BLKD, v_BLKD = (pad_L(pad_L(x, padded_head_dim(D), axis=3), Lp) for x in (q_BLHD, k_BLKD, v_BLKD))
    qseg_BL, kseg_BL = (pad_L(s.astype(jnp.int32), Lp, fill=-1) for s in (qseg_BL, kseg_BL))
    return c, q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL


def flash_attention(q_BLHD, k_BLKD, v_BLKD, seg_BL, *, window: int = 0, softcap: float = 0.0, scale: float = 0.0,
                    interpret: bool = False, block_q: int | None = None, block_k: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None) -> jax.Array:
    """Causal GQA self-attention over packed segments; same semantics as `reference_attention`
    (query i sees key j iff seg[i] == seg[j], j <= i and, with window > 0, i - j < window)."""
    L, D = q_BLHD.shape[1], q_BLHD.shape[3]
    tiles = dict(block_q=block_q, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    c, q_BLHD, k_BLKD, v_BLKD, seg_BL, _ = _setup(
        "flash_attention", q_BLHD, k_BLKD, v_BLKD, seg_BL, seg_BL, offset=0, window=window, softcap=softcap,
        scale=scale, interpret=interpret, overrides=tiles)
    return _attend(c, q_BLHD, k_BLKD, v_BLKD, seg_BL)[:, :L, :, :D]


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
    L, D = q_BLHD.shape[1], q_BLHD.shape[3]
    c, *args = _setup("block_forward", q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, offset=offset, window=window,
                      softcap=softcap, scale=scale, interpret=interpret, overrides=tiles)
    o_BLHD, lse_BHL = _forward(c, *args)
    # internal lse is log2 with +inf for unseen rows (so the backward's exp2(s - lse) is 0 there)
    return o_BLHD[:, :L, :, :D], jnp.where(lse_BHL[:, :, :L] == jnp.inf, -jnp.inf, lse_BHL[:, :, :L] / LOG2E)


def block_backward(q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, o_BLHD, lse_BHL, do_BLHD, *, offset: int = 0,
                   window: int = 0, softcap: float = 0.0, scale: float = 0.0, interpret: bool = False, **tiles):
    """One chunk pair of ring attention, backward: (dq_BLHD, dk_BLKD, dv_BLKD) of this pair's share of the
    attention whose GLOBAL output is o_BLHD and global natural-log logsumexp lse_BHL (both over all the
    K/V chunks, as merged by the ring): p = exp(s - lse), dv = p^T do, ds = p * (do v^T - rowsum(o * do)),
    dq = ds k * scale, dk = ds^T q * scale. Rows whose lse is +-inf contribute nothing. Summed over the
    chunks, these are the gradients of the whole attention. Masking and arguments as block_forward."""
    c, *args = _setup("block_backward", q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, offset=offset, window=window,
                      softcap=softcap, scale=scale, interpret=interpret, overrides=tiles)
    B, L, H, D = q_BLHD.shape
    if o_BLHD.shape != q_BLHD.shape or do_BLHD.shape != q_BLHD.shape or tuple(lse_BHL.shape) != (B, H, L):
        raise ValueError(f"block_backward: o {o_BLHD.shape} and do {do_BLHD.shape} must be q's shape "
                         f"{q_BLHD.shape}, lse {lse_BHL.shape} must be {(B, H, L)}")
    Lp, Dp = args[0].shape[1], args[0].shape[3]
    o_BLHD, do_BLHD = (pad_L(pad_L(x, Dp, axis=3), Lp) for x in (o_BLHD, do_BLHD))
    lse_BHL = lse_BHL.astype(jnp.float32)
    lse_BHL = pad_L(jnp.where(jnp.isfinite(lse_BHL), lse_BHL * LOG2E, jnp.inf), Lp, axis=2, fill=jnp.inf)
    dq_BLHD, dk_BLKD, dv_BLKD = _backward(c, *args, o_BLHD, lse_BHL, do_BLHD)
    return dq_BLHD[:, :L, :, :D], dk_BLKD[:, :L, :, :D], dv_BLKD[:, :L, :, :D]


def refused_kernels(device, head_dim: int, dtype, *, softcap: float = 0.0) -> list[str]:
    """Compile the forward, dq and dk/dv kernels one at a time for `device` and describe each one its
    compiler refuses, with its tile and the compiler's reason: a failed train-step compile does not say
    which kernel asked for too much."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    fwd, bwd = tiles(head_dim, dtype)
    D, L, H, K = padded_head_dim(head_dim), 256, 2, 1  # any L that is a multiple of every block
    c = _Cfg(head_dim ** -0.5, float(softcap), 0, fwd.block_q, fwd.block_k, fwd.num_warps, fwd.num_stages, bwd,
             False)
    cb = dataclasses.replace(c, bq=bwd.block_q, bk=bwd.block_k, num_warps=bwd.num_warps, num_stages=bwd.num_stages)
    mesh = Mesh([device], ("x",))

    def spec(*shape, dt=dtype):
        return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, PartitionSpec()))
    q, k, seg, stat = spec(1, L, H, D), spec(1, L, K, D), spec(1, L, dt=jnp.int32), spec(1, H, L, dt=jnp.float32)
    kernels = {"forward": (lambda q, k, v, s: _forward(c, q, k, v, s, s), (q, k, k, seg), fwd),
               "dq": (functools.partial(_dq, cb), (q, k, k, seg, seg, q, stat, stat), bwd),
               "dk/dv": (functools.partial(_dkv, cb), (q, k, k, seg, seg, q, stat, stat), bwd)}
    refused = []
    for name, (fn, args, t) in kernels.items():
        try:
            with jax.set_mesh(mesh):
                jax.jit(fn).lower(*args).compile()
        except Exception as e:  # noqa: BLE001 - the compiler's reason is the report
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0].removeprefix("RESOURCE_EXHAUSTED: ")
            refused.append(f"the flash {name} kernel at head_dim {head_dim} in {jnp.dtype(dtype).name} (tile "
                           f"{t.block_q}x{t.block_k}, {t.num_warps} warps, {t.num_stages} stages): {reason}")
    return refused
