"""Storage against a real GCS server (fake-gcs-server): whole writes, the run lease, metrics chunks, partial
saves on gs://, FUSE refusal, credential/bucket errors as one line, and a gs:// run that saves, resumes
bitwise and holds every metrics row once."""

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT, gcs_env, run_cli

from maxlm import metrics, runlock, storage
from maxlm.config import ConfigError

TINY = ["model.n_layers=1", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=16",
        "model.d_ff=128", "seq_len=32", "global_batch_size=8", "sample_tokens=0", "log_every=1"]


@pytest.fixture(params=["local", "gcs"])
def where(request, tmp_path):
    return str(tmp_path / "d") if request.param == "local" else request.getfixturevalue("gcs") + "/d"


def test_whole_writes_list_and_remove(where):
    a = storage.join(where, "a.txt")
    storage.write(a, "one")
    storage.write(a, "two\n")  # replaced whole
    storage.write(storage.join(where, "sub", "b.bin"), b"\x00\x01")
    assert storage.read_text(a) == "two\n" and storage.read_text(storage.join(where, "none")) is None
    assert storage.listdir(where) == ["a.txt", "sub"]  # no temporary file left behind
    storage.remove(a)
    storage.remove(a)  # removing what is gone is not an error
    assert storage.listdir(where) == ["sub"]


def test_ranged_reads(where):
    """What prepared data is read with: byte ranges, several at once (in flight together on gs://), a range
    that runs past the end cut there, one that starts past it empty; and sizes."""
    data = bytes(range(256)) * 40
    f = storage.join(where, "f.bin")
    storage.write(f, data)
    ranges = [(0, 10), (5000, 5100), (10200, 20000), (10240, 10300), (7, 7), (3, 4096)]
    assert storage.read_ranges([(f, a, b) for a, b in ranges]) == [data[a:b] for a, b in ranges]
    assert storage.read_range(f, 3, 9) == data[3:9]
    assert storage.size(f) == len(data) and storage.size(storage.join(where, "none")) is None


@pytest.mark.malformed
def test_a_run_dir_on_gcs_fuse_is_refused_naming_the_gs_path(tmp_path, monkeypatch):
    mounts = tmp_path / "mounts"
    point = tmp_path / "gcs" / "bkt"
    mounts.write_text(f"proc /proc proc rw 0 0\nbkt {point} fuse.gcsfuse rw,nosuid,nodev 0 0\n")
    monkeypatch.setattr(storage, "MOUNTS", str(mounts))
    with pytest.raises(ConfigError, match=rf"`run_dir` {point}/runs/a is on a GCS FUSE mount of bucket bkt \({point}\), "
                                          r"which cannot rename directories or lock files, so checkpoints would never "
                                          r"commit; pass run_dir=gs://bkt/runs/a instead"):
        storage.prepare_dir("run_dir", str(point / "runs" / "a"))
    storage.prepare_dir("run_dir", str(tmp_path / "elsewhere"))  # a path off the mount is fine


@pytest.mark.malformed
def test_bucket_permission_and_credential_problems_are_one_line(gcs, gcs_server, tmp_path, monkeypatch):
    storage.check_writable("run_dir", gcs + "/run")
    with pytest.raises(ConfigError, match=r"gs://no-such-bucket-x/run: bucket `no-such-bucket-x` does not exist"):
        storage.check_writable("run_dir", "gs://no-such-bucket-x/run")
    with pytest.raises(storage.StorageError, match="bucket `no-such-bucket-x` does not exist"):
        storage.write("gs://no-such-bucket-x/a", "x")  # during a run: an I/O failure, exit 4
    # No emulator and no credential anywhere: the train.py line names the fix, before anything compiles.
    env = {k: v for k, v in gcs_env(gcs_server).items()}
    r = run_cli("configs/tiny.yml", *TINY, "run_dir=gs://some-bucket/run", devices=1,
                env={**{k: "" for k in env}, "HOME": str(tmp_path), "GOOGLE_APPLICATION_CREDENTIALS": "",
                     "NO_GCE_CHECK": "True"})
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (
        "maxlm: error: no Google Cloud credentials for gs:// paths: run `gcloud auth application-default login` or set "
        "GOOGLE_APPLICATION_CREDENTIALS; on GKE give the pod's Kubernetes service account access to the bucket "
        "(Workload Identity)")
    assert "Traceback" not in r.stderr


