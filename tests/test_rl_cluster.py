"""objective=grpo as a cluster runs it. A job of two processes x 4 CPU devices (jax.distributed, gloo on
127.0.0.1) samples, scores and updates through `train.py` exactly as one process x 8 devices does on the same
mesh; both processes save their place in the prompts, and the job resumes from it bit for bit. A run whose
run_dir is a bucket of a real GCS server (fake-gcs-server) checkpoints there and resumes from there with the
losses of an uninterrupted run."""

import json
import shutil

import numpy as np
import pytest
from conftest import start_cli
from test_distributed import two_processes
from test_rl import ARGS, prompts_file

from maxlm import metrics, storage, train
from maxlm.config import load

# Two updates per rollout, a checkpoint at each rollout's end: 4 steps are 2 rollouts.
RUN = ["configs/tiny.yml", *ARGS, "rl.updates_per_batch=2", "steps=4", "log_every=1", "checkpoint.every=2"]


@pytest.mark.slow  # ~20 s on 2 quiet cores (44 s at load 5): two 2-process jobs, the reference alongside the first
def test_two_processes_sample_and_train_what_one_process_does_and_resume(tmp_path):
    """Each process samples every completion (the decoder's output is replicated) but builds only its own
    devices' rows of the batch, from its own copy: had the processes sampled or scored differently, the
    job's losses and gradient norms would leave the single process's, and process 0's logged sampler-to-
    trainer gap, which compares its own sampled log-probabilities with the trainer's over every row of the
    global batch, would not be ~0."""
    run_args = [*RUN, f"data.path={prompts_file(tmp_path / 'p.jsonl')}"]
    ref = tmp_path / "ref"
    with open(tmp_path / "ref.txt", "w") as log:  # alongside the job: most of each is start-up
        single = start_cli(*run_args, f"run_dir={ref}", devices=8, log=log)
    run_dir = tmp_path / "run"
    try:
        outs = two_processes(run_dir, tmp_path, args=run_args, devices=4)
    finally:
        assert single.wait(timeout=300) == 0, (tmp_path / "ref.txt").read_text()[-3000:]
    assert "maxlm: processes: process 0 of 2 (JAX_COORDINATOR_ADDRESS); 4 local of 8 devices" in outs[0]
    assert "over 8 x cpu (2 process(es))" in outs[0]
    assert "over 8 x cpu (1 process(es))" in (tmp_path / "ref.txt").read_text()
    # One log and one metrics file for the job: process 1 reports no steps and writes nothing.
    assert "trained steps 1-4" in outs[0] and not [line for line in outs[1].splitlines() if "maxlm: " in line]

    rows = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    job, one = rows(run_dir), rows(ref)
    assert [r["step"] for r in job] == [r["step"] for r in one] == [1, 2, 3, 4]
    # Host-side numbers of the sampled completions: the same completions, the same scores.
    for key in ("reward", "reward_std", "completion_len", "truncated", "groups_all_equal"):
        assert [r[key] for r in job] == [r[key] for r in one], key
    # The same global batches on the same 8-device mesh; only the collectives' transport (gloo) differs, which
    # moves a number by about a float32 ulp (measured: 3e-8 absolute on the losses, 1.1e-6 relative on the norms).
    # A loss on a rollout's first update is 0 by construction, so the losses also get an absolute tolerance.
    np.testing.assert_allclose([r["loss"] for r in job], [r["loss"] for r in one], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose([r["grad_norm"] for r in job], [r["grad_norm"] for r in one], rtol=1e-5)
    assert all(r["grad_norm"] > 0 for r in job) and job[1]["loss"] != 0  # the comparisons compare something
    assert max(r["logp_gap_max"] for r in job) <= 1e-5
    # Each process saved its own place in the prompts (a process that skipped the save would hang it).
    for step in (2, 4):
        data = run_dir / "checkpoints" / str(step) / "data"
        states = [json.loads((data / f"process_{i}-of-2.json").read_text()) for i in range(2)]
        assert states[0] == states[1] == {"prompts": step, "rollouts": step // 2, "uses": 2}

    # The job stopped after step 2's save: each process restores its own place and the next rollout's key.
    # The copy keeps only rows 1-2, so that rows 3-4 can only be the resumed job's.
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "4")
    (resumed / "metrics.jsonl").write_text("".join((run_dir / "metrics.jsonl").read_text().splitlines(True)[:2]))
    outs = two_processes(resumed, tmp_path, args=run_args, devices=4)
    assert f"resuming from step 2 ({resumed}/checkpoints/2)" in outs[0]
    keys = ("step", "loss", "grad_norm", "reward", "completion_len", "logp_gap_max")
    assert [[r[k] for k in keys] for r in rows(resumed)] == [[r[k] for k in keys] for r in job]


def test_a_grpo_run_on_gcs_resumes_from_the_bucket_bitwise(tmp_path, gcs, capsys):
    """run_dir=gs://...: the uninterrupted run writes its checkpoints and metrics chunks to the bucket; a copy
    of it as a run stopped after step 2's save would have left it resumes from step 2, read back from the bucket
    (the parameters, the optimizer state and the rollouts' place in the prompts and their sampling keys), and
    takes the same steps, bit for bit."""
    run_args = [*RUN, f"data.path={prompts_file(tmp_path / 'p.jsonl')}"]
    a, b = f"{gcs}/a", f"{gcs}/b"
    assert train.run(load(run_args[0], run_args[1:] + [f"run_dir={a}"])) == 0
    bucket = storage.client().bucket(gcs[len("gs://"):])
    # Neither step 4's checkpoint nor the metrics chunk of steps 3-4: b's rows 3-4 can only be its own.
    later = ("a/checkpoints/4/", "a/metrics/000000003-")
    blobs = list(bucket.list_blobs(prefix="a/"))
    assert all(any(blob.name.startswith(p) for blob in blobs) for p in later)  # the uninterrupted run wrote them
    for blob in blobs:
        if not blob.name.startswith(later):
            bucket.copy_blob(blob, bucket, "b/" + blob.name[len("a/"):])
    capsys.readouterr()
    assert train.run(load(run_args[0], run_args[1:] + [f"run_dir={b}"])) == 0
    out = capsys.readouterr()
    assert f"resuming from step 2 ({b}/checkpoints/2)" in out.out + out.err
    rows_a, rows_b = metrics.read_rows(a), metrics.read_rows(b)
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b] == [1, 2, 3, 4]
    keys = ("loss", "grad_norm", "reward", "reward_std", "completion_len", "logp_gap_max")
    assert [[r[k] for k in keys] for r in rows_a[2:]] == [[r[k] for k in keys] for r in rows_b[2:]]
    assert rows_b[3]["loss"] != 0 and rows_b[2]["grad_norm"] != rows_a[0]["grad_norm"]  # a new rollout, trained on
    assert storage.listdir(f"{b}/checkpoints") == ["2", "4"]
    state = json.loads(storage.read_text(f"{b}/checkpoints/4/data/process_0-of-1.json"))
    assert state == {"prompts": 4, "rollouts": 2, "uses": 2}
