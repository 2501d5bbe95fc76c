"""The acceptance rehearsal of a cluster job, on this machine, with real parts: the launcher renders a gke
JobSet for 2 GPU hosts; each pod's exact command and environment run here as a local process (4 CPU
devices each, the coordinator on 127.0.0.1), writing run_dir=gs://... to a real GCS server
(fake-gcs-server). Faults get the cluster's answer, read from the manifest's own failure policy:
  - `kill -9` of one pod: the other exits within watchdog_s with a code the JobSet restarts on;
  - the restarted pods resume; a second job on the same run_dir is refused in one line;
  - SIGTERM to both (a preemption): both save and exit with a restart code; restarted, they finish;
  - the final losses equal an uninterrupted job's bit for bit, and the metrics hold every step once.
Slow (about 3-4 minutes on 2 cores): `make test-slow`."""

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, cli_env, gcs_env

from maxlm import metrics, storage
from maxlm.launch.__main__ import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # 3-5 min alone; far more beside the rest of CI

MODEL = ["model.n_layers=1", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=16",
         "model.d_ff=128", "seq_len=32", "global_batch_size=8", "sample_tokens=0", "log_every=1",
         "checkpoint.every=5", "watchdog_s=20"]
# Long enough that the second job's refusal (its start, then up to a lease renewal, 15 s) comes while the
# first trains: at 150 a CI runner trained steps 25-150 (29 s) before the refusal, and the preemption came
# during the final save.
STEPS = 300


def render(tmp: Path, name: str, run_dir: str, nodes: int, gpus: int) -> dict:
    out = tmp / f"{name}-manifest"
    assert main(["gke", "configs/tiny.yml", *MODEL, f"steps={STEPS}", f"run_dir={run_dir}", "--name", name,
                 "--nodes", str(nodes), "--gpus-per-node", str(gpus), "--image", "maxlm:rehearsal",
                 "--out", str(out)]) == 0
    return yaml.safe_load((out / "jobset.yaml").read_text())


