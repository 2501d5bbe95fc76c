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
from maxlm import lora
from maxlm.errors import ConfigError
from maxlm.convert import adapters, hf
from maxlm.models import params as P_
from maxlm.schedules import Layout

# Families whose HF projections are nn.Linear, one per maxlm weight; GPT-2's are Conv1D and fuse q, k, v.
PEFT_FAMILIES = ("llama", "mistral", "gemma", "gemma2", "qwen3")


def _abstract(specs, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), P_.abstract(specs), shardings)


def _shardings(specs, placement):
    """`placement`: one Sharding for every array, or a function of the spec tree giving a tree of them."""
    if callable(placement):
        return placement(specs)
    return jax.tree.map(lambda _: placement, specs, is_leaf=P_.is_param)


def resolve_model(path: str, key: str = "`init_from`") -> tuple[ckpt.Checkpointer, int]:
    """checkpoint.resolve_init_from for a checkpoint that must hold a whole model: a LoRA run's holds only its
    adapters (and a reference to its base), so it is refused naming both ways on."""
    ck, step = ckpt.resolve_init_from(path, key)
    saved = ck.meta(step)["config"]
    rank = saved.get("lora", {}).get("rank", 0)
    if rank:
        base = saved.get("init_from") or "(none: its base was drawn from the seed)"
        ck.close()
        raise ConfigError(f"{key}: {path} is a LoRA run's checkpoint: it holds rank-{rank} adapters, not a model. "
                          f"To start from the fine-tuned model, export it merged (python -m maxlm.convert.to_hf "
                          f"--checkpoint {path} --out DIR) and set {key.strip('`')}=hf:DIR; to start from its base, "
                          f"set {key.strip('`')}={base}")
    return ck, step


def check_model(path: str, abstract_params) -> None:
    """resolve_model's checks, and that the step's parameters have `abstract_params`' shapes (metadata only)."""
    ck, step = resolve_model(path)
    try:
        ck.check_params(step, abstract_params)
    finally:
        ck.close()


def params_of(ck, step: int, abstract):
    """A checkpoint step's parameters (a model's, or a LoRA run's adapters) placed onto `abstract`, with their
    layer stacks in natural order, whatever schedule wrote them."""
    return Layout().move(ck.restore_params(step, abstract), Layout.saved(ck.meta(step)["config"]))


def base(cfg, specs, placement, mesh=None, rule_table=None):
    """The model's float32 params (spec tree `specs`) named by init_from (a LoRA run's base, DPO's reference,
    or a fine-tune's start), or without init_from the seed's draw, placed by `placement` (rule_table over
    mesh for hf:)."""
    src = cfg.init_from
    if src.startswith("hf:"):
        if not (Path(src[3:]) / "config.json").is_file():
            raise ConfigError(f"init_from={src} is not there any more (no config.json); a LoRA run's checkpoints hold "
                              f"only the adapters: put the base model back at that path")
        return hf.load_params(src[3:], cfg, mesh, rule_table if mesh is not None else None)
    abstract = _abstract(specs, _shardings(specs, placement))
    if src:
        ck, step = resolve_model(src)
        try:
            return params_of(ck, step, abstract)
        finally:
            ck.close()
    out = jax.tree.map(lambda a: a.sharding, abstract)
    return jax.jit(lambda: P_.init(specs, jax.random.key(cfg.seed)), out_shardings=out)()


def adapters_of(ck, step: int, cfg, specs, placement):
    """A LoRA run's adapters at `step` (its model's spec tree `specs`)."""
    ad_specs = lora.specs(specs, cfg.lora)
    return params_of(ck, step, _abstract(ad_specs, _shardings(ad_specs, placement)))


def restore(ck, step: int, cfg, specs, placement, mesh=None, rule_table=None):
    """The params of a LoRA run's step with its adapters merged in (float32); `specs` the model's."""
    merged = lora.merge(base(cfg, specs, placement, mesh, rule_table), adapters_of(ck, step, cfg, specs, placement),
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
