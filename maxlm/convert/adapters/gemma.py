"""Gemma <-> GemmaForCausalLM."""

from maxlm.convert import tables as T
from maxlm.convert.adapters import llama

HF_ARCHITECTURES = {"GemmaForCausalLM": "gemma"}
TANH_GELU = ("gelu_pytorch_tanh", "gelu_new")  # both the tanh approximation


def common_from_hf(c: dict) -> dict:
    T.require(c, "attention_bias", (False,), False)
    T.require(c, "use_bidirectional_attention", (None, False), None)
    return {**T.common_from_hf(c, tie_default=True, head_dim=256), **T.rope_from_hf(c)}  # Gemma(2)Config's head_dim


def config_from_hf(c: dict) -> dict:
    # GemmaConfig turns the legacy hidden_act "gelu" into the tanh form; older releases read hidden_activation.
    T.require(c, "hidden_act", ("gelu", *TANH_GELU), "gelu_pytorch_tanh")
    T.require(c, "hidden_activation", (None, "gelu", *TANH_GELU), None)
    return common_from_hf(c)


def config_to_hf(m) -> dict:
    T.refuse_absent(m, "GemmaForCausalLM")
    return {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "hidden_act": "gelu_pytorch_tanh",
            "attention_bias": False, **T.common_to_hf(m), **T.rope_to_hf(m)}


HF_NORMS = (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"))  # (maxlm, HF) per layer


def hf_tensors(m, norms=HF_NORMS) -> list[T.Tensor]:
    layer = "model.layers.{i}"
    return [*T.embedding_tensors(m), *(T.copy(f"layers/{p}", f"{layer}.{n}.weight") for p, n in norms),
            *T.attention_tensors(f"{layer}.self_attn", m), *llama.mlp_tensors(f"{layer}.mlp")]
