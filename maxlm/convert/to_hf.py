"""Export a maxlm checkpoint as a Hugging Face model directory.

    python -m maxlm.convert.to_hf --checkpoint runs/x/checkpoints --out DIR [--dtype bfloat16]
        [--max-shard-size 5GB] [--force] [--peft]

`--checkpoint` is a checkpoints directory (its newest step is used), one step's directory, or a run
directory holding `checkpoints/`. The model config comes from the checkpoint itself. If the run was
initialised from an HF directory that still exists, its tokenizer and generation files are copied
along, so the export is a complete model. `--out` must be new or empty: `--force` writes into a
non-empty directory, replacing a previous export's weights, index and config (other files stay).
A LoRA run (lora.rank > 0) is exported with its adapters merged into the base, or with `--peft` as a
PEFT adapter directory for the base model (maxlm.convert.peft).
Every mistake is one `maxlm.convert.to_hf: error:` line on stderr and exit status 2.
"""

import argparse
import functools
import shutil
import sys
from pathlib import Path

import jax

from maxlm import checkpoint, config, models, platforms
from maxlm.errors import ConfigError
from maxlm.convert import hf, peft
from maxlm.models import params as P_

SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
              "generation_config.json")


def _size(text: str) -> int:
    """Bytes of a size such as 500MB, 2GB or 1000000; a one-line ConfigError for anything else."""
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "B": 1}
    t = text.strip().upper()
    unit = next((u for u in units if t.endswith(u)), "")
    try:
        n = int(float(t[:len(t) - len(unit)]) * units.get(unit, 1))
    except (ValueError, OverflowError):  # not a number, or nan / inf
        n = None
    if n is None or n <= 0:
        raise ConfigError(f"--max-shard-size {text!r} must be a positive size such as 500MB, 5GB or 1000000 (bytes)")
    return n


def restore(path: str, adapters_only: bool = False):
    """(config, params on this host, step dir) of the newest step under `path`: a LoRA run's merged, or
    with `adapters_only` its adapters."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"--checkpoint {path} is a file; name a run directory, its checkpoints/ or one step's "
                          f"directory")
    if (p / "config.json").is_file() and not (p / "checkpoints").is_dir():
        raise ConfigError(f"--checkpoint {path} is a Hugging Face model directory, not a maxlm checkpoint; "
                          f"it needs no export (maxlm.from_pretrained reads it as is)")
    if (p / "checkpoints").is_dir():
        p = p / "checkpoints"
    ck, step = checkpoint.resolve_init_from(str(p), "--checkpoint")
    try:
        cfg = config.from_saved(ck.meta(step)["config"], str(ck.step_path(step)),
                                log=lambda m: print(f"maxlm.convert.to_hf: {m}"))
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        if adapters_only and not cfg.lora.rank:
            raise ConfigError(f"--peft: {ck.step_path(step)} is not a LoRA run (lora.rank=0); it has no adapters to "
                              f"export: drop --peft")
        specs = models.get(cfg.model.family).param_specs(cfg.model)
        if adapters_only:
            return cfg, peft.adapters_of(ck, step, cfg, specs, dev), ck.step_path(step)
        if cfg.lora.rank:
            return cfg, peft.restore(ck, step, cfg, specs, dev), ck.step_path(step)
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev), P_.abstract(specs))
        return cfg, peft.params_of(ck, step, abstract), ck.step_path(step)
    finally:
        ck.close()


def check_out(out: Path, force: bool) -> None:
    """Refuse an --out that is a file, or a non-empty directory unless --force: an export must not mix
    with, or silently replace, files already there."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is an existing file; name a directory (it is created)")
    if out.is_dir() and not force:
        entries = sorted(c.name for c in out.iterdir())
        if entries:
            raise ConfigError(f"--out {out} is not empty ({len(entries)} entries, e.g. {entries[0]}); pass --force to "
                              f"replace an export there, or name a new directory")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage and a second line; a usage mistake gets one line, as ours do
        print(f"maxlm.convert.to_hf: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def main(argv=None) -> int:
    ap = _Parser(prog="python -m maxlm.convert.to_hf", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="checkpoints dir, one step's dir, or a run dir")
    ap.add_argument("--out", required=True, help="output directory (created; must be empty unless --force)")
    ap.add_argument("--force", action="store_true",
                    help="write into a non-empty --out, replacing a previous export's files (others are kept)")
    ap.add_argument("--dtype", default="float32", choices=sorted(hf.DTYPES), help="tensor dtype written")
    ap.add_argument("--max-shard-size", default="5GB", help="split safetensors files at this size (e.g. 500MB)")
    ap.add_argument("--peft", action="store_true",
                    help="a LoRA run: write its adapters as a PEFT adapter directory instead of the merged model")
    a = ap.parse_args(argv)
    out = Path(a.out)
    try:
        shard_bytes = _size(a.max_shard_size)  # every argument is checked before the (long) restore
        check_out(out, a.force)
        platforms.skip_absent_tpu()  # before jax starts: libtpu on a machine without a TPU says nothing
        cfg, params, where = restore(a.checkpoint, adapters_only=a.peft)
        src = cfg.init_from[3:] if cfg.init_from.startswith("hf:") else ""
        if a.peft:
            files = peft.save(params, cfg, out, src)
        else:
            files = hf.save(params, cfg.model, out, a.dtype, shard_bytes)
        copied = [f for f in SIDE_FILES if src and (Path(src) / f).is_file()]
        for f in copied:
            hf.checked_io(out / f, functools.partial(shutil.copyfile, Path(src) / f, out / f))
    except ConfigError as e:
        print(f"maxlm.convert.to_hf: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # reading the checkpoint; a failed write is a ConfigError naming the file
        print(f"maxlm.convert.to_hf: error: {e.filename or a.checkpoint}: {e.strerror or e}", file=sys.stderr)
        return 2
    what = "LoRA adapters (PEFT) of " if a.peft else "merged LoRA " if cfg.lora.rank else ""
    print(f"maxlm.convert.to_hf: wrote {what}{cfg.model.family} from {where} to {out}: {len(files)} files "
          f"({a.dtype}){'; copied ' + ', '.join(copied) + ' from ' + src if copied else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
