"""Flash attention for Hopper (sm_90a) in Pallas Mosaic GPU: the contract of flash_gpu.py (causal, window,
soft-cap, packed segments, GQA, a static query offset for ring attention, the natural-log LSE), built
on what Triton-from-Pallas cannot reach: wgmma, TMA bulk copies into 128-byte-swizzled shared memory, a
multi-stage K/V ring and warp specialisation.

Forward (FlashAttention-3's layout). A CTA owns 2 x 64 query rows of one (batch, head) and runs three
warpgroups: two consumers, 64 rows each (one wgmma M tile), and a producer that only issues TMA copies
of K, V and the key segment ids into a STAGES-deep ring. The consumers run the online softmax in float32
(base 2) on wgmma accumulators; each frees a slot by arriving on its `done` barrier, and the producer
waits for both before it refills it. Key blocks come from the causal diagonal and the static window
(flash_gpu.key_range): the producer loads the union of the two consumers' ranges, and a consumer whose
own range is narrower waits on and frees those slots without computing, so every barrier's phase stays
in step and a tile that sees nothing is never multiplied. Segment ids mask inside the visited tiles.

Internally the LSE is base 2 with +inf for rows that see no key (so a backward's exp2(s - lse) is 0
there); `block_forward` converts it to the ring's natural log with -inf.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from maxlm.kernels_pallas.flash_gpu import LOG2E, M_INIT, key_range

BLOCK_Q = 64      # rows per consumer warpgroup: one wgmma M tile (a CTA holds two)
CONSUMERS = 2
STAGES = 2        # K/V slots in flight; 3 at head_dim 256 would ask 288 KiB of shared memory
HEAD_DIMS = (64, 128, 256)  # multiples of the 128-byte swizzle's 64 bf16 columns; others pad up to one
BLOCK_K = {64: 128, 128: 64, 256: 64}  # key rows per step, by (padded) head_dim: the score tile's registers


@dataclasses.dataclass(frozen=True)
class _Cfg:
    scale: float
    softcap: float
    window: int
    offset: int
    bk: int
    interpret: bool


def padded_head_dim(head_dim: int) -> int:
    return next(d for d in HEAD_DIMS if d >= head_dim)


def unsupported(head_dim: int, dtype) -> str | None:
    """Why the Mosaic GPU kernels cannot take this head_dim and dtype, or None if they can."""
    if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16) and jnp.dtype(dtype) != jnp.dtype(jnp.float32):
        return f"the Mosaic GPU flash kernels run bfloat16 (float32 only in the interpreter), not {jnp.dtype(dtype)}"
    if head_dim > HEAD_DIMS[-1]:
        return f"head_dim {head_dim} is over {HEAD_DIMS[-1]}, the largest the Mosaic GPU flash kernels take"
    return None


def _smem(shape, dtype):
    """Shared memory for a wgmma operand: (8, 128-byte) tiles with the 128-byte swizzle TMA writes."""
    cols = 128 // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(128)))


def _interpret(c: _Cfg):
    return plgpu.InterpretGPUParams(detect_races=True) if c.interpret else None


def _col_chunks(D: int) -> list[pl.Slice]:
    """Column chunks of at most 128 for an accumulator of width D (see _mm)."""
    return [pl.ds(c, min(D, 128)) for c in range(0, D, 128)]


def _mm(a_ref, b_ref, b_transposed=False):
    """a @ b (or a @ b.T), both in shared memory, on the tensor cores into a fresh float32 accumulator,
    returned as a value.

    The Mosaic GPU interpreter, which is how these kernels are verified, runs wgmma only on shared-memory
    operands and cannot run pl.run_state(ACC.init(x)), Pallas' way to accumulate into a live
    accumulator. So P and dS are stored to shared memory before their products (FlashAttention-3 keeps P
    in registers), a running sum adds each product in registers, and products wider than 128 columns
    are taken in chunks of 128 (_col_chunks), which bounds the fresh accumulator to 64 registers a thread.
    What either costs on an H100 is for a measurement there to say (docs/attention.md)."""
    def mm(acc_ref):
        plgpu.wgmma(acc_ref, a_ref, b_ref.T if b_transposed else b_ref)
        return acc_ref[...]
    rows = a_ref.shape[0]
    cols = b_ref.shape[0] if b_transposed else b_ref.shape[1]
    return pl.run_scoped(mm, plgpu.ACC((rows, cols), jnp.float32))


def _masked_scores(s_QK, q0, k0, qseg_Q, kseg_K, c: _Cfg):
    """Scaled, soft-capped, masked scores in log2 units (wgmma layout); also tanh of the capped scores."""
    shape = s_QK.shape
    s_QK = s_QK * c.scale
    t_QK = None
    if c.softcap:
        t_QK = jnp.tanh(s_QK * (1.0 / c.softcap))
        s_QK = c.softcap * t_QK
    rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
    cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    d_QK = (rows + (c.offset + q0)) - (cols + k0)  # query position - key position
    mask = (lax.broadcast_in_dim(qseg_Q, shape, [0]) == lax.broadcast_in_dim(kseg_K, shape, [1])) & (d_QK >= 0)
    if c.window:
        mask &= d_QK < c.window
    return jnp.where(mask, s_QK * LOG2E, -jnp.inf), t_QK


def _forward(c: _Cfg, q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL):
    """Padded inputs (L a multiple of 2 * BLOCK_Q and of bk) -> (o_BLHD, lse_BHL in log2, +inf unseen)."""
    B, L, H, D = q_BLHD.shape
    G = H // k_BLKD.shape[2]
    bq, bk, dtype = BLOCK_Q, c.bk, q_BLHD.dtype
    n_k = L // bk

    def kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, o_ref, lse_ref,
               q_smem, qseg_smem, lse_smem, p_smem, k_smem, v_smem, kseg_smem, q_bar, k_bar, v_bar, kseg_bar, k_done, v_done):
        b, h, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
        cta_q0 = lax.axis_index("q") * (CONSUMERS * bq)
        lo, hi = key_range(c.offset + cta_q0, CONSUMERS * bq, bk, c.window, n_k)

        @pl.when(wg < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
            q0 = cta_q0 + wg * bq
            q_s, qseg_s, lse_s, p_s = q_smem.at[wg], qseg_smem.at[wg], lse_smem.at[wg], p_smem.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, bq), h], q_s, q_bar.at[wg])
            plgpu.copy_gmem_to_smem(qseg_ref.at[b, pl.ds(q0, bq)], qseg_s, q_bar.at[CONSUMERS + wg])
            plgpu.barrier_wait(q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[CONSUMERS + wg])
            qseg_Q = plgpu.load(qseg_s, (), layout=plgpu.Layout.WGMMA.reduce(1))
            lo_w, hi_w = key_range(c.offset + q0, bq, bk, c.window, n_k)

            def skip(j, _):  # a slot this warpgroup does not need: keep the phases, free it at once
                slot = lax.rem(j - lo, STAGES)
                for bar in (k_bar, kseg_bar, v_bar):
                    plgpu.barrier_wait(bar.at[slot])
                plgpu.barrier_arrive(k_done.at[slot])
                plgpu.barrier_arrive(v_done.at[slot])

            def step(j, carry):
                acc_QD, m_Q, l_Q = carry
                slot = lax.rem(j - lo, STAGES)
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_wait(kseg_bar.at[slot])

                s_QK = _mm(q_s, k_smem.at[slot], b_transposed=True)
                kseg_K = plgpu.load(kseg_smem.at[slot], (), layout=plgpu.Layout.WGMMA.reduce(0))
                plgpu.barrier_arrive(k_done.at[slot])
                s_QK, _ = _masked_scores(s_QK, q0, j * bk, qseg_Q, kseg_K, c)
                m_new_Q = jnp.maximum(m_Q, s_QK.max(axis=1))
                alpha_Q = jnp.exp2(m_Q - m_new_Q)
                p_QK = jnp.exp2(s_QK - lax.broadcast_in_dim(m_new_Q, s_QK.shape, [0]))
                l_Q = alpha_Q * l_Q + p_QK.sum(axis=1)
                p_s[...] = p_QK.astype(dtype)
                plgpu.commit_smem()
                plgpu.barrier_wait(v_bar.at[slot])
                acc_QD = tuple(a * lax.broadcast_in_dim(alpha_Q, a.shape, [0]) + _mm(p_s, v_smem.at[slot, :, cols])
                               for a, cols in zip(acc_QD, _col_chunks(D)))
                plgpu.barrier_arrive(v_done.at[slot])
                return acc_QD, m_new_Q, l_Q

            row = plgpu.Layout.WGMMA.reduce(1)
            init = (tuple(plgpu.layout_cast(jnp.zeros((bq, cols.size), jnp.float32), plgpu.Layout.WGMMA)
                          for cols in _col_chunks(D)),
                    plgpu.layout_cast(jnp.full((bq,), M_INIT, jnp.float32), row),
                    plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row))
            lax.fori_loop(lo, lo_w, skip, None)
            acc_QD, m_Q, l_Q = lax.fori_loop(lo_w, hi_w, step, init)
            lax.fori_loop(hi_w, hi, skip, None)
            seen_Q = l_Q > 0  # false for rows that see no key: o = 0, lse = +inf
            l_Q = jnp.where(seen_Q, l_Q, 1.0)
            for a, cols in zip(acc_QD, _col_chunks(D)):
                q_s[:, cols] = (a / lax.broadcast_in_dim(l_Q, a.shape, [0])).astype(dtype)
            lse_s[...] = jnp.where(seen_Q, m_Q + jnp.log(l_Q) * LOG2E, jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_s, o_ref.at[b, pl.ds(q0, bq), h])
            plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[b, h, pl.ds(q0, bq)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == CONSUMERS)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            kh = lax.div(h, jnp.int32(G))

            @pl.loop(0, hi - lo)
            def _(t):
                j, slot = lo + t, lax.rem(t, STAGES)
                rows = pl.ds(j * bk, bk)

                @pl.when(t >= STAGES)
                def _():
                    plgpu.barrier_wait(k_done.at[slot])
                plgpu.copy_gmem_to_smem(k_ref.at[b, rows, kh], k_smem.at[slot], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(kseg_ref.at[b, rows], kseg_smem.at[slot], kseg_bar.at[slot])

                @pl.when(t >= STAGES)
                def _():
                    plgpu.barrier_wait(v_done.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[b, rows, kh], v_smem.at[slot], v_bar.at[slot])

    slots = lambda n=STAGES, arrivals=1: plgpu.Barrier(num_arrivals=arrivals, num_barriers=n)
    return plgpu.kernel(
        kernel,
        out_type=[jax.ShapeDtypeStruct(q_BLHD.shape, dtype), jax.ShapeDtypeStruct((B, H, L), jnp.float32)],
        scratch_types=[_smem((CONSUMERS, bq, D), dtype), plgpu.SMEM((CONSUMERS, bq), jnp.int32),
                       plgpu.SMEM((CONSUMERS, bq), jnp.float32), _smem((CONSUMERS, bq, bk), dtype),
                       _smem((STAGES, bk, D), dtype),
                       _smem((STAGES, bk, D), dtype), plgpu.SMEM((STAGES, bk), jnp.int32),
                       slots(2 * CONSUMERS), slots(), slots(), slots(),
                       slots(arrivals=CONSUMERS), slots(arrivals=CONSUMERS)],
        grid=(H, L // (CONSUMERS * bq), B), grid_names=("heads", "q", "batch"),
        num_threads=CONSUMERS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True), interpret=_interpret(c),
        kernel_name="flash_mgpu_forward",
    )(q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL)
