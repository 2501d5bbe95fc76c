"""Two processes x 4 CPU devices, joined through jax.distributed on 127.0.0.1, train exactly the global
batches one process x 8 devices trains (from a prepared dataset in a bucket of the GCS emulator, each
process reading only its own rows), stop together when one of them is signalled, and resume (joined
through Slurm's variables), dispatching ahead of the device and saving by the clock at the same steps.
A process that cannot reach the coordinator, or loses a peer, exits with one line naming it."""

import json
import os
import random
import re
import signal
import socket
import time

import numpy as np
import pytest
from conftest import run_cli, start_cli

MODEL = ["model.n_layers=2", "model.d_model=64", "model.d_ff=128", "model.n_heads=4", "model.n_kv_heads=2",
         "model.head_dim=16", "seq_len=32", "global_batch_size=8"]
STEPS = 24
# tiny.yml's width at 2 layers: a step's device time is many times its dispatch (measured 0.5 s against 1 ms), so
# that running ahead shows
ARGS = ["configs/tiny.yml", "model.n_layers=2", "seq_len=32", "global_batch_size=16", f"steps={STEPS}", "log_every=1",
        "checkpoint.every=10", "sample_tokens=8"]


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def free_port(slurm: bool = False) -> int:
    """A free port; with slurm, one in the range JAX derives from a Slurm job id (61440 + id % 4096)."""
    while True:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", random.randint(61440, 65535) if slurm else 0))
                return s.getsockname()[1]
            except OSError:
                continue


