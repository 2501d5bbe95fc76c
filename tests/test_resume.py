"""Kill the trainer at any moment and it continues as if nothing happened: through the CLI, in
subprocesses, with real signals. Float32 on CPU, so "the same" means bit for bit."""

import json
import os
import random
import re
import shutil
import signal
import time

import numpy as np
import pytest
from conftest import run_cli, start_cli

from maxlm import checkpoint as ckpt

MODEL = ["model.n_layers=2", "model.d_model=64", "model.d_ff=128", "model.n_heads=4", "model.n_kv_heads=2",
         "model.head_dim=16", "seq_len=32", "global_batch_size=8"]
STEPS = 40
# The cosine's length is pinned (decay_steps), so a 20-step run and a 40-step run share one schedule.
ARGS = ["configs/tiny.yml", *MODEL, f"steps={STEPS}", f"optim.decay_steps={STEPS}", "optim.warmup_steps=5",
        "log_every=1", "sample_tokens=0", "checkpoint.every=2", "checkpoint.keep=2"]


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows(run_dir)}


def final_state(run_dir, step=STEPS):
    """The saved state of `step` as host arrays, read back without a model (Orbax's own tree)."""
    ck = ckpt.Checkpointer(str(run_dir / "checkpoints"), read_only=True)
    import orbax.checkpoint as ocp
    state = ck.mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore())).state
    ck.close()
    import jax
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].tobytes() == b[k].tobytes(), k


def train(run_dir, *extra, devices=8, ok=True):
    r = run_cli(*ARGS, f"run_dir={run_dir}", *extra, devices=devices)
    if ok:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """40 uninterrupted steps."""
    run_dir = tmp_path_factory.mktemp("reference")
    train(run_dir)
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    return run_dir


@pytest.fixture(scope="module")
def half(tmp_path_factory):
    """The first 20 steps only, stopped there by `steps=20`."""
    run_dir = tmp_path_factory.mktemp("half")
    train(run_dir, "steps=20")
    return run_dir


