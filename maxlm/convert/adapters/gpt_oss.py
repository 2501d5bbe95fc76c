"""gpt-oss <-> GptOssForCausalLM: Llama's names plus attention biases and sinks, a biased router, and each
layer's experts fused in one tensor per projection (gate and up interleaved by column). The published
checkpoints store the expert weights in MXFP4 (`*_blocks`, `*_scales`); import dequantizes them exactly
(`mxfp4`). Export writes them unquantized."""

import numpy as np

from maxlm.convert import tables as T
from maxlm.convert.adapters.mistral import check_exportable, fixed_keys
from maxlm.convert.adapters.mixtral import check_moe_exportable, moe_from_hf
from maxlm.layers.mlp import SWIGLU_ALPHA, SWIGLU_LIMIT

HF_ARCHITECTURES = {"GptOssForCausalLM": "gpt_oss"}
QUANT_METHODS = ("mxfp4",)  # a config.json quantization_config's quant_method import dequantizes (mxfp4)
EXPERTS = "model.layers.{i}.mlp.experts"
# OCP Microscaling FP4 (E2M1): the value of each 4-bit code; the sign is the high bit.
FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[..., R, G, 16] bytes of two FP4 codes each (low nibble first) and [..., R, G] E8M0 exponents (bias
    127), one per 32 values, -> float32 [..., G * 32, R]: the rows transposed, as GptOssExperts holds them.
    Sources of other types or shapes are a ValueError (convert.hf names them)."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[-1:] != (16,) or \
            scales.shape != blocks.shape[:-1]:
        raise ValueError("MXFP4 needs uint8 blocks [..., rows, groups, 16] and uint8 scales [..., rows, groups]")
    v = np.stack([FP4[blocks & 0x0F], FP4[blocks >> 4]], axis=-1).reshape(*blocks.shape[:-1], 32)
    v = np.ldexp(v, scales.astype(np.int32)[..., None] - 127)
    return v.reshape(*blocks.shape[:-2], -1).swapaxes(-1, -2)


def config_from_hf(c: dict) -> dict:
    T.require(c, "hidden_act", ("silu",), "silu")
    T.require(c, "attention_bias", (True,), True)
    T.require(c, "swiglu_alpha", (SWIGLU_ALPHA,), SWIGLU_ALPHA)
    n, w = c["num_hidden_layers"], c.get("sliding_window", 128)
    types = c.get("layer_types")
    if types is None:  # as GptOssConfig derives it (a present [] is refused, not derived)
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    pattern = T.layer_pattern(types, n)
    if "L" in pattern and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
        raise T.unsupported("sliding_window", w, "expected a positive int")
    return {**T.common_from_hf(c, tie_default=False), **T.rope_from_hf(c), **fixed_keys(qkv_bias=True, per_layer=True, attn_sinks=True),
            "sliding_window": w if "L" in pattern else 0, "layer_pattern": pattern,
            **moe_from_hf(c, "num_local_experts", renorm=True),
            "swiglu_limit": float(T.number(c, "swiglu_limit", SWIGLU_LIMIT, "a number > 0", lambda v: v > 0))}


def config_to_hf(m) -> dict:
    check_exportable(m, qkv_bias=True, per_layer=True, attn_sinks=True)
    check_moe_exportable(m, renorm=True)
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_act": "silu",
            "attention_bias": True, "swiglu_alpha": SWIGLU_ALPHA, "swiglu_limit": m.swiglu_limit,
            "num_local_experts": m.n_experts, "num_experts_per_tok": m.experts_per_token,
            "router_aux_loss_coef": m.router_aux_loss, "sliding_window": m.sliding_window or None,
            "layer_types": T.layer_types(m), **T.common_to_hf(m), **T.rope_to_hf(m)}


def derived_tensors(names) -> dict:
    """The unquantized expert tensors an MXFP4 checkpoint stands for: name -> (dequantize, its sources)."""
    out = {}
    for n in names:
        if n.endswith("_blocks") and n[:-len("blocks")] + "scales" in names:
            out[n[:-len("_blocks")]] = (mxfp4, (n, n[:-len("blocks")] + "scales"))
    return out


def _interleaved(path_gate: str, path_up: str, hf: str) -> T.Tensor:
    """gate and up, interleaved by column in HF's last axis."""
    def to_maxlm(w, shapes):
        return w[..., 0::2].reshape(shapes[0]), w[..., 1::2].reshape(shapes[1])

    def to_hf(g, u):
        return np.stack([g, u], axis=-1).reshape(*g.shape[:-1], 2 * g.shape[-1])
    return T.Tensor(hf, (path_gate, path_up), to_maxlm, to_hf)


def hf_tensors(m) -> list[T.Tensor]:
    layer = "model.layers.{i}"
    return [*T.embedding_tensors(m), T.copy("layers/attn_norm", f"{layer}.input_layernorm.weight"),
            T.copy("layers/mlp_norm", f"{layer}.post_attention_layernorm.weight"),
            *T.attention_tensors(f"{layer}.self_attn", m), T.copy("layers/bo", f"{layer}.self_attn.o_proj.bias"),
            T.copy("layers/sinks", f"{layer}.self_attn.sinks"),
            T.linear("layers/router", f"{layer}.mlp.router.weight"), T.copy("layers/b_router", f"{layer}.mlp.router.bias"),
            _interleaved("layers/w_gate", "layers/w_up", f"{EXPERTS}.gate_up_proj"),
            _interleaved("layers/b_gate", "layers/b_up", f"{EXPERTS}.gate_up_proj_bias"),
            T.copy("layers/w_down", f"{EXPERTS}.down_proj"), T.copy("layers/b_down", f"{EXPERTS}.down_proj_bias")]
