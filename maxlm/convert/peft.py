"""A LoRA run's checkpoints hold only its adapters; these put the model back together. `restore` gives
the base with the adapters merged (what `to_hf` exports and `from_pretrained` loads); `save` writes a
PEFT adapter directory (adapter_config.json + adapter_model.safetensors) that `peft` loads onto the
Hugging Face base model. The base is found as the run found it: init_from (an HF directory or a maxlm
checkpoint, which must still be there) or, without init_from, drawn again from the run's seed."""

import json
from pathlib import Path

import jax
import numpy as np

from maxlm import checkpoint as ckpt
from maxlm import lora, models
from maxlm.errors import ConfigError
from maxlm.convert import adapters, hf
from maxlm.models import params as P_

# Families whose HF projections are nn.Linear, one per maxlm weight; GPT-2's are Conv1D and fuse q, k, v.
PEFT_FAMILIES = ("llama", "mistral", "gemma", "gemma2", "qwen3")


def _abstract(specs, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), P_.abstract(specs), shardings)


def _shardings(specs, placement):
    """`placement`: one Sharding for every array, or a function of the spec tree giving a tree of them."""
    if callable(placement):
        return placement(specs)
    return jax.tree.map(lambda _: placement, specs, is_leaf=P_.is_param)


def base(cfg, placement, mesh=None, rule_table=None):
    """The model's float32 params named by init_from (a LoRA run's base, DPO's reference, or a fine-tune's
    start), or without init_from the seed's draw, placed by `placement` (rule_table over mesh for hf:)."""
    specs = models.get(cfg.model.family).param_specs(cfg.model)
    src = cfg.init_from
    if src.startswith("hf:"):
        if not (Path(src[3:]) / "config.json").is_file():
            raise ConfigError(f"init_from={src} is not there any more (no config.json); a LoRA run's checkpoints hold "
                              f"only the adapters: put the base model back at that path")
        return hf.load_params(src[3:], cfg, mesh, rule_table if mesh is not None else None)
    abstract = _abstract(specs, _shardings(specs, placement))
    if src:
        ck, step = ckpt.resolve_model(src)
        try:
            return ck.restore_params(step, abstract)
        finally:
            ck.close()
    out = jax.tree.map(lambda a: a.sharding, abstract)
    return jax.jit(lambda: P_.init(specs, jax.random.key(cfg.seed)), out_shardings=out)()


def adapters_of(ck, step: int, cfg, placement):
    specs = lora.specs(models.get(cfg.model.family).param_specs(cfg.model), cfg.lora)
    return ck.restore_params(step, _abstract(specs, _shardings(specs, placement)))


def restore(ck, step: int, cfg, placement, mesh=None, rule_table=None):
    """The params of a LoRA run's step with its adapters merged in (float32)."""
    merged = lora.merge(base(cfg, placement, mesh, rule_table), adapters_of(ck, step, cfg, placement),
                        lora.scale_of(cfg.lora))
    return jax.tree.map(lambda x: x.astype(np.float32), merged)


def save(adapter_params, cfg, out: Path, base_path: str = "") -> list[Path]:
    """adapter_config.json and adapter_model.safetensors in PEFT's layout (lora_A [r, in], lora_B [out, r]
    per module and layer, scaling alpha / r), for `PeftModel.from_pretrained(base, out)`."""
    m, lc = cfg.model, cfg.lora
    if m.family not in PEFT_FAMILIES:
        raise ConfigError(f"--peft: {m.family}'s Hugging Face projections are not one nn.Linear per maxlm weight, so "
                          f"PEFT cannot load its adapters; export the merged model (drop --peft)")
    table = {t.paths[0]: t for t in adapters.get(m.family).hf_tensors(m) if len(t.paths) == 1}
    host = jax.tree.map(np.asarray, jax.device_get(adapter_params))
    tensors, modules = {}, set()
    for target in lc.targets:
        t = table[f"layers/{target}"]
        module = t.hf.removesuffix(".weight")
        modules.add(module.rsplit(".", 1)[-1])
        a, b = host["layers"][target]["a"], host["layers"][target]["b"]
        for i in range(m.n_layers):
            name = f"base_model.model.{module.format(i=i)}"
            tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, lc.rank).T)
            tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(lc.rank, -1).T)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lc.rank, "lora_alpha": lc.alpha,
              "lora_dropout": lc.dropout, "target_modules": sorted(modules), "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "inference_mode": True, "base_model_name_or_path": base_path}
    hf.checked_io(out, lambda: out.mkdir(parents=True, exist_ok=True))
    return [hf.save_file(tensors, out / "adapter_model.safetensors"),
            hf.write_text(out / "adapter_config.json", json.dumps(config, indent=2, sort_keys=True))]
