"""Gemma 3 (text) <-> Gemma3ForCausalLM, and the text model of Gemma3ForConditionalGeneration (every size
above 1B ships multimodal): Gemma 2's tensors plus q/k norms, local and global layers as
`layer_types` says, and a RoPE of their own for each kind. Export writes Gemma3ForCausalLM."""

from maxlm.convert import tables as T
from maxlm.convert.adapters import gemma, gemma2
from maxlm.errors import ConfigError

HF_ARCHITECTURES = {"Gemma3ForCausalLM": "gemma3", "Gemma3ForConditionalGeneration": "gemma3"}
# Gemma3TextConfig's defaults: the published multimodal configs leave these out of text_config.
DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
            "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096, "tie_word_embeddings": True,
            "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}
# The text model's names in the published files and in what transformers >= 4.52 saves; what follows
# these prefixes is Gemma3ForCausalLM's layout.
TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                 ("language_model.lm_head.", "lm_head."))
VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_config(c: dict) -> dict:
    """The text model's config: a multimodal config's `text_config`, over Gemma3TextConfig's defaults."""
    multimodal = "Gemma3ForConditionalGeneration" in (c.get("architectures") or [])
    if multimodal and not isinstance(c.get("text_config"), dict):  # else the 4B default model, silently
        raise T.unsupported("text_config", c.get("text_config"), "a Gemma3ForConditionalGeneration config holds its "
                            "text model's fields in a text_config object")
    return {**DEFAULTS, **(c["text_config"] if multimodal else c)}


def _ropes(c: dict) -> tuple[dict, float]:
    """(the global layers' rope keys, the local layers' base) from either config.json layout: nested
    `rope_parameters` per layer type, or rope_theta + rope_scaling + rope_local_base_freq."""
    nested = c.get("rope_parameters")
    positive = dict(want="a number > 0", ok=lambda v: v > 0)
    if isinstance(nested, dict) and "full_attention" in nested:
        full, local = nested["full_attention"], nested.get("sliding_attention")
        for kind, d in (("full_attention", full), ("sliding_attention", local)):
            if d is not None and not isinstance(d, dict):
                raise T.unsupported(f"rope_parameters.{kind}", d, "expected a JSON object")
        full, local = full or {}, local or {}  # null: transformers' defaults, as an empty object says
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise T.unsupported("rope_parameters.sliding_attention", local, "maxlm's local layers use plain RoPE")
        local_theta = T.number(local, "rope_theta", DEFAULTS["rope_local_base_freq"],
                               where="rope_parameters.sliding_attention.", **positive)
        return T.rope_from_hf(c, full, "rope_parameters.full_attention."), float(local_theta)
    if c.get("rope_scaling") is not None and not isinstance(c["rope_scaling"], dict):
        raise T.unsupported("rope_scaling", c["rope_scaling"], "expected a JSON object, or null")
    full = dict(c.get("rope_scaling") or {}, rope_theta=c["rope_theta"])
    local_theta = T.number(c, "rope_local_base_freq", DEFAULTS["rope_local_base_freq"], **positive)
    return T.rope_from_hf(c, full, "rope_scaling."), float(local_theta)


def config_from_hf(c: dict) -> dict:
    t = text_config(c)
    T.require(t, "hidden_activation", gemma.TANH_GELU, "gelu_pytorch_tanh")
    n = t["num_hidden_layers"]
    types = t.get("layer_types")
    if types is None:  # as Gemma3TextConfig derives it (a present [] is refused, not derived)
        every = T.number(t, "sliding_window_pattern", 6, "a positive integer", lambda v: v > 0, integer=True)
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    window = t["sliding_window"]
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise T.unsupported("sliding_window", window, "expected a positive int")
    rope, local_theta = _ropes(t)
    return {**gemma.common_from_hf(t), **rope, "local_rope_theta": local_theta, "qk_norm": True,
            "sliding_window": window, "layer_pattern": T.layer_pattern(types, n), "qkv_bias": False,
            "attn_scale": gemma2.scalar(t) ** -0.5,
            "attn_softcap": gemma2.softcap(t, "attn_logit_softcapping", 0.0),
            "final_softcap": gemma2.softcap(t, "final_logit_softcapping", 0.0)}


def import_note(c: dict) -> str | None:
    if "Gemma3ForConditionalGeneration" in (c.get("architectures") or []):
        return ("Gemma3ForConditionalGeneration: maxlm loads its text model; the vision tower and the multimodal "
                "projector are dropped")
    return None


def checkpoint_names(names, c: dict, m) -> dict:
    """Stored name -> Gemma3ForCausalLM's name, or None for the vision tower and projector (dropped)."""
    out = {}
    for n in names:
        prefix = next(((a, b) for a, b in TEXT_PREFIXES if n.startswith(a)), None)
        out[n] = prefix[1] + n[len(prefix[0]):] if prefix else None if n.startswith(VISION) else n
    return out


def config_to_hf(m) -> dict:
    T.refuse_absent(m, "Gemma3ForCausalLM", ("qkv_bias", "attn_sinks"))
    if not m.qk_norm or not m.local_rope_theta or not m.sliding_window:
        raise ConfigError("model.qk_norm, model.local_rope_theta and model.sliding_window must be set to export "
                          "as gemma3: Gemma3ForCausalLM normalises q and k and has local layers with a RoPE base of "
                          "their own")
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, **T.common_to_hf(m), **T.rope_to_hf(m),
            "rope_local_base_freq": m.local_rope_theta, "sliding_window": m.sliding_window,
            "layer_types": T.layer_types(m),
            "query_pre_attn_scalar": gemma2.query_pre_attn_scalar(m),
            "attn_logit_softcapping": m.attn_softcap or None, "final_logit_softcapping": m.final_softcap or None}


hf_tensors = gemma2.hf_tensors  # attention_tensors adds q_norm/k_norm (m.qk_norm)
