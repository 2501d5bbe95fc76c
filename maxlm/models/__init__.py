"""Model families by name. Each module exposes `param_specs(model_cfg)` and
`forward(params, tokens_BL, pos_BL, seg_BL, model_cfg, dtype, wrap_block)`."""

from maxlm.config import ConfigError
from maxlm.models import llama

FAMILIES = {"llama": llama}


def get(family: str):
    if family not in FAMILIES:
        raise ConfigError(f"`model.family` must be one of {', '.join(FAMILIES)}; got `{family}`")
    return FAMILIES[family]
