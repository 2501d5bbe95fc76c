import math

import jax
import jax.numpy as jnp
import numpy as np


def _yarn(f: np.ndarray, head_dim: int, theta: float, r) -> np.ndarray:
    """YaRN (arXiv:2309.00071) as transformers computes it: frequencies that turn fewer than beta_slow
    times over the original context are interpolated (divided by `factor`), those that turn more than
    beta_fast times are kept, and a linear ramp over the dimensions between blends the two."""
    def dim_of(turns):  # the dimension whose wavelength fits `turns` times into the original context
        return head_dim * math.log(r.original_max_positions / (turns * 2 * math.pi)) / (2 * math.log(theta))
    lo, hi = dim_of(r.beta_fast), dim_of(r.beta_slow)
    if r.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    ramp = np.clip((np.arange(head_dim // 2) - lo) / ((hi - lo) or 0.001), 0.0, 1.0)
    return f / r.factor * ramp + f * (1 - ramp)


def inv_freq(head_dim: int, theta: float, scaling=None) -> np.ndarray:
    """RoPE inverse frequencies [head_dim/2] under `scaling.kind`: none; linear (positions divided by
    `factor`, Gemma 3's global layers); llama3 (Llama 3.1: long wavelengths slowed by `factor`, short ones
    kept, the band between blended smoothly); yarn."""
    f = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    kind = scaling.kind if scaling is not None else "none"
    if kind == "linear":
        f = f / scaling.factor
    elif kind == "llama3":
        wavelen = 2 * math.pi / f
        ctx, lo, hi = scaling.original_max_positions, scaling.low_freq_factor, scaling.high_freq_factor
        smooth = np.clip((ctx / wavelen - lo) / (hi - lo), 0.0, 1.0)
        f = (1 - smooth) * f / scaling.factor + smooth * f
    elif kind == "yarn":
        f = _yarn(f, head_dim, theta, scaling)
    return f.astype(np.float32)


def attention_factor(scaling=None) -> float:
    """YaRN's temperature: sin and cos are multiplied by it, so every score by its square. 0.1 ln(factor)
    + 1 by default, DeepSeek's ratio of two such terms when mscale and mscale_all_dim are set, or the
    config's own `attention_factor`; 1 for every other kind."""
    if scaling is None or scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor:
        return float(scaling.attention_factor)
    m = lambda s: 0.1 * s * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0  # noqa: E731
    return m(scaling.mscale) / m(scaling.mscale_all_dim) if scaling.mscale and scaling.mscale_all_dim else m(1.0)


def rope_angles(pos_BL: jax.Array, head_dim: int, theta: float, scaling=None) -> tuple[jax.Array, jax.Array]:
    """(sin, cos) of shape [B, L, head_dim/2] in float32, for per-token positions (packing resets them),
    times YaRN's attention factor."""
    ang_BLF = pos_BL.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq(head_dim, theta, scaling))
    a = attention_factor(scaling)
    return (jnp.sin(ang_BLF), jnp.cos(ang_BLF)) if a == 1.0 else (jnp.sin(ang_BLF) * a, jnp.cos(ang_BLF) * a)


def apply_rope(x_BLHD: jax.Array, sin_BLF: jax.Array, cos_BLF: jax.Array) -> jax.Array:
    """Rotate the two halves of each head (the Llama / HF `rotate_half` layout), in float32."""
    x = x_BLHD.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    sin, cos = sin_BLF[:, :, None, :], cos_BLF[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHD.dtype)
