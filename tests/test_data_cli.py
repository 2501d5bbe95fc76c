"""The data path through the real CLI: a streaming JSONL source tokenized in worker processes, with bad
lines, resumes bit for bit, and its skips reach the log and metrics.jsonl."""

import json

import pytest

from conftest import run_cli

MODEL = ["model.n_layers=1", "model.d_model=64", "model.d_ff=128", "model.n_heads=4", "model.n_kv_heads=2",
         "model.head_dim=16", "seq_len=32", "global_batch_size=8"]


def corpus(path):
    # 20 lines of ~100 bytes: 24 steps of 256 tokens read every line about 3 times.
    lines = [json.dumps({"text": f"Document {i}: " + "the quick brown fox jumps over the lazy dog " * 2}) for i in range(20)]
    lines[2], lines[5] = "{broken", json.dumps({"body": "no text"})
    path.write_text("\n".join(lines) + "\n")


def losses(run_dir) -> dict:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow  # ~30 s; worker tokenization itself is in the fast suite (test_prepare)
def test_jsonl_with_workers_resumes_bitwise_and_reports_skips(tmp_path):
    corpus(tmp_path / "c.jsonl")
    args = ["configs/tiny.yml", *MODEL, "data.source=jsonl", f"data.path={tmp_path}/c.jsonl", "data.workers=2",
            "steps=24", "optim.decay_steps=24", "log_every=1", "sample_tokens=0", "checkpoint.every=12"]
    straight = run_cli(*args, f"run_dir={tmp_path / 'a'}")
    assert straight.returncode == 0, straight.stdout[-2000:] + straight.stderr[-2000:]
    first = run_cli(*args, f"run_dir={tmp_path / 'b'}", "steps=12")
    assert first.returncode == 0, first.stderr[-2000:]
    second = run_cli(*args, f"run_dir={tmp_path / 'b'}")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resuming from step 12" in second.stdout
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert [a[s]["loss"] for s in range(1, 25)] == [b[s]["loss"] for s in range(1, 25)]
    assert "streaming: tokenized as read" in straight.stdout
    # Each kind of skip is logged once, with its line, and counted (once per epoch) in metrics.jsonl.
    for reason, line in (("bad_json", 3), ("missing_field", 6)):
        assert straight.stdout.count(f"data: skipping documents: {reason} (first: {tmp_path}/c.jsonl:{line})") == 1
        counts = [a[s].get(f"data_skipped_{reason}", 0) for s in range(1, 25)]
        assert counts == sorted(counts) and counts[-1] >= 2 and counts == [b[s].get(f"data_skipped_{reason}", 0) for s in range(1, 25)]
