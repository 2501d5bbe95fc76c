"""Export a maxlm checkpoint as a Hugging Face model directory.

    python -m maxlm.convert.to_hf --checkpoint runs/x/checkpoints [--out DIR] [--dtype bfloat16]

`--checkpoint` is a checkpoints directory (its newest step is used), one step's directory, or a run
directory holding `checkpoints/`. The model config comes from the checkpoint itself. If the run was
initialised from an HF directory that still exists, its tokenizer and generation files are copied
along, so the export is a complete model.
"""

import argparse
import shutil
import sys
from pathlib import Path

import jax
import ml_collections

from maxlm import checkpoint, config, models
from maxlm.config import ConfigError
from maxlm.convert import hf
from maxlm.models import params as P_

SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
              "generation_config.json")


def _size(text: str) -> int:
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30}
    t = text.strip().upper()
    for u, f in units.items():
        if t.endswith(u):
            return int(float(t[:-2]) * f)
    return int(t)


def checkpoint_config(meta_config: dict):
    """The checkpoint's config over today's defaults, so checkpoints from before a key existed load."""
    d = config.to_dict(config.load(None))

    def merge(into: dict, new: dict) -> None:
        for k, v in new.items():
            if isinstance(v, dict) and isinstance(into.get(k), dict) and k != "mixture":
                merge(into[k], v)
            else:
                into[k] = v
    merge(d, meta_config)
    config.validate(d)
    return ml_collections.FrozenConfigDict(d)


def restore(path: str):
    """(config, params on this host) of the newest step under `path`."""
    p = Path(path)
    if (p / "checkpoints").is_dir():
        p = p / "checkpoints"
    ck, step = checkpoint.resolve_init_from(str(p))
    try:
        cfg = checkpoint_config(ck.meta(step)["config"])
        specs = models.get(cfg.model.family).param_specs(cfg.model)
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev), P_.abstract(specs))
        return cfg, ck.restore_params(step, abstract), ck.step_path(step)
    finally:
        ck.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m maxlm.convert.to_hf", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="checkpoints dir, one step's dir, or a run dir")
    ap.add_argument("--out", required=True, help="output directory (created)")
    ap.add_argument("--dtype", default="float32", choices=sorted(hf.DTYPES), help="tensor dtype written")
    ap.add_argument("--max-shard-size", default="5GB", help="split safetensors files at this size (e.g. 500MB)")
    a = ap.parse_args(argv)
    try:
        cfg, params, where = restore(a.checkpoint)
        files = hf.save(params, cfg.model, a.out, a.dtype, _size(a.max_shard_size))
        src = cfg.init_from[3:] if cfg.init_from.startswith("hf:") else ""
        copied = [f for f in SIDE_FILES if src and (Path(src) / f).is_file()]
        for f in copied:
            shutil.copy(Path(src) / f, Path(a.out) / f)
    except ConfigError as e:
        print(f"maxlm.convert.to_hf: error: {e}", file=sys.stderr)
        return 2
    print(f"maxlm.convert.to_hf: wrote {cfg.model.family} from {where} to {a.out}: {len(files)} files "
          f"({a.dtype}){'; copied ' + ', '.join(copied) + ' from ' + src if copied else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
