"""One job per run_dir, with real processes: two live copies of one job (the same MAXLM_JOB, as one launcher
--name started twice) are refused, while a restarted attempt of a dead job takes over at once; a holder
whose GCS stops answering stops before its lease could be taken over; an endpoint that does not answer
is retried aloud, then one line. On fake-gcs-server (`gcs`) and on a local disk (flock), with the lease's
intervals shrunk in each process (module constants), so every test takes seconds."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import ROOT, gcs_env

from maxlm import runlock, storage
from maxlm.config import ConfigError

# The lease's times, shrunk alike in the test process and in every holder process.
FAST = {"RENEW_S": 0.5, "GRACE_S": 0.5, "TTL_S": 4.0, "MARGIN_S": 1.5, "RETRY_S": 0.2, "TIMEOUT_S": (0.5, 0.5)}

HOLDER = """
import sys, time
sys.path.insert(0, {root!r})
from maxlm import runlock, storage
from maxlm.errors import ConfigError
for k, v in {fast!r}.items():
    setattr(runlock, k, v)
storage.RETRY_FOR_S, storage.TIMEOUT_S = 2.0, (0.5, 0.5)
try:
    with runlock.hold({run!r}, lambda m: print("maxlm: " + m, flush=True)):
        print("held", runlock.previous_holder_may_write(), flush=True)
        time.sleep({seconds})
except ConfigError as e:
    sys.stderr.write(f"maxlm: error: {{e}}\\n")
    sys.exit(2)
"""


def holder(run: str, env: dict, job: str = "j1", seconds: float = 60) -> subprocess.Popen:
    """A process that holds `run` (as process 0 of job `job` does for its whole run), or exits 2 refused."""
    code = HOLDER.format(root=str(ROOT), fast=FAST, run=run, seconds=seconds)
    return subprocess.Popen([sys.executable, "-c", code], env={**env, "PATH": "/usr/bin:/bin", "MAXLM_JOB": job},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_held(p: subprocess.Popen) -> tuple[list[str], float]:
    """(the log lines up to `held`, the seconds its previous holder may still write), or fail with its stderr."""
    lines = []
    for line in p.stdout:
        if line.startswith("held"):
            return lines, float(line.split()[1])
        lines.append(line.strip())
    pytest.fail(f"the holder exited {p.wait()} without holding: {p.stderr.read()[-2000:]} {lines}")


@pytest.fixture
def fast(monkeypatch):
    for k, v in FAST.items():
        monkeypatch.setattr(runlock, k, v)


@pytest.fixture(params=["gcs", "local"])
def where(request, tmp_path):
    """(run_dir, env) of a holder process on fake-gcs-server or on a local disk."""
    if request.param == "local":
        (tmp_path / "run").mkdir()
        return str(tmp_path / "run"), dict(os.environ)
    return request.getfixturevalue("gcs") + "/run", {**os.environ, **gcs_env(request.getfixturevalue("gcs_server"))}


@pytest.mark.malformed
def test_a_second_live_copy_of_a_job_is_refused_and_the_first_keeps_it(where, fast):
    run, env = where
    first = holder(run, env)
    try:
        wait_held(first)
        t = time.monotonic()
        second = holder(run, env)  # the same MAXLM_JOB: as one launcher --name started twice
        assert second.wait(timeout=30) == 2
        took = time.monotonic() - t
        err = second.stderr.read().strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0], err
        if runlock.storage.is_gcs(run):
            assert err[0].startswith(f"maxlm: error: `run_dir` {run} is in use by another live copy of this job, j1 "
                                     f"(pid {first.pid} on host "), err
            assert "the same job was started twice; stop one copy" in err[0]
            assert took < 1 + runlock.stale_s() + 3  # one renewal interval (and the process's start)
            record = json.loads(storage.read_text(run + "/.lease"))
            assert record["pid"] == first.pid  # untouched: the first still holds it
        else:  # flock: the kernel knows the holder is alive
            assert err[0].startswith(f"maxlm: error: `run_dir` {run} is in use by another job (job j1: pid {first.pid} "), err
        assert first.poll() is None
    finally:
        first.kill()
        first.wait()


@pytest.mark.malformed
def test_a_restarted_attempt_of_a_dead_job_takes_over_promptly(where, fast):
    run, env = where
    first = holder(run, env)
    wait_held(first)
    first.send_signal(signal.SIGKILL)  # the attempt died: its lease (or lock file) is left behind
    first.wait()
    t = time.monotonic()
    second = holder(run, env)
    try:
        lines, busy = wait_held(second)
        took = time.monotonic() - t
        assert took < runlock.stale_s() + 3, (took, lines)
        if runlock.storage.is_gcs(run):
            assert lines[-1].startswith(f"maxlm: took over the lease of {run}/.lease from this job's previous attempt, "
                                        f"which stopped renewing it "), lines
            assert f"(job j1: pid {first.pid} on host " in lines[-1]
            # Its previous holder renewed less than TTL_S ago: its partial checkpoints are left alone for now.
            assert 0 < busy <= runlock.TTL_S
        else:
            assert lines[-1].startswith(f"maxlm: took over the lock of {run} from a job that is gone (job j1: pid "
                                        f"{first.pid} "), lines
            assert busy == 0
    finally:
        second.kill()
        second.wait()


def test_another_job_waits_for_the_ttl_and_a_restart_for_one_renewal(gcs, fast, monkeypatch):
    """In-process: a lease left by a dead holder of another job is taken over after TTL_S, one of this
    job's after stale_s (one renewal interval and a grace), never at once."""
    run, lines = gcs + "/run", []
    monkeypatch.setenv("MAXLM_JOB", "j1")
    dead = runlock.Lease(run, lines.append)
    dead.acquire()
    dead._stop.set()
    dead._thread.join()
    monkeypatch.setattr(runlock, "ATTEMPT", "next")  # the restarted attempt
    t = time.monotonic()
    with runlock.hold(run, lines.append):
        took = time.monotonic() - t
    assert runlock.stale_s() - 0.6 < took < runlock.stale_s() + 2, (took, lines)
    assert "waiting up to" in lines[-2] and "for a renewal, which would show it still running" in lines[-2]
    assert "from this job's previous attempt, which stopped renewing it" in lines[-1]


