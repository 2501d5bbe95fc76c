"""Gemma: the Llama layout with a GeGLU MLP (tanh GELU), the input embedding scaled by sqrt(d_model),
RMSNorm gains stored as w - 1 (zero-initialised, applied as 1 + w) and, by default, tied embeddings.
Gemma 2 (gemma2.py) reuses this module's specs, embedding and head with its own layer."""

import jax.numpy as jnp

from maxlm.layers.attention import self_attention
from maxlm.layers.mlp import gated_mlp
from maxlm.layers.norm import rms_norm
from maxlm.models import decoder, llama
from maxlm.models.params import Param, normal, zeros
from maxlm.sharding import constrain

NORMS = ("attn_norm", "mlp_norm")


def param_specs(m, norms=NORMS) -> dict:
    V, D, L, F = m.vocab_size, m.d_model, m.n_layers, m.d_ff
    w = normal(m.init_std)
    specs = {
        "embed": Param((V, D), ("vocab", "embed"), w),
        "layers": {**{n: Param((L, D), ("layers", "embed"), zeros) for n in norms}, **llama.attention_specs(m, w, norm_init=zeros),
                   "w_gate": Param((L, D, F), ("layers", "embed", "mlp"), w),
                   "w_up": Param((L, D, F), ("layers", "embed", "mlp"), w),
                   "w_down": Param((L, F, D), ("layers", "mlp", "embed"), w)},
        "final_norm": Param((D,), ("embed",), zeros),
    }
    if not m.tie_embeddings:
        specs["unembed"] = Param((D, V), ("embed", "vocab"), w)
    return specs


def norm(x_BLD, w_D, m):
    return rms_norm(x_BLD, w_D, m.norm_eps, offset=1.0)


def mlp(p, h_BLD):
    return gated_mlp(h_BLD, p["w_gate"], p["w_up"], p["w_down"], act="gelu_tanh")


def block(p: dict, x_BLD, i, ctx: decoder.Ctx, m):
    """x + attn(norm(x)), then x + geglu(norm(x))."""
    window, ctx = decoder.layer_attention(i, ctx, m)
    a_BLD, kv = self_attention(p, norm(x_BLD, p["attn_norm"], m), ctx, eps=m.norm_eps, window=window,
                               softcap=m.attn_softcap, scale=m.attn_scale, attend=ctx.attend, norm_offset=1.0)
    x_BLD = constrain(x_BLD + a_BLD, ("batch", "length", None))
    y_BLD = mlp(p, norm(x_BLD, p["mlp_norm"], m))
    return constrain(x_BLD + y_BLD, ("batch", "length", None)), kv, {}


def forward(params: dict, tokens_BL, pos_BL, seg_BL, m, dtype, wrap_block=lambda f: f, cache=None,
            attend=None, stack=None, block=block) -> decoder.Hidden:
    # HF multiplies by sqrt(d) cast to the activation dtype (55.4256 -> 55.5 in bfloat16); so does embed().
    x_BLD = decoder.embed(params, tokens_BL, dtype, scale=m.d_model ** 0.5)
    x_BLD, _, cache = decoder.run_layers(lambda p, x, i, ctx: block(p, x, i, ctx, m), x_BLD, params["layers"],
                                         seg_BL, decoder.rope(pos_BL, m), wrap_block, cache, attend, stack)
    x_BLD = norm(x_BLD, params["final_norm"], m)
    return decoder.Hidden(x_BLD, jnp.zeros((), jnp.float32), cache)


unembed = decoder.unembed


matmul_params, windowed_layers = llama.matmul_params, decoder.windowed_layers
