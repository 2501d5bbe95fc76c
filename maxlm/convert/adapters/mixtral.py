"""Mixtral <-> MixtralForCausalLM: Llama's attention, per-expert MLP tensors, Mistral's window."""

from maxlm.convert import tables as T
from maxlm.convert.adapters.mistral import check_exportable, fixed_keys, window_from_hf

HF_ARCHITECTURES = {"MixtralForCausalLM": "mixtral"}


def n_experts_from_hf(c: dict, field: str) -> int:
    """Experts per layer. Mixtral's config.json names them `num_local_experts` and Qwen3-MoE's hub files
    `num_experts`, but both config classes alias one name to the other (transformers 5.x saves
    `num_local_experts` for both), so either spelling is read; two that disagree are refused."""
    names = [n for n in ("num_local_experts", "num_experts") if c.get(n) is not None]
    if not names:
        raise KeyError(field)
    values = {c[n] for n in names}
    if len(values) > 1:
        raise T.unsupported("num_experts", c["num_experts"], f"it contradicts num_local_experts="
                                                               f"{c['num_local_experts']}")
    return int(values.pop())


def moe_from_hf(c: dict, field: str, renorm: bool = True) -> dict:
    # router_aux_loss is a training choice (convert.hf.USER_KEYS): the checkpoint's coefficient is only
    # the default. router_jitter_noise (Mixtral) is training-time noise that transformers applies only in
    # train mode, like attention_dropout: the model's function, and so its logits, do not depend on it.
    # maxlm trains without it. Both families score by softmax and have no shared experts.
    k = T.number(c, "num_experts_per_tok", None, "an integer >= 1", lambda v: v >= 1, integer=True, required=True)
    aux = float(T.number(c, "router_aux_loss_coef", 0.001, "a number >= 0", lambda v: v >= 0))
    return {"n_experts": n_experts_from_hf(c, field), "experts_per_token": k, "router_aux_loss": aux, "router_score": "softmax",
            "router_renorm": renorm, "shared_experts": 0, "router_groups": 0, "router_topk_groups": 0,
            "router_scale": 1.0}


def check_moe_exportable(m, renorm: bool | None = True) -> None:
    """Refuse what a Mixtral/Qwen3-MoE config.json cannot say: sigmoid scores, shared experts, DeepSeek-V3's
    group-limited routing and routed scale, the renormalisation it fixes (None: either), and a loss-free
    bias, which lives in maxlm's train state and would be lost (the exported model would choose other
    experts)."""
    fixed = {"router_score": "softmax", "shared_experts": 0, "router_bias_rate": 0.0, "router_groups": 0,
             "router_topk_groups": 0, "router_scale": 1.0}
    if renorm is not None:
        fixed["router_renorm"] = renorm
    T.refuse_options(m, fixed, lambda key, want: f" as {m.family}: its Hugging Face model has {key}={want!r}")


def config_from_hf(c: dict) -> dict:
    T.require(c, "hidden_act", ("silu",), "silu")
    rope = c
    # MixtralConfig.default_theta: without a rope_theta anywhere, transformers uses 1e6, not 10000.
    if c.get("rope_parameters"):
        rope = {**c, "rope_parameters": {"rope_theta": 1e6, **c["rope_parameters"]}}
    elif "rope_theta" not in c:
        rope = {**c, "rope_theta": 1e6}
    return {**T.common_from_hf(c, tie_default=False), **T.rope_from_hf(rope), **fixed_keys(),
            "sliding_window": window_from_hf(c, default=None), **moe_from_hf(c, "num_local_experts")}


def config_to_hf(m) -> dict:
    check_exportable(m)
    check_moe_exportable(m)
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
            "sliding_window": m.sliding_window or None, "num_local_experts": m.n_experts,
            "num_experts_per_tok": m.experts_per_token, "router_aux_loss_coef": m.router_aux_loss,
            "router_jitter_noise": 0.0, **T.common_to_hf(m), **T.rope_to_hf(m)}


def hf_tensors(m) -> list[T.Tensor]:
    """The hub's per-expert layout, which transformers 5.x also writes (it fuses the experts only in
    memory): w1 is the gate, w3 the up and w2 the down projection of expert {j}."""
    layer, moe = "model.layers.{i}", "model.layers.{i}.block_sparse_moe"
    return [*T.embedding_tensors(m), T.copy("layers/attn_norm", f"{layer}.input_layernorm.weight"),
            T.copy("layers/mlp_norm", f"{layer}.post_attention_layernorm.weight"),
            *T.attention_tensors(f"{layer}.self_attn", m), T.linear("layers/router", f"{moe}.gate.weight"),
            T.linear("layers/w_gate", f"{moe}.experts.{{j}}.w1.weight"),
            T.linear("layers/w_up", f"{moe}.experts.{{j}}.w3.weight"),
            T.linear("layers/w_down", f"{moe}.experts.{{j}}.w2.weight")]