def test_stop_and_resume_is_bitwise(reference, half, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(half, run_dir)
    r = train(run_dir)
    assert f"resuming from step 20 ({run_dir}/checkpoints/20)" in r.stdout
    changed = re.search(r"config changed since the checkpoint: (.*)", r.stdout).group(1)
    assert changed.split("; ") == [f"run_dir {str(half)!r} -> {str(run_dir)!r}", "steps 20 -> 40"], changed
    assert [row["step"] for row in rows(run_dir)] == list(range(1, STEPS + 1))
    assert losses(run_dir) == losses(reference)  # every step, exactly: same data order, same numbers
    assert_same_state(final_state(run_dir), final_state(reference))  # params, moments, step, rng
    saves = [row for row in rows(run_dir) if "checkpoint_block_s" in row]
    assert [row["step"] for row in saves] == list(range(2, STEPS + 1, 2))  # every save, the final ones too
    assert all(0 < row["checkpoint_block_s"] < 5 for row in saves)


def wait_for_step(run_dir, step, proc, timeout=120):
    t = time.time()
    while time.time() - t < timeout:
        if proc.poll() is not None:
            return False
        path = run_dir / "metrics.jsonl"
        if path.exists():
            done = [line for line in path.read_text().splitlines() if line.endswith("}")]
            if done and json.loads(done[-1])["step"] >= step:
                return True
        time.sleep(0.02)
    raise TimeoutError(f"no step {step} after {timeout}s")


def committed_steps(run_dir) -> list[int]:
    if not (run_dir / "checkpoints").exists():
        return []
    ck = ckpt.Checkpointer(str(run_dir / "checkpoints"), read_only=True)
    steps = ck.steps()
    ck.close()
    return steps


def trial_seed() -> int:
    """A fresh seed per run, or MAXLM_KILL_SEED to replay one; printed, so a failure can be replayed."""
    seed = int(os.environ.get("MAXLM_KILL_SEED") or time.time())
    print(f"kill -9 trials: seed {seed} (replay with MAXLM_KILL_SEED={seed})")
    return seed


def kill_trials(reference, tmp_path, n_trials, seed):
    """`kill -9` at random moments, each trial resuming the last one's run, then finish; every trial
    must resume from the newest committed step and the finished run must match the uninterrupted one
    bitwise. Most kills land a few steps into the loop (where saves run every 2 steps); one in five lands
    at a random time during start-up or restore, before the loop."""
    rng = random.Random(seed)
    run_dir = tmp_path / "run"
    log_path = tmp_path / "log.txt"
    resumed, during_save, seen = [], 0, set()
    for _ in range(n_trials):
        committed = committed_steps(run_dir)
        with open(log_path, "w") as log:
            proc = start_cli(*ARGS, f"run_dir={run_dir}", log=log)
            during_startup = rng.random() < 0.2
            deadline = time.time() + rng.uniform(0.5, 5.0)
            while "MFU: " not in log_path.read_text() and proc.poll() is None:  # the loop is about to start
                if during_startup and time.time() > deadline:
                    break
                time.sleep(0.02)
            if not during_startup:
                # Stay clear of the last steps, so that every trial kills a run that is still going.
                start = committed[-1] if committed else 0
                wait_for_step(run_dir, min(start + rng.randint(1, 6), STEPS - 6), proc)
                time.sleep(rng.uniform(0, 0.5))
            proc.send_signal(signal.SIGKILL)
            assert proc.wait() == -signal.SIGKILL, log_path.read_text()[-2000:]  # it was still running
        m = re.search(r"resuming from step (\d+)", log_path.read_text())
        if m:  # the newest committed step, never an older one and never a silent step 0
            assert int(m.group(1)) == committed[-1], (m.group(0), committed)
            resumed.append(int(m.group(1)))
        partial = {p.name for p in (run_dir / "checkpoints").glob(f"*{ckpt.TMP_SUFFIX}")}
        during_save += bool(partial - seen)  # a partial save this kill left, not one an earlier kill left
        seen |= partial
    r = train(run_dir)
    assert losses(run_dir) == losses(reference), f"seed {seed}"
    assert_same_state(final_state(run_dir), final_state(reference))
    print(f"{n_trials} kills; resumed from steps {resumed} (+ the final run); {during_save} kills left a partial save")


# ~11 s a trial (two process starts). Twelve puts two or three kills in start-up or restore and, most runs,
# one or more in the middle of a save; every seed differs, so CI's runs add up to a soak over time.
@pytest.mark.slow  # test_stop_and_resume_is_bitwise and the SIGTERM test stay in the fast suite
def test_kill_9_at_random_moments(reference, tmp_path):
    kill_trials(reference, tmp_path, n_trials=12, seed=trial_seed())


@pytest.mark.slow  # 21 s; the fast suite's two-process test stops a job by SIGTERM (exit 143, saved, resumed)
def test_sigterm_and_sigint_save_and_exit(reference, tmp_path):
    run_dir = tmp_path / "run"
    for sig, code, at in ((signal.SIGTERM, 143, 9), (signal.SIGINT, 0, 25)):
        with open(tmp_path / "log.txt", "w") as log:
            proc = start_cli(*ARGS, f"run_dir={run_dir}", log=log)
            assert wait_for_step(run_dir, at, proc)
            t = time.time()
            proc.send_signal(sig)
            assert proc.wait(timeout=60) == code
        assert time.time() - t < 30
        out = (tmp_path / "log.txt").read_text()
        stopped = int(re.search(rf"{sig.name}: stopped after step (\d+) and saved it; exiting with code {code}", out).group(1))
        assert stopped >= at and (run_dir / "checkpoints" / str(stopped) / "commit_success.txt").exists()
        assert rows(run_dir)[-1]["step"] == stopped  # metrics flushed up to the saved step
    r = train(run_dir)
    assert f"resuming from step {stopped}" in r.stdout
    assert losses(run_dir) == losses(reference)


@pytest.mark.parametrize("devices, mesh", [
    pytest.param(8, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], marks=pytest.mark.slow),
    (4, ["mesh.data=2", "mesh.fsdp=2"]),
])
def test_resume_onto_another_mesh(reference, half, tmp_path, devices, mesh):
    run_dir = tmp_path / "run"
    shutil.copytree(half, run_dir)
    r = train(run_dir, *mesh, devices=devices)
    assert "resuming from step 20" in r.stdout
    assert (f"mesh changed: the checkpoint was saved on data=1 x fsdp=8 x tensor=1 x expert=1 x context=1 (8 devices, 1 process(es)); "
            f"restored resharded onto ") in r.stdout
    got, want = losses(run_dir), losses(reference)
    assert [got[s] for s in range(1, 21)] == [want[s] for s in range(1, 21)]
    # A different mesh sums in a different order: float32 rounding, amplified a little by Adam.
    np.testing.assert_allclose([got[s] for s in range(21, STEPS + 1)], [want[s] for s in range(21, STEPS + 1)], rtol=2e-4)


def one_line_error(r, code=2) -> str:
    assert r.returncode == code, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("maxlm: error: ")]
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]


