"""Model families by name (the list is registry.py). A family module exports

    param_specs(m) -> {name: Param}                 the parameter tree (shapes, logical axes, init)
    forward(params, tokens_BL, pos_BL, seg_BL, m, dtype, wrap_block=identity, cache=None, attend=None)
        -> decoder.Output(logits_BLV, aux_loss, cache)
    matmul_params(m) -> int, windowed_layers(m) -> int   what metrics.flops_per_token counts

and its config checks are facts in registry.py (jax-free). Mistral, Mixtral and Qwen3 (dense and MoE)
are the Llama math with config switches: llama.py runs them. Hugging Face mapping lives in
maxlm/convert/adapters/. Importing this package does not import jax; `get` loads a family's module.
"""

from maxlm.config import ConfigError
from maxlm.models.registry import FAMILIES, NAMES, module


def get(family: str):
    """The module that defines `family`; an unknown name is a one-line ConfigError."""
    if family not in FAMILIES:
        raise ConfigError(f"`model.family` must be one of {', '.join(NAMES)}; got `{family}`")
    return module(family)
