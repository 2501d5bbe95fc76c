"""The Mosaic GPU (Hopper) flash-attention kernels, run in the Mosaic GPU interpreter on CPU (threads for
warpgroups, simulated shared memory, TMA and barriers, with its race detector on), against the float64
reference: forward and dq/dk/dv over head dims, GQA, windows, soft-caps, packed segments and padding, and
the ring's block API with a query offset. tests/test_gpu_compile.py compiles the same kernels for sm_90a.

The interpreter (jax 0.11.2) runs each warpgroup of a CTA as its own XLA:CPU computation, and a warpgroup
waiting at a barrier holds, inside a host callback, a thread of XLA:CPU's intra-op pool (tf_XLAEigen),
which has max(cores, devices) threads unless PJRT_NPROC sizes it. With one device on 2 cores both
consumers can hold the pool's 2 threads while the producer they wait for queues behind them: a hang at
any shape, not a barrier the kernel leaves unmatched (the same call completes with PJRT_NPROC=64, which
conftest sets, and matches the reference). The interpreter also cannot run a kernel on several devices at
once (under shard_map): its end-of-kernel check (`assert_no_barriers_allocated`) looks at every device's
live barriers in one process-wide table, so the device that finishes first fails with "Barrier remains
allocated" on another's. These tests call the kernels on one device."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import value_and_vjp
from test_flash_gpu import TOL, _inputs, _reference, _rel

from maxlm.kernels_pallas import flash_mgpu


@functools.partial(jax.jit, static_argnames=("kw",))
def _kernel(q, k, v, seg, do, kw):
    o, vjp = jax.vjp(lambda q, k, v: flash_mgpu.flash_attention(q, k, v, seg, interpret=True, **dict(kw)), q, k, v)
    return (o, *vjp(do))


# (D, L, H, K, window, softcap, dtype): every head dim (96 runs padded to 128), one to three CTAs of 128
# rows, K/V rings of up to four steps (so slots are refilled), windows that make some warpgroups skip
# slots, GQA 1 and 2, padded lengths, float32 and bfloat16. Small, because the interpreter runs every
# warpgroup, copy and barrier in Python.
# The first three cover every feature once (each 10-20 s here), the fourth is tiny.yml's shape; the slow
# suite adds two more combinations, as test_flash_gpu.py does for the Triton kernels.
CASES = [
    (64, 300, 2, 2, 0, 0.0, jnp.float32),
    (128, 200, 2, 1, 40, 0.0, jnp.bfloat16),
    (256, 130, 2, 1, 0, 2.0, jnp.bfloat16),
    # configs/tiny.yml's per-sequence shape: head_dim 32 padded to 64, one key block of 128 (fewer K/V
    # loads than STAGES, so a slot is never used and the drain waits on one), GQA 2, one CTA per head
    (32, 128, 8, 4, 0, 0.0, jnp.float32),
    pytest.param(64, 256, 2, 1, 100, 5.0, jnp.float32, marks=pytest.mark.slow),
    pytest.param(96, 256, 2, 1, 64, 0.0, jnp.float32, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("D, L, H, K, window, softcap, dtype", CASES, ids=lambda x: str(getattr(x, "__name__", x)))
def test_forward_and_gradients_match_float64_reference(D, L, H, K, window, softcap, dtype):
    q, k, v, seg, do = _inputs(np.random.RandomState(D + L), 1, L, H, K, D, dtype, docs=3, pad=L // 7)
    kw = (("window", window), ("softcap", softcap))
    got = _kernel(q, k, v, seg, do, kw)
    want = _reference(q, k, v, seg, do, **dict(kw))
    errs = [_rel(g, w) for g, w in zip(got, want)]
    assert got[0].dtype == q.dtype and got[0].shape == q.shape
    assert max(errs) <= TOL[dtype], f"o/dq/dk/dv rel errors {errs}"


@pytest.mark.parametrize("offset, window", [(128, 100), pytest.param(64, 0, marks=pytest.mark.slow)])
def test_block_api_with_a_query_offset_matches_the_reference(offset, window):
    """Ring attention's block pair: queries at offset + i against keys at j. The forward's o and
    natural-log lse (-inf for rows that see no key) and the backward from the global o and lse equal the
    float64 reference on the rows that see a key (the rest must be exactly 0)."""
    from maxlm.layers.attention import reference_attention

    q, k, v, seg, do = _inputs(np.random.RandomState(offset), 1, 200, 2, 1, 64, jnp.float32, docs=2)
    kw = dict(offset=offset, window=window, interpret=True)
    o, lse = flash_mgpu.block_forward(q, k, v, seg, seg, **kw)
    dq, dk, dv = flash_mgpu.block_backward(q, k, v, seg, seg, o, lse, do, **kw)
    with jax.enable_x64(True):
        f64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
        ref = lambda q, k, v: reference_attention(q, k, v, seg, seg, q_offset=offset, window=window)
        seen = np.isfinite(np.asarray(lse))  # [B, H, L]
        do_seen = f64(do) * np.transpose(seen, (0, 2, 1))[..., None]  # unseen rows have no gradient here
        o_want, *grads = value_and_vjp(ref, do_seen, f64(q), f64(k), f64(v))
    seen_BLH = np.transpose(seen, (0, 2, 1))
    assert seen.any() and not np.asarray(o)[~seen_BLH].any()
    assert _rel(np.asarray(o)[seen_BLH], np.asarray(o_want)[seen_BLH]) <= 1e-5
    for got, want in zip((dq, dk, dv), grads):
        assert _rel(got, np.asarray(want)) <= 1e-5
