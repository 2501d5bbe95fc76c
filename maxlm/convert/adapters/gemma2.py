"""Gemma 2 <-> Gemma2ForCausalLM: Gemma's tensors with four norms per layer, the window, scale and soft caps."""

from maxlm.errors import ConfigError
from maxlm.convert import tables as T
from maxlm.convert.adapters import gemma

HF_ARCHITECTURES = {"Gemma2ForCausalLM": "gemma2"}


def layer_types(n: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


def config_from_hf(c: dict) -> dict:
    # Gemma2Config reads hidden_activation (hidden_act is ignored) and maps no legacy "gelu" to tanh.
    T.require(c, "hidden_activation", gemma.TANH_GELU, "gelu_pytorch_tanh")
    n, types, window = c["num_hidden_layers"], c.get("layer_types"), c.get("sliding_window", 4096)
    if types is not None and list(types) != layer_types(n):
        raise T.unsupported("layer_types", types, "maxlm's gemma2 alternates sliding (even layers) and full (odd)")
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise T.unsupported("sliding_window", window, "expected a positive int")
    return {**gemma.common_from_hf(c), "sliding_window": window, "layer_pattern": "LG", "local_rope_theta": 0.0,
            "attn_scale": scalar(c) ** -0.5,
            "attn_softcap": softcap(c, "attn_logit_softcapping", 50.0),
            "final_softcap": softcap(c, "final_logit_softcapping", 30.0)}


def scalar(c: dict) -> float:
    """query_pre_attn_scalar: the scores are scaled by its inverse square root."""
    return float(T.number(c, "query_pre_attn_scalar", 256, "a number > 0", lambda v: v > 0))


def softcap(c: dict, name: str, default: float) -> float:
    """A soft cap: absent is the config class's default, null is none (0.0); transformers divides by any
    other value, so 0 or a negative one would make every logit NaN or flip its sign: refused."""
    return float(T.number(c, name, default if name not in c else 0.0, "a positive number, or null for no cap",
                          lambda v: v > 0))


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
    T.refuse_absent(m, "Gemma2ForCausalLM", ("qk_norm", "qkv_bias", "local_rope_theta", "attn_sinks"))
    if m.layer_pattern != "LG":
        raise ConfigError(f"model.layer_pattern={m.layer_pattern!r} cannot be exported as gemma2: Gemma2ForCausalLM "
                          f"alternates local and global layers (LG)")
    # A window of 0 (none) is one no sequence up to max_positions reaches; HF needs a number.
    return {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh",
            "hidden_act": "gelu_pytorch_tanh", "attention_bias": False, **T.common_to_hf(m), **T.rope_to_hf(m),
            "sliding_window": m.sliding_window or m.max_positions, "layer_types": layer_types(m.n_layers),
            "query_pre_attn_scalar": query_pre_attn_scalar(m),
            "attn_logit_softcapping": m.attn_softcap or None, "final_logit_softcapping": m.final_softcap or None}


# In Gemma 2, HF's post_attention_layernorm normalises the attention output (in Gemma, the MLP input).
HF_NORMS = (("attn_norm", "input_layernorm"), ("post_attn_norm", "post_attention_layernorm"),
            ("mlp_norm", "pre_feedforward_layernorm"), ("post_mlp_norm", "post_feedforward_layernorm"))


def hf_tensors(m) -> list[T.Tensor]:
    return gemma.hf_tensors(m, HF_NORMS)