def job_envs(slurm: bool = False) -> list[dict]:
    """The two processes' variables: JAX_COORDINATOR_ADDRESS and co., or what Slurm's srun sets for 2 tasks
    on one node (no coordinator address: it comes from the node list and the job id)."""
    if slurm:
        job = str(free_port(slurm=True) - 61440 + 4096 * 7)
        return [{"SLURM_JOB_ID": job, "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2", "SLURM_PROCID": str(i),
                 "SLURM_LOCALID": str(i), "SLURM_NTASKS_PER_NODE": "2"} for i in range(2)]
    address = f"127.0.0.1:{free_port()}"
    return [{"JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)} for i in range(2)]


def start_two(run_dir, tmp_path, *extra, slurm: bool = False, args=ARGS, devices: int = 4, script=None):
    logs = [open(tmp_path / f"proc{i}.txt", "w") for i in range(2)]
    procs = [start_cli(*args, f"run_dir={run_dir}", *extra, devices=devices, log=logs[i], env=env, script=script)
             for i, env in enumerate(job_envs(slurm))]
    for f in logs:
        f.close()  # each child holds its own copy
    return procs


def wait_for_step(run_dir, step: int, procs) -> None:
    t = time.time()
    while time.time() - t < 240 and all(p.poll() is None for p in procs):
        rows = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
        if rows and json.loads(rows[-1])["step"] >= step:
            return
        time.sleep(0.02)


def two_processes(run_dir, tmp_path, *extra, codes=(0, 0), signal_at=None, slurm=False, args=ARGS, devices=4,
                  script=None):
    """Run both processes to the end; with signal_at, SIGTERM process 1 alone once step `signal_at` is logged."""
    procs = start_two(run_dir, tmp_path, *extra, slurm=slurm, args=args, devices=devices, script=script)
    if signal_at:
        wait_for_step(run_dir, signal_at, procs)
        procs[1].send_signal(signal.SIGTERM)
    got = [p.wait(timeout=300) for p in procs]
    outs = [(tmp_path / f"proc{i}.txt").read_text() for i in range(2)]
    assert tuple(got) == codes, outs[0][-3000:] + outs[1][-3000:]
    return outs


def prepared(tmp_path, out=None) -> list[str]:
    """Python's docs as text files, prepared into token shards (in `out`, a directory or gs:// URL; by default
    <tmp_path>/prep): the production data path."""
    from pydoc_data.topics import topics

    from maxlm.data import prepare

    out = out or str(tmp_path / "prep")
    (tmp_path / "txt").mkdir(exist_ok=True)
    for k in sorted(topics):
        (tmp_path / "txt" / f"{k}.txt").write_text(topics[k])
    assert prepare.main([str(tmp_path / "txt"), "--tokenizer", "byte", "--out", out, "--workers", "1"]) == 0
    return ["data.source=prepared", f"data.path={out}"]


# The restart runs train.py through this driver, which wraps the compiled step to note when each call returned
# (dispatched) and, from a thread, when its result was ready on the device.
DRIVER = """
import json, sys, threading, time
sys.path.insert(0, %r)
import jax
import train as cli
from maxlm import train
real, events = train.compile_all, []

def compile_all(*args):
    step_fn, eval_fn = real(*args)
    def step(state, batch):
        out = step_fn(state, batch)
        events.append([time.monotonic(), None])
        e = events[-1]
        threading.Thread(target=lambda: (jax.block_until_ready(out[1]), e.__setitem__(1, time.monotonic()))).start()
        return out
    return step, eval_fn

train.compile_all = compile_all
code = cli.main(sys.argv[1:])
time.sleep(0.5)
json.dump(events, open(%r + str(jax.process_index()) + ".json", "w"))
sys.exit(code)
"""


def test_two_processes_match_one_and_resume_together(tmp_path, gcs):
    """The reference reads the prepared data from local disk; the job's two processes read the same data,
    prepared into a bucket of the GCS emulator, and train the same batches. The restart also shows that
    there is no host-device sync per step: each process dispatches step s+1 before step s is done, so its
    host time per step is the single process's. The steps and stops are agreed through the coordinator
    instead: a checkpoint every few hundred ms by process 0's clock (checkpoint.minutes) is saved by both
    processes at the same steps."""
    from conftest import ROOT

    ref_src, src = prepared(tmp_path), prepared(tmp_path, f"{gcs}/prep")
    ref = tmp_path / "ref"
    with open(tmp_path / "ref.txt", "w") as log:  # the reference runs alongside the job: most of each is start-up
        single = start_cli(*ARGS, f"run_dir={ref}", *ref_src, log=log)

    # SIGTERM reaches process 1 only; the target step it publishes stops both after the same step.
    run_dir = tmp_path / "run"
    try:
        outs = two_processes(run_dir, tmp_path, *src, codes=(143, 143), signal_at=3)
    finally:
        assert single.wait(timeout=300) == 0, (tmp_path / "ref.txt").read_text()[-2000:]
    assert "maxlm: processes: process 0 of 2 (JAX_COORDINATOR_ADDRESS); 4 local of 8 devices" in outs[0]
    assert re.search(r"maxlm: process 1 received SIGTERM: saving after step \d+, then exiting", outs[0])
    # One log for the job: process 1 only says that it was signalled.
    assert [line for line in outs[1].splitlines() if "maxlm: " in line] == [
        "maxlm: SIGTERM received: saving at the end of this step, then exiting (send it again to exit at once)"]
    stopped = int(outs[0].split("SIGTERM: stopped after step ")[1].split()[0])
    assert 3 <= stopped < STEPS - 8
    data = run_dir / "checkpoints" / str(stopped) / "data"
    assert sorted(p.name for p in data.glob("process_*.json")) == ["process_0-of-2.json", "process_1-of-2.json"]

    # The restart joins as Slurm's srun would start it (2 tasks on one node), not through JAX_COORDINATOR_ADDRESS,
    # and saves by the clock.
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER % (str(ROOT), str(tmp_path / "events")))
    outs = two_processes(run_dir, tmp_path, *src, "checkpoint.every=0", "checkpoint.minutes=0.01", slurm=True,
                         script=driver)
    assert "maxlm: processes: process 0 of 2 (Slurm); 4 local of 8 devices" in outs[0]
    assert "indexed: batches independent of the process count" in outs[0]
    assert f"resuming from step {stopped}" in outs[0] and "greedy sample:" in outs[0]
    # The same global batches on the same 8-device mesh; only the collectives' transport (gloo) differs,
    # which moves a loss by about one float32 ulp.
    np.testing.assert_allclose(losses(run_dir), losses(ref), rtol=1e-6)
    # Each start's first row carries its own start-up cost; the restart's includes its restore.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "startup_total_s" in r] == [1, stopped + 1]
    assert rows[stopped]["startup_restore_s"] > 0 and rows[stopped]["startup_join_s"] > 0
    assert outs[0].count("maxlm: start-up: joined in ") == 1 and ", state restored in " in outs[0]

    timed = [int(s) for s in re.findall(r"saving step (\d+) ", outs[0])]
    for i in range(2):
        events = json.loads((tmp_path / f"events{i}.json").read_text())  # events[k]: step stopped + 1 + k
        assert len(events) == STEPS - stopped
        # step s+1 was dispatched before step s was done, except where step s was saved (a save reads the state)
        late = [stopped + s for s in range(2, len(events))
                if events[s][0] >= events[s - 1][1] and stopped + s not in timed]
        assert not late, (i, late, events)
    saved = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if int(p.name) > stopped)
    assert len(timed) >= 3 and timed[-len(saved):] == saved  # steps before the last: by the clock
    for step in saved:  # both processes saved each of them (a step one of them skipped would hang the save)
        data = run_dir / "checkpoints" / str(step) / "data"
        assert sorted(p.name for p in data.glob("process_*.json")) == ["process_0-of-2.json", "process_1-of-2.json"]

    def host(restart_rows):
        rows = restart_rows[2:]  # past each start's first steps
        return np.median([r["host_time_s"] for r in rows]), np.median([r["step_time_s"] for r in rows])
    (h2, t2) = host([r for r in rows if r["step"] > stopped])
    (h1, t1) = host([json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()])
    # a few ms for the step-boundary agreement; CI's loaded cores saw 14.6 ms against 1.3 ms for one process
    assert h2 < 0.2 * t2 and h2 < 3 * h1 + 0.03, (h2, t2, h1, t1)


