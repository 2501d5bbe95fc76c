"""Gemma 2: Gemma (gemma.py) plus a norm after attention and after the MLP, a sliding window on even
layers (0, 2, ...) and global attention on odd ones, queries scaled by query_pre_attn_scalar^-0.5
(`model.attn_scale`), and tanh soft-capping of attention scores (`model.attn_softcap`, after the
scale, before the mask) and of the output logits (`model.final_softcap`)."""

import jax.numpy as jnp

from maxlm.config import ConfigError
from maxlm.layers.attention import self_attention
from maxlm.models import decoder, gemma, hf
from maxlm.sharding import constrain

NORMS = ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")


def param_specs(m) -> dict:
    return gemma.param_specs(m, NORMS)


def block(p: dict, x_BLD, i, ctx: decoder.Ctx, m):
    """x + norm(attn(norm(x))), then x + norm(geglu(norm(x))); layer `i` (traced) is local when even."""
    window = jnp.where(i % 2 == 0, m.sliding_window, 0)
    a_BLD, kv = self_attention(p, gemma.norm(x_BLD, p["attn_norm"], m), ctx, m, window=window)
    x_BLD = constrain(x_BLD + gemma.norm(a_BLD, p["post_attn_norm"], m), ("batch", "length", None))
    y_BLD = gemma.mlp(p, gemma.norm(x_BLD, p["mlp_norm"], m))
    return constrain(x_BLD + gemma.norm(y_BLD, p["post_mlp_norm"], m), ("batch", "length", None)), kv, {}


def forward(params: dict, tokens_BL, pos_BL, seg_BL, m, dtype, wrap_block=lambda f: f, cache=None,
            attend=None) -> decoder.Output:
    return gemma.forward(params, tokens_BL, pos_BL, seg_BL, m, dtype, wrap_block, cache, attend, block=block)


# ---- Hugging Face ---------------------------------------------------------------------------------
HF_ARCHITECTURES = {"Gemma2ForCausalLM": "gemma2"}


def layer_types(n: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


def config_from_hf(c: dict) -> dict:
    # Gemma2Config reads hidden_activation (hidden_act is ignored) and maps no legacy "gelu" to tanh.
    hf.require(c, "hidden_activation", gemma.TANH_GELU, "gelu_pytorch_tanh")
    n, types, window = c["num_hidden_layers"], c.get("layer_types"), c.get("sliding_window", 4096)
    if types is not None and list(types) != layer_types(n):
        raise hf.unsupported("layer_types", types, "maxlm's gemma2 alternates sliding (even layers) and full (odd)")
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise hf.unsupported("sliding_window", window, "expected a positive int")
    return {**gemma.common_from_hf(c), "sliding_window": window,
            "attn_scale": float(c.get("query_pre_attn_scalar", 256)) ** -0.5,
            "attn_softcap": float(c.get("attn_logit_softcapping", 50.0) or 0.0),
            "final_softcap": float(c.get("final_logit_softcapping", 30.0) or 0.0)}


def query_pre_attn_scalar(m) -> int:
    """The integer HF's config holds, from maxlm's score scale (0: head_dim^-0.5)."""
    if not m.attn_scale:
        return m.head_dim
    q = m.attn_scale ** -2
    if abs(q - round(q)) > 1e-6 * q:
        raise ConfigError(f"model.attn_scale={m.attn_scale} cannot be exported: Gemma2ForCausalLM scales by "
                          f"query_pre_attn_scalar^-0.5 with an integer query_pre_attn_scalar")
    return round(q)


def config_to_hf(m) -> dict:
    hf.refuse_options(m, "Gemma2ForCausalLM", ("qk_norm",))
    # A window of 0 (none) is one no sequence up to max_positions reaches; HF needs a number.
    return {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh",
            "hidden_act": "gelu_pytorch_tanh", "attention_bias": False, **hf.common_to_hf(m), **hf.rope_to_hf(m),
            "sliding_window": m.sliding_window or m.max_positions, "layer_types": layer_types(m.n_layers),
            "query_pre_attn_scalar": query_pre_attn_scalar(m),
            "attn_logit_softcapping": m.attn_softcap or None, "final_logit_softcapping": m.final_softcap or None}


# In Gemma 2, HF's post_attention_layernorm normalises the attention output (in Gemma, the MLP input).
HF_NORMS = (("attn_norm", "input_layernorm"), ("post_attn_norm", "post_attention_layernorm"),
            ("mlp_norm", "pre_feedforward_layernorm"), ("post_mlp_norm", "post_feedforward_layernorm"))


def hf_tensors(m) -> list[hf.Tensor]:
    return gemma.hf_tensors(m, HF_NORMS)
