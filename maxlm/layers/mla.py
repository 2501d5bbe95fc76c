"""Multi-head latent attention (DeepSeek-V2/V3): keys and values come from one low-rank latent of each
token, the query from another (or from a full-rank projection).

Each head's query and key have head_dim dims: the first head_dim - rope_dim carry no position, the last
rope_dim carry RoPE. The key's RoPE part is one projection of the token, shared by every head. Values
have v_dim dims. Attention itself is `attention.attend_and_project`, the one every family uses: the
kernels, the ring and the KV cache see ordinary per-head q, k and v (the cache holds the expanded keys
and values, not the latent).
"""

import math

import jax.numpy as jnp

from maxlm.layers.attention import attend_and_project
from maxlm.layers.dense import dense
from maxlm.layers.norm import rms_norm
from maxlm.layers.rope import apply_rope

# The latents' RMSNorms use their module's default epsilon in DeepSeek's code (and transformers'), not
# the model's rms_norm_eps.
LATENT_EPS = 1e-6


def scale(m) -> float:
    """The score scale: model.attn_scale, else head_dim^-0.5, times DeepSeek's YaRN correction mscale^2,
    where mscale = 0.1 mscale_all_dim ln(factor) + 1 (the RoPE angles carry the rest, rope.attention_factor)."""
    r = m.rope_scaling
    base = m.attn_scale or m.head_dim ** -0.5
    if r.kind != "yarn" or not r.mscale_all_dim or r.factor <= 1:
        return base
    return base * (0.1 * r.mscale_all_dim * math.log(r.factor) + 1.0) ** 2


def qkv(p: dict, x_BLD, rope, m):
    """q_BLHD and k_BLHD [.., head_dim], v_BLHV [.., v_dim], with RoPE on their last rope_dim dims.
    `rope` is (sin, cos) over rope_dim."""
    R = m.mla.rope_dim
    if "wq_a" in p:
        c_BLQ = rms_norm(dense("bld,dq->blq", x_BLD, p["wq_a"]), p["q_norm"], LATENT_EPS)
        q_BLHD = dense("blq,qhk->blhk", c_BLQ, p["wq_b"])
    else:
        q_BLHD = dense("bld,dhk->blhk", x_BLD, p["wq"])
    c_BLC = rms_norm(dense("bld,dc->blc", x_BLD, p["wkv_a"]), p["kv_norm"], LATENT_EPS)
    kn_BLHN = dense("blc,chn->blhn", c_BLC, p["wk_b"])
    v_BLHV = dense("blc,chv->blhv", c_BLC, p["wv_b"])
    kr_BL1R = apply_rope(dense("bld,dr->blr", x_BLD, p["wk_rope"])[:, :, None], *rope)
    q_BLHD = jnp.concatenate([q_BLHD[..., :-R], apply_rope(q_BLHD[..., -R:], *rope)], axis=-1)
    k_BLHD = jnp.concatenate([kn_BLHN, jnp.broadcast_to(kr_BL1R, (*kn_BLHN.shape[:3], R))], axis=-1)
    return q_BLHD, k_BLHD, v_BLHV


def mla_attention(p: dict, x_BLD, ctx, m, *, window=0, attend=None):
    """(out_BLD, the layer's updated cache slice or None), as attention.self_attention returns."""
    q_BLHD, k_BLHD, v_BLHV = qkv(p, x_BLD, ctx.rope, m)
    return attend_and_project(p, q_BLHD, k_BLHD, v_BLHV, ctx, window=window, scale=scale(m), attend=attend)
