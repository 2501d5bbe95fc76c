from pathlib import Path

import pytest

from maxlm import metrics
from maxlm.config import load
from maxlm.models import llama, params as P_


def test_llama3_8b_flops_by_hand():
    cfg = load("configs/models/llama3-8b.yml")
    m = cfg.model
    # D=4096, L=32, H=32, K=8, Dh=128, F=14336, V=128256, S=8192, computed by hand:
    attn_proj = 4096 * 4096 + 4096 * 1024 + 4096 * 1024 + 4096 * 4096  # q, k, v, o = 41,943,040
    mlp = 3 * 4096 * 14336  # gate, up, down = 176,160,768
    n_matmul = 32 * (attn_proj + mlp) + 4096 * 128256  # layers + unembedding
    assert n_matmul == 7_504_658_432
    assert metrics.matmul_params(m) == n_matmul
    attn_noncausal = 12 * 32 * 32 * 128 * 8192  # 12 * layers * heads * head_dim * seq
    assert attn_noncausal == 12_884_901_888
    assert metrics.flops_per_token(m, 8192, causal=False) == 6 * n_matmul + attn_noncausal == 57_912_852_480
    assert metrics.flops_per_token(m, 8192, causal=True) == 6 * n_matmul + attn_noncausal // 2 == 51_470_401_536
    # And the full parameter count is the published 8.03B: + input embedding + 65 norm vectors.
    assert P_.count(llama.param_specs(m)) == n_matmul + 128256 * 4096 + 65 * 4096 == 8_030_261_248


@pytest.mark.parametrize("kind, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA B200", 2250e12), ("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5", 459e12),
    ("TPU v5p", 459e12), ("TPU v6 lite", 918e12), ("cpu", None), ("NVIDIA GeForce RTX 4090", None),
])
def test_peak_table(kind, peak):
    assert metrics.peak_flops(kind) == peak


def test_logger_writes_jsonl_tensorboard_and_plot(tmp_path):
    import json
    log = metrics.Logger(tmp_path, total_steps=3, start_step=0)
    for s in (1, 2, 3):
        log.step(s, {"loss": 5.0 - s, "grad_norm": 1.0, "lr": 1e-3, "step_time_s": 0.1, "tokens_per_sec": 10.0,
                     "tflops_per_device": 0.5, "mfu": None}, log=s != 2)
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 3] and rows[0]["mfu"] is None
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert Path(log.plot()).stat().st_size > 1000


def test_trim_history_drops_rows_that_run_again_and_moves_a_fresh_start_aside(tmp_path):
    import json
    path = tmp_path / "metrics.jsonl"
    assert metrics.trim_history(tmp_path, 0) is None  # nothing there yet
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "lo')
    note = metrics.trim_history(tmp_path, 2)  # a kill left a half-written line: it goes too
    assert note == "metrics.jsonl: dropped 3 row(s) after step 2 (those steps run again)"
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert metrics.trim_history(tmp_path, 2) is None
    (tmp_path / "tb").mkdir()
    assert metrics.trim_history(tmp_path, 0).startswith("starting at step 0: moved the previous run's metrics-replaced-")
    assert not path.exists() and not (tmp_path / "tb").exists()
    assert len(list(tmp_path.glob("metrics-replaced-*.jsonl"))) == 1 and len(list(tmp_path.glob("tb-replaced-*"))) == 1


def test_sliding_window_counts_only_the_keys_in_the_window():
    m = load(None, ["model.n_layers=4", "model.n_heads=2", "model.n_kv_heads=2", "model.head_dim=8",
                    "model.sliding_window=4"]).model
    L, per_key = 16, 12 * 2 * 8
    # Query i attends min(i + 1, 4) keys; in the causal convention (seq_len / 2 keys, not (seq_len + 1) / 2,
    # when nothing is windowed) that is w - w^2 / (2 seq_len) = 3.5 keys per query, on all 4 layers.
    assert metrics.flops_per_token(m, L) == 6 * metrics.matmul_params(m) + per_key * 4 * 3.5
    assert metrics.flops_per_token(m, L, causal=False) == 6 * metrics.matmul_params(m) + per_key * 4 * 4
    # Gemma 2 windows layers 0 and 2 only; the global ones count seq_len / 2.
    g = load(None, ["model.family=gemma2", "model.n_layers=4", "model.n_heads=2", "model.head_dim=8",
                    "model.sliding_window=4", "model.n_kv_heads=2"]).model
    assert metrics.flops_per_token(g, L) == 6 * metrics.matmul_params(g) + per_key * (2 * 3.5 + 2 * 8)


def test_the_tensorboard_writer_does_not_import_torch(tmp_path):
    """tensorboardX imports torch whenever it is installed: ~2.5 s of every run's start, for nothing."""
    import subprocess
    import sys
    code = ("import sys; from maxlm import metrics; w = metrics._summary_writer()(sys.argv[1]); "
            "w.add_scalar('loss', 1.0, 1); w.close(); print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False"
    assert list(tmp_path.glob("events.out.tfevents.*"))
