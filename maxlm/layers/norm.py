import jax
import jax.numpy as jnp


def rms_norm(x_BLD: jax.Array, w_D: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm in float32 whatever the activation dtype; the result is cast back. Gemma stores its gain
    as w - 1 (`offset=1`), so a zero-initialised weight is the identity."""
    x = x_BLD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return (x * (offset + w_D.astype(jnp.float32))).astype(x_BLD.dtype)


def layer_norm(x_BLD: jax.Array, w_D: jax.Array, b_D: jax.Array, eps: float) -> jax.Array:
    """LayerNorm (GPT-2) with gain and bias, in float32."""
    x = x_BLD.astype(jnp.float32)
    x = x - jnp.mean(x, axis=-1, keepdims=True)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return (x * w_D.astype(jnp.float32) + b_D.astype(jnp.float32)).astype(x_BLD.dtype)