CONTEXT_ARGS = ["configs/tiny.yml", *MODEL, "dtype=float32", "steps=4", "log_every=1", "checkpoint.every=0",
                "sample_tokens=0"]


@pytest.mark.slow  # ~40 s on 2 quiet cores, most of it the first gloo collectives
def test_context_ring_across_two_processes_matches_one_device(tmp_path):
    """mesh.context=2 over 2 processes x 1 CPU device: each sequence is split between the processes, so every
    ring step's ppermute of K/V chunks (and its reverse in the backward) crosses them through gloo. The losses
    are those of one process on one device with no context split, on the same global batches."""
    ref = tmp_path / "ref"
    with open(tmp_path / "ref.txt", "w") as log:  # the reference runs alongside the job: most of each is start-up
        single = start_cli(*CONTEXT_ARGS, f"run_dir={ref}", devices=1, log=log)
    run_dir = tmp_path / "run"
    try:
        outs = two_processes(run_dir, tmp_path, "mesh.context=2", args=CONTEXT_ARGS, devices=1)
    finally:
        code = single.wait(timeout=300)
    assert code == 0, (tmp_path / "ref.txt").read_text()[-2000:]
    assert "context=1 over 1 x cpu (1 process(es))" in (tmp_path / "ref.txt").read_text()
    # The mesh has 2 devices, one per process, and context is its only axis of size > 1 (the others resolve to
    # 1), so the context pair is {process 0's device, process 1's device}: the ring spans the processes.
    # (With 2 devices per process and context=2, make_mesh's plain CPU order, process by process with the last
    # axis, context, varying fastest, would keep each pair inside one process.)
    assert "maxlm: processes: process 0 of 2 (JAX_COORDINATOR_ADDRESS); 1 local of 2 devices" in outs[0]
    assert "mesh data=1 x fsdp=1 x tensor=1 x expert=1 x context=2 over 2 x cpu (2 process(es))" in outs[0]
    assert "context parallel: each sequence split over 2 devices (mesh.context)" in outs[0]
    assert "indexed: batches independent of the process count" in outs[0]
    # Each process loads all B rows (its device holds half of every sequence). Measured: rel. difference 3.5e-7.
    np.testing.assert_allclose(losses(run_dir), losses(ref), rtol=1e-5)
    assert len(losses(ref)) == 4


