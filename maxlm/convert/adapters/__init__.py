"""One Hugging Face adapter per model family, in the spirit of torchtitan's state_dict_adapter.py:
tensor names and layouts, the config.json mapping both ways, and what cannot be exported. Each module
defines `HF_ARCHITECTURES` (HF class name -> maxlm family), `config_from_hf(config_json) -> model keys`,
`config_to_hf(m) -> config.json` (refusing what HF cannot express) and `hf_tensors(m) -> [Tensor]`,
and may set `HF_PREFIX` (see gpt2), `checkpoint_names(names, config_json, m)` (stored -> HF name, None to drop: see gemma3)
`QUANT_METHODS` (the quantization_config quant_methods its import dequantizes; none by default),
`import_note(config_json)` (what an import leaves out, for the log), `export_tensors(m)` (what export writes, when
not hf_tensors(m): deepseek_v3 leaves its training-only modules out) and `derived_tensors(names)` (tensors made
from stored ones: gpt-oss's MXFP4 experts). maxlm.convert.hf reads and writes; the models know nothing of HF."""

import importlib

from maxlm.errors import ConfigError

# family -> adapter module (Qwen3 and Qwen3-MoE share one)
ADAPTERS = {"llama": "llama", "mistral": "mistral", "mixtral": "mixtral", "gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3",
            "qwen2": "qwen2", "gpt_oss": "gpt_oss", "qwen3": "qwen3", "qwen3_moe": "qwen3", "gpt2": "gpt2",
            "deepseek_v3": "deepseek_v3"}


def get(family: str):
    """The adapter of `family`."""
    if family not in ADAPTERS:
        raise ConfigError(f"`model.family` must be one of {', '.join(ADAPTERS)}; got `{family}`")
    return importlib.import_module(f"maxlm.convert.adapters.{ADAPTERS[family]}")


def architectures() -> dict:
    """HF architecture name -> maxlm family name, from every adapter."""
    return {a: f for name in dict.fromkeys(ADAPTERS.values())
            for a, f in importlib.import_module(f"maxlm.convert.adapters.{name}").HF_ARCHITECTURES.items()}
