import jax
import jax.numpy as jnp


def rms_norm(x_BLD: jax.Array, w_D: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32 whatever the activation dtype; the result is cast back."""
    x = x_BLD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return (x * w_D.astype(jnp.float32)).astype(x_BLD.dtype)
