import math

import jax
import jax.numpy as jnp
import numpy as np


def inv_freq(head_dim: int, theta: float, scaling=None) -> np.ndarray:
    """RoPE inverse frequencies [head_dim/2], with Llama 3.1's long-context scaling when asked: long
    wavelengths are slowed by `factor`, short ones kept, and the band between blended smoothly."""
    f = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is not None and scaling.kind == "llama3":
        wavelen = 2 * math.pi / f
        ctx, lo, hi = scaling.original_max_positions, scaling.low_freq_factor, scaling.high_freq_factor
        smooth = np.clip((ctx / wavelen - lo) / (hi - lo), 0.0, 1.0)
        f = (1 - smooth) * f / scaling.factor + smooth * f
    return f.astype(np.float32)


def rope_angles(pos_BL: jax.Array, head_dim: int, theta: float, scaling=None) -> tuple[jax.Array, jax.Array]:
    """(sin, cos) of shape [B, L, head_dim/2] in float32, for per-token positions (packing resets them)."""
    ang_BLF = pos_BL.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq(head_dim, theta, scaling))
    return jnp.sin(ang_BLF), jnp.cos(ang_BLF)


def apply_rope(x_BLHD: jax.Array, sin_BLF: jax.Array, cos_BLF: jax.Array) -> jax.Array:
    """Rotate the two halves of each head (the Llama / HF `rotate_half` layout), in float32."""
    x = x_BLHD.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    sin, cos = sin_BLF[:, :, None, :], cos_BLF[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHD.dtype)