class Proxy:
    """A TCP relay to the GCS server that can stop answering (`hang`): connections stay open, nothing comes
    back, as when a network path or the storage service stops responding."""

    def __init__(self, upstream: str):
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream, self.hung = (host, int(port)), threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                a, _ = self.sock.accept()
            except OSError:
                return
            b = socket.create_connection(self.upstream)
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src, dst):
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                return
            if not self.hung.is_set():
                try:
                    dst.sendall(data)
                except OSError:
                    return

    def hang(self):
        self.hung.set()


@pytest.mark.malformed
def test_a_holder_whose_gcs_stops_answering_stops_before_its_lease_could_be_taken(gcs, gcs_server, fast):
    proxy = Proxy(gcs_server)
    env = {**os.environ, **gcs_env(proxy.url)}
    run = gcs + "/run"
    p = holder(run, env)
    try:
        wait_held(p)
        time.sleep(1.2)  # a few renewals
        proxy.hang()
        t = time.monotonic()
        assert p.wait(timeout=30) == 4
        took = time.monotonic() - t
        # Its last renewal was at most RENEW_S before the hang: it stopped before TTL_S had passed since.
        assert runlock.hold_s() - FAST["RENEW_S"] - 0.5 < took < FAST["TTL_S"] - FAST["RENEW_S"], took
        out, err = p.stdout.read(), p.stderr.read().strip().splitlines()
        assert err[-1].startswith(f"maxlm: error: cannot renew the lease of {run}/.lease: GCS has not answered for "), err
        assert "when another job may take this run_dir; stopping now, without saving" in err[-1]
        assert [e for e in err if e.startswith("maxlm: error:")] == [err[-1]] and "Traceback" not in "\n".join(err)
        assert f"maxlm: warning: renewing the lease of {run}/.lease failed (" in out  # said while it retried
        assert "retrying in 0s (this job stops in " in out
    finally:
        p.kill()
        p.wait()


@pytest.mark.malformed
def test_an_endpoint_that_does_not_answer_is_retried_aloud_then_one_line(monkeypatch, capsys):
    monkeypatch.setattr(storage, "_client", None)
    monkeypatch.setattr(storage, "RETRY_FOR_S", 3.0)
    monkeypatch.setattr(storage, "TIMEOUT_S", (0.5, 0.5))
    silent = socket.create_server(("127.0.0.1", 0))  # listens, never answers
    refused = socket.create_server(("127.0.0.1", 0))
    refused_port = refused.getsockname()[1]
    refused.close()
    try:
        for port, cause in ((refused_port, "ConnectionError: [Errno 111] Connection refused"),
                            (silent.getsockname()[1], "timed out")):
            for k, v in gcs_env(f"http://127.0.0.1:{port}").items():
                monkeypatch.setenv(k, v)
            monkeypatch.setattr(storage, "_client", None)
            t = time.monotonic()
            with pytest.raises(storage.StorageError) as e:
                storage.check_writable("run_dir", "gs://bkt/run")
            took = time.monotonic() - t
            assert took < 3.0 + 1.5, took
            msg = str(e.value)
            m = re.fullmatch(rf"gs://bkt/run: GCS at http://127.0.0.1:{port} did not answer a probe write \((\d+) "
                             r"attempt\(s\) over \ds; (.*)\); check the network and the endpoint, then re-run \(it "
                             r"resumes\)", msg)
            assert m and cause in m[2], msg
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == int(m[1]) - 1 >= 1, err  # one line per wait
            for n, line in enumerate(err, 2):
                assert re.fullmatch(rf"maxlm: warning: gs://bkt/run: GCS at http://127.0.0.1:{port} did not answer a "
                                    rf"probe write \(.*{re.escape(cause)}.*\); retrying in \ds \(attempt {n}, giving "
                                    r"up 3s after the first\)", line), line
    finally:
        silent.close()


