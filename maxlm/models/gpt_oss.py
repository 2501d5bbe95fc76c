"""gpt-oss: the Llama layout (llama.py) with sparse MoE layers, biases on every attention projection
(q, k and v through `model.qkv_bias`, the output's here), a learned sink per head (`model.attn_sinks`),
local and global layers alternating (`model.layer_pattern: LG`, 128-token windows) and YaRN. Its router
has a bias, its top-k weights are a softmax over the k chosen logits (`model.router_renorm` over a
softmax), its experts have biases, and their gated unit is clamped (mlp.clamped_swiglu) at `model.swiglu_limit`."""

import functools

from maxlm.models import decoder, llama
from maxlm.models.params import Param, zeros


def param_specs(m) -> dict:
    L, D, E, F = m.n_layers, m.d_model, m.n_experts, m.d_ff
    specs = llama.param_specs(m)
    specs["layers"].update(
        bo=Param((L, D), ("layers", "embed"), zeros),
        b_router=Param((L, E), ("layers", None), zeros),
        b_gate=Param((L, E, F), ("layers", "experts", "mlp"), zeros),
        b_up=Param((L, E, F), ("layers", "experts", "mlp"), zeros),
        b_down=Param((L, E, D), ("layers", "experts", "embed"), zeros))
    return specs


block = functools.partial(llama.block, act="gpt_oss")  # clamped at model.swiglu_limit (moe.moe)


def forward(params: dict, tokens_BL, pos_BL, seg_BL, m, dtype, wrap_block=lambda f: f, cache=None,
            attend=None, stack=None, routes: bool = False) -> decoder.Hidden:
    return llama.forward(params, tokens_BL, pos_BL, seg_BL, m, dtype, wrap_block, cache, attend, stack, block=block,
                         routes=routes)


unembed, windowed_layers = decoder.unembed, decoder.windowed_layers


def matmul_params(m) -> int:
    return decoder.matmul_params(m)
