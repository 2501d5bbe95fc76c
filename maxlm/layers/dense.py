"""The one matmul hook: every weight matmul of every family (attention projections, MLPs, MoE router
and experts, the unembedding) is `dense`, or `grouped` for MoE experts whose rows are sorted by
expert. A transform that changes how weights multiply (LoRA adding x @ A @ B, FP8 scaling and casting
both operands) acts here, and only here, so it reaches every layer of every family without any of them
knowing; nothing else multiplies a parameter. `dense`'s contract is einsum's: `eq` names the axes, `x`
is the activation (its dtype is the matmul dtype), `w` the parameter (cast to x's dtype here), `more`
any further activation-side operands (MoE's routing weights), and `out_dtype` the accumulation/result
type when it must differ from x's (float32 logits).

A weight may arrive as a `Lora` node (maxlm.lora puts them in the param tree): the frozen weight plus
its adapters, which `dense` multiplies as W x + (alpha / r) B A x. It may arrive as an `Fp8` node
(maxlm.fp8): the weight with its delayed-scaling state, which `dense` multiplies in FP8 (flax's
fp8_ops: both operands e4m3, the output gradient e5m2, each scaled per tensor from its amax history).
The two compose: a Lora's `w` may be an Fp8 (the frozen base in FP8, the small adapters in `dtype`)."""

import dataclasses
import functools
import string
from typing import Any

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w", "a", "b", "key"],
                   meta_fields=["scale", "dropout"])
@dataclasses.dataclass
class Lora:
    """A frozen weight `w` [*in, *out] and its adapters `a` [*in, r] and `b` [r, *out], added with `scale`
    (alpha / r). `key` (raw key data) switches on dropout of the adapters' input at rate `dropout`."""
    w: Any
    a: Any
    b: Any
    key: Any = None
    scale: float = 1.0
    dropout: float = 0.0


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w", "scale", "amax"], meta_fields=[])
@dataclasses.dataclass
class Fp8:
    """A weight `w` to multiply in FP8, with its matmul's scaling state: `scale` [3] and amax `history`
    [3, H] for the matmul's two operands (e4m3) and its output gradient (e5m2). Their gradient is their
    next value (flax's fp8_ops convention), which maxlm.fp8 turns into the state's update."""
    w: Any
    scale: Any
    amax: Any


def _fp8(eq: str, x: jax.Array, w: Fp8, out_dtype) -> jax.Array:
    # einsum may hand the operands to dot_general in either order; slots 0 and 1 follow its order, which
    # is fixed for a call site, so each operand keeps its own history from step to step.
    dot = functools.partial(fp8_ops.fp8_scaled_dot_general, lhs_scale=w.scale[0], rhs_scale=w.scale[1],
                            grad_scale=w.scale[2], lhs_amax_history=w.amax[0], rhs_amax_history=w.amax[1],
                            grad_amax_history=w.amax[2], quantize_compute_type=x.dtype)
    return jnp.einsum(eq, x, w.w.astype(x.dtype), preferred_element_type=out_dtype or x.dtype,
                      _dot_general=lambda a, b, dims, precision=None, **kw: dot(a, b, dims, **kw))


def _lora_eqs(eq: str, w_ndim: int) -> tuple[str, str, str]:
    """einsum equations of x -> x A -> (x A) B for a weight matmul `eq` ("bld,dhk->blhk", or "bld,d...->bl...")."""
    ins, out = eq.split("->")
    x_sub, w_sub = ins.split(",")[:2]
    if "..." in w_sub:  # spell the ellipsis out: the weight's trailing axes, in the output too
        free = [c for c in string.ascii_letters if c not in eq][:w_ndim - len(w_sub) + 3]
        w_sub, out = w_sub.replace("...", "".join(free)), out.replace("...", "".join(free))
    r = next(c for c in string.ascii_letters if c not in x_sub + w_sub + out)
    contracted = "".join(c for c in w_sub if c in x_sub and c not in out)
    kept = "".join(c for c in x_sub if c not in contracted)
    w_out = "".join(c for c in w_sub if c in out)
    return f"{x_sub},{w_sub}->{out}", f"{x_sub},{contracted}{r}->{kept}{r}", f"{kept}{r},{r}{w_out}->{out}"


def _lora(eq: str, x: jax.Array, w: Lora, out_dtype) -> jax.Array:
    eq_w, eq_a, eq_b = _lora_eqs(eq, (w.w.w if isinstance(w.w, Fp8) else w.w).ndim)
    y = dense(eq_w, x, w.w, out_dtype=out_dtype)
    if w.key is not None and w.dropout:
        keep = jax.random.bernoulli(jax.random.wrap_key_data(w.key), 1.0 - w.dropout, x.shape)
        x = jnp.where(keep, x / (1.0 - w.dropout), 0).astype(x.dtype)
    xa = jnp.einsum(eq_a, x, w.a.astype(x.dtype))
    return y + (w.scale * jnp.einsum(eq_b, xa, w.b.astype(x.dtype), preferred_element_type=out_dtype)).astype(y.dtype)


def dense(eq: str, x: jax.Array, w, *more: jax.Array, out_dtype=None) -> jax.Array:
    if isinstance(w, Lora):
        return _lora(eq, x, w, out_dtype)
    if isinstance(w, Fp8):
        return _fp8(eq, x, w, out_dtype)
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
