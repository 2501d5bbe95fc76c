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

from maxlm.kernels_pallas import flash_gpu
from maxlm.kernels_pallas.flash_gpu import LOG2E, M_INIT, key_range, query_range

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


def describe_tiles(head_dim: int, dtype) -> str:
    D = padded_head_dim(head_dim)
    n = _consumers(D)
    return (f"forward {CONSUMERS}x{BLOCK_Q} query rows, {BLOCK_K[D]} keys a step, {STAGES} stages; backward "
            f"{n}x{BLOCK_Q} rows, {BLOCK_K[D]} a step")


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


def _stream_kv(gmem, smem, bars, b, kh, lo, hi, bk, k_done, v_done=None):
    """The producer warpgroup of the forward and dq kernels: K, key segments and V of key blocks lo..hi-1
    (kv head kh) into the ring, each slot refilled once the consumers have released it: K and its
    segments after `k_done`, V after `v_done` (the forward frees K before its PV product), or all three
    after `k_done` alone."""
    plgpu.set_max_registers(40, action="decrease")

    (k_ref, kseg_ref, v_ref), (k_smem, kseg_smem, v_smem), (k_bar, kseg_bar, v_bar) = gmem, smem, bars

    @pl.loop(0, hi - lo)
    def _(t):
        slot, rows = lax.rem(t, STAGES), pl.ds((lo + t) * bk, bk)
        refill = lambda done: pl.when(t >= STAGES)(lambda: plgpu.barrier_wait(done.at[slot]))  # noqa: E731
        refill(k_done)
        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, kh], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(kseg_ref.at[b, rows], kseg_smem.at[slot], kseg_bar.at[slot])
        if v_done is not None:
            refill(v_done)
        plgpu.copy_gmem_to_smem(v_ref.at[b, rows, kh], v_smem.at[slot], v_bar.at[slot])
    _drain(hi - lo, k_done, *([v_done] if v_done is not None else []))


def _drain(steps, *done):
    """The producer's last waits: the consumers' releases of the final STAGES slots, which no refill
    waited for. A CTA then ends with every barrier phase seen by every warpgroup that waits on it (the
    interpreter checks this; on the GPU it costs one wait at the end)."""
    @pl.loop(jnp.maximum(steps - STAGES, 0), steps)
    def _(t):
        for bar in done:
            plgpu.barrier_wait(bar.at[lax.rem(t, STAGES)])


