"""The one matmul hook: every weight matmul of every family (attention projections, MLPs, MoE router
and experts, the unembedding) is `dense`, or `grouped` for MoE experts whose rows are sorted by
expert. Nothing else multiplies a parameter, so a feature that changes how a weight multiplies reaches
every layer of every family without any of them knowing. `dense`'s contract is einsum's: `eq` names the
axes, `x` is the activation (its dtype is the matmul dtype), `w` the parameter (cast to x's dtype
here), `more` any further activation-side operands (MoE's routing weights), and `out_dtype` the
accumulation/result type when it must differ from x's (float32 logits).

A weight may arrive as a `WeightNode`: a pytree that wraps a weight `w` with state of its own and
computes its own matmul. Each lives in its feature's module: maxlm.lora's `Lora` (frozen weight plus
low-rank adapters) and maxlm.fp8's `Fp8` (the weight with its delayed-scaling state). Nodes nest, the
outer one multiplying its `w` through `dense` again, so neither knows the other: LoRA over an FP8 base
is a `Lora` whose `w` is an `Fp8`, which `wrap_innermost` builds."""

import dataclasses

import jax
import jax.numpy as jnp


class WeightNode:
    """A wrapped weight. Subclasses are dataclasses registered as pytrees, with the wrapped weight (an array,
    or another node) in the field `w`, and implement `matmul(eq, x, out_dtype)` with `dense`'s contract (the
    nodes wrap no weight that takes further operands: those are the MoE experts')."""
    w: object

    def matmul(self, eq: str, x: jax.Array, out_dtype=None) -> jax.Array:
        raise NotImplementedError


def innermost(w):
    """The plain weight inside any nesting of nodes (its shape is the matmul's)."""
    while isinstance(w, WeightNode):
        w = w.w
    return w


def wrap_innermost(w, wrap):
    """`w` with its plain weight replaced by `wrap(weight)`, inside whatever nodes already wrap it."""
    if isinstance(w, WeightNode):
        return dataclasses.replace(w, w=wrap_innermost(w.w, wrap))
    return wrap(w)


def dense(eq: str, x: jax.Array, w, *more: jax.Array, out_dtype=None) -> jax.Array:
    if isinstance(w, WeightNode):
        return w.matmul(eq, x, out_dtype=out_dtype)
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