def test_single_process_unless_the_environment_says_otherwise(monkeypatch):
    from maxlm import distributed
    from maxlm.config import ConfigError

    for var in ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "TPU_WORKER_HOSTNAMES", "MEGASCALE_NUM_SLICES"):
        monkeypatch.delenv(var, raising=False)
    assert distributed.initialize() == "single process"
    # On a Cloud TPU, JAX finds the job itself, from what GKE injects or from the TPU VM's metadata: a
    # one-host slice of a 2-slice job and a multi-host TPU VM (no variable at all) must both join.
    monkeypatch.setenv("MEGASCALE_NUM_SLICES", "2")
    assert distributed.find_job() == ("Cloud TPU", {})
    monkeypatch.delenv("MEGASCALE_NUM_SLICES")
    monkeypatch.setattr(distributed, "_has_tpu", lambda: True)
    assert distributed.find_job() == ("Cloud TPU", {})
    monkeypatch.undo()
    for var in ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "TPU_WORKER_HOSTNAMES", "MEGASCALE_NUM_SLICES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert distributed.initialize() == "single process"
    # GKE names every worker of a multi-host slice; a lone one (what a compile for a TPU topology sets in
    # this process, for libtpu) is a single process, so a run after it in the same process stays one.
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")
    assert distributed.find_job() is None
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t1v-0,t1v-1")
    assert distributed.find_job() == ("Cloud TPU", {})
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    try:
        distributed.initialize()
        raise AssertionError("expected an error")
    except ConfigError as e:
        assert str(e) == "JAX_COORDINATOR_ADDRESS is set: also set JAX_NUM_PROCESSES and JAX_PROCESS_ID (integers)"


@pytest.mark.slow  # the data end of one process is in the fast suite (test_pipeline)
def test_streaming_processes_end_together_when_the_data_runs_out(tmp_path, gcs):
    """Streaming processes pack their own rows, so one runs out first: both must stop at the same step.
    Two files in a bucket of the GCS emulator, two units, one per process: the short one (which holds the
    broken line) runs out first, after its process has read all of it."""
    from maxlm import storage

    lines = [json.dumps({"text": f"doc {i} " + "lorem ipsum dolor sit amet " * (1 + i % 7)}) for i in range(40)]
    lines[7] = "{broken"
    storage.write(f"{gcs}/data/short.jsonl", "\n".join(lines[:12]) + "\n")
    storage.write(f"{gcs}/data/long.jsonl", "\n".join(lines[12:] * 3) + "\n")
    outs = two_processes(tmp_path / "run", tmp_path, "data.source=jsonl", f"data.path={gcs}/data",
                         "data.epochs=1", "steps=1000", "sample_tokens=0")
    assert "the data ran out: data.epochs=1 ended after step" in outs[0]
    # The skip was on one process or the other; the job's count is the total, logged once.
    assert outs[0].count(f"data: skipping documents: bad_json") == 1
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["data_skipped_bad_json"] == 1


def only(monkeypatch, **env):
    """Exactly these job variables in the environment."""
    for var in [v for v in os.environ if v.startswith(("SLURM_", "JAX_", "TPU_WORKER"))]:
        monkeypatch.delenv(var)
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))