class Pods:
    """One attempt of the JobSet's pods, as local processes with each pod's command and environment; only
    the coordinator's DNS name (JobSet's headless service) becomes 127.0.0.1 and a free port."""

    def __init__(self, js: dict, tmp: Path, server: str, attempt: str):
        rjob = js["spec"]["replicatedJobs"][0]
        spec = rjob["template"]["spec"]
        container = spec["template"]["spec"]["containers"][0]
        name = js["metadata"]["name"]
        self.logs = [tmp / f"{name}-{attempt}-pod{i}.txt" for i in range(spec["parallelism"])]
        port = _free_port()
        self.procs = []
        for i, log in enumerate(self.logs):
            env = {}
            for e in container["env"]:
                if "value" in e:
                    env[e["name"]] = e["value"]
                else:  # the pod's index in its Job: the only field the manifest asks Kubernetes for
                    assert e["valueFrom"]["fieldRef"]["fieldPath"].endswith("['batch.kubernetes.io/job-completion-index']")
                    env[e["name"]] = str(i)
            if "JAX_COORDINATOR_ADDRESS" in env:
                host, _ = env["JAX_COORDINATOR_ADDRESS"].rsplit(":", 1)
                assert host == f"{name}-{rjob['name']}-0-0.{name}"  # pod 0 of the JobSet
                env["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{port}"
            command = container["command"]
            assert command[0] == "python"
            devices = next(iter(container["resources"]["limits"].values()))
            with open(log, "w") as f:
                self.procs.append(subprocess.Popen([sys.executable, *command[1:]], cwd=ROOT, stdout=f,
                                                   stderr=subprocess.STDOUT, env={**cli_env(devices, optimized=True), **gcs_env(server), **env}))

    def text(self, i: int = 0) -> str:
        return self.logs[i].read_text()

    def wait_for_step(self, step: int, timeout: float = 480) -> None:  # CI's suite shares the 2 cores
        end = time.monotonic() + timeout
        while time.monotonic() < end and all(p.poll() is None for p in self.procs):
            logged = re.findall(r"^step +(\d+) \|", self.text(), flags=re.M)
            if logged and int(logged[-1]) >= step:
                return
            time.sleep(0.1)
        raise AssertionError(f"no step {step} within {timeout:.0f}s:\n{self.tails()}")

    def wait(self, timeout: float = 300) -> list[int]:
        return [p.wait(timeout=timeout) for p in self.procs]

    def tails(self) -> str:
        return "\n".join(f"===== pod {i}\n{self.text(i)[-3000:]}" for i in range(len(self.logs)))

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def restarts_on(js: dict, code: int) -> bool:
    """Whether the JobSet restarts a job whose pod exited `code`: its pod failure policy fails the job for
    good only on the codes it lists, and the JobSet restarts a failed job up to maxRestarts times."""
    spec = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    final = {v for rule in spec["podFailurePolicy"]["rules"] if rule["action"] == "FailJob"
             for v in rule["onExitCodes"]["values"]}
    # A pod killed by a signal exits 128 + signal in a container
    return code != 0 and (code if code > 0 else 128 - code) not in final and js["spec"]["failurePolicy"]["maxRestarts"] > 0


@pytest.fixture
def launched():
    """Every attempt started, killed at the end whatever the outcome."""
    attempts = []
    yield attempts
    for pods in attempts:
        pods.kill()


def test_a_gke_job_survives_a_lost_pod_and_a_preemption_bit_for_bit(gcs, gcs_server, tmp_path, launched):
    tmp, server = tmp_path, gcs_server

    def start(js, attempt):
        launched.append(Pods(js, tmp, server, attempt))
        return launched[-1]

    ref_dir, run_dir = f"{gcs}/ref", f"{gcs}/run"
    ref = start(render(tmp, "ref", ref_dir, 2, 4), "a1")
    assert ref.wait() == [0, 0], ref.tails()

    js = render(tmp, "llm", run_dir, 2, 4)
    # 1. A lost pod: the other notices within watchdog_s and exits with a code the JobSet restarts on.
    first = start(js, "a1")
    first.wait_for_step(12)  # checkpoints at 5 and 10
    first.procs[1].send_signal(signal.SIGKILL)
    t = time.monotonic()
    code = first.procs[0].wait(timeout=60)
    took = time.monotonic() - t
    assert code == 5 and took < 20, (code, took, first.tails())
    assert restarts_on(js, code) and restarts_on(js, first.procs[1].wait())
    assert re.search(r"^maxlm: error: lost process 1 of 2 ", first.text(0), flags=re.M)

    # 2. Restarted, as the JobSet restarts every pod of the job: it resumes, and holds the run_dir.
    second = start(js, "a2")
    second.wait_for_step(25)
    resumed = int(re.search(r"^maxlm: resuming from step (\d+) ", second.text(), flags=re.M)[1])
    assert resumed >= 10
    # No wait for the lease: the survivor released it on its way out (gloo reports the lost peer at once on
    # CPU), or, where it was ended from the peer monitor's thread, this job's next attempt takes it over.
    assert "is held by" not in second.text()
    # A second job on the same run_dir (here a one-host one) is refused in one line, naming the holder.
    other = start(render(tmp, "other", run_dir, 1, 8), "a1")
    assert other.wait(timeout=120) == [2], other.tails()
    last = other.text().strip().splitlines()[-1]
    assert re.fullmatch(rf"maxlm: error: `run_dir` {run_dir} is in use by another job \(job llm: pid \d+ on host "
                        r".*; it renewed its lease \d+s ago\).*", last), last
    assert "Traceback" not in other.text()

    # 3. A preemption: SIGTERM to every pod; each saves the same step and exits 143, a restart code.
    assert all(p.poll() is None for p in second.procs), "the job finished before it could be preempted; raise STEPS"
    for p in second.procs:
        p.send_signal(signal.SIGTERM)
    codes = second.wait(timeout=120)
    assert codes == [143, 143] and restarts_on(js, 143), second.tails()
    stopped = int(re.search(r"^maxlm: SIGTERM: stopped after step (\d+) and saved it", second.text(), flags=re.M)[1])

    # 4. Restarted again: it resumes from the preemption's save and finishes.
    third = start(js, "a3")
    assert third.wait() == [0, 0], third.tails()
    assert f"maxlm: resuming from step {stopped} " in third.text()

    ref_rows, rows = metrics.read_rows(ref_dir), metrics.read_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # every step once, across three attempts
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref_rows]  # bit for bit
    assert sorted(int(s) for s in storage.listdir(f"{run_dir}/checkpoints"))[-1] == STEPS
    assert ".lease" not in storage.listdir(run_dir)
