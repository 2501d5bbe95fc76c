"""The one list of model families: the module that defines each (in maxlm/models/), and the facts about
it that config validation checks. It imports nothing of maxlm and no jax, so `maxlm.config` can check a
family before anything touches a device; the family module itself is loaded only by `module()`."""

import importlib
from typing import NamedTuple


class Family(NamedTuple):
    module: str                   # maxlm.models.<module> defines it
    moe: bool = False             # sparse MoE MLPs: needs model.n_experts > 0 (a dense family needs 0)
    position_table: bool = False  # learned absolute positions: one row per slot, so seq_len <= max_positions
    layer_pattern: str = ""       # model.layer_pattern when the config leaves it empty (its Hugging Face layout)
    mla: bool = False             # multi-head latent attention (model.mla) and dense first layers (model.dense_layers)
    clamped_glu: bool = False     # its experts' gated unit is clamped at model.swiglu_limit (gpt-oss's)


FAMILIES = {
    "llama": Family("llama"),
    "mistral": Family("llama"),  # a sliding window on every layer
    "mixtral": Family("llama", moe=True),
    "gemma": Family("gemma"),
    "gemma2": Family("gemma2", layer_pattern="LG"),
    "gemma3": Family("gemma2", layer_pattern="LLLLLG"),  # qk_norm, local_rope_theta
    "qwen2": Family("llama"),  # qkv_bias
    "qwen3": Family("llama"),  # qk_norm
    "qwen3_moe": Family("llama", moe=True),
    "gpt2": Family("gpt2", position_table=True),
    "gpt_oss": Family("gpt_oss", moe=True, layer_pattern="LG", clamped_glu=True),  # qkv_bias, attn_sinks
    "deepseek_v3": Family("deepseek_v3", moe=True, mla=True),  # router_groups, router_scale, shared_experts
}
NAMES = tuple(FAMILIES)


def module(family: str):
    """The module that defines `family` (imports jax)."""
    return importlib.import_module(f"maxlm.models.{FAMILIES[family].module}")
