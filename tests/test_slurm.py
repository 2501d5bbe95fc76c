"""The job.sbatch the launcher writes, run by a real Slurm: Debian's slurm-wlm (22.05 on Debian 12) and
munge, installed with apt if missing, their daemons started here as root on one node with 2 fake GPUs
(GRES with File= device nodes; JAX itself runs on the CPU). It shows that a job saves and comes back on
each real way Slurm asks it to stop:
  - a preemption with GraceTime (a job in a higher-priority partition wants the node), then
    `scancel --signal=TERM --full` (the batch shell's process group is signalled), then a preemption
    with GraceTime=0 (Slurm requeues the job itself): each attempt saves, the job is requeued, and the
    next resumes; the final losses equal an uninterrupted job's bit for bit, and one log holds every
    attempt;
  - the time limit's warning signal (`--signal=TERM@300`, reached by shortening the limit of a running
    job): it saves, is requeued, and resumes from that step; a plain `scancel` then ends the job for good.
Slow (about 4 minutes on 2 cores): `make test-slow`, or `pytest -m slow tests/test_slurm.py`."""

import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ROOT, cli_env

from maxlm.launch.__main__ import main

pytestmark = pytest.mark.slow

SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
DAEMONS = ("munged", "slurmctld", "slurmd")
MODEL = ["model.n_layers=1", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=16",
         "model.d_ff=128", "seq_len=32", "global_batch_size=8", "sample_tokens=0", "log_every=1",
         "checkpoint.every=5"]
STEPS = 160  # about 15 s of training here: long enough to be stopped three times after it has started
CRED_EXPIRE = 10  # a requeued job waits this long (+1 s) before it may start again: Slurm's default is 120 s
GRACE_S = 60  # the preemptible partition's GraceTime: SIGTERM, then this long to save before the kill


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss, as the run's metrics record them (the one place here that knows their layout)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _tool(name: str) -> str | None:
    return shutil.which(name) or next((f"{d}/{name}" for d in SBIN if os.access(f"{d}/{name}", os.X_OK)), None)


