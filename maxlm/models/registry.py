"""The one list of model families: the module that defines each, and the facts about it that config
validation checks. jax-free, so `maxlm.config` can validate a family before anything touches a device;
the family module itself (which imports jax) is loaded only by `module()`."""

import importlib
from typing import NamedTuple

from maxlm.config import ConfigError


class Family(NamedTuple):
    module: str                   # maxlm.models.<module> defines it
    moe: bool = False             # sparse MoE MLPs: needs model.n_experts > 0 (a dense family needs 0)
    position_table: bool = False  # learned absolute positions: one row per slot, so seq_len <= max_positions


FAMILIES = {
    "llama": Family("llama"),
    "mistral": Family("llama"),  # a sliding window on every layer
    "mixtral": Family("llama", moe=True),
    "gemma": Family("gemma"),
    "gemma2": Family("gemma2"),
    "qwen3": Family("llama"),  # qk_norm
    "qwen3_moe": Family("llama", moe=True),
    "gpt2": Family("gpt2", position_table=True),
}
NAMES = tuple(FAMILIES)


def validate(cfg: dict) -> None:
    """The checks that depend on the family (model.family is known to be one of NAMES)."""
    m = cfg["model"]
    f = FAMILIES[m["family"]]
    if f.moe != (m["n_experts"] > 0):
        fix = "set model.n_experts > 0" if f.moe else f"model.family={m['family']} is dense; set model.n_experts=0"
        raise ConfigError(f"`model.n_experts`={m['n_experts']} does not fit model.family={m['family']}: {fix}")
    if f.moe and not 0 < m["experts_per_token"] <= m["n_experts"]:
        raise ConfigError(f"`model.experts_per_token` must be in 1..n_experts={m['n_experts']}, got {m['experts_per_token']}")
    if f.position_table and cfg["seq_len"] > m["max_positions"]:
        raise ConfigError(f"`seq_len`={cfg['seq_len']} exceeds `model.max_positions`={m['max_positions']}, the rows of "
                          f"{m['family']}'s learned position table; lower seq_len (or, training from scratch, raise "
                          f"max_positions)")


def module(family: str):
    """The module that defines `family` (imports jax)."""
    return importlib.import_module(f"maxlm.models.{FAMILIES[family].module}")
