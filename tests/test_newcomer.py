"""The first run as a new user makes it: relative paths from any working directory, a run directory
that moves, a full disk, a second job on the same run_dir, and libtpu installed on a machine without
a TPU. Each runs the CLI in a subprocess, as a user would."""

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml
from conftest import ROOT, cli_env, needs, run_cli

SMALL = ["model.n_layers=1", "seq_len=32", "sample_tokens=0", "log_every=1", "mesh.fsdp=2", "mesh.data=4"]


def committed(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def errors(r) -> list[str]:
    return [line for line in r.stderr.splitlines() if line.strip()]


def test_relative_paths_from_another_directory(tmp_path):
    """The README's command with a relative run_dir, run from a directory that is not the repository:
    it saves, resumes, survives a move of its run directory, and exports with relative paths."""
    here = tmp_path / "work"
    here.mkdir()
    config = os.path.relpath(ROOT / "configs" / "tiny.yml", here)
    r = run_cli(config, *SMALL, "steps=2", "run_dir=runs/x", cwd=here)
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = here / "runs" / "x"
    assert committed(run_dir) == ["2"]
    assert "checkpoint step 2 committed" in r.stdout
    saved = yaml.safe_load((run_dir / "config.yml").read_text())
    assert saved["run_dir"] == str(run_dir)  # what was used, absolute
    assert (run_dir / "config.yml").read_text().startswith("# maxlm run config")

    # Move the run directory and resume through its saved config, from yet another directory: the config
    # finds the checkpoints where they are now.
    moved = tmp_path / "elsewhere"
    shutil.move(run_dir, moved)
    r = run_cli("elsewhere/config.yml", "steps=4", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"run_dir: {moved} (the directory of this run config; it was written in {run_dir})" in r.stdout
    assert "resuming from step 2" in r.stdout and committed(moved) == ["2", "4"]
    assert not run_dir.exists()

    # A second `make train` on a finished run resumes and finishes at once, without compiling.
    r = run_cli("elsewhere/config.yml", cwd=tmp_path)
    assert r.returncode == 0 and "nothing to train" in r.stdout and "compiled" not in r.stdout

    # Export with relative paths (from the moved run), then a refused overwrite.
    export = subprocess.run([sys.executable, "-m", "maxlm.convert.to_hf", "--checkpoint", "elsewhere", "--out", "hf"],
                            cwd=tmp_path, env={**cli_env(1), "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                            timeout=300)
    assert export.returncode == 0, export.stderr[-2000:]
    assert (tmp_path / "hf" / "config.json").is_file()


def _limit_file_size(limit: int):
    def pre():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit then fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return pre


@pytest.mark.malformed
@pytest.mark.slow  # ~23 s; the suite budget (docs/testing.md)
def test_full_disk_is_one_line_and_keeps_the_last_checkpoint(tmp_path):
    """A save that cannot be written stops the run with exit 4 and one line naming the path and cause;
    the last committed checkpoint stays, and the run resumes from it once there is room."""
    run_dir = tmp_path / "run"
    r = run_cli("configs/tiny.yml", *SMALL, "steps=2", f"run_dir={run_dir}")
    assert r.returncode == 0, r.stderr[-3000:]
    # 1 MB per file: the metrics still fit, a checkpoint's data file (about 13 MB here) does not.
    r = run_cli("configs/tiny.yml", *SMALL, "steps=4", f"run_dir={run_dir}", preexec_fn=_limit_file_size(1 << 20))
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-3000:]
    # One line of maxlm's, the last; before it Orbax's own error records (quiet.py: rate-limited, one line
    # each, no traceback), which say what the storage answered.
    assert [e for e in errors(r) if e.startswith("maxlm:")] == errors(r)[-1:] and "Traceback" not in r.stderr, r.stderr[-5000:]
    msg = errors(r)[-1]
    assert msg.startswith(f"maxlm: error: saving checkpoint step 4 to {run_dir}/checkpoints failed: ") and "File too large" in msg
    assert msg.endswith(f"the last committed checkpoint is {run_dir}/checkpoints/2")
    assert "checkpoint step 4 committed" not in r.stdout
    r = run_cli("configs/tiny.yml", *SMALL, "steps=4", f"run_dir={run_dir}")
    assert r.returncode == 0 and "resuming from step 2" in r.stdout, r.stderr[-3000:]
    assert committed(run_dir) == ["2", "4"]


@pytest.mark.slow  # ~21 s; the suite budget (docs/testing.md)
def test_one_job_per_run_dir(tmp_path):
    """A second job on a run_dir in use is refused in one line; a lock left by a job that was killed is
    taken over, with a log line."""
    run_dir = tmp_path / "run"
    log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "configs/tiny.yml", *SMALL, "steps=100000",
                              "checkpoint.every=0", f"run_dir={run_dir}"], cwd=ROOT, env=cli_env(), stdout=log,
                             stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 240
        while "step      1 |" not in (tmp_path / "first.log").read_text():
            assert first.poll() is None and time.time() < deadline, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.5)
        r = run_cli("configs/tiny.yml", *SMALL, "steps=3", f"run_dir={run_dir}")
        assert r.returncode == 2 and len(errors(r)) == 1, r.stderr[-3000:]
        assert errors(r)[0].startswith(f"maxlm: error: `run_dir` {run_dir} is in use by another job (pid {first.pid} on host ")
        assert "compiled" not in r.stdout  # refused before any compile
    finally:
        first.kill()
        first.wait()
        log.close()
    holder = json.loads((run_dir / ".lock").read_text())
    assert holder["pid"] == first.pid  # kill -9 left the file; the kernel released the lock
    r = run_cli("configs/tiny.yml", *SMALL, "steps=2", f"run_dir={run_dir}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"took over the lock of {run_dir} from a job that is gone (pid {first.pid} on host " in r.stdout
    assert not (run_dir / ".lock").exists()  # a clean exit leaves no lock behind


LIBTPU = ROOT / ".venv" / "tpu" / "libtpu" / "libtpu.so"


@needs(LIBTPU.exists(), reason="libtpu is installed by `make test`")
@pytest.mark.parametrize("args, want", [
    (["run_dir=/dev/null/x"], "`run_dir` /dev/null/x cannot be created (Not a directory)"),
    (["global_batch_size=12"], "must be divisible by the data-parallel size"),
])
def test_libtpu_without_a_tpu_is_quiet(args, want):
    """With libtpu installed (as compile_topology needs) and no TPU, errors after jax starts are still
    one line: the TPU runtime's host-bounds warnings are not printed."""
    env = {k: v for k, v in cli_env().items() if k != "JAX_PLATFORMS"}
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "configs/tiny.yml", *SMALL, "steps=2", *args], cwd=ROOT,
                       env={**env, "TPU_LIBRARY_PATH": str(LIBTPU)}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and len(errors(r)) == 1, r.stderr[-3000:]
    assert errors(r)[0].startswith("maxlm: error: ") and want in errors(r)[0]
    assert "libtpu is installed but this machine has no TPU: platforms cpu" in r.stdout


@needs(LIBTPU.exists(), reason="libtpu is installed by `make test`")
@pytest.mark.parametrize("command, want", [
    # the topology's name is checked before libtpu loads
    ([str(ROOT / "train.py"), "configs/tiny.yml", "dry_run=true", "compile_topology=v9x-8"],
     "maxlm: error: compile_topology `v9x-8`: unknown generation `v9x`"),
    # jax starts to read the (empty) checkpoints directory
    (["-m", "maxlm.convert.to_hf", "--checkpoint", "{tmp}", "--out", "{tmp}/out"],
     "maxlm.convert.to_hf: error: --checkpoint: {tmp}/checkpoints holds no committed checkpoint"),
])
def test_libtpu_without_a_tpu_is_quiet_beyond_training(tmp_path, command, want):
    """The dry run for a topology and the export start jax outside the training path; they are as quiet."""
    (tmp_path / "checkpoints").mkdir()
    env = {k: v for k, v in cli_env().items() if k != "JAX_PLATFORMS"}
    r = subprocess.run([sys.executable, *(c.format(tmp=tmp_path) for c in command)], cwd=ROOT,
                       env={**env, "TPU_LIBRARY_PATH": str(LIBTPU)}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and len(errors(r)) == 1, r.stderr[-3000:]
    assert errors(r)[0].startswith(want.format(tmp=tmp_path)), r.stderr[-3000:]
