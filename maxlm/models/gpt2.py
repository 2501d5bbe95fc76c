"""GPT-2: learned absolute positions (no RoPE), pre-LayerNorm with bias, biases on every projection,
an ungated tanh-GELU MLP, and tied embeddings by default. The position table has `model.max_positions`
rows; config validation keeps `seq_len` within it."""

import jax.numpy as jnp

from maxlm.layers.attention import self_attention
from maxlm.layers.mlp import mlp
from maxlm.layers.norm import layer_norm
from maxlm.models import decoder, llama
from maxlm.models.params import Param, normal, ones, zeros
from maxlm.sharding import constrain


def param_specs(m) -> dict:
    V, D, L, F, H, K, Dh = m.vocab_size, m.d_model, m.n_layers, m.d_ff, m.n_heads, m.n_kv_heads, m.head_dim
    w, LD = normal(m.init_std), ("layers", "embed")
    layers = {
        "attn_norm": Param((L, D), LD, ones), "attn_norm_bias": Param((L, D), LD, zeros),
        **llama.attention_specs(m, w),
        "bq": Param((L, H, Dh), ("layers", "heads", "head_dim"), zeros),
        "bk": Param((L, K, Dh), ("layers", "kv_heads", "head_dim"), zeros),
        "bv": Param((L, K, Dh), ("layers", "kv_heads", "head_dim"), zeros),
        "bo": Param((L, D), LD, zeros),
        "mlp_norm": Param((L, D), LD, ones), "mlp_norm_bias": Param((L, D), LD, zeros),
        "w_in": Param((L, D, F), ("layers", "embed", "mlp"), w),
        "b_in": Param((L, F), ("layers", "mlp"), zeros),
        "w_out": Param((L, F, D), ("layers", "mlp", "embed"), w),
        "b_out": Param((L, D), LD, zeros),
    }
    specs = {"embed": Param((V, D), ("vocab", "embed"), w),
             "positions": Param((m.max_positions, D), (None, "embed"), w),
             "layers": layers, "final_norm": Param((D,), ("embed",), ones),
             "final_norm_bias": Param((D,), ("embed",), zeros)}
    if not m.tie_embeddings:
        specs["unembed"] = Param((D, V), ("embed", "vocab"), w)
    return specs


def block(p: dict, x_BLD, i, ctx: decoder.Ctx, m):
    """x + attn(ln(x)), then x + mlp(ln(x))."""
    h_BLD = layer_norm(x_BLD, p["attn_norm"], p["attn_norm_bias"], m.norm_eps)
    window, ctx = decoder.layer_attention(i, ctx, m)
    a_BLD, kv = self_attention(p, h_BLD, ctx, eps=m.norm_eps, window=window, softcap=m.attn_softcap,
                               scale=m.attn_scale, attend=ctx.attend)
    x_BLD = constrain(x_BLD + a_BLD, ("batch", "length", None))
    h_BLD = layer_norm(x_BLD, p["mlp_norm"], p["mlp_norm_bias"], m.norm_eps)
    y_BLD = mlp(h_BLD, p["w_in"], p["b_in"], p["w_out"], p["b_out"], act="gelu_tanh")
    return constrain(x_BLD + y_BLD, ("batch", "length", None)), kv, {}


def forward(params: dict, tokens_BL, pos_BL, seg_BL, m, dtype, wrap_block=lambda f: f, cache=None,
            attend=None, stack=None) -> decoder.Hidden:
    # Token and position rows are summed in float32, then cast once.
    x_BLD = jnp.take(params["embed"], tokens_BL, axis=0) + jnp.take(params["positions"], pos_BL, axis=0)
    x_BLD = constrain(x_BLD.astype(dtype), ("batch", "length", None))
    x_BLD, _, cache = decoder.run_layers(lambda p, x, i, ctx: block(p, x, i, ctx, m), x_BLD, params["layers"],
                                         seg_BL, None, wrap_block, cache, attend, stack)
    x_BLD = layer_norm(x_BLD, params["final_norm"], params["final_norm_bias"], m.norm_eps)
    return decoder.Hidden(x_BLD, jnp.zeros((), jnp.float32), cache)


unembed = decoder.unembed


def matmul_params(m) -> int:
    return decoder.matmul_params(m, mlp_matrices=2)  # ungated: in and out, no gate


windowed_layers = decoder.windowed_layers