def test_slurm_tasks_get_every_device_of_their_node_unless_they_share_it(monkeypatch):
    from maxlm import distributed
    from maxlm.config import ConfigError

    task = dict(SLURM_JOB_ID=4242, SLURM_STEP_NODELIST="gpu[007-010],login1", SLURM_PROCID=2, SLURM_LOCALID=1)
    joined = dict(coordinator_address="gpu007:61586", cluster_detection_method="deactivate")  # 61440 + 4242 % 4096
    # One task per node (--ntasks-per-node=1 --gpus-per-node=8): all 8 GPUs, not just GPU 0 as JAX would give.
    only(monkeypatch, **{**task, "SLURM_LOCALID": 0}, SLURM_NTASKS=4, SLURM_NTASKS_PER_NODE=1)
    assert distributed.find_job() == ("Slurm", dict(joined, num_processes=4, process_id=2, local_device_ids=None))
    # One task per GPU: the GPU numbered like the task on its node.
    only(monkeypatch, **task, SLURM_NTASKS=16, SLURM_NTASKS_PER_NODE=8, JAX_COORDINATOR_PORT=1234)
    assert distributed.find_job() == ("Slurm", dict(joined, coordinator_address="gpu007:1234", num_processes=16,
                                                   process_id=2, local_device_ids=[1]))
    # srun's own layout of the step wins, read for this node: "2(x3),1" is 2, 2, 2 tasks, then 1.
    for node, ids in ((1, [1]), (3, None)):
        only(monkeypatch, **task, SLURM_NTASKS=7, SLURM_NODEID=node, SLURM_STEP_TASKS_PER_NODE="2(x3),1",
             SLURM_NTASKS_PER_NODE=1)
        assert distributed.find_job()[1]["local_device_ids"] == ids
    only(monkeypatch, SLURM_JOB_ID=1, SLURM_NTASKS=2, SLURM_PROCID=0, SLURM_LOCALID=0)  # sbatch's shell, no srun
    with pytest.raises(ConfigError, match=r"^SLURM_NTASKS=2 says this is a multi-process Slurm job, but "
                                          r"SLURM_STEP_NODELIST is not set: start every process with srun$"):
        distributed.find_job()
    # An explicit coordinator wins over Slurm's variables, and keeps every local device.
    only(monkeypatch, **task, SLURM_NTASKS=16, SLURM_NTASKS_PER_NODE=8, JAX_COORDINATOR_ADDRESS="10.0.0.1:99",
         JAX_NUM_PROCESSES=2, JAX_PROCESS_ID=1)
    assert distributed.find_job() == ("JAX_COORDINATOR_ADDRESS", dict(
        coordinator_address="10.0.0.1:99", num_processes=2, process_id=1, cluster_detection_method="deactivate"))


@pytest.mark.malformed
def test_unreachable_coordinator_is_one_line_and_exit_5(tmp_path):
    address = f"127.0.0.1:{free_port()}"  # nobody listens there
    t = time.time()
    r = run_cli("configs/tiny.yml", f"run_dir={tmp_path}", "watchdog_s=2", devices=4, timeout=60, env={
        "JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"})
    assert r.returncode == 5 and time.time() - t < 30, r.stderr[-2000:]
    assert r.stderr.splitlines() == [
        f"maxlm: error: no progress for 2s while waiting for the job's 2 processes to join through the coordinator at "
        f"{address} (this is process 1); the coordinator cannot be reached (Connection refused): check that process 0 "
        f"is running and that this host can reach {address}"]


def test_a_coordinator_port_in_use_is_found_before_jax_crashes_on_it():
    from maxlm import distributed

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert distributed.port_in_use(f"127.0.0.1:{taken}") == "Address already in use"
    assert distributed.port_in_use(f"127.0.0.1:{free_port()}") is None


def test_a_step_failed_by_a_lost_coordinator_names_process_0():
    """The failed collective can be a peer's first sight of the coordinator's death, before its monitor
    thread's next beat (a race CI lost): the verdict is then the coordinator itself, not 'nobody lost'."""
    import jax
    from maxlm.distributed import PeerMonitor

    class Client:
        def __init__(self, *answers):
            self.answers = list(answers)

        def key_value_try_get(self, key):
            answer = self.answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

    gone = jax.errors.JaxRuntimeError("UNAVAILABLE: failed to connect to all addresses\nmore")
    nothing_yet = jax.errors.JaxRuntimeError("NOT_FOUND: maxlm/lost")
    monitor = PeerMonitor(Client(nothing_yet, gone), 1, 2, "10.0.0.1:1234", timeout=2)
    assert monitor.wait_verdict(5) == ("lost process 0 of 2, the coordinator at 10.0.0.1:1234 (UNAVAILABLE: failed "
                                       "to connect to all addresses); " + PeerMonitor.ADVICE)
    published = "lost process 1 of 2 (its heartbeats stopped 3s ago: ...)"
    assert PeerMonitor(Client(nothing_yet, published), 0, 2, "a:1", 2).wait_verdict(5) == published
    assert PeerMonitor(Client(*[nothing_yet] * 100), 0, 2, "a:1", 2).wait_verdict(0.5) is None


# What the JAX runtime may print after maxlm's last line as it goes down (glog lines, its stack trace, gloo).
RUNTIME_NOISE = re.compile(r"^([EWFI]\d{4} |\*\*\* |\s+@ |=== |external/|RPC: |Additional GRPC|:|\[Gloo\]|$)")