@pytest.mark.malformed
def test_unusable_checkpoints_are_refused(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    ck40 = run_dir / "checkpoints" / "40"
    r = train(run_dir, "model.d_ff=256", ok=False)
    assert "compiled" not in r.stdout  # refused from the checkpoint's metadata, before any compile
    msg = one_line_error(r)
    assert msg == (f"maxlm: error: checkpoint step 40 at {ck40}: it does not match the model: `params.layers.w_down` "
                   f"has shape (2, 128, 64) in the checkpoint but (2, 256, 64) in this config. Fix or move it away, "
                   f"or start over with resume=never or a new run_dir")
    msg = one_line_error(train(run_dir, "steps=10", ok=False))
    assert "holds step 40, beyond steps=10" in msg
    for f in (ck40 / "state" / "d").iterdir():
        f.write_bytes(f.read_bytes()[:10])  # truncated files, as a full disk would leave them
    msg = one_line_error(train(run_dir, ok=False))
    assert msg.startswith(f"maxlm: error: checkpoint step 40 at {ck40}: ") and "cannot be read" in msg


def test_partials_are_ignored_and_resume_never_starts_over(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    (run_dir / "checkpoints" / f"42{ckpt.TMP_SUFFIX}" / "state").mkdir(parents=True)
    r = train(run_dir, "resume=never", "steps=2", f"optim.decay_steps={STEPS}")
    assert f"ignoring and removing 1 partial checkpoint(s) left by an interrupted save: 42{ckpt.TMP_SUFFIX}" in r.stdout
    assert "resume=never: moved 2 existing checkpoint(s) (steps 38..40) to " in r.stdout
    assert "moved the previous run's metrics-replaced-" in r.stdout
    moved = [p for p in run_dir.iterdir() if p.name.startswith("checkpoints-replaced-")]
    assert len(moved) == 1 and sorted(p.name for p in moved[0].iterdir()) == ["38", "40"]
    assert sorted(losses(run_dir)) == [1, 2] and losses(run_dir)[1] == losses(reference)[1]


@pytest.mark.slow  # ~15 s; the suite budget; the NaN policy itself is in test_train
def test_nan_stop_keeps_last_good_checkpoint(tmp_path):
    # lr=1e30: step 1 is finite and throws the weights to ~1e30; step 2's loss is not finite.
    blowup = ["optim.lr=1e30", "optim.warmup_steps=0", "checkpoint.every=1", "checkpoint.keep=5", "steps=10"]
    msg = one_line_error(train(tmp_path / "stop", *blowup, ok=False), code=3)
    assert msg.startswith("maxlm: error: non-finite loss or gradient at step 2 (loss ")
    assert msg.endswith(f"(nan_policy=stop); stopped; the last good checkpoint is step 1 ({tmp_path}/stop/checkpoints/1)")
    assert sorted(int(p.name) for p in (tmp_path / "stop" / "checkpoints").iterdir()) == [1]
    assert not np.isfinite(rows(tmp_path / "stop")[-1]["loss"]) or not np.isfinite(rows(tmp_path / "stop")[-1]["grad_norm"])

    r = train(tmp_path / "skip", *blowup, "nan_policy=skip", "max_consecutive_skips=3", ok=False)
    msg = one_line_error(r, code=3)
    assert "non-finite loss or gradient at step 4" in msg and "3 steps skipped in a row (max_consecutive_skips=3)" in msg
    skip_rows = rows(tmp_path / "skip")
    assert [(row["step"], row["skipped"], row["skips_total"]) for row in skip_rows] == [
        (1, 0, 0), (2, 1, 1), (3, 1, 2), (4, 1, 3)]
    # The skipped steps saved at 2 and 3 hold exactly step 1's parameters and optimizer state.
    s1, s3 = final_state(tmp_path / "skip", 1), final_state(tmp_path / "skip", 3)
    assert_same_state({k: v for k, v in s1.items() if k != "['step']"}, {k: v for k, v in s3.items() if k != "['step']"})


def test_init_from_and_own_checkpoints_win(reference, tmp_path):
    run_dir = tmp_path / "run"
    r = train(run_dir, f"init_from={reference}/checkpoints", "steps=2")
    assert f"initialised parameters from step 40 of {reference}/checkpoints (init_from); optimizer state fresh" in r.stdout
    first = losses(run_dir)[1]
    assert first < losses(reference)[1] - 1.0  # a trained model, not a fresh one (ln 256 = 5.55)
    r = train(run_dir, f"init_from={reference}/checkpoints", "steps=4")
    assert "this run's own checkpoints take precedence" in r.stdout and "resuming from step 2" in r.stdout
    assert losses(run_dir)[1] == first