def test_lease_one_job_per_gs_run_dir(gcs, monkeypatch):
    monkeypatch.setattr(runlock, "TTL_S", 4.0)
    monkeypatch.setattr(runlock, "RENEW_S", 0.5)
    monkeypatch.setattr(runlock, "GRACE_S", 0.5)
    monkeypatch.delenv("MAXLM_JOB", raising=False)
    lines = []
    run = gcs + "/run"
    with runlock.hold(run, lines.append):
        t = time.monotonic()
        with pytest.raises(ConfigError, match=rf"`run_dir` {run} is in use by another job \(pid \d+ on host .*; it "
                                              r"renewed its lease \d+s ago\)"):
            with runlock.hold(run, lines.append):
                pass
        assert time.monotonic() - t < 3  # refused on seeing a renewal, not after the lease's whole life
    assert storage.listdir(run) == []  # released
    # A holder that stopped renewing (killed) is taken over once its lease expires ...
    assert 3 < took_over_after(run, lines) < 8
    assert "from a job that stopped renewing it" in lines[-1]
    # ... and after one renewal interval (and a grace, stale_s) by the next attempt of the same job (the
    # launcher names jobs in MAXLM_JOB): never at once, as a live copy of the job might hold it
    # (tests/test_runlock.py: two processes).
    monkeypatch.setenv("MAXLM_JOB", "j1")
    assert runlock.stale_s() - 0.6 < took_over_after(run, lines) < runlock.stale_s() + 1.5
    assert "from this job's previous attempt, which stopped renewing it" in lines[-1] and "(job j1: pid" in lines[-1]


def took_over_after(run: str, lines: list) -> float:
    """Seconds until a job holds `run` after a holder stopped renewing its lease (as a killed job does)."""
    dead = runlock.Lease(run, lines.append)
    dead.acquire()
    dead._stop.set()
    dead._thread.join()
    t = time.monotonic()
    with runlock.hold(run, lines.append):
        return time.monotonic() - t


