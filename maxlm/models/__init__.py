"""Model families by name. Each module exposes `param_specs(model_cfg)` and
`forward(params, tokens_BL, pos_BL, seg_BL, model_cfg, dtype, wrap_block, cache, attend) -> decoder.Output`.
Mistral, Mixtral and Qwen3 (dense and MoE) are the Llama math with config switches: llama.py runs them.
Their Hugging Face mapping is in maxlm/convert/adapters/."""

from maxlm.config import ConfigError, FAMILIES as NAMES
from maxlm.models import gemma, gemma2, gpt2, llama

FAMILIES = {"llama": llama, "mistral": llama, "mixtral": llama, "qwen3": llama, "qwen3_moe": llama,
            "gemma": gemma, "gemma2": gemma2, "gpt2": gpt2}


def get(family: str):
    if family not in FAMILIES:
        known = [f for f in NAMES if f in FAMILIES]
        raise ConfigError(f"`model.family` must be one of {', '.join(known)}; got `{family}`")
    return FAMILIES[family]
