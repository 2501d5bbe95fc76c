"""Model families by name. Each module exposes `param_specs(model_cfg)` and
`forward(params, tokens_BL, pos_BL, seg_BL, model_cfg, dtype, wrap_block, cache, attend) -> decoder.Output`.
Mistral, Mixtral and Qwen3 (dense and MoE) are the Llama math with config switches; their modules
add only the Hugging Face mapping."""

from maxlm.config import ConfigError, FAMILIES as NAMES
from maxlm.models import gemma, gemma2, gpt2, llama, mistral, mixtral, qwen3

FAMILIES = {"llama": llama, "mistral": mistral, "mixtral": mixtral, "qwen3": qwen3, "qwen3_moe": qwen3,
            "gemma": gemma, "gemma2": gemma2, "gpt2": gpt2}


def get(family: str):
    if family not in FAMILIES:
        known = [f for f in NAMES if f in FAMILIES]
        raise ConfigError(f"`model.family` must be one of {', '.join(known)}; got `{family}`")
    return FAMILIES[family]