def _install() -> None:
    """slurm-wlm and munge from Debian, unless they are here; a skip only where that cannot be done."""
    if os.geteuid() != 0:
        pytest.skip("a real Slurm needs root here: its daemons run as root, and GRES needs device nodes (mknod)")
    if all(_tool(t) for t in (*DAEMONS, "sbatch", "scontrol", "squeue", "scancel", "sinfo")):
        return
    if not shutil.which("apt-get"):
        pytest.skip("slurm-wlm and munge are not installed, and there is no apt-get to install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "slurm-wlm", "munge"]
    r = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    if r.returncode:  # stale package lists: update once, then try again
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, text=True, timeout=900)
        r = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"apt-get install slurm-wlm munge failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Slurm:
    """One node, two partitions: `low` (the default, preemptible with GraceTime, jobs requeued when
    preempted) and `high` (preempts `low`). Accounting is off: states come from `scontrol show job`,
    which keeps a finished job for MinJobAge; jobcomp/filetxt keeps a line per ended attempt."""

    def __init__(self, d: Path):
        self.d, self.procs, self.history, self.t0 = d, {}, {}, time.monotonic()
        self.host = socket.gethostname().split(".")[0]
        # sbatch passes this environment on to the job: JAX on 1 CPU device per process (one per fake
        # GPU), and nothing of a Slurm job this test may itself be running in.
        self.env = {k: v for k, v in cli_env(devices=1, optimized=True).items() if not k.startswith("SLURM_")}
        self.env["SLURM_CONF"] = str(d / "slurm.conf")

    def start(self) -> None:
        d = self.d
        for sub in ("state", "spool", "log"):
            (d / sub).mkdir()
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        # The GPUs GRES hands out: device nodes that are /dev/null's twin (a character device, 1:3), here
        # rather than in /dev, so that nothing outside this directory changes.
        self.devices = [d / f"nvidia{i}" for i in range(2)]
        for dev in self.devices:
            os.mknod(dev, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        ctld_port, slurmd_port = _free_ports(2)
        # proctrack/linuxproc and no task plugin: the signals under test go to a process group (scancel
        # --full) or to whole steps, the same under proctrack/cgroup, and a container's cgroups are often
        # not ours to write; so no cgroup.conf either.
        (d / "slurm.conf").write_text(f"""\
ClusterName=maxlmtest
SlurmctldHost={self.host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.sock,cred_expire={CRED_EXPIRE}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
SlurmctldDebug=debug
SlurmdDebug=debug
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={d}/jobcomp.txt
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
ReturnToService=2
MinJobAge=3600
KillWait=10
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory=1000 Gres=gpu:2 State=UNKNOWN
PartitionName=low Nodes={self.host} Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime={GRACE_S} MaxTime=INFINITE State=UP
PartitionName=high Nodes={self.host} PriorityTier=10 PreemptMode=OFF MaxTime=INFINITE State=UP
""")
        (d / "gres.conf").write_text(f"AutoDetect=off\nNodeName={self.host} Name=gpu File={d}/nvidia[0-1]\n")
        conf = str(d / "slurm.conf")
        self._daemon("munged", "-F", "--force", f"--key-file={key}", f"--socket={d}/munge.sock",
                     f"--pid-file={d}/munged.pid", f"--log-file={d}/log/munged.log", f"--seed-file={d}/munged.seed")
        self.wait_for("munged's socket", lambda: (d / "munge.sock").exists(), 30)
        self._daemon("slurmctld", "-D", "-f", conf)
        self.wait_for("slurmctld to answer", lambda: self.run("scontrol", "ping", check=False).returncode == 0, 60)
        self._daemon("slurmd", "-D", "-f", conf)
        self.wait_for("the node to be idle", lambda: self.run("sinfo", "-h", "-o", "%T", "-p", "low").stdout.strip()
                      == "idle", 60)

    def _daemon(self, name: str, *args: str) -> None:
        out = open(self.d / "log" / f"{name}.out", "w")
        self.procs[name] = subprocess.Popen([_tool(name), *args], env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        """Cancel what is left, then stop the daemons this started, by their PIDs, and remove the devices."""
        if "slurmd" in self.procs:
            self.run("scancel", "--quiet", "--partition=low,high", check=False)
            with contextlib.suppress(AssertionError):
                self.wait_for("the queue to drain", lambda: not self.run("squeue", "-h").stdout.strip(), 60)
        for name in reversed(DAEMONS):
            p = self.procs.get(name)
            if p and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for dev in getattr(self, "devices", []):
            dev.unlink(missing_ok=True)

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 or not check, f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}"
        return r

    def submit(self, *args: str) -> str:
        return self.run("sbatch", "--parsable", *args).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """The job as `scontrol show job` has it now; its state changes are kept in `history`."""
        text = self.run("scontrol", "show", "job", "-o", job_id, check=False).stdout
        fields = dict(re.findall(r"(\w+)=(\S*)", text))
        seen = self.history.setdefault(job_id, [])
        now = (fields.get("JobState"), fields.get("Reason"), fields.get("Restarts"))
        if now[0] and (not seen or seen[-1][1:] != now):
            seen.append((f"{time.monotonic() - self.t0:.0f}s", *now))
        return fields

    def wait_for(self, what: str, ready, timeout: float, job: str | None = None):
        """Poll `ready()` (noting the job's state each time) until it is true, or fail naming `what`."""
        end = time.monotonic() + timeout
        while True:
            if job:
                self.job(job)
            value = ready()
            if value:
                return value
            if time.monotonic() > end:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(0.5)

    def report(self, *files: Path) -> str:
        """The end of every log, for a failure's output."""
        parts = [f"job states: {self.history}"]
        for f in [*sorted((self.d / "log").glob("*")), self.d / "jobcomp.txt", *files]:
            if f.exists():
                parts.append(f"===== {f} (end)\n" + "\n".join(f.read_text(errors="replace").splitlines()[-80:]))
        return "\n".join(parts)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    _install()
    cluster = Slurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except BaseException:
        print(cluster.report())
        cluster.stop()
        raise
    yield cluster
    cluster.stop()


@contextlib.contextmanager
def explained(cluster: Slurm, *logs: Path):
    """On a failure, print the daemons' logs and the job's (pytest shows them with the failure)."""
    try:
        yield
    except BaseException:
        print(cluster.report(*logs))
        raise
    print(f"job states: {cluster.history}")  # shown with -s: what the test saw


def write_job(tmp: Path, name: str, steps: int) -> tuple[Path, Path]:
    """The launcher's job.sbatch for 1 node x 2 GPUs, one process per GPU; returns (script, run_dir)."""
    run_dir, out = tmp / f"{name}-run", tmp / f"{name}-job"
    assert main(["slurm", "configs/tiny.yml", *MODEL, f"steps={steps}", f"run_dir={run_dir}", "--name", "s",
                 "--nodes", "1", "--gpus-per-node", "2", "--process-per", "gpu", "--out", str(out)]) == 0
    return out / "job.sbatch", run_dir


def log_of(script: Path, job_id: str) -> Path:
    return script.parent / f"slurm-{job_id}.out"


def attempts(log: Path) -> list[str]:
    """The log's text split at each attempt's first line (the script echoes it)."""
    text = log.read_text() if log.exists() else ""
    return re.split(r"^(?=maxlm\.launch: job \d+ attempt \d+ )", text, flags=re.M)[1:]


def last_step(log: Path) -> int:
    """The last step the current attempt printed (0 before its first)."""
    parts = attempts(log)
    steps = re.findall(r"^step +(\d+) \|", parts[-1], flags=re.M) if parts else []
    return int(steps[-1]) if steps else 0


def saved_at(log: Path, n: int) -> int | None:
    """The step the n-th SIGTERM stopped and saved (maxlm's own line), or None before that."""
    text = log.read_text() if log.exists() else ""
    stops = re.findall(r"^maxlm: SIGTERM: stopped after step (\d+) and saved it", text, flags=re.M)
    return int(stops[n - 1]) if 1 <= n <= len(stops) else None


def test_preempted_and_signalled_job_requeues_and_ends_like_an_uninterrupted_one(slurm, tmp_path, monkeypatch):
    """One job stopped three ways, each after its attempt has trained a few steps; every stop saves, the job
    comes back, and the next attempt resumes from the saved step:
      1. preemption with GraceTime: the steps get SIGTERM; maxlm saves and exits 143; the script requeues;
      2. `scancel --signal=TERM --full`: the batch shell's process group gets it, not the steps; the
         script's trap passes it on (srun, in a group of its own, is not signalled);
      3. preemption with GraceTime=0: Slurm requeues the job itself, sending the steps SIGTERM twice and
         SIGKILL KillWait later; maxlm takes the second SIGTERM as the first's twin and saves in time."""
    monkeypatch.chdir(ROOT)  # the launcher, like a user, runs from the checkout
    ref_script, ref_dir = write_job(tmp_path, "ref", STEPS)
    script, run_dir = write_job(tmp_path, "run", STEPS)
    ref = slurm.submit(str(ref_script))
    with explained(slurm, log_of(ref_script, ref)):
        slurm.wait_for("the uninterrupted job to complete", lambda: slurm.job(ref)["JobState"] == "COMPLETED", 240,
                       job=ref)
        assert (slurm.job(ref)["ExitCode"], slurm.job(ref)["Restarts"]) == ("0:0", "0")

    job = slurm.submit(str(script))
    log = log_of(script, job)

    def stop(n: int, how: str, signal_it) -> int:
        """Once attempt n has trained 15 steps past the last save, stop it; return the step it saved."""
        after = saved_at(log, n - 1) or 0
        slurm.wait_for(f"attempt {n} to train 15 steps",
                       lambda: len(attempts(log)) == n and last_step(log) >= after + 15, 240, job=job)
        t = time.monotonic()
        signal_it()
        saved = slurm.wait_for(f"attempt {n} to save after {how}", lambda: saved_at(log, n), 60, job=job)
        slurm.wait_for(f"the requeue after {how}", lambda: slurm.job(job)["Restarts"] == str(n), 60, job=job)
        print(f"{how}: saved step {saved} and requeued in {time.monotonic() - t:.1f}s")
        assert (run_dir / "checkpoints" / str(saved)).is_dir()
        return saved

    def preempt():
        slurm.submit("--partition=high", "--ntasks=1", f"--output={tmp_path}/high-%j.out", "--wrap", "sleep 1")

    def no_grace():
        slurm.run("scontrol", "update", "PartitionName=low", "GraceTime=0")
        preempt()

    with explained(slurm, log):
        try:
            saved = [stop(1, "a preemption with GraceTime", preempt),
                     stop(2, "scancel --signal=TERM --full", lambda: slurm.run("scancel", "--signal=TERM", "--full", job)),
                     stop(3, "a preemption with GraceTime=0", no_grace)]
        finally:
            slurm.run("scontrol", "update", "PartitionName=low", f"GraceTime={GRACE_S}", check=False)
        slurm.wait_for("the job to complete", lambda: slurm.job(job)["JobState"] == "COMPLETED", 180, job=job)
        end = slurm.job(job)
        assert (end["ExitCode"], end["Restarts"]) == ("0:0", "3")
        parts = attempts(log)  # one log, every attempt in it
        assert [re.match(r"maxlm\.launch: job \d+ attempt (\d+) ", p)[1] for p in parts] == ["1", "2", "3", "4"]
        for part, step in zip(parts[1:], saved):
            assert f"maxlm: resuming from step {step} " in part
        # Requeued by the script after 1 and 2; after 3 Slurm had requeued it already, and the script left it.
        ends = [[line for line in p.splitlines() if re.match(r"maxlm(\.launch)?: (?!checkpoint|saving)", line)][-4:]
                for p in parts]  # what each attempt said last, shown if the next line fails
        assert ["requeued job" in p for p in parts] == [True, True, False, False], ends
        # Slurm sends the steps a second SIGTERM milliseconds after the first here, or not at all (seen both
        # ways); maxlm saved either way (stop() checked it), and the script left the requeue to Slurm.
        assert "not requeueing: Slurm is ending the job" in parts[2]
        # No attempt ended as a failure (FAILED is what Slurm recorded before the script requeued itself).
        ended = re.findall(rf"^JobId={job} .*?JobState=(\S+)", (slurm.d / "jobcomp.txt").read_text(), flags=re.M)
        assert "FAILED" not in ended and ended[-1] == "COMPLETED", ended
        assert losses(run_dir) == losses(ref_dir) and len(losses(ref_dir)) == STEPS


def test_time_limit_signal_saves_and_requeues(slurm, tmp_path, monkeypatch):
    """--signal=TERM@300 comes when the job has 300 s left (Slurm checks every 30 s, so up to 30 s early):
    shortening a running job's limit to under 5 minutes brings it within half a minute."""
    monkeypatch.chdir(ROOT)
    script, run_dir = write_job(tmp_path, "limit", 5000)  # would train for minutes: it is cancelled instead
    job = slurm.submit(str(script))
    log = log_of(script, job)
    with explained(slurm, log):
        slurm.wait_for("the first attempt to train 20 steps", lambda: last_step(log) >= 20, 240, job=job)
        ran = int(slurm.job(job)["RunTime"].split(":")[-2]) * 60 + int(slurm.job(job)["RunTime"].split(":")[-1])
        slurm.run("scontrol", "update", f"JobId={job}", f"TimeLimit={math.ceil(ran / 60) + 5}")  # 4-5 min left
        stopped = slurm.wait_for("the time limit's SIGTERM and the save", lambda: saved_at(log, 1), 90, job=job)
        slurm.wait_for("the requeue", lambda: slurm.job(job)["Restarts"] == "1", 60, job=job)
        assert re.search(rf"warning signal 15 to JobId={job}\b", (slurm.d / "log" / "slurmctld.log").read_text())
        assert (run_dir / "checkpoints" / str(stopped)).is_dir()
        # The requeued job keeps its shortened limit, whose warning would come at once: lift it.
        slurm.run("scontrol", "update", f"JobId={job}", "TimeLimit=UNLIMITED")
        slurm.wait_for("the next attempt to resume", lambda: f"maxlm: resuming from step {stopped} " in log.read_text(),
                       120, job=job)
        # A cancelled job stays cancelled: the script does not requeue a job Slurm is ending.
        slurm.run("scancel", job)
        slurm.wait_for("the cancel", lambda: slurm.job(job)["JobState"] == "CANCELLED", 60, job=job)
        assert log.read_text().count("maxlm.launch: requeued job") == 1


@pytest.mark.malformed
def test_a_task_killed_with_sigkill_requeues_and_resumes(slurm, tmp_path, monkeypatch):
    """An OOM kill: one training process gets SIGKILL, which nothing can catch. srun reports 137 for the step,
    and the script requeues the job (within --max-restarts) rather than leaving it FAILED; the next attempt
    resumes from the last step saved."""
    monkeypatch.chdir(ROOT)
    script, run_dir = write_job(tmp_path, "oom", 5000)  # MODEL saves every 5 steps
    job = slurm.submit(str(script))
    log = log_of(script, job)
    with explained(slurm, log):
        slurm.wait_for("the first attempt to train 25 steps", lambda: last_step(log) >= 25, 240, job=job)
        pythons = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _is_training(p, run_dir)]
        assert len(pythons) == 2, pythons  # one process per GPU
        first = next(p for p in pythons if b"SLURM_PROCID=0" in (p / "environ").read_bytes().split(b"\0"))
        os.kill(int(first.name), signal.SIGKILL)  # process 0: the other loses its coordinator at once
        slurm.wait_for("the requeue after the kill", lambda: slurm.job(job)["Restarts"] == "1", 90, job=job)
        slurm.wait_for("the next attempt to resume", lambda: re.search(r"^maxlm: resuming from step (\d+) ",
                                                                       attempts(log)[-1] if len(attempts(log)) == 2
                                                                       else "", flags=re.M), 180, job=job)
        resumed = int(re.search(r"^maxlm: resuming from step (\d+) ", attempts(log)[1], flags=re.M)[1])
        assert resumed >= 20 and resumed % 5 == 0
        # srun reports the killed task's 137, or the other's abort (134) when it sees its peer gone first
        code = re.search(r"^maxlm\.launch: the training processes exited with code (\d+)", attempts(log)[0], re.M)
        assert code and code[1] in ("137", "134") and "requeued job" in attempts(log)[0], attempts(log)[0][-2000:]
        slurm.run("scancel", job)
        slurm.wait_for("the cancel", lambda: slurm.job(job)["JobState"] == "CANCELLED", 60, job=job)


def _is_training(proc: Path, run_dir: Path) -> bool:
    """A python process running train.py for `run_dir` (not srun or the batch shell, whose command lines hold
    the same words)."""
    try:
        exe, cmd = os.readlink(proc / "exe"), (proc / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return Path(exe).name.startswith("python") and any(c.endswith(b"train.py") for c in cmd) and \
        f"run_dir={run_dir}".encode() in cmd
