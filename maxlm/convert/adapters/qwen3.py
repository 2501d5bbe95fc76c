"""Qwen3 <-> Qwen3ForCausalLM and Qwen3-MoE <-> Qwen3MoeForCausalLM: Llama's names plus q/k norms."""

from maxlm.convert import tables as T
from maxlm.convert.adapters import llama
from maxlm.convert.adapters.mistral import check_exportable, fixed_keys
from maxlm.convert.adapters.mixtral import check_moe_exportable, moe_from_hf

HF_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}


def _is_moe(c: dict) -> bool:
    arch = next(a for a in c.get("architectures") or [] if a in HF_ARCHITECTURES)  # as convert.hf picks it
    return HF_ARCHITECTURES[arch] == "qwen3_moe"


def window_from_hf(c: dict, moe: bool) -> dict:
    """`sliding_window` and `layer_pattern` from Qwen's fields. The window counts only with
    `use_sliding_window`. Qwen3-MoE then puts it on every layer; Qwen2 and Qwen3 on the layers `layer_types`
    marks "sliding_attention", by default those from `max_window_layers` on (maxlm's per-layer table)."""
    w = c.get("sliding_window") if T.flag(c, "use_sliding_window", False) else None
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
        raise T.unsupported("sliding_window", w, "expected a positive integer with use_sliding_window")
    if moe or w is None:  # no window: transformers gives "sliding" layers none either
        return {"sliding_window": w or 0, "layer_pattern": ""}
    field, types = "layer_types", c.get("layer_types")
    if types is None:  # as Qwen2Config and Qwen3Config derive it
        field, first = "max_window_layers", c.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(c["num_hidden_layers"])]
    pattern = T.layer_pattern(types, c["num_hidden_layers"], field)
    if pattern == "G":
        return {"sliding_window": 0, "layer_pattern": ""}
    return {"sliding_window": w, "layer_pattern": "" if pattern == "L" else pattern}


def config_from_hf(c: dict) -> dict:
    moe = _is_moe(c)
    T.require(c, "hidden_act", ("silu",), "silu")
    T.require(c, "attention_bias", (False,), False)
    out = {**T.common_from_hf(c, tie_default=False), **T.rope_from_hf(c), **fixed_keys(qk_norm=True, per_layer=not moe),
           **window_from_hf(c, moe)}
    if not moe:
        # Qwen3Config's head_dim defaults to 128 whatever hidden_size / num_attention_heads is.
        out["head_dim"] = T.number(c, "head_dim", 128, "a positive integer", lambda v: v > 0, integer=True)
        return out
    # Every layer sparse: a sparse step or mlp_only_layers would mix dense layers in. The top-k weights
    # are renormalised as norm_topk_prob says (Qwen3MoeConfig defaults to false; released models set true).
    T.require(c, "decoder_sparse_step", (1,), 1)
    if c.get("mlp_only_layers"):
        raise T.unsupported("mlp_only_layers", c["mlp_only_layers"], "maxlm makes every layer sparse; expected []")
    for field in ("shared_expert_intermediate_size", "n_shared_experts"):
        if c.get(field):  # not a Qwen3-MoE field; a config that has one expects shared experts
            raise T.unsupported(field, c[field], "maxlm has no shared experts")
    out.update(moe_from_hf(c, "num_experts", renorm=T.flag(c, "norm_topk_prob", False)),
               d_ff=c.get("moe_intermediate_size", 768))
    return out


def config_to_hf(m) -> dict:
    moe = m.family == "qwen3_moe"
    check_exportable(m, qk_norm=True, per_layer=not moe)
    w = m.sliding_window
    out = {"architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
           "model_type": "qwen3_moe" if moe else "qwen3", "hidden_act": "silu", "attention_bias": False,
           "use_sliding_window": bool(w), "sliding_window": w or None, **T.common_to_hf(m), **T.rope_to_hf(m)}
    if moe:
        check_moe_exportable(m, renorm=None)
        out.update(num_experts=m.n_experts, num_experts_per_tok=m.experts_per_token, norm_topk_prob=m.router_renorm,
                   moe_intermediate_size=m.d_ff, decoder_sparse_step=1, mlp_only_layers=[],
                   router_aux_loss_coef=m.router_aux_loss)
    else:
        out.update(max_window_layers=0 if w else m.n_layers, layer_types=T.layer_types(m))
    return out


def hf_tensors(m) -> list[T.Tensor]:
    layer = "model.layers.{i}"
    if m.family != "qwen3_moe":
        return llama.hf_tensors(m)  # Llama's names; attention_tensors adds q_norm/k_norm (m.qk_norm)
    return [*T.embedding_tensors(m), T.copy("layers/attn_norm", f"{layer}.input_layernorm.weight"),
            T.copy("layers/mlp_norm", f"{layer}.post_attention_layernorm.weight"),
            *T.attention_tensors(f"{layer}.self_attn", m), T.linear("layers/router", f"{layer}.mlp.gate.weight"),
            *llama.mlp_tensors(f"{layer}.mlp.experts.{{j}}")]