def _masked_scores(s, q0, k0, qseg, kseg, c: _Cfg, keys_by_row=False):
    """Scaled, soft-capped, masked scores in log2 units (wgmma layout), queries by row and keys by column
    (or, keys_by_row, the transpose, as the dk/dv kernel holds them); also tanh of the capped scores."""
    q_dim, k_dim = (1, 0) if keys_by_row else (0, 1)
    s = s * c.scale
    t = None
    if c.softcap:
        t = jnp.tanh(s * (1.0 / c.softcap))
        s = c.softcap * t
    qpos = plgpu.broadcasted_iota(jnp.int32, s.shape, q_dim, layout=plgpu.Layout.WGMMA) + (c.offset + q0)
    kpos = plgpu.broadcasted_iota(jnp.int32, s.shape, k_dim, layout=plgpu.Layout.WGMMA) + k0
    d = qpos - kpos
    mask = (lax.broadcast_in_dim(qseg, s.shape, [q_dim]) == lax.broadcast_in_dim(kseg, s.shape, [k_dim])) & (d >= 0)
    if c.window:
        mask &= d < c.window
    return jnp.where(mask, s * LOG2E, -jnp.inf), t


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
            qseg_Q = plgpu.load(qseg_s, layout=plgpu.Layout.WGMMA.reduce(1))
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
                kseg_K = plgpu.load(kseg_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
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
            _stream_kv((k_ref, kseg_ref, v_ref), (k_smem, kseg_smem, v_smem), (k_bar, kseg_bar, v_bar), b,
                       lax.div(h, jnp.int32(G)), lo, hi, bk, k_done, v_done)

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


def _consumers(D: int) -> int:
    """Consumer warpgroups of the backward kernels: each holds its own rows' two operand tiles beside the
    producer's ring, and at head_dim 256 two of them would ask for about 256 KiB of shared memory."""
    return 1 if D > 128 else CONSUMERS


def _dq(c: _Cfg, q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, do_BLHD, lse_BHL, delta_BHL):
    """dq = scale * sum_j dS_j k_j, dS = P * (dO v^T - delta): laid out like the forward, the producer
    streaming K, V and key segments through the ring, each consumer owning 64 query rows."""
    B, L, H, D = q_BLHD.shape
    G = H // k_BLKD.shape[2]
    bq, bk, dtype, n = BLOCK_Q, c.bk, q_BLHD.dtype, _consumers(D)
    n_k = L // bk
    row = plgpu.Layout.WGMMA.reduce(1)

    def kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref, dq_ref,
               q_smem, do_smem, qseg_smem, lse_smem, delta_smem, ds_smem, k_smem, v_smem, kseg_smem,
               own_bar, k_bar, v_bar, kseg_bar, done):
        b, h, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
        cta_q0 = lax.axis_index("q") * (n * bq)
        lo, hi = key_range(c.offset + cta_q0, n * bq, bk, c.window, n_k)

        @pl.when(wg < n)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
            q0 = cta_q0 + wg * bq
            q_s, do_s, ds_s = q_smem.at[wg], do_smem.at[wg], ds_smem.at[wg]
            rows = pl.ds(q0, bq)
            own = [(q_ref.at[b, rows, h], q_s), (do_ref.at[b, rows, h], do_s), (qseg_ref.at[b, rows], qseg_smem.at[wg]),
                   (lse_ref.at[b, h, rows], lse_smem.at[wg]), (delta_ref.at[b, h, rows], delta_smem.at[wg])]
            for t, (src, dst) in enumerate(own):
                plgpu.copy_gmem_to_smem(src, dst, own_bar.at[wg * len(own) + t])
            for t in range(len(own)):
                plgpu.barrier_wait(own_bar.at[wg * len(own) + t])
            qseg_Q, lse_Q, delta_Q = (plgpu.load(r.at[wg], layout=row) for r in (qseg_smem, lse_smem, delta_smem))
            lo_w, hi_w = key_range(c.offset + q0, bq, bk, c.window, n_k)

            def skip(j, _):
                slot = lax.rem(j - lo, STAGES)
                for bar in (k_bar, kseg_bar, v_bar):
                    plgpu.barrier_wait(bar.at[slot])
                plgpu.barrier_arrive(done.at[slot])

            def step(j, dq_QD):
                slot = lax.rem(j - lo, STAGES)
                for bar in (k_bar, kseg_bar, v_bar):
                    plgpu.barrier_wait(bar.at[slot])
                s_QK = _mm(q_s, k_smem.at[slot], b_transposed=True)
                kseg_K = plgpu.load(kseg_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                s_QK, t_QK = _masked_scores(s_QK, q0, j * bk, qseg_Q, kseg_K, c)
                p_QK = jnp.exp2(s_QK - lax.broadcast_in_dim(lse_Q, s_QK.shape, [0]))
                dp_QK = _mm(do_s, v_smem.at[slot], b_transposed=True)
                ds_QK = p_QK * (dp_QK - lax.broadcast_in_dim(delta_Q, s_QK.shape, [0]))
                if c.softcap:
                    ds_QK = ds_QK * (1.0 - t_QK * t_QK)
                ds_s[...] = ds_QK.astype(dtype)
                plgpu.commit_smem()
                dq_QD = tuple(a + _mm(ds_s, k_smem.at[slot, :, cols]) for a, cols in zip(dq_QD, _col_chunks(D)))
                plgpu.barrier_arrive(done.at[slot])
                return dq_QD

            zeros = tuple(plgpu.layout_cast(jnp.zeros((bq, cols.size), jnp.float32), plgpu.Layout.WGMMA)
                          for cols in _col_chunks(D))
            lax.fori_loop(lo, lo_w, skip, None)
            dq_QD = lax.fori_loop(lo_w, hi_w, step, zeros)
            lax.fori_loop(hi_w, hi, skip, None)
            for a, cols in zip(dq_QD, _col_chunks(D)):
                q_s[:, cols] = (a * c.scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_s, dq_ref.at[b, rows, h])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == n)
        def _producer():
            _stream_kv((k_ref, kseg_ref, v_ref), (k_smem, kseg_smem, v_smem), (k_bar, kseg_bar, v_bar), b,
                       lax.div(h, jnp.int32(G)), lo, hi, bk, done)

    ring = lambda: plgpu.Barrier(num_barriers=STAGES)
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct(q_BLHD.shape, dtype),
        scratch_types=[_smem((n, bq, D), dtype), _smem((n, bq, D), dtype), plgpu.SMEM((n, bq), jnp.int32),
                       plgpu.SMEM((n, bq), jnp.float32), plgpu.SMEM((n, bq), jnp.float32), _smem((n, bq, bk), dtype),
                       _smem((STAGES, bk, D), dtype), _smem((STAGES, bk, D), dtype), plgpu.SMEM((STAGES, bk), jnp.int32),
                       plgpu.Barrier(num_barriers=5 * n), ring(), ring(), ring(),
                       plgpu.Barrier(num_arrivals=n, num_barriers=STAGES)],
        grid=(H, L // (n * bq), B), grid_names=("heads", "q", "batch"), num_threads=n + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True), interpret=_interpret(c), kernel_name="flash_mgpu_dq",
    )(q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, do_BLHD, lse_BHL, delta_BHL)


