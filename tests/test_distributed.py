"""Two processes x 4 CPU devices, joined through jax.distributed on 127.0.0.1, train exactly the global
batches one process x 8 devices trains (from a prepared ArrayRecord dataset, each process reading only
its own rows), stop together when one of them is signalled, and resume."""

import json
import signal
import socket
import time

import numpy as np
import pytest
from conftest import run_cli, start_cli

MODEL = ["model.n_layers=2", "model.d_model=64", "model.d_ff=128", "model.n_heads=4", "model.n_kv_heads=2",
         "model.head_dim=16", "seq_len=32", "global_batch_size=8"]
STEPS = 30
ARGS = ["configs/tiny.yml", *MODEL, f"steps={STEPS}", "log_every=1", "checkpoint.every=10", "sample_tokens=8"]


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def two_processes(run_dir, tmp_path, *extra, codes=(0, 0), signal_at=None):
    """Run both processes to the end; with signal_at, SIGTERM process 1 alone once step `signal_at` is logged."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs = [open(tmp_path / f"proc{i}.txt", "w") for i in range(2)]
    procs = [start_cli(*ARGS, f"run_dir={run_dir}", *extra, devices=4, log=logs[i], env={
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)})
        for i in range(2)]
    if signal_at:
        t = time.time()
        while time.time() - t < 240 and procs[1].poll() is None:
            rows = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
            if rows and json.loads(rows[-1])["step"] >= signal_at:
                break
            time.sleep(0.02)
        procs[1].send_signal(signal.SIGTERM)
    got = [p.wait(timeout=300) for p in procs]
    for f in logs:
        f.close()
    outs = [(tmp_path / f"proc{i}.txt").read_text() for i in range(2)]
    assert tuple(got) == codes, outs[0][-3000:] + outs[1][-3000:]
    return outs


def prepared(tmp_path) -> list[str]:
    """Python's docs as text files, prepared into ArrayRecord shards: the production data path."""
    from pydoc_data.topics import topics

    from maxlm.data import prepare

    (tmp_path / "txt").mkdir()
    for k in sorted(topics):
        (tmp_path / "txt" / f"{k}.txt").write_text(topics[k])
    assert prepare.main([str(tmp_path / "txt"), "--tokenizer", "byte", "--out", str(tmp_path / "prep"), "--workers", "1"]) == 0
    return ["data.source=arrayrecord", f"data.path={tmp_path / 'prep'}"]


def test_two_processes_match_one_and_resume_together(tmp_path):
    src = prepared(tmp_path)
    ref = tmp_path / "ref"
    r = run_cli(*ARGS, f"run_dir={ref}", *src)
    assert r.returncode == 0, r.stderr[-2000:]

    # SIGTERM reaches process 1 only; the per-step all-gather of the flag stops both at the same step.
    run_dir = tmp_path / "run"
    outs = two_processes(run_dir, tmp_path, *src, codes=(143, 143), signal_at=3)
    assert "maxlm: processes: process 0 of 2 (JAX_COORDINATOR_ADDRESS); 4 local of 8 devices" in outs[0]
    assert "maxlm: another process received SIGTERM" in outs[0]
    # One log for the job: process 1 only says that it was signalled.
    assert [line for line in outs[1].splitlines() if "maxlm: " in line] == [
        "maxlm: SIGTERM received: saving at the end of this step, then exiting (send it again to exit at once)"]
    stopped = int(outs[0].split("SIGTERM: stopped after step ")[1].split()[0])
    assert 3 <= stopped < STEPS
    data = run_dir / "checkpoints" / str(stopped) / "data"
    assert sorted(p.name for p in data.glob("process_*.json")) == ["process_0-of-2.json", "process_1-of-2.json"]

    outs = two_processes(run_dir, tmp_path, *src)
    assert "indexed: batches independent of the process count" in outs[0]
    assert f"resuming from step {stopped}" in outs[0] and "greedy sample:" in outs[0]
    # The same global batches on the same 8-device mesh; only the collectives' transport (gloo) differs,
    # which moves a loss by about one float32 ulp.
    np.testing.assert_allclose(losses(run_dir), losses(ref), rtol=1e-6)


def test_single_process_unless_the_environment_says_otherwise(monkeypatch):
    from maxlm import distributed
    from maxlm.config import ConfigError

    for var in ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(var, raising=False)
    assert distributed.initialize() == "single process"
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert distributed.initialize() == "single process"
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    try:
        distributed.initialize()
        raise AssertionError("expected an error")
    except ConfigError as e:
        assert str(e) == "JAX_COORDINATOR_ADDRESS is set: also set JAX_NUM_PROCESSES and JAX_PROCESS_ID (integers)"


@pytest.mark.slow  # the data end of one process is in the fast suite (test_pipeline)
def test_streaming_processes_end_together_when_the_data_runs_out(tmp_path):
    """Streaming processes pack their own rows, so one runs out first: both must stop at the same step."""
    lines = [json.dumps({"text": f"doc {i} " + "lorem ipsum dolor sit amet " * (1 + i % 7)}) for i in range(40)]
    lines[7] = "{broken"
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    outs = two_processes(tmp_path / "run", tmp_path, "data.source=jsonl", f"data.path={tmp_path}/c.jsonl",
                         "data.epochs=1", "steps=1000", "sample_tokens=0")
    assert "the data ran out: data.epochs=1 ended after step" in outs[0]
    # The skip was on one process or the other; the job's count is the total, logged once.
    assert outs[0].count(f"data: skipping documents: bad_json") == 1
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["data_skipped_bad_json"] == 1