def test_the_first_request_answered_late_is_not_an_error(gcs, monkeypatch, capsys):
    """A transient failure, then an answer: one warning line, no error."""
    monkeypatch.setattr(storage, "RETRY_FOR_S", 10.0)
    calls = []

    def flaky(timeout):
        import requests

        calls.append(timeout)
        if len(calls) == 1:
            raise requests.ConnectionError("('Connection aborted.', ConnectionResetError(104, 'Connection reset'))")
        return "ok"

    monkeypatch.setattr("time.sleep", lambda s: None)
    assert storage.attempts("a probe write", gcs + "/run", flaky) == "ok"
    assert calls == [storage.TIMEOUT_S] * 2
    assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(ConfigError, match="does not exist"):  # not retried: a mistake is one line at once
        storage.check_writable("run_dir", "gs://no-such-bucket-y/run")


WRAPPER = """
import sys
sys.path.insert(0, {root!r})
from maxlm import runlock
for k, v in {fast!r}.items():
    setattr(runlock, k, v)
import runpy
sys.argv = [{train!r}, *sys.argv[1:]]
runpy.run_path({train!r}, run_name="__main__")
"""


@pytest.mark.malformed
@pytest.mark.malformed
@pytest.mark.slow
def test_train_twice_under_one_job_name_on_gs_refuses_the_second_then_a_restart_resumes(gcs, gcs_server, tmp_path):
    """The reported damage, end to end: one launcher --name started twice on one bucket. The second copy of
    train.py is refused (exit 2, one line) while the first trains and saves; once the first is killed, a
    restarted attempt takes over within one renewal interval and resumes from its last committed step."""
    from conftest import cli_env, start_cli

    from test_storage import TINY

    wrapper = tmp_path / "train_fast_lease.py"
    wrapper.write_text(WRAPPER.format(root=str(ROOT), fast={**FAST, "RENEW_S": 1.0, "GRACE_S": 1.0, "TTL_S": 8.0,
                                                             "MARGIN_S": 3.0}, train=str(ROOT / "train.py")))
    env = {**gcs_env(gcs_server), "MAXLM_JOB": "dup"}
    run = gcs + "/run"
    args = ["configs/tiny.yml", *TINY, "steps=100000", "checkpoint.every=5", "watchdog_s=0", f"run_dir={run}"]
    log1 = open(tmp_path / "first.log", "w+")
    first = start_cli(*args, devices=1, log=log1, env=env, script=wrapper)
    try:
        deadline = time.monotonic() + 240
        while "checkpoint step 5 committed" not in (tmp_path / "first.log").read_text():
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.5)
        second = subprocess.run([sys.executable, str(wrapper), *args], cwd=ROOT, capture_output=True, text=True,
                                timeout=240, env={**cli_env(1), **env})
        assert second.returncode == 2, second.stderr[-3000:]
        last = second.stderr.strip().splitlines()[-1]
        assert re.fullmatch(rf"maxlm: error: `run_dir` {run} is in use by another live copy of this job, dup \(pid "
                            rf"{first.pid} on host .*; it renewed its lease \d+s ago\): the same job was started twice; "
                            r"stop one copy, or give the other another job name \(MAXLM_JOB\) or run_dir", last), last
        assert "Traceback" not in second.stderr and "ignoring" not in second.stdout  # it deleted nothing
        assert first.poll() is None  # undisturbed
        first.send_signal(signal.SIGKILL)
        first.wait()
        log3 = open(tmp_path / "third.log", "w+")
        third = start_cli(*args, devices=1, log=log3, env=env, script=wrapper)
        try:
            deadline = time.monotonic() + 240
            while "trained step" not in (text := (tmp_path / "third.log").read_text()) and "resuming from" not in text:
                assert third.poll() is None and time.monotonic() < deadline, text[-3000:]
                time.sleep(0.5)
            assert f"took over the lease of {run}/.lease from this job's previous attempt" in text, text[-3000:]
            assert re.search(r"^maxlm: resuming from step \d+ ", text, flags=re.M), text[-3000:]
            assert "ignoring and removing" not in text  # the dead attempt's in-flight save, if any, is left alone
            left = re.search(r"^maxlm: ignoring 1 partial checkpoint\(s\) without removing them: (\d+); the job this "
                             r"run_dir's lease was taken over from may still be writing them", text, flags=re.M)
            if left:  # killed during a save (most runs): the new attempt's save of that step replaces it
                while f"checkpoint step {left[1]} committed" not in (text := (tmp_path / "third.log").read_text()):
                    assert third.poll() is None and time.monotonic() < deadline, text[-3000:]
                    time.sleep(0.5)
                assert "commit_success.txt" in storage.listdir(f"{run}/checkpoints/{left[1]}")
        finally:
            third.kill()
            third.wait()
    finally:
        first.kill()
        first.wait()
