"""The loop's parts: the NaN policy, the metrics row, and the profiler window of a real run."""

import pytest

import train as cli
from maxlm import loop, train


def test_nan_policy_stop_raises_at_the_first_non_finite_step():
    p = loop.NanPolicy("stop", 3, 0, print)
    p.check(1, {"loss": 2.0, "grad_norm": 1.0, "skipped": 0.0})
    with pytest.raises(loop.NonFinite, match=r"non-finite loss or gradient at step 2 \(loss nan, grad_norm 1.0\) "
                                              r"\(nan_policy=stop\)"):
        p.check(2, {"loss": float("nan"), "grad_norm": 1.0, "skipped": 0.0})


def test_nan_policy_skip_counts_and_stops_after_a_run_of_skips():
    p = loop.NanPolicy("skip", 2, skips_total=5, log=print)  # 5 skips before a resume
    rows = [{"loss": 1.0, "grad_norm": 1.0, "skipped": s} for s in (1.0, 0.0, 1.0)]
    for i, m in enumerate(rows, 1):
        p.check(i, m)
    assert [m["skips_total"] for m in rows] == [6, 6, 7] and p.in_row == 1
    with pytest.raises(loop.NonFinite, match="2 steps skipped in a row"):
        p.check(4, {"loss": float("inf"), "grad_norm": 1.0, "skipped": 1.0})


def test_metrics_row():
    m = loop.metrics_row({"loss": 2.0}, 0.5, tokens=1000, flops_per_token=6e9, n_dev=4, peak=1e12, data_wait=0.1,
                          host_s=None, skips={"empty": 0, "bad_json": 3})
    assert m["tokens_per_sec"] == 2000 and m["tokens_per_sec_per_device"] == 500
    assert m["tflops_per_device"] == pytest.approx(3.0) and m["mfu"] == pytest.approx(3.0)
    assert m["data_skipped_bad_json"] == 3 and "data_skipped_empty" not in m
    assert loop.metrics_row({"loss": 2.0}, 0.5, tokens=1000, flops_per_token=6e9, n_dev=4, peak=None, data_wait=0,
                             host_s=0.1, skips={})["mfu"] is None


def test_profile_steps_write_a_trace_and_the_run_builds_its_recipe_once(tmp_path, capfd, monkeypatch):
    """The trace of steps 2-3; and one recipe for the whole run (maxlm.recipe): nothing downstream of it, the
    evaluator's compile included, builds another from the config."""
    from maxlm import recipe

    builds, real = [], recipe.build
    monkeypatch.setattr(recipe, "build", lambda *a, **k: builds.append(1) or real(*a, **k))
    rc = cli.main(["configs/tiny.yml", "model.n_layers=1", "seq_len=32", "sample_tokens=0", "steps=4",
                   "profile_steps=[2,3]", "eval.every=4", "eval.steps=1", f"run_dir={tmp_path}"])
    out = capfd.readouterr().out
    assert rc == 0 and f"profile of steps 2-3 written to {tmp_path}/profile" in out
    assert list((tmp_path / "profile").rglob("*.xplane.pb")) and list((tmp_path / "profile").rglob("*.trace.json.gz"))
    assert len(builds) == 1


@pytest.mark.malformed
def test_a_url_run_dir_other_than_gs_is_refused_not_made_a_local_directory(tmp_path, monkeypatch):
    from maxlm.config import ConfigError, load

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"`run_dir` s3://b/x: maxlm writes to local paths and gs:// \(Google Cloud "
                                          r"Storage\) only"):
        load(str(cli.__file__).replace("train.py", "configs/tiny.yml"), ["run_dir=s3://b/x"])
    assert list(tmp_path.iterdir()) == []


def test_host_time_leaves_out_a_dispatch_that_blocks(tmp_path, monkeypatch):
    """On a GPU the call that dispatches a step returns only once the previous step has finished (seen on an
    H100): that wait is the device's, so host_time_s must not count it. Here the call sleeps 0.3 s."""
    import json
    import time

    real = train.compile_all

    def blocking_dispatch(*args):
        step_fn, eval_fn = real(*args)
        return (lambda *a: (time.sleep(0.3), step_fn(*a))[1]), eval_fn

    monkeypatch.setattr(train, "compile_all", blocking_dispatch)
    assert cli.main(["configs/tiny.yml", "model.n_layers=1", "seq_len=32", "sample_tokens=0", "steps=4",
                     "log_every=1", f"run_dir={tmp_path}"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["step_time_s"] >= 0.3 for r in rows[1:3])  # the sleep is in the step time
    assert all(0 < r["host_time_s"] < 0.2 for r in rows[1:]), [r["host_time_s"] for r in rows]


def test_a_signal_while_the_data_stalls_stops_the_run_and_saves_the_last_step(tmp_path, monkeypatch, capfd):
    """The loader stops answering before step 3 (a stalled file system, a source that filters everything
    out) and SIGTERM comes: the run does not wait for a batch that never comes. It saves step 2 with the
    data position from before the wait, exits 143, and the resumed run's steps 3-4 are an uninterrupted
    run's, bit for bit."""
    import json
    import os
    import signal
    import threading

    from maxlm.data import pipeline

    args = ["configs/tiny.yml", "model.n_layers=1", "seq_len=32", "sample_tokens=0", "steps=4", "log_every=1"]
    assert cli.main(args + [f"run_dir={tmp_path / 'whole'}"]) == 0
    real, calls = pipeline.Loader.__next__, []

    def stalls(self):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
            threading.Event().wait(60)  # what a stalled read looks like to the loop
            raise AssertionError("the signal did not end the wait")
        return real(self)

    monkeypatch.setattr(pipeline.Loader, "__next__", stalls)
    run_dir = tmp_path / "cut"
    assert cli.main(args + [f"run_dir={run_dir}"]) == 143
    out = capfd.readouterr().out
    assert "SIGTERM while waiting for data for step 3: stopping after step 2" in out
    assert "SIGTERM: stopped after step 2 and saved it; exiting with code 143" in out
    monkeypatch.setattr(pipeline.Loader, "__next__", real)
    assert cli.main(args + [f"run_dir={run_dir}"]) == 0
    assert "resuming from step 2" in capfd.readouterr().out
    losses = lambda d: {r["step"]: r["loss"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())}  # noqa: E731
    assert losses(run_dir) == losses(tmp_path / "whole")


@pytest.mark.malformed
def test_a_sample_longer_than_the_positions_is_cut_aloud_and_the_run_ends_well(tmp_path, capfd):
    """With model.max_positions=2 the sample was asked for -2 tokens and crashed after the save (exit 1); a
    sample cut to fit the positions was cut without a word."""
    assert cli.main(["configs/tiny.yml", "model.family=gpt2", "model.n_layers=1", "model.max_positions=2", "seq_len=2",
                     "steps=1", "sample_tokens=5", "model.n_kv_heads=8", f"run_dir={tmp_path}"]) == 0
    out = capfd.readouterr().out
    assert "greedy sample: 0 of sample_tokens=5 tokens, as the prompt's" in out and "model.max_positions=2" in out
