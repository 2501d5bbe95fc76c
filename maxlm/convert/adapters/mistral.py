"""Mistral <-> MistralForCausalLM: Llama's tensors, a sliding window on every layer."""

from maxlm.convert import tables as T
from maxlm.convert.adapters import llama

HF_ARCHITECTURES = {"MistralForCausalLM": "mistral"}


def window_from_hf(c: dict, default) -> int:
    """`sliding_window` as maxlm's `model.sliding_window` (0: full attention).

    transformers (masking_utils.sliding_window_overlay) lets query i see key j when i - j < window, as
    maxlm does. `default` is what the config class assumes when config.json has no such field (Mistral:
    4096, Mixtral: None). Mistral and Mixtral put the window on every layer and ignore `layer_types`, so a
    `layer_types` list that says otherwise is refused rather than read one way or the other."""
    w = c.get("sliding_window", default)
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
        # transformers would mask every key (0) or fail; null is how a config says "no window".
        raise T.unsupported("sliding_window", w, "expected a positive integer, or null for full attention")
    window = w or 0
    uniform_layers(c, window)
    return window


def uniform_layers(c: dict, window: int) -> None:
    """Refuse a `layer_types` list that is not one kind throughout, matching the window maxlm will use:
    maxlm applies one window (or none) to every layer."""
    types = c.get("layer_types")
    if types is None:
        return
    want = "sliding_attention" if window else "full_attention"
    if any(t != want for t in types):
        raise T.unsupported("layer_types", types, f"maxlm applies one attention kind to every layer; with "
                                                   f"sliding_window={window or None} every entry must be {want!r}")


def fixed_keys(qk_norm: bool = False, qkv_bias: bool = False, per_layer: bool = False, attn_sinks: bool = False) -> dict:
    """Model keys that any maxlm family may set but these Hugging Face families fix. Import states them,
    so an override that contradicts the checkpoint is refused (convert.hf.with_hf_model). `per_layer`:
    the family's config.json has `layer_types` (Qwen), so the pattern is the checkpoint's, not fixed."""
    return {"qk_norm": qk_norm, "qkv_bias": qkv_bias, "attn_softcap": 0.0, "final_softcap": 0.0, "attn_scale": 0.0,
            "local_rope_theta": 0.0, "attn_sinks": attn_sinks, **({} if per_layer else {"layer_pattern": ""})}


def check_exportable(m, qk_norm: bool = False, qkv_bias: bool = False, per_layer: bool = False,
                     attn_sinks: bool = False) -> None:
    """Refuse to export what the family's config.json cannot say: transformers would silently load it as
    a different model."""
    T.refuse_options(m, fixed_keys(qk_norm, qkv_bias, per_layer, attn_sinks), lambda key, want: f" as {m.family}: its Hugging Face model has "
                                                               f"{key}={want!r}")


def config_from_hf(c: dict) -> dict:
    T.require(c, "hidden_act", ("silu",), "silu")
    return {**T.common_from_hf(c, tie_default=False), **T.rope_from_hf(c), **fixed_keys(),
            "sliding_window": window_from_hf(c, default=4096)}


def config_to_hf(m) -> dict:
    check_exportable(m)
    return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu",
            "sliding_window": m.sliding_window or None, **T.common_to_hf(m), **T.rope_to_hf(m)}


def hf_tensors(m) -> list[T.Tensor]:
    return llama.hf_tensors(m)  # the same names and layouts as Llama's