@pytest.mark.malformed
def test_a_holder_that_loses_its_lease_stops_at_once(gcs, gcs_server):
    code = ("import sys, time; sys.path.insert(0, %r)\nfrom maxlm import runlock, storage\n"
            "runlock.RENEW_S = 0.3\nl = runlock.Lease(%r, print); l.acquire(); print('held', flush=True)\n"
            "time.sleep(30)\n" % (str(ROOT), gcs + "/run"))
    p = subprocess.Popen([sys.executable, "-c", code], env={**gcs_env(gcs_server), "PATH": "/usr/bin:/bin"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    storage.write(gcs + "/run/.lease", "{}")  # another job's write: the holder's next renewal fails
    assert p.wait(timeout=20) == 2
    assert p.stderr.read().strip().splitlines()[-1].startswith(
        f"maxlm: error: lost the lease of {gcs}/run/.lease to an unknown writer")


def row(step):
    return {"loss": 10.0 - step, "grad_norm": 1.0, "lr": 1e-3, "step_time_s": 0.1, "tokens_per_sec": 1.0,
            "tflops_per_device": 0.1, "mfu": None}


def test_metrics_chunks_on_gcs_never_append_and_trim_on_resume(gcs, monkeypatch):
    run = gcs + "/run"
    monkeypatch.setattr(metrics, "FLUSH_S", 3600.0)  # only the forced flushes: a save, the end
    log = metrics.Logger(run, 10, 0)
    for s in range(1, 11):
        log.step(s, row(s), log=True, flush=s in (3, 6))
    log.close()
    assert not os.path.exists(log.tb_dir)  # the events' local staging is removed once uploaded
    assert storage.listdir(run + "/metrics") == ["000000001-000000003.jsonl", "000000004-000000006.jsonl",
                                                 "000000007-000000010.jsonl"]
    assert [r["step"] for r in metrics.read_rows(run)] == list(range(1, 11))
    # resumed from step 5: rows 6-10 run again; the chunk across the cut is rewritten, later ones deleted
    assert metrics.trim_history(run, 5) == "metrics: dropped 5 row(s) after step 5 (those steps run again)"
    assert storage.listdir(run + "/metrics") == ["000000001-000000003.jsonl", "000000004-000000005.jsonl"]
    log = metrics.Logger(run, 10, 5)
    assert log.history == [(s, 10.0 - s) for s in range(1, 6)]
    for s in range(6, 11):
        log.step(s, row(s), log=True)
    log.close()
    assert [r["step"] for r in metrics.read_rows(run)] == list(range(1, 11))
    assert log.attempt() == [(s, 10.0 - s) for s in range(6, 11)]
    assert metrics.trim_history(run, 0) == "metrics: dropped 10 row(s) after step 0 (those steps run again)"
    assert metrics.read_rows(run) == []


def test_a_gs_run_saves_resumes_bitwise_and_logs_every_step_once(gcs, gcs_server, tmp_path):
    env = gcs_env(gcs_server)
    args = ["configs/tiny.yml", *TINY, "checkpoint.every=2"]
    local = run_cli(*args, "steps=6", f"run_dir={tmp_path / 'local'}", devices=2)
    assert local.returncode == 0, local.stderr[-2000:]
    run = gcs + "/run"
    first = run_cli(*args, "steps=4", f"run_dir={run}", devices=2, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "maxlm: checkpoint step 4 committed" in first.stdout
    # A save of step 5 that was cut off: a step without commit_success.txt, as Orbax leaves it on gs://
    bucket = storage.client().bucket(gcs[len("gs://"):])
    for blob in bucket.list_blobs(prefix="run/checkpoints/4/"):
        if not blob.name.endswith("/commit_success.txt"):
            bucket.copy_blob(blob, bucket, blob.name.replace("/4/", "/5/", 1))
    second = run_cli(*args, "steps=6", f"run_dir={run}", devices=2, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "ignoring and removing 1 partial checkpoint(s) left by an interrupted save: 5" in second.stdout
    assert f"resuming from step 4 ({run}/checkpoints/4)" in second.stdout
    assert "trained steps 5-6 in" in second.stdout and "outputs in " + run + " (metrics/, tb/, loss.png)" in second.stdout
    losses = [r["loss"] for r in metrics.read_rows(run)]
    assert losses == [json.loads(x)["loss"] for x in (tmp_path / "local" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6
    assert {"config.yml", "summary.json", "loss.png", "checkpoints", "metrics", "tb"} <= set(storage.listdir(run))
    assert ".lease" not in storage.listdir(run)  # released at the end
    assert json.loads(storage.read_text(run + "/summary.json"))["steps"] == 6
    never = run_cli(*args, "steps=6", "resume=never", f"run_dir={run}", devices=2, env=env)
    assert never.returncode == 2
    assert never.stderr.strip().splitlines()[-1] == (
        f"maxlm: error: resume=never: {run}/checkpoints holds 3 checkpoint(s) (steps 2..6), and object storage "
        f"cannot move them aside; delete them (gcloud storage rm -r {run}/checkpoints) or choose a new run_dir")


@pytest.mark.malformed
def test_a_damaged_metrics_chunk_is_named_in_a_warning_and_its_good_rows_kept(gcs, capsys):
    run = gcs + "/run"
    line = lambda s: json.dumps({"step": s, **row(s)}) + "\n"  # noqa: E731 - a row as the Logger writes it
    good = "".join(line(s) for s in (1, 2, 3))
    storage.write(f"{run}/metrics/000000001-000000003.jsonl", good)
    storage.write(f"{run}/metrics/000000004-000000006.jsonl", line(4) + "{garbage\n" + line(6))
    storage.write(f"{run}/metrics/000000007-000000008.jsonl", b"\xff\xfe\x00 binary")
    assert [r["step"] for r in metrics.read_rows(run)] == [1, 2, 3, 4, 6]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"maxlm: warning: metrics chunk {run}/metrics/000000004-000000006.jsonl is damaged: 1 of its 3 line(s) are not "
        f"metrics rows (first: line 2); those steps' rows are missing from the run's history (the loss plot, resume's "
        f"rows), the rest are kept",
        f"maxlm: warning: metrics chunk {run}/metrics/000000007-000000008.jsonl is damaged: 1 of its 1 line(s) are not "
        f"metrics rows (first: line 1); those steps' rows are missing from the run's history (the loss plot, resume's "
        f"rows), the rest are kept"]
    metrics.read_rows(run)  # named once per process
    assert capsys.readouterr().err == ""
    assert metrics.trim_history(run, 5) == "metrics: dropped 1 row(s) after step 5 (those steps run again)"  # 6: 7-8 were lost
    assert storage.listdir(run + "/metrics") == ["000000001-000000003.jsonl", "000000004-000000004.jsonl"]


@pytest.mark.malformed
@pytest.mark.parametrize("name, why", [
    ("Bad_Bucket!!", "bucket name `Bad_Bucket!!` has '!', 'B' (upper case)"),
    ("ab", "bucket name `ab` is 2 characters long"),
    ("-abc", "bucket name `-abc` does not start and end with a letter or digit"),
    ("192.168.5.4", "bucket name `192.168.5.4` is an IP address"),
    ("google-data", "bucket name `google-data` starts with `goog` or contains `google`"),
])
def test_a_malformed_bucket_name_is_one_line_with_the_naming_rule(gcs, name, why):
    from maxlm.data import sources

    rule = "a GCS bucket name is 3-63 characters (up to 222 with dots, 63 between them) of lowercase letters, digits"
    for call, key in ((lambda u: storage.check_writable("run_dir", u), "run_dir"),
                      (lambda u: sources.resolve(u, "data.path"), "data.path")):
        with pytest.raises(ConfigError) as e:
            call(f"gs://{name}/r")
        msg = str(e.value)
        assert msg.startswith(f"`{key}` gs://{name}/r: {why}; {rule}") and msg.endswith(": fix the path"), msg
    for ok in ("my-bucket", "a_b.c-1", "t-0123456789ab"):
        assert storage.bucket_problem(ok) is None


@pytest.mark.malformed
def test_a_malformed_bucket_through_prepare_and_train_is_one_line(gcs_server, tmp_path):
    env = {**os.environ, **gcs_env(gcs_server), "JAX_PLATFORMS": "cpu"}
    (tmp_path / "a.jsonl").write_text('{"text": "hello"}\n')
    r = subprocess.run([sys.executable, "-m", "maxlm.data.prepare", str(tmp_path / "a.jsonl"), "--tokenizer", "byte",
                        "--out", "gs://Bad_Bucket!!/r"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and r.stderr.startswith(
        "maxlm: error: `--out` gs://Bad_Bucket!!/r: bucket name `Bad_Bucket!!` has '!', 'B' (upper case); "), r.stderr
    r = run_cli("configs/tiny.yml", *TINY, "run_dir=gs://Bad_Bucket!!/r", devices=1, env=gcs_env(gcs_server))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith(
        "maxlm: error: `run_dir` gs://Bad_Bucket!!/r: bucket name `Bad_Bucket!!` has '!', 'B' (upper case); "), r.stderr


@pytest.mark.malformed
@pytest.mark.parametrize("content, why", [
    (None, "GOOGLE_APPLICATION_CREDENTIALS={f}: cannot read it (No such file or directory); point it at a service-account key"),
    (b"\x00\x01 garbage", "GOOGLE_APPLICATION_CREDENTIALS={f} is not a credentials file (not JSON); point it at"),
    (b'{"hello": 1}', "GOOGLE_APPLICATION_CREDENTIALS={f} is not a credentials file (its `type` is None, not one of "
                      "service_account, authorized_user"),
    (b'{"type": "service_account"}', "GOOGLE_APPLICATION_CREDENTIALS={f} is not usable ("),
])
def test_a_credentials_file_that_is_missing_or_garbage_is_named(tmp_path, monkeypatch, content, why):
    f = tmp_path / "key.json"
    if content is not None:
        f.write_bytes(content)
    for k in ("STORAGE_EMULATOR_HOST", "GOOGLE_AUTH_TOKEN_FOR_TESTING"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(f))
    monkeypatch.setenv("NO_GCE_CHECK", "True")
    monkeypatch.setattr(storage, "_client", None)
    with pytest.raises(ConfigError) as e:
        storage.check_writable("run_dir", "gs://some-bucket/run")
    assert str(e.value).startswith(why.format(f=f)) and "\n" not in str(e.value), str(e.value)