@pytest.mark.malformed
@pytest.mark.slow  # ~30 s each; the joining end (an unreachable coordinator) is in the fast suite
@pytest.mark.parametrize("victim", [1, 0], ids=["lost-process-1", "lost-coordinator"])
def test_a_killed_process_ends_the_other_with_one_line_naming_it(tmp_path, victim):
    run_dir = tmp_path / "run"
    procs = start_two(run_dir, tmp_path, "steps=100000", "data.source=synthetic", "watchdog_s=20")
    wait_for_step(run_dir, 3, procs)
    procs[victim].send_signal(signal.SIGKILL)
    t = time.time()
    survivor = 1 - victim
    code = procs[survivor].wait(timeout=120)
    took = time.time() - t
    procs[victim].wait()
    log = tmp_path / f"proc{survivor}.txt"
    while time.time() - t < took + 10 and "maxlm: error:" not in log.read_text():
        time.sleep(0.1)  # a lost coordinator is reported by a helper process, after the runtime's abort
    lines = log.read_text().splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("maxlm: error:")]
    assert len(errors) == 1, "\n".join(lines[-30:])
    assert all(RUNTIME_NOISE.match(line) for line in lines[errors[0] + 1:]), "\n".join(lines[errors[0]:])
    if victim == 1:  # found by the heartbeats: half of watchdog_s, long before the runtime's own check
        assert code == 5 and took < 20, (code, took)
        assert re.fullmatch(r"maxlm: error: lost process 1 of 2 \(its heartbeats stopped \d+s ago: it was killed, "
                            r"crashed, or its host went away\); the job cannot continue: restart it, and it resumes "
                            r"from its last checkpoint", lines[errors[0]]), lines[errors[0]]
    elif code == 5:  # the peer monitor's call to the coordinator failed before the runtime noticed (a race)
        assert took < 10, took
        assert re.fullmatch(r"maxlm: error: lost process 0 of 2, the coordinator at 127\.0\.0\.1:\d+ \(.+\); the job "
                            r"cannot continue: restart it, and it resumes from its last checkpoint", lines[errors[0]]), \
            lines[errors[0]]
    else:  # the runtime aborts the survivor at once (SIGABRT); the helper names the coordinator after it
        assert code == -signal.SIGABRT and took < 10, (code, took)
        assert re.fullmatch(r"maxlm: error: lost process 0 of 2, the coordinator at 127\.0\.0\.1:\d+ \(Connection "
                            r"refused\); the JAX runtime ended process 1 at once \(the lines above are its own\)\. The "
                            r"job cannot continue: restart it, and it resumes from its last checkpoint", lines[-1])


# Runs train.py with one start-up phase announced ("PAUSED <phase>" on stdout) and held for a minute, so that a
# test can signal the processes there: "join" (announced as the processes start to join; the test then makes the
# join wait for a third process that never comes), "compile", "restore", or "first step" (the loop has started
# and has not reached its first step boundary).
PHASE_DRIVER = """
import os, sys, time
sys.path.insert(0, %r)
import jax
import train as cli
from maxlm import loop, train

phase = os.environ["MAXLM_TEST_PHASE"]

def paused(name, real, hold=60):
    def call(*args, **kwargs):
        print("PAUSED " + name, flush=True)
        end = time.monotonic() + hold
        while time.monotonic() < end:
            time.sleep(0.05)
        return real(*args, **kwargs)
    return call

if phase == "join":
    jax.distributed.initialize = paused("join", jax.distributed.initialize, hold=0)
elif phase == "compile":
    train.compile_all = paused("compile", train.compile_all)
elif phase == "restore":
    train.initial_state = paused("restore", train.initial_state)
elif phase == "first step":
    class Boundary(loop.Boundary):
        __init__ = paused("first step", loop.Boundary.__init__)
    loop.Boundary = Boundary
sys.exit(cli.main(sys.argv[1:]))
"""
QUIT_LINE = re.compile(r"maxlm: (SIGTERM received|process [01] of 2 received SIGTERM) before the first step: exiting now "
                       r"with code 143; nothing new to save \(re-run the same command to resume\)")
PHASE_ARGS = [*CONTEXT_ARGS[:-3], "log_every=1", "checkpoint.every=2", "sample_tokens=0", "watchdog_s=20"]


