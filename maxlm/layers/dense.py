"""The one matmul hook: every weight matmul of every family (attention projections, MLPs, MoE router
and experts, the unembedding) is `dense`. A transform that changes how weights multiply (LoRA adding
x @ A @ B, FP8 scaling and casting both operands) replaces this function, and only this function, so it
reaches every layer of every family without any of them knowing; nothing else calls jnp.einsum on a
parameter. Its contract is einsum's: `eq` names the axes, `x` is the activation (its dtype is the
matmul dtype), `w` the float32 parameter (cast to x's dtype here), `more` any further activation-side
operands (MoE's routing weights), and `out_dtype` the accumulation/result type when it must differ
from x's (float32 logits)."""

import jax
import jax.numpy as jnp


def dense(eq: str, x: jax.Array, w: jax.Array, *more: jax.Array, out_dtype=None) -> jax.Array:
    return jnp.einsum(eq, x, w.astype(x.dtype), *more, preferred_element_type=out_dtype)
