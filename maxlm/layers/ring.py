"""Context parallelism: causal attention over a sequence split along one mesh axis, as a ring.

Layout. The `length` rule puts the sequence on a mesh axis of C devices (`context`). The train step first
permutes every sequence into 2C chunks in the order 0, 2C-1, 1, 2C-2, ... (`to_zigzag`), so the plain
split along `length` hands device i chunks i and 2C-1-i: one early and one late chunk, the same causal
work on every device. Everything but attention is per token and does not care about the order; RoPE
reads the permuted `positions`, and the loss is a sum.

Ring. Each device keeps its queries and passes its K/V chunks (with their segment ids) to the next
device, C-1 times (`ppermute`). At each step it attends its two query chunks to the K/V chunks it
holds and merges the partial outputs through their log-sum-exp. Whether a chunk pair is on the
diagonal, fully visible, partly visible (a sliding window) or not visible at all follows from the two
chunks' places in the original sequence; `lax.switch` picks a block kernel compiled for that static
offset, and an invisible pair (the future, or beyond the window) costs nothing. The query chunk i
never sees the K/V chunk 2C-1-j of any device j, so that pair is not even traced.

Backward (a custom_vjp): the residuals are this device's q, k, v, segment ids, output and log-sum-exp,
O(L / C). The K/V chunks go around the ring again, now with their gradient accumulators, and each
block's backward uses the global output and log-sum-exp (FlashAttention-2's trick: exp(s - lse) is
already the final probability), so no step's partial result is kept. After C moves the K/V gradients
are back on the device that owns the chunk.

A block kernel is a pair `(forward, backward)` with maxlm's block contract (layers.attention,
kernels_pallas.flash_gpu, kernels_pallas.flash_tpu): forward(q, k, v, qseg, kseg, *, offset, window,
softcap, scale) -> (o_BLHD, lse_BHL) where query i sits at position offset + i and key j at j, and
backward(q, k, v, qseg, kseg, o, lse, do, *, same) -> (dq, dk, dv) given the global o and lse.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from maxlm.layers.sinks import sink_grad, sink_merge


def zigzag_order(L: int, C: int) -> np.ndarray:
    """Token indices of the zig-zag layout: chunks 0, 2C-1, 1, 2C-2, ... of length L / 2C."""
    c = L // (2 * C)
    chunks = [x for i in range(C) for x in (i, 2 * C - 1 - i)]
    return np.concatenate([np.arange(k * c, (k + 1) * c) for k in chunks])


def to_zigzag(x_BL, C: int):
    return x_BL[:, zigzag_order(x_BL.shape[1], C)]


def from_zigzag(x_BL, C: int):
    return x_BL[:, np.argsort(zigzag_order(x_BL.shape[1], C))]


def _offsets(c: int, C: int, window: int) -> list[int]:
    """The static offsets a chunk pair can have, in query positions relative to the key chunk's start:
    0 (the diagonal), then c, 2c, ... as far as the window reaches (without a window, every earlier
    chunk is fully visible, so offset c stands for all of them)."""
    if not window:
        return [0, c]
    reach = (window + c - 2) // c  # farthest chunk distance with a visible pair
    return [d * c for d in range(min(reach, 2 * C - 1) + 1)]


def _case(dist, n_offsets: int, window: int):
    """lax.switch index of a pair `dist` chunks apart (query chunk minus key chunk): 0 skips it."""
    if not window:
        return jnp.where(dist < 0, 0, 1 + jnp.minimum(dist, 1))
    return jnp.where((dist < 0) | (dist >= n_offsets), 0, 1 + dist)


def _merge(o_BLHD, lse_BHL, o2_BLHD, lse2_BHL):
    """Two softmax-normalised partial outputs over disjoint keys -> over their union (float32)."""
    lse = jnp.logaddexp(lse_BHL, lse2_BHL)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)  # a row that saw nothing yet stays 0, not NaN
    w1 = jnp.exp(lse_BHL - safe).transpose(0, 2, 1)[..., None]
    w2 = jnp.exp(lse2_BHL - safe).transpose(0, 2, 1)[..., None]
    return o_BLHD * w1 + o2_BLHD.astype(o_BLHD.dtype) * w2, lse


def _halves(x_BL):
    h = x_BL.shape[1] // 2
    return x_BL[:, :h], x_BL[:, h:]


def _shift(tree, axis: str, C: int):
    """Everyone passes `tree` to the next device along `axis`."""
    return jax.lax.ppermute(tree, axis, [(d, (d + 1) % C) for d in range(C)])


class _Ring:
    """The static facts of one ring call, shared by its forward and backward."""

    def __init__(self, kernel, axis: str, C: int, c: int, window: int, opts: dict):
        self.fwd, self.bwd = kernel
        self.axis, self.C, self.window, self.opts = axis, C, window, opts
        self.offsets = _offsets(c, C, window)

    def dists(self, s):
        """Chunk distances of the three pairs that can see anything at ring step s: (q_early, k_early),
        (q_late, k_early), (q_late, k_late). This device holds the K/V of device j = i - s."""
        i = jax.lax.axis_index(self.axis)
        j = (i - s) % self.C
        return i - j, 2 * self.C - 1 - i - j, j - i

    def pair(self, backward: bool, dist, *args):
        """One chunk pair through the kernel compiled for its offset (or skipped)."""
        kern = self.bwd if backward else self.fwd
        q, k = args[0], args[1]

        def skip(*_):
            if backward:
                return jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype), jnp.zeros(k.shape, k.dtype)
            B, L, H, _ = q.shape
            return jnp.zeros(q.shape, q.dtype), jnp.full((B, H, L), -jnp.inf, _acc(q))

        branches = [skip] + [functools.partial(_call, kern, dict(offset=o, window=self.window, **self.opts))
                             for o in self.offsets]
        return jax.lax.switch(_case(dist, len(self.offsets), self.window), branches, *args)


def _acc(x):
    return jnp.promote_types(x.dtype, jnp.float32)  # float64 in the float64 reference tests


def _call(kern, kw, *args):
    return kern(*args, **kw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(r: _Ring, q_BLHD, k_BLKD, v_BLKD, seg_BL, sinks_H):
    return _ring_fwd(r, q_BLHD, k_BLKD, v_BLKD, seg_BL, sinks_H)[0]


def _ring_fwd(r: _Ring, q_BLHD, k_BLKD, v_BLKD, seg_BL, sinks_H):
    q0, q1 = _halves(q_BLHD)
    B, L, H, D = q_BLHD.shape
    acc = (jnp.zeros((B, L // 2, H, D), _acc(q_BLHD)), jnp.full((B, H, L // 2), -jnp.inf, _acc(q_BLHD)))
    acc = (acc, acc)

    def step(acc, kv, s):
        (o0, l0), (o1, l1) = acc
        k0, k1, v0, v1, s0, s1 = kv
        d00, d10, d11 = r.dists(s)
        q_seg0, q_seg1 = _halves(seg_BL)
        o0, l0 = _merge(o0, l0, *r.pair(False, d00, q0, k0, v0, q_seg0, s0))
        o1, l1 = _merge(o1, l1, *r.pair(False, d10, q1, k0, v0, q_seg1, s0))
        o1, l1 = _merge(o1, l1, *r.pair(False, d11, q1, k1, v1, q_seg1, s1))
        return (o0, l0), (o1, l1)

    def body(carry, s):
        acc, kv = carry
        # The next chunks are sent while these are attended: nothing here waits for the transfer.
        return (step(acc, kv, s), _shift(kv, r.axis, r.C)), None

    kv = (*_halves(k_BLKD), *_halves(v_BLKD), *_halves(seg_BL))
    (acc, kv), _ = jax.lax.scan(body, (acc, kv), jnp.arange(r.C - 1))
    (o0, l0), (o1, l1) = step(acc, kv, r.C - 1)
    o_BLHD, lse_BHL = jnp.concatenate([o0, o1], axis=1), jnp.concatenate([l0, l1], axis=2)
    if sinks_H is not None:  # once, on the merged row: not once per chunk
        o_BLHD, lse_BHL = sink_merge(o_BLHD, lse_BHL, sinks_H)
    o_BLHD = o_BLHD.astype(q_BLHD.dtype)
    return o_BLHD, (q_BLHD, k_BLKD, v_BLKD, seg_BL, sinks_H, o_BLHD, lse_BHL)


def _ring_bwd(r: _Ring, res, do_BLHD):
    q_BLHD, k_BLKD, v_BLKD, seg_BL, sinks_H, o_BLHD, lse_BHL = res
    q0, q1 = _halves(q_BLHD)
    qs0, qs1 = _halves(seg_BL)
    o0, o1 = _halves(o_BLHD)
    do0, do1 = _halves(do_BLHD.astype(q_BLHD.dtype))
    l0, l1 = lse_BHL[..., :lse_BHL.shape[2] // 2], lse_BHL[..., lse_BHL.shape[2] // 2:]
    f32 = lambda x: jnp.zeros(x.shape, _acc(x))  # noqa: E731

    def step(dq, kv, dkv, s):
        dq0, dq1 = dq
        k0, k1, v0, v1, s0, s1 = kv
        dk0, dk1, dv0, dv1 = dkv
        d00, d10, d11 = r.dists(s)
        a, b, c = r.pair(True, d00, q0, k0, v0, qs0, s0, o0, l0, do0)
        dq0, dk0, dv0 = dq0 + a, dk0 + b, dv0 + c
        a, b, c = r.pair(True, d10, q1, k0, v0, qs1, s0, o1, l1, do1)
        dq1, dk0, dv0 = dq1 + a, dk0 + b, dv0 + c
        a, b, c = r.pair(True, d11, q1, k1, v1, qs1, s1, o1, l1, do1)
        dq1, dk1, dv1 = dq1 + a, dk1 + b, dv1 + c
        return (dq0, dq1), (dk0, dk1, dv0, dv1)

    def body(carry, s):
        dq, kv, dkv = carry
        nxt = _shift(kv, r.axis, r.C)  # in flight while this step computes
        dq, dkv = step(dq, kv, dkv, s)
        return (dq, nxt, _shift(dkv, r.axis, r.C)), None  # the gradients follow the chunk they belong to

    kv = (*_halves(k_BLKD), *_halves(v_BLKD), *_halves(seg_BL))
    dkv = tuple(f32(x) for x in (*_halves(k_BLKD), *_halves(v_BLKD)))
    (dq, kv, dkv), _ = jax.lax.scan(body, ((f32(q0), f32(q1)), kv, dkv), jnp.arange(r.C - 1))
    dq, dkv = step(dq, kv, dkv, r.C - 1)
    dk0, dk1, dv0, dv1 = _shift(dkv, r.axis, r.C)  # the C-th move brings them home
    cat = lambda a, b, like: jnp.concatenate([a, b], axis=1).astype(like.dtype)  # noqa: E731
    dsinks = None if sinks_H is None else sink_grad(o_BLHD, lse_BHL, do_BLHD, sinks_H)  # this shard's rows
    return cat(*dq, q_BLHD), cat(dk0, dk1, k_BLKD), cat(dv0, dv1, v_BLKD), None, dsinks


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(kernel, q_BLHD, k_BLKD, v_BLKD, seg_BL, sinks_H=None, *, axis: str, size: int, window: int = 0,
                   softcap: float = 0.0, scale: float = 0.0, **opts):
    """Causal attention of this device's zig-zag shard (call inside shard_map; `size` devices along
    `axis`). `kernel` is a (forward, backward) pair with the block contract; `opts` go to both. `sinks_H`
    (gpt-oss) joins each row's merged softmax once (attention.sink_merge)."""
    L = q_BLHD.shape[1]
    if L % 2:
        raise ValueError(f"ring_attention: the local shard has {L} tokens; it must hold two equal chunks")
    r = _Ring(kernel, axis, size, L // 2, int(window), dict(softcap=softcap, scale=scale, **opts))
    return _ring(r, q_BLHD, k_BLKD, v_BLKD, seg_BL.astype(jnp.int32), sinks_H)
