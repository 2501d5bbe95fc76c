"""Attention sinks (gpt-oss): one more logit per head in every softmax, learned, with no value.

TPU's splash kernel takes them itself (kernels_pallas.flash_tpu). Every other path, and every ring, takes
them the same way here. A kernel's block forward gives each row's normalised output
and log-sum-exp over the keys; `sink_merge` joins the sink to that once, on the whole row (the ring merges
its chunks first, then the sink). The block backward, given the merged output and lse, is already the
gradient with the sink in the softmax (exp(s - lse) is the final probability), and `sink_grad` is the
sink's own. XLA's reference and KV-cache decoding put the sink column in the softmax directly
(attention.reference_attention), which the tests use as the float64 oracle.
"""

import functools

import jax
import jax.numpy as jnp


def sink_merge(o_BLHD, lse_BHL, sinks_H):
    """A softmax over the keys, joined by one more logit per head that has no value (gpt-oss's learned
    sink): the normalised output shrinks by exp(lse - lse'), lse' = logaddexp(lse, sink). Done once on a
    row's whole output, whichever kernel (or ring of blocks) produced it."""
    lse2_BHL = jnp.logaddexp(lse_BHL, sinks_H.astype(lse_BHL.dtype)[None, :, None])
    return o_BLHD * jnp.exp(lse_BHL - lse2_BHL).transpose(0, 2, 1)[..., None].astype(o_BLHD.dtype), lse2_BHL


def sink_grad(o_BLHD, lse_BHL, do_BLHD, sinks_H):
    """d loss / d sink per head, given the output and lse with the sink merged: each row's sink
    probability exp(sink - lse) times -rowsum(o do), summed over rows (the sink has no value, so its
    score gradient is FlashAttention's p (dp - delta) with dp = 0)."""
    acc = jnp.promote_types(o_BLHD.dtype, jnp.float32)
    delta_BHL = jnp.einsum("blhd,blhd->bhl", o_BLHD.astype(acc), do_BLHD.astype(acc))
    p_BHL = jnp.exp(sinks_H.astype(acc)[None, :, None] - lse_BHL)
    return -(p_BHL * delta_BHL).sum(axis=(0, 2)).astype(sinks_H.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sink_blocks(blocks, static: tuple, q_BLHD, k_BLKD, v_BLKD, seg_BL, sinks_H):
    return _sink_blocks_fwd(blocks, static, q_BLHD, k_BLKD, v_BLKD, seg_BL, sinks_H)[0]


def _sink_blocks_fwd(blocks, static, q_BLHD, k_BLKD, v_BLKD, seg_BL, sinks_H):
    o, lse = blocks[0](q_BLHD, k_BLKD, v_BLKD, seg_BL, seg_BL, **dict(static))
    o, lse = sink_merge(o.astype(jnp.promote_types(o.dtype, jnp.float32)), lse, sinks_H)
    o = o.astype(q_BLHD.dtype)
    return o, (q_BLHD, k_BLKD, v_BLKD, seg_BL, sinks_H, o, lse)


def _sink_blocks_bwd(blocks, static, res, do_BLHD):
    q, k, v, seg, sinks_H, o, lse = res
    dq, dk, dv = blocks[1](q, k, v, seg, seg, o, lse, do_BLHD, **dict(static))  # the merged o and lse
    return dq, dk, dv, None, sink_grad(o, lse, do_BLHD, sinks_H)


_sink_blocks.defvjp(_sink_blocks_fwd, _sink_blocks_bwd)


def sink_attention(blocks, q_BLHD, k_BLKD, v_BLKD, seg_BL, sinks_H, *, window=0, softcap=0.0, scale=0.0):
    """Causal self-attention with sinks through a kernel's block pair (layers.ring's contract): the block
    forward's output and lse merged with the sinks, and its backward given the merged ones."""
    static = tuple(sorted(dict(window=int(window), softcap=float(softcap), scale=float(scale)).items()))
    return _sink_blocks(blocks, static, q_BLHD, k_BLKD, v_BLKD, seg_BL.astype(jnp.int32), sinks_H)
