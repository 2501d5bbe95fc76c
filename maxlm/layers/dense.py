"""The one matmul hook: every weight matmul of every family (attention projections, MLPs, MoE router
and experts, the unembedding) is `dense`, or `grouped` for MoE experts whose rows are sorted by
expert. A transform that changes how weights multiply (LoRA adding x @ A @ B, FP8 scaling and casting
both operands) replaces these two functions, and only these, so it reaches every layer of every family
without any of them knowing; nothing else multiplies a parameter. `dense`'s contract is einsum's: `eq`
names the axes, `x` is the activation (its dtype is the matmul dtype), `w` the float32 parameter (cast
to x's dtype here), `more` any further activation-side operands (MoE's routing weights), and
`out_dtype` the accumulation/result type when it must differ from x's (float32 logits)."""

import jax
import jax.numpy as jnp


def dense(eq: str, x: jax.Array, w: jax.Array, *more: jax.Array, out_dtype=None) -> jax.Array:
    return jnp.einsum(eq, x, w.astype(x.dtype), *more, preferred_element_type=out_dtype)


def grouped(x_RD: jax.Array, w_EDF: jax.Array, groups_E: jax.Array, block_N: jax.Array | None) -> jax.Array:
    """Rows sorted by expert times each row's expert's matrix: rows [sum(groups_E[:e]), +groups_E[e])
    use w_EDF[e]; rows past the last group come out zero. With `block_N` (XLA:CPU, where ragged_dot is a
    dense masked product costing E times the work), every group is padded to a multiple of the block
    size R / N and block n uses expert block_N[n]: one batched matmul over blocks."""
    w_EDF = w_EDF.astype(x_RD.dtype)
    if block_N is None:
        return jax.lax.ragged_dot(x_RD, w_EDF, groups_E)
    R, N = x_RD.shape[0], block_N.shape[0]
    x_NbD = x_RD.reshape(N, R // N, x_RD.shape[1])
    return jnp.einsum("nbd,ndf->nbf", x_NbD, w_EDF[block_N]).reshape(R, w_EDF.shape[2])
