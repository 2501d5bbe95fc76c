"""Model families by name. Each module exposes `param_specs(model_cfg)` and
`forward(params, tokens_BL, pos_BL, seg_BL, model_cfg, dtype, wrap_block, cache) -> decoder.Output`.
Mistral, Mixtral and Qwen3 (dense and MoE) are the Llama module with config switches."""

from maxlm.config import ConfigError, FAMILIES as NAMES
from maxlm.models import llama

FAMILIES = {"llama": llama, "mistral": llama, "mixtral": llama, "qwen3": llama, "qwen3_moe": llama}


def get(family: str):
    if family not in FAMILIES:
        known = [f for f in NAMES if f in FAMILIES]
        raise ConfigError(f"`model.family` must be one of {', '.join(known)}; got `{family}`")
    return FAMILIES[family]