def signalled_in(phase: str, run_dir, tmp_path, *extra, victims=(0, 1), env=None):
    """Start the two processes, SIGTERM `victims` once both are in `phase`; both must exit 143 within seconds,
    each with one line after the phase began, having trained and saved nothing."""
    from conftest import ROOT

    driver = tmp_path / "phase_driver.py"
    driver.write_text(PHASE_DRIVER % str(ROOT))
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir()) if (run_dir / "checkpoints").exists() else []
    rows = (run_dir / "metrics.jsonl").read_text() if (run_dir / "metrics.jsonl").exists() else ""
    logs = [open(tmp_path / f"proc{i}.txt", "w") for i in range(2)]
    envs = job_envs()
    if phase == "join":  # a third process that never comes: both wait in the join
        envs = [dict(e, JAX_NUM_PROCESSES="3") for e in envs]
    procs = [start_cli(*PHASE_ARGS, f"run_dir={run_dir}", *extra, devices=1, log=logs[i],
                       env={**e, "MAXLM_TEST_PHASE": phase, **(env or {})}, script=driver)
             for i, e in enumerate(envs)]
    for f in logs:
        f.close()
    texts = lambda: [(tmp_path / f"proc{i}.txt").read_text() for i in range(2)]  # noqa: E731
    t = time.time()
    while time.time() - t < 120 and not all(f"PAUSED {phase}" in x for x in texts()) and \
            all(p.poll() is None for p in procs):
        time.sleep(0.05)
    assert all(f"PAUSED {phase}" in x for x in texts()), texts()
    time.sleep(1.0 if phase == "join" else 0.2)  # into the join's wait for the third process
    t = time.time()
    for i in victims:
        procs[i].send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=60) for p in procs]
    took = time.time() - t
    outs = texts()
    assert codes == [143, 143], outs
    assert took < 15, (took, outs)
    for out in outs:
        after = out.split(f"PAUSED {phase}\n", 1)[1].splitlines()
        said = [line for line in after if "maxlm" in line or "SIGTERM" in line or "Traceback" in line]
        assert len(said) == 1 and QUIT_LINE.fullmatch(said[0]), after
    assert "maxlm: step " not in "".join(o.split(f"PAUSED {phase}", 1)[1] for o in outs)
    # nothing trained, nothing saved, nothing lost
    assert before == (sorted(p.name for p in (run_dir / "checkpoints").iterdir())
                      if (run_dir / "checkpoints").exists() else [])
    assert rows == ((run_dir / "metrics.jsonl").read_text() if (run_dir / "metrics.jsonl").exists() else "")
    return outs, took


@pytest.mark.malformed
@pytest.mark.parametrize("phase", ["join", "compile"])
def test_a_sigterm_while_joining_or_compiling_ends_the_job_at_once(tmp_path, phase):
    """Joining starts JAX's preemption notifier, which took SIGTERM for itself: a signal after the join (here,
    during the compile) was only logged ("SIGTERM caught") and the job trained on. Now every process exits 143
    at once with one line, at each phase before the first step."""
    signalled_in(phase, tmp_path / "run", tmp_path)


@pytest.mark.malformed
@pytest.mark.slow  # ~60 s: a first run to save a checkpoint, then three signalled restarts
def test_a_sigterm_while_restoring_or_before_the_first_step_keeps_the_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    two_processes(run_dir, tmp_path, *PHASE_ARGS[1:], args=PHASE_ARGS[:1], devices=1)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["2", "4"]
    for phase in ("restore", "first step"):
        signalled_in(phase, run_dir, tmp_path, "steps=8")
    # One process alone signalled (one pod of a job evicted): the other quits when its peer monitor sees it.
    outs, took = signalled_in("restore", run_dir, tmp_path, "steps=8", victims=(1,))
    assert "maxlm: process 1 of 2 received SIGTERM before the first step" in outs[0]
    # And the run resumes from its checkpoint as if nothing happened.
    outs = two_processes(run_dir, tmp_path, *PHASE_ARGS[1:], "steps=6", args=PHASE_ARGS[:1], devices=1)
    assert "resuming from step 4" in outs[0]
