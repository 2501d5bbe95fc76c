import jax
import jax.numpy as jnp


def rope_angles(pos_BL: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """(sin, cos) of shape [B, L, head_dim/2] in float32, for per-token positions (packing resets them)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    ang_BLF = pos_BL.astype(jnp.float32)[..., None] * inv_freq
    return jnp.sin(ang_BLF), jnp.cos(ang_BLF)


def apply_rope(x_BLHD: jax.Array, sin_BLF: jax.Array, cos_BLF: jax.Array) -> jax.Array:
    """Rotate the two halves of each head (the Llama / HF `rotate_half` layout), in float32."""
    x = x_BLHD.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    sin, cos = sin_BLF[:, :, None, :], cos_BLF[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHD.dtype)
