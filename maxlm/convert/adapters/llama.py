"""Llama <-> LlamaForCausalLM."""

from maxlm.convert import tables as T

HF_ARCHITECTURES = {"LlamaForCausalLM": "llama"}


def config_from_hf(c: dict) -> dict:
    T.require(c, "hidden_act", ("silu",), "silu")
    T.require(c, "attention_bias", (False,), False)
    T.require(c, "mlp_bias", (False,), False)
    return {**T.common_from_hf(c, tie_default=False), **T.rope_from_hf(c)}


def config_to_hf(m) -> dict:
    T.refuse_absent(m, "LlamaForCausalLM")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, **T.common_to_hf(m), **T.rope_to_hf(m)}


def mlp_tensors(prefix: str) -> list[T.Tensor]:
    return [T.linear("layers/w_gate", f"{prefix}.gate_proj.weight"), T.linear("layers/w_up", f"{prefix}.up_proj.weight"),
            T.linear("layers/w_down", f"{prefix}.down_proj.weight")]


def hf_tensors(m) -> list[T.Tensor]:
    layer = "model.layers.{i}"
    return [*T.embedding_tensors(m), T.copy("layers/attn_norm", f"{layer}.input_layernorm.weight"),
            T.copy("layers/mlp_norm", f"{layer}.post_attention_layernorm.weight"),
            *T.attention_tensors(f"{layer}.self_attn", m), *mlp_tensors(f"{layer}.mlp")]
