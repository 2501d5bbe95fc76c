"""Llama-family decoder as pure functions over a parameter pytree. It is also Mistral (a sliding
window), Mixtral (sparse MoE MLPs), Qwen2 (q/k/v biases) and Qwen3 (RMSNorm on each query and key head),
each switched on by the config alone.

Layers are stacked on a leading `layers` axis and run with `lax.scan`, so compile time does not grow
with depth. Parameters are float32; activations and matmuls run in `dtype`; norms, RoPE, softmax and
the logits in float32.
"""

import jax

from maxlm.layers.attention import self_attention
from maxlm.layers.mlp import gated_mlp
from maxlm.layers import moe
from maxlm.layers.norm import rms_norm
from maxlm.models import decoder
from maxlm.models.params import Param, normal, ones, zeros
from maxlm.sharding import constrain


def attention_specs(m, w, norm_init=ones) -> dict:
    """q, k, v, o and, as the config says, q/k/v biases, attention sinks and per-head q/k norm gains
    (`norm_init`: zeros for Gemma's gains, stored as w - 1)."""
    L, D, H, K, Dh = m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim
    specs = {
        "wq": Param((L, D, H, Dh), ("layers", "embed", "heads", "head_dim"), w),
        "wk": Param((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim"), w),
        "wv": Param((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim"), w),
        "wo": Param((L, H, Dh, D), ("layers", "heads", "head_dim", "embed"), w),
    }
    if m.qkv_bias:
        specs.update(bq=Param((L, H, Dh), ("layers", "heads", "head_dim"), zeros),
                     bk=Param((L, K, Dh), ("layers", "kv_heads", "head_dim"), zeros),
                     bv=Param((L, K, Dh), ("layers", "kv_heads", "head_dim"), zeros))
    if m.attn_sinks:
        specs["sinks"] = Param((L, H), ("layers", "heads"), zeros)
    if m.qk_norm:
        specs["q_norm"] = Param((L, Dh), ("layers", "head_dim"), norm_init)
        specs["k_norm"] = Param((L, Dh), ("layers", "head_dim"), norm_init)
    return specs


def dense_mlp_specs(L: int, D: int, F: int, w) -> dict:
    return {"w_gate": Param((L, D, F), ("layers", "embed", "mlp"), w),
            "w_up": Param((L, D, F), ("layers", "embed", "mlp"), w),
            "w_down": Param((L, F, D), ("layers", "mlp", "embed"), w)}


def moe_specs(m, L: int, w) -> dict:
    """L layers' router, experts (stacked after the layers) and shared experts, if any."""
    D, F, E = m.d_model, m.d_ff, m.n_experts
    mlp = {"router": Param((L, D, E), ("layers", "embed", None), w),
           "w_gate": Param((L, E, D, F), ("layers", "experts", "embed", "mlp"), w),
           "w_up": Param((L, E, D, F), ("layers", "experts", "embed", "mlp"), w),
           "w_down": Param((L, E, F, D), ("layers", "experts", "mlp", "embed"), w)}
    if m.shared_experts:  # one wide MLP, as DeepSeek-V3 fuses its shared experts
        S = m.shared_experts * F
        mlp.update(shared_gate=Param((L, D, S), ("layers", "embed", "mlp"), w),
                   shared_up=Param((L, D, S), ("layers", "embed", "mlp"), w),
                   shared_down=Param((L, S, D), ("layers", "mlp", "embed"), w))
    return mlp


def outer_specs(m, w) -> dict:
    """The embedding, final norm and (untied) output table around the layers."""
    V, D = m.vocab_size, m.d_model
    specs = {"embed": Param((V, D), ("vocab", "embed"), w), "final_norm": Param((D,), ("embed",), ones)}
    if not m.tie_embeddings:
        specs["unembed"] = Param((D, V), ("embed", "vocab"), w)
    return specs


def param_specs(m) -> dict:
    D, L = m.d_model, m.n_layers
    w = normal(m.init_std)
    mlp = moe_specs(m, L, w) if m.n_experts else dense_mlp_specs(L, D, m.d_ff, w)
    return {**outer_specs(m, w),
            "layers": {"attn_norm": Param((L, D), ("layers", "embed"), ones), **attention_specs(m, w),
                       "mlp_norm": Param((L, D), ("layers", "embed"), ones), **mlp}}


def block(p: dict, x_BLD, i, ctx: decoder.Ctx, m, act: str = "silu", routes: bool = False):
    """One pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x)); `act` names the MLP's gated
    unit (mlp.glu); `routes` as moe.moe's."""
    h_BLD = rms_norm(x_BLD, p["attn_norm"], m.norm_eps)
    window, ctx = decoder.layer_attention(i, ctx, m)
    a_BLD, kv = self_attention(p, h_BLD, ctx, eps=m.norm_eps, window=window, softcap=m.attn_softcap,
                               scale=m.attn_scale, attend=ctx.attend)
    x_BLD = constrain(x_BLD + a_BLD, ("batch", "length", None))
    h_BLD = rms_norm(x_BLD, p["mlp_norm"], m.norm_eps)
    if m.n_experts:
        y_BLD, stats = moe.moe(h_BLD, p, m, ctx.seg_BL > 0, act, routes)
    else:
        y_BLD, stats = gated_mlp(h_BLD, p["w_gate"], p["w_up"], p["w_down"], act), {}
    return constrain(x_BLD + y_BLD, ("batch", "length", None)), kv, stats


def forward(params: dict, tokens_BL, pos_BL, seg_BL, m, dtype, wrap_block=lambda f: f, cache=None,
            attend=None, stack=None, block=block, routes: bool = False) -> decoder.Hidden:
    """Final hidden states [B, L, D] (after the final norm; `unembed` makes logits), the MoE auxiliary
    losses and expert load, and the updated KV cache if one was given. `wrap_block` transforms the layer
    function (remat); `stack` is the train step's schedule's runner of the layer stack (decoder.run_layers).
    An MoE model's params["layers"] may carry `router_bias` [n_layers, n_experts], the train state's
    selection bias (transforms.RouterBias attaches it for the forward). `routes` (MoE, stack=None):
    Hidden.routes holds each token's experts per layer (decoder.Hidden)."""
    x_BLD = decoder.embed(params, tokens_BL, dtype)
    x_BLD, stats, cache = decoder.run_layers(lambda p, x, i, ctx: block(p, x, i, ctx, m, routes=routes), x_BLD,
                                             params["layers"], seg_BL, decoder.rope(pos_BL, m), wrap_block, cache,
                                             attend, stack)
    x_BLD = rms_norm(x_BLD, params["final_norm"], m.norm_eps)
    if not m.n_experts:
        return decoder.Hidden(x_BLD, jax.numpy.zeros((), jax.numpy.float32), cache)
    stats, routes_BLM = moe.split_routes(stats)
    return decoder.Hidden(x_BLD, moe.aux_loss(stats, m), cache, moe.load(stats), routes=routes_BLM)


unembed = decoder.unembed


def matmul_params(m) -> int:
    return decoder.matmul_params(m)


windowed_layers = decoder.windowed_layers
