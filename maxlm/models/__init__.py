"""Model families by name (the list is maxlm/families.py). A family module exports

    param_specs(m) -> {name: Param}                 the parameter tree (shapes, logical axes, init)
    forward(params, tokens_BL, pos_BL, seg_BL, m, dtype, wrap_block=identity, cache=None, attend=None, stack=None)
        -> decoder.Hidden(x_BLD, aux_loss, cache, moe)   final hidden states, after the final norm
        (`wrap_block`: remat; `attend`: the attention kernel; `stack`: the schedule's runner of the layer
        stack, maxlm.schedules; each passed explicitly, none read from a context)
        (an MoE family reads params["layers"]["router_bias"], the train state's selection bias, if present,
        and takes `routes=False`: True, outside the train step's schedule, fills Hidden.routes)
    unembed(params, x_BLD, m) -> logits_BLV         float32, soft-capped by model.final_softcap if set
    matmul_params(m) -> int, windowed_layers(m) -> int   what metrics.flops_per_token counts

and its config checks are facts in maxlm/families.py (jax-free). Mistral, Mixtral, Qwen2 and Qwen3 (dense and MoE)
are the Llama math with config switches: llama.py runs them. Hugging Face mapping lives in
maxlm/convert/adapters/. Importing this package does not import jax; `get` loads a family's module.
"""

from maxlm.errors import ConfigError
from maxlm.families import FAMILIES, NAMES, module


def get(family: str):
    """The module that defines `family`; an unknown name is a one-line ConfigError."""
    if family not in FAMILIES:
        raise ConfigError(f"`model.family` must be one of {', '.join(NAMES)}; got `{family}`")
    return module(family)


def apply(params, tokens_BL, pos_BL, seg_BL, m, dtype, **kw):
    """forward then unembed, as one call: decoder.Output(logits_BLV, aux_loss, cache). `kw` goes to
    forward (wrap_block, cache, attend, stack). The train step calls the two apart, so its loss sees x_BLD."""
    from maxlm.models import decoder  # imports jax: not at package import
    family = get(m.family)
    h = family.forward(params, tokens_BL, pos_BL, seg_BL, m, dtype, **kw)
    return decoder.Output(family.unembed(params, h.x_BLD, m), h.aux_loss, h.cache)
