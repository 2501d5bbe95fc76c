"""Llama-family decoder (Llama 2/3 layout) as pure functions over a parameter pytree.

Layers are stacked on a leading `layers` axis and run with `lax.scan`, so compile time does not grow
with depth. Parameters are float32; activations and matmuls run in `dtype`; norms, RoPE, softmax and
the logits in float32.
"""

import jax
import jax.numpy as jnp

from maxlm.layers.attention import reference_attention
from maxlm.layers.mlp import swiglu
from maxlm.layers.norm import rms_norm
from maxlm.layers.rope import apply_rope, rope_angles
from maxlm.models.params import Param, normal, ones
from maxlm.sharding import constrain


def param_specs(m) -> dict:
    V, D, L, H, K, Dh, F = m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff
    w = normal(m.init_std)
    specs = {
        "embed": Param((V, D), ("vocab", "embed"), w),
        "layers": {
            "attn_norm": Param((L, D), ("layers", "embed"), ones),
            "wq": Param((L, D, H, Dh), ("layers", "embed", "heads", "head_dim"), w),
            "wk": Param((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim"), w),
            "wv": Param((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim"), w),
            "wo": Param((L, H, Dh, D), ("layers", "heads", "head_dim", "embed"), w),
            "mlp_norm": Param((L, D), ("layers", "embed"), ones),
            "w_gate": Param((L, D, F), ("layers", "embed", "mlp"), w),
            "w_up": Param((L, D, F), ("layers", "embed", "mlp"), w),
            "w_down": Param((L, F, D), ("layers", "mlp", "embed"), w),
        },
        "final_norm": Param((D,), ("embed",), ones),
    }
    if not m.tie_embeddings:
        specs["unembed"] = Param((D, V), ("embed", "vocab"), w)
    return specs


def block(p: dict, x_BLD, sin_BLF, cos_BLF, seg_BL, m) -> jax.Array:
    """One pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x))."""
    dt = x_BLD.dtype
    h_BLD = rms_norm(x_BLD, p["attn_norm"], m.norm_eps)
    q_BLHD = jnp.einsum("bld,dhk->blhk", h_BLD, p["wq"].astype(dt))
    k_BLKD = jnp.einsum("bld,dhk->blhk", h_BLD, p["wk"].astype(dt))
    v_BLKD = jnp.einsum("bld,dhk->blhk", h_BLD, p["wv"].astype(dt))
    q_BLHD = constrain(apply_rope(q_BLHD, sin_BLF, cos_BLF), ("batch", "length", "heads", "head_dim"))
    k_BLKD = constrain(apply_rope(k_BLKD, sin_BLF, cos_BLF), ("batch", "length", "kv_heads", "head_dim"))
    v_BLKD = constrain(v_BLKD, ("batch", "length", "kv_heads", "head_dim"))
    o_BLHD = reference_attention(q_BLHD, k_BLKD, v_BLKD, seg_BL, seg_BL, causal=True)
    x_BLD = x_BLD + jnp.einsum("blhk,hkd->bld", o_BLHD, p["wo"].astype(dt))
    x_BLD = constrain(x_BLD, ("batch", "length", None))
    h_BLD = rms_norm(x_BLD, p["mlp_norm"], m.norm_eps)
    x_BLD = x_BLD + swiglu(h_BLD, p["w_gate"], p["w_up"], p["w_down"])
    return constrain(x_BLD, ("batch", "length", None))


def forward(params: dict, tokens_BL, pos_BL, seg_BL, m, dtype, wrap_block=lambda f: f) -> jax.Array:
    """Logits [B, L, V] in float32. `wrap_block` transforms the layer function (remat)."""
    x_BLD = jnp.take(params["embed"], tokens_BL, axis=0).astype(dtype)
    x_BLD = constrain(x_BLD, ("batch", "length", None))
    sin_BLF, cos_BLF = rope_angles(pos_BL, m.head_dim, m.rope_theta)
    layer = wrap_block(lambda p, x: block(p, x, sin_BLF, cos_BLF, seg_BL, m))
    x_BLD, _ = jax.lax.scan(lambda x, p: (layer(p, x), None), x_BLD, params["layers"])
    x_BLD = rms_norm(x_BLD, params["final_norm"], m.norm_eps)
    w_DV = params["embed"].T if m.tie_embeddings else params["unembed"]
    logits_BLV = jnp.einsum("bld,dv->blv", x_BLD, w_DV.astype(dtype), preferred_element_type=jnp.float32)
    return constrain(logits_BLV, ("batch", "length", "vocab"))
