"""Qwen2 (and Qwen2.5) <-> Qwen2ForCausalLM: Llama's tensors plus q/k/v biases, and Qwen's sliding-window
fields (read as Qwen3's: per layer, into maxlm's per-layer table)."""

from maxlm.convert import tables as T
from maxlm.convert.adapters import llama
from maxlm.convert.adapters.mistral import check_exportable, fixed_keys
from maxlm.convert.adapters.qwen3 import window_from_hf

HF_ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2"}


def config_from_hf(c: dict) -> dict:
    T.require(c, "hidden_act", ("silu",), "silu")
    return {**T.common_from_hf(c, tie_default=False), **T.rope_from_hf(c), **fixed_keys(qkv_bias=True, per_layer=True),
            **window_from_hf(c, moe=False)}


def config_to_hf(m) -> dict:
    check_exportable(m, qkv_bias=True, per_layer=True)
    w = m.sliding_window
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
            "use_sliding_window": bool(w), "sliding_window": w or None, "max_window_layers": 0 if w else m.n_layers,
            "layer_types": T.layer_types(m),
            **T.common_to_hf(m), **T.rope_to_hf(m)}


hf_tensors = llama.hf_tensors  # attention_tensors adds the q/k/v biases (m.qkv_bias)
