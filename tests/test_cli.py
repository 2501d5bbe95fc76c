"""The CLI as a user meets it: one-line errors with exit code 2, and a real run's outputs."""

import json
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT, cli_env, run_cli


@pytest.mark.malformed
@pytest.mark.parametrize("args, message", [
    (["stepz=3"], "unknown config key `stepz`; did you mean `steps`?"),
    (["steps=ten"], "`steps` must be int, got ten (str)"),
    (["mesh.data=3", "mesh.fsdp=1"], "mesh data=3 x fsdp=1 x tensor=1 x expert=1 x context=1 has 3 devices but 8 are available"),
    (["global_batch_size=12"], "sequences per microbatch must be divisible by the data-parallel size"),
    (["model.n_heads=6", "mesh.tensor=4", "model.n_kv_heads=2"], "`model.n_heads`=6 must be divisible by `mesh.tensor`=4"),
])
def test_config_errors_are_one_line_exit_2(args, message):
    r = run_cli("configs/tiny.yml", *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("maxlm: error: ") and message in lines[0], r.stderr


@pytest.mark.malformed
def test_missing_config_file():
    r = run_cli("configs/nope.yml")
    assert r.returncode == 2
    assert r.stderr.startswith("maxlm: error: config file not found: ") and r.stderr.strip().endswith("configs/nope.yml")


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


ARGS = ["steps=4", "log_every=1", "seq_len=64", "sample_tokens=12", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("e2e")
    r = run_cli("configs/tiny.yml", *ARGS, f"run_dir={run_dir}")
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir, r


def test_e2e_outputs(e2e):
    run_dir, r = e2e
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    for key in ("loss", "lr", "grad_norm", "tokens_per_sec", "tflops_per_device", "mfu", "step_time_s", "data_wait_s"):
        assert all(key in row for row in rows), key
    assert rows[0]["host_time_s"] is None and all(row["host_time_s"] > 0 for row in rows[1:])
    assert all(row["mfu"] is None for row in rows)  # CPU: no peak is known, so none is invented
    assert rows[0]["loss"] == pytest.approx(5.55, abs=0.1)  # ln(256): an untrained byte model
    assert rows[-1]["loss"] < rows[0]["loss"]
    saved = yaml.safe_load((run_dir / "config.yml").read_text())
    assert saved["steps"] == 4 and saved["mesh"]["tensor"] == 2
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert (run_dir / "loss.png").stat().st_size > 1000
    assert "mesh data=2 x fsdp=2 x tensor=2 x expert=1 x context=1 over 8 x cpu" in r.stdout
    assert "greedy sample:\nThe " in r.stdout


def test_saved_config_reruns(e2e, tmp_path):
    run_dir, _ = e2e
    r = run_cli(str(run_dir / "config.yml"), "dry_run=true")
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.slow  # 11 s; in the fast suite, test_resume's bitwise resume in a second process needs the same determinism
def test_same_seed_gives_bitwise_identical_losses(e2e, tmp_path):
    run_dir, _ = e2e
    r = run_cli("configs/tiny.yml", *ARGS, "sample_tokens=0", f"run_dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert _losses(tmp_path) == _losses(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(1000)  # 250 steps: 150 s alone, past 600 s beside the rest of CI's suite on 2 cores
def test_default_job_learns(tmp_path):
    """`make train`'s job: the loss falls well below its starting value (ln 256 = 5.55)."""
    r = run_cli("configs/tiny.yml", f"run_dir={tmp_path}", devices=1, timeout=900, optimized=True)
    assert r.returncode == 0, r.stderr[-2000:]
    losses = _losses(tmp_path)
    assert losses[0] > 5.0 and losses[-1] < 2.2, losses


BENCHMARKS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if "__main__" in p.read_text())


@pytest.mark.malformed
@pytest.mark.parametrize("script", BENCHMARKS)
def test_a_benchmark_given_a_bad_flag_says_so_in_one_line(script):
    """Nine of them printed a traceback (often of the ConfigError whose line train.py prints), one its usage
    block, and two exited 1."""
    r = subprocess.run([sys.executable, f"benchmarks/{script}", "--bogus-flag"], cwd=ROOT, env=cli_env(),
                       capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"{script}: error: "), r.stderr[-2000:]