def _dkv(c: _Cfg, q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, do_BLHD, lse_BHL, delta_BHL):
    """dk = scale * sum dS^T q and dv = sum P^T dO over the G query heads of a kv head and the query blocks
    that see these keys: each consumer owns 64 key rows of one kv head and holds its K and V tiles; the
    producer streams (head g, query block i) tiles of q, dO, query segments, lse and delta. The scores are
    held transposed (keys by row), so both products take the streamed tiles straight from the ring."""
    B, L, H, D = q_BLHD.shape
    K = k_BLKD.shape[2]
    G = H // K
    bk, bq, dtype, n = BLOCK_Q, c.bk, q_BLHD.dtype, _consumers(D)  # keys by row: 64 key rows a consumer
    n_q = L // bq
    col = plgpu.Layout.WGMMA.reduce(0)

    def kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
               k_smem, v_smem, kseg_smem, ds_smem, q_smem, do_smem, qseg_smem, lse_smem, delta_smem,
               own_bar, ring_bar, done):
        b, kh, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
        cta_k0 = lax.axis_index("k") * (n * bk)
        lo, hi = query_range(cta_k0, n * bk, c.offset, bq, c.window, n_q)
        span = hi - lo
        streams = 5

        def slot_of(g, i):
            return lax.rem(g * span + (i - lo), STAGES)

        @pl.when(wg < n)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
            k0 = cta_k0 + wg * bk
            k_s, v_s, ds_s = k_smem.at[wg], v_smem.at[wg], ds_smem.at[wg]
            rows = pl.ds(k0, bk)
            own = [(k_ref.at[b, rows, kh], k_s), (v_ref.at[b, rows, kh], v_s), (kseg_ref.at[b, rows], kseg_smem.at[wg])]
            for t, (src, dst) in enumerate(own):
                plgpu.copy_gmem_to_smem(src, dst, own_bar.at[wg * len(own) + t])
            for t in range(len(own)):
                plgpu.barrier_wait(own_bar.at[wg * len(own) + t])
            kseg_K = plgpu.load(kseg_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
            lo_w, hi_w = query_range(k0, bk, c.offset, bq, c.window, n_q)

            def wait(slot):
                for t in range(streams):
                    plgpu.barrier_wait(ring_bar.at[slot * streams + t])

            def skip(g, i, _):
                slot = slot_of(g, i)
                wait(slot)
                plgpu.barrier_arrive(done.at[slot])

            def step(g, i, carry):
                dk_KD, dv_KD = carry
                slot = slot_of(g, i)
                wait(slot)
                q_s, do_s = q_smem.at[slot], do_smem.at[slot]
                st_KQ = _mm(k_s, q_s, b_transposed=True)
                qseg_Q, lse_Q, delta_Q = (plgpu.load(r.at[slot], layout=col) for r in (qseg_smem, lse_smem, delta_smem))
                st_KQ, tt_KQ = _masked_scores(st_KQ, i * bq, k0, qseg_Q, kseg_K, c, keys_by_row=True)
                pt_KQ = jnp.exp2(st_KQ - lax.broadcast_in_dim(lse_Q, st_KQ.shape, [1]))
                dpt_KQ = _mm(v_s, do_s, b_transposed=True)
                dst_KQ = pt_KQ * (dpt_KQ - lax.broadcast_in_dim(delta_Q, st_KQ.shape, [1]))
                if c.softcap:
                    dst_KQ = dst_KQ * (1.0 - tt_KQ * tt_KQ)
                ds_s[...] = pt_KQ.astype(dtype)
                plgpu.commit_smem()
                dv_KD = tuple(a + _mm(ds_s, do_s.at[:, cols]) for a, cols in zip(dv_KD, _col_chunks(D)))
                ds_s[...] = dst_KQ.astype(dtype)
                plgpu.commit_smem()
                dk_KD = tuple(a + _mm(ds_s, q_s.at[:, cols]) for a, cols in zip(dk_KD, _col_chunks(D)))
                plgpu.barrier_arrive(done.at[slot])
                return dk_KD, dv_KD

            def head(g, carry):
                lax.fori_loop(lo, lo_w, functools.partial(skip, g), None)
                carry = lax.fori_loop(lo_w, hi_w, functools.partial(step, g), carry)
                lax.fori_loop(hi_w, hi, functools.partial(skip, g), None)
                return carry

            zeros = tuple(plgpu.layout_cast(jnp.zeros((bk, cols.size), jnp.float32), plgpu.Layout.WGMMA)
                          for cols in _col_chunks(D))
            dk_KD, dv_KD = lax.fori_loop(0, G, head, (zeros, zeros))
            for a, d, cols in zip(dk_KD, dv_KD, _col_chunks(D)):
                k_s[:, cols] = (a * c.scale).astype(dtype)
                v_s[:, cols] = d.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_s, dk_ref.at[b, rows, kh])
            plgpu.copy_smem_to_gmem(v_s, dv_ref.at[b, rows, kh])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == n)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")

            @pl.loop(0, G * span)
            def _(t):
                g, i, slot = lax.div(t, span), lo + lax.rem(t, span), lax.rem(t, STAGES)
                h, rows = kh * G + g, pl.ds(i * bq, bq)

                @pl.when(t >= STAGES)
                def _():
                    plgpu.barrier_wait(done.at[slot])
                ring = [(q_ref.at[b, rows, h], q_smem), (do_ref.at[b, rows, h], do_smem), (qseg_ref.at[b, rows], qseg_smem),
                        (lse_ref.at[b, h, rows], lse_smem), (delta_ref.at[b, h, rows], delta_smem)]
                for s, (src, dst) in enumerate(ring):
                    plgpu.copy_gmem_to_smem(src, dst.at[slot], ring_bar.at[slot * streams + s])
            _drain(G * span, done)

    return plgpu.kernel(
        kernel, out_type=[jax.ShapeDtypeStruct(k_BLKD.shape, dtype)] * 2,
        scratch_types=[_smem((n, bk, D), dtype), _smem((n, bk, D), dtype), plgpu.SMEM((n, bk), jnp.int32),
                       _smem((n, bk, bq), dtype), _smem((STAGES, bq, D), dtype), _smem((STAGES, bq, D), dtype),
                       plgpu.SMEM((STAGES, bq), jnp.int32), plgpu.SMEM((STAGES, bq), jnp.float32),
                       plgpu.SMEM((STAGES, bq), jnp.float32), plgpu.Barrier(num_barriers=3 * n),
                       plgpu.Barrier(num_barriers=5 * STAGES), plgpu.Barrier(num_arrivals=n, num_barriers=STAGES)],
        grid=(K, L // (n * bk), B), grid_names=("heads", "k", "batch"), num_threads=n + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True), interpret=_interpret(c), kernel_name="flash_mgpu_dkv",
    )(q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, do_BLHD, lse_BHL, delta_BHL)


def _backward(c: _Cfg, q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, o_BLHD, lse_BHL, do_BLHD):
    """Padded inputs, the (global) o and log2 lse -> (dq, dk, dv). Rows with lse = +inf get p = 0."""
    do_BLHD = do_BLHD.astype(q_BLHD.dtype)
    args = (q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, do_BLHD, lse_BHL, flash_gpu.delta(o_BLHD, do_BLHD))
    return (_dq(c, *args), *_dkv(c, *args))


_attend = flash_gpu.self_attention_vjp(_forward, _backward)

# A CTA's rows (2 x 64) and every key block divide this, so inputs are padded to a multiple of it.
ROWS = CONSUMERS * BLOCK_Q


def _setup(name, q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, *, offset, window, softcap, scale, interpret):
    """Check the inputs; returns the config and q, k, v, qseg, kseg padded to ROWS rows and a head_dim of
    HEAD_DIMS (zero columns leave scores and the real output columns unchanged; pad rows get segment -1,
    which no real row has)."""
    flash_gpu.check_shapes(name, q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL)
    B, L, H, D = q_BLHD.shape
    why = unsupported(D, q_BLHD.dtype) or (None if q_BLHD.dtype == k_BLKD.dtype == v_BLKD.dtype else "q, k, v differ")
    if why:
        raise ValueError(f"{name}: dtypes {q_BLHD.dtype}/{k_BLKD.dtype}/{v_BLKD.dtype}, head_dim {D}: {why}")
    if window < 0 or softcap < 0 or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"{name}: window {window} and softcap {softcap} must be >= 0 (0 switches them off), "
                         f"offset {offset!r} a Python int >= 0")
    Dp = padded_head_dim(D)
    c = _Cfg(float(scale or D ** -0.5), float(softcap), int(window), offset, BLOCK_K[Dp], bool(interpret))
    Lp = -(-L // ROWS) * ROWS
    pad = functools.partial(flash_gpu.pad_L, Lp=Lp)
    q_BLHD, k_BLKD, v_BLKD = (pad(flash_gpu.pad_L(x, Dp, axis=3)) for x in (q_BLHD, k_BLKD, v_BLKD))
    qseg_BL, kseg_BL = (pad(s.astype(jnp.int32), fill=-1) for s in (qseg_BL, kseg_BL))
    return c, q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL


def flash_attention(q_BLHD, k_BLKD, v_BLKD, seg_BL, *, window: int = 0, softcap: float = 0.0, scale: float = 0.0,
                    interpret: bool = False) -> jax.Array:
    """Causal GQA self-attention over packed segments: flash_gpu.flash_attention's semantics, on Hopper."""
    L, D = q_BLHD.shape[1], q_BLHD.shape[3]
    c, q_BLHD, k_BLKD, v_BLKD, seg_BL, _ = _setup("flash_attention", q_BLHD, k_BLKD, v_BLKD, seg_BL, seg_BL, offset=0,
                                                  window=window, softcap=softcap, scale=scale, interpret=interpret)
    return _attend(c, q_BLHD, k_BLKD, v_BLKD, seg_BL)[:, :L, :, :D]


def block_forward(q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, *, offset: int = 0, window: int = 0,
                  softcap: float = 0.0, scale: float = 0.0, interpret: bool = False):
    """One (query chunk, K/V chunk) pair of ring attention, forward: flash_gpu.block_forward's contract
    (o normalised over this chunk, the natural-log lse, -inf and o = 0 for a row that sees no key)."""
    L, D = q_BLHD.shape[1], q_BLHD.shape[3]
    c, *args = _setup("block_forward", q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, offset=offset, window=window,
                      softcap=softcap, scale=scale, interpret=interpret)
    o_BLHD, lse_BHL = _forward(c, *args)
    return o_BLHD[:, :L, :, :D], jnp.where(lse_BHL[:, :, :L] == jnp.inf, -jnp.inf, lse_BHL[:, :, :L] / LOG2E)


def block_backward(q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, o_BLHD, lse_BHL, do_BLHD, *, offset: int = 0,
                   window: int = 0, softcap: float = 0.0, scale: float = 0.0, interpret: bool = False):
    """One chunk pair of ring attention, backward, from the GLOBAL o and natural-log lse:
    flash_gpu.block_backward's contract."""
    c, *args = _setup("block_backward", q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, offset=offset, window=window,
                      softcap=softcap, scale=scale, interpret=interpret)
    B, L, H, D = q_BLHD.shape
    if o_BLHD.shape != q_BLHD.shape or do_BLHD.shape != q_BLHD.shape or tuple(lse_BHL.shape) != (B, H, L):
        raise ValueError(f"block_backward: o {o_BLHD.shape} and do {do_BLHD.shape} must be q's shape "
                         f"{q_BLHD.shape}, lse {lse_BHL.shape} must be {(B, H, L)}")
    Lp, Dp = args[0].shape[1], args[0].shape[3]
    o_BLHD, do_BLHD = (flash_gpu.pad_L(flash_gpu.pad_L(x, Dp, axis=3), Lp) for x in (o_BLHD, do_BLHD))
    lse_BHL = lse_BHL.astype(jnp.float32)
    lse_BHL = flash_gpu.pad_L(jnp.where(jnp.isfinite(lse_BHL), lse_BHL * LOG2E, jnp.inf), Lp, axis=2, fill=jnp.inf)
    dq_BLHD, dk_BLKD, dv_BLKD = _backward(c, *args, o_BLHD, lse_BHL, do_BLHD)
    return dq_BLHD[:, :L, :, :D], dk_BLKD[:, :L, :, :D], dv_BLKD[:, :L, :, :D]
