"""`python -m maxlm.convert.to_hf`: every malformed argument is one `maxlm.convert.to_hf: error:` line
with exit 2, checked before the checkpoint is read; --out is never silently mixed or overwritten; the
files written get the same umask-derived mode; a write that fails names the file and the cause."""

import json
import os
import stat
import subprocess
import sys

import jax
import pytest

from conftest import ROOT, cli_env, params_checkpoint
from maxlm import models
from maxlm.config import load
from maxlm.convert import to_hf
from maxlm.models import params as P_

TINY = ["model.vocab_size=128", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.head_dim=8", "model.d_ff=64", "dtype=float32"]
PREFIX = "maxlm.convert.to_hf: error: "


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory with one checkpoint as the trainer lays it out (params and the config in meta)."""
    cfg = load(None, TINY)
    params = P_.init(models.get(cfg.model.family).param_specs(cfg.model), jax.random.key(0))
    return params_checkpoint(tmp_path_factory.mktemp("run"), cfg, params)


def export(capfd, *argv) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of to_hf.main(argv), in this process (argparse exits instead of
    returning)."""
    try:
        rc = to_hf.main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out, err = capfd.readouterr()
    return rc, out, err


def _layout(tmp, run):
    """Paths the malformed cases refer to, created fresh for each case."""
    (tmp / "a_file").write_text("x")
    (tmp / "full").mkdir()
    (tmp / "full" / "notes.txt").write_text("mine")
    (tmp / "empty").mkdir()
    (tmp / "hf").mkdir()
    (tmp / "hf" / "config.json").write_text("{}")
    return {"RUN": run, "FILE": tmp / "a_file", "FULL": tmp / "full", "EMPTY": tmp / "empty", "HF": tmp / "hf",
            "NEW": tmp / "new", "MISSING": tmp / "missing"}


# (arguments, substring of the one stderr line). RUN, NEW, ... are replaced by the paths _layout makes.
SHARD = ["--checkpoint", "RUN", "--out", "NEW", "--max-shard-size"]
MALFORMED = [
    ([*SHARD, "abc"], "--max-shard-size 'abc' must be a positive size"),
    ([*SHARD, "0"], "--max-shard-size '0' must be a positive size"),
    ([*SHARD[:-1], "--max-shard-size=-5"], "--max-shard-size '-5' must be a positive size"),
    ([*SHARD[:-1], "--max-shard-size=-1GB"], "--max-shard-size '-1GB' must be a positive size"),
    ([*SHARD, "inf"], "--max-shard-size 'inf' must be a positive size"),
    ([*SHARD, "5XB"], "--max-shard-size '5XB' must be a positive size"),
    (["--checkpoint", "RUN", "--out", "FILE"], "is an existing file; name a directory"),
    (["--checkpoint", "RUN", "--out", "FULL"], "is not empty (1 entries, e.g. notes.txt); pass --force"),
    (["--checkpoint", "RUN", "--out", "FILE/sub"], "cannot write"),
    (["--checkpoint", "MISSING", "--out", "NEW"], "does not exist"),
    (["--checkpoint", "FILE", "--out", "NEW"], "is a file; name a run directory"),
    (["--checkpoint", "EMPTY", "--out", "NEW"], "holds no committed checkpoint"),
    (["--checkpoint", "HF", "--out", "NEW"], "is a Hugging Face model directory, not a maxlm checkpoint"),
    (["--checkpoint", "RUN", "--out", "NEW", "--dtype", "float17"], "argument --dtype: invalid choice: 'float17'"),
    (["--checkpoint", "RUN"], "the following arguments are required: --out"),
    (["--out", "NEW"], "the following arguments are required: --checkpoint"),
    (["--checkpoint", "RUN", "--out", "NEW", "--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.mark.malformed
@pytest.mark.parametrize("argv, message", MALFORMED, ids=[m for _, m in MALFORMED])
def test_malformed_arguments_are_one_line(run_dir, tmp_path, capfd, argv, message):
    paths = _layout(tmp_path, run_dir)
    argv = [str(paths[a.split("/")[0]]) + a.removeprefix(a.split("/")[0]) if a.split("/")[0] in paths else a
            for a in argv]  # "FILE/sub" -> <tmp>/a_file/sub
    rc, out, err = export(capfd, *argv)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(PREFIX) and message in lines[0], err
    assert "wrote" not in out and not paths["NEW"].exists()  # refused before anything was written


def test_files_get_the_umask_mode_and_force_replaces_an_export(run_dir, tmp_path, capfd):
    out = tmp_path / "out"
    old = os.umask(0o022)
    try:
        rc, _, err = export(capfd, "--checkpoint", run_dir, "--out", out, "--max-shard-size", "30KB")
        assert rc == 0, err
        sharded = sorted(p.name for p in out.iterdir())
        assert "model.safetensors.index.json" in sharded and len(sharded) > 3
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
        assert set(modes.values()) == {0o644}, modes  # safetensors' own writer leaves 0600

        (out / "notes.txt").write_text("mine")
        rc, _, err = export(capfd, "--checkpoint", run_dir, "--out", out)
        assert rc == 2 and "pass --force" in err
        rc, stdout, err = export(capfd, "--checkpoint", run_dir, "--out", out, "--force")
        assert rc == 0 and "wrote llama" in stdout and err == "", err
    finally:
        os.umask(old)
    # The old shards and index are gone (transformers would read them); the user's file is kept.
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o644
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 32


def test_a_failed_write_names_the_file_and_the_cause(run_dir, tmp_path, capfd):
    out = tmp_path / "out"
    (out / "model.safetensors").mkdir(parents=True)  # the weights cannot replace a directory
    rc, _, err = export(capfd, "--checkpoint", run_dir, "--out", out, "--force")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    cause = lines[0].removeprefix(f"{PREFIX}cannot write {out / 'model.safetensors'}: ")
    assert "Is a directory" in cause and ".tmp" not in cause, err  # not safetensors' temporary file name


@pytest.mark.malformed
@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_permission_denied_is_one_line(run_dir, tmp_path, capfd):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    rc, _, err = export(capfd, "--checkpoint", run_dir, "--out", locked / "out")
    assert rc == 2 and err.strip() == f"{PREFIX}cannot write {locked / 'out'}: Permission denied", err


@pytest.mark.malformed
def test_a_usage_error_from_a_shell_is_one_line():
    """As a user runs it: a fresh process, nothing but the one line on stderr."""
    r = subprocess.run([sys.executable, "-m", "maxlm.convert.to_hf", "--checkpoint", "x", "--out", "y",
                        "--max-shard-size", "0"], cwd=ROOT, env=cli_env(1), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"{PREFIX}--max-shard-size '0' must be a positive size such as 500MB, 5GB or 1000000 (bytes)\n"
