"""Multi-process start-up: join the job's other processes before anything touches a device, then watch them.

One process per host (TPU VM, GPU node) or per GPU. maxlm calls `jax.distributed.initialize` when:
  - JAX_COORDINATOR_ADDRESS is set (host:port of process 0), with JAX_NUM_PROCESSES and JAX_PROCESS_ID
    (any launcher, and localhost tests); every local device is used unless JAX_LOCAL_DEVICE_IDS says
    otherwise;
  - Slurm started more than one task (srun): maxlm reads the Slurm variables itself (`slurm_job`);
  - a Cloud TPU (a TPU VM or a GKE TPU pod): JAX reads the hosts and slices from the TPU metadata or the
    variables GKE injects (TPU_WORKER_*, MEGASCALE_*). Joining on every TPU machine, a single host
    included, is what makes a multi-host TPU VM or a second slice of one-host slices join at all: the
    environment does not always say so (TPU VMs keep their worker list in the metadata server).
Otherwise the run is single-process. A job that looks multi-process but cannot join fails loudly,
rather than training N independent copies of the model.

Joining may take `watchdog_s` (processes of a big job start minutes apart: image pulls, node boot);
then the process exits 5 naming the coordinator's address. Once joined, a peer monitor notices a process
that died (its heartbeats stop) and ends every other process with one line naming it, well before the
runtime's own heartbeat check would abort them with a C++ stack trace.
"""

import atexit
import math
import os
import re
import socket
import threading
import time
from typing import NoReturn

import jax
from jax._src import distributed as jax_distributed

from maxlm import preemption, watchdog
from maxlm.errors import ConfigError

JOIN_S_WITHOUT_WATCHDOG = 300  # joining with watchdog_s=0: JAX's own default limit
# A dead peer is declared after this long without a heartbeat, or half of watchdog_s if that is shorter (the
# watchdog then sees the stalled step later, and the line names the lost process rather than the wait). Well
# under two minutes, yet far above any pause of a live process's heartbeat thread (it needs the GIL briefly).
PEER_TIMEOUT_S = 60
RUNTIME_HEARTBEAT = 4  # JAX's own heartbeat timeout, in multiples of ours
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
# Where a Slurm step says how many tasks each node runs, most precise first: srun's layout of this step,
# --ntasks-per-node, and the allocation's layout ("2(x3),1": three nodes with 2 tasks, then one with 1).
SLURM_TASKS_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


def _int_env(var: str, default: str | None = None) -> int:
    value = os.environ.get(var, default)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{var}={value!r} must be an integer") from None


def find_job() -> tuple[str, dict] | None:
    """(how the job was found, keyword arguments for jax.distributed.initialize), or None: one process."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        if not {"JAX_NUM_PROCESSES", "JAX_PROCESS_ID"} <= os.environ.keys():
            raise ConfigError("JAX_COORDINATOR_ADDRESS is set: also set JAX_NUM_PROCESSES and JAX_PROCESS_ID "
                              "(integers)")
        # "deactivate": no cluster detection filling in local_device_ids behind our back (under Slurm it
        # would keep one GPU per process).
        return "JAX_COORDINATOR_ADDRESS", dict(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"], num_processes=_int_env("JAX_NUM_PROCESSES"),
            process_id=_int_env("JAX_PROCESS_ID"), cluster_detection_method="deactivate")
    if _int_env("SLURM_NTASKS", "1") > 1:
        return "Slurm", slurm_job()
    # One worker is one process: a compile for a TPU topology (platforms.compile_only_tpu) names a lone
    # `localhost`, and a later run in the same process (a notebook, a test) must not take it for a job.
    workers = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(workers) > 1 or _int_env("MEGASCALE_NUM_SLICES", "1") > 1 or _has_tpu():
        return "Cloud TPU", {}
    return None


def _has_tpu() -> bool:
    from jax._src import hardware_utils

    return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0


def slurm_job() -> dict:
    """jax.distributed.initialize's arguments for a Slurm step. JAX's own detection gives each process only
    the device numbered SLURM_LOCALID, which is right for one task per GPU and silently wrong for one task
    per node (1 GPU of 8 used); here a task sees every device of its node unless it shares the node."""
    from jax._src.clusters.slurm_cluster import SlurmCluster

    missing = [v for v in SLURM_VARS if v not in os.environ]
    if missing:
        raise ConfigError(f"SLURM_NTASKS={os.environ['SLURM_NTASKS']} says this is a multi-process Slurm job, but "
                          f"{missing[0]} is not set: start every process with srun")
    shared = tasks_on_this_node() > 1
    return dict(coordinator_address=SlurmCluster.get_coordinator_address(None, os.environ.get("JAX_COORDINATOR_PORT")),
                num_processes=_int_env("SLURM_NTASKS"), process_id=_int_env("SLURM_PROCID"),
                local_device_ids=[_int_env("SLURM_LOCALID")] if shared else None,
                cluster_detection_method="deactivate")


def tasks_on_this_node() -> int:
    var = next((v for v in SLURM_TASKS_PER_NODE if os.environ.get(v)), None)
    if var is None:
        raise ConfigError(f"Slurm does not say how many tasks run on this node (none of {', '.join(SLURM_TASKS_PER_NODE)} "
                          f"is set): start every process with srun")
    counts = []
    for item in os.environ[var].split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise ConfigError(f"{var}={os.environ[var]!r}: cannot read the tasks per node (expected e.g. 8 or 2(x3),1)")
        counts += [int(m[1])] * int(m[2] or 1)
    node = _int_env("SLURM_NODEID", "0")
    return counts[node] if node < len(counts) else max(counts)


def initialize(watchdog_s: int = 0) -> str:
    """Join the job if there is one, and start watching its processes; return a line for the log."""
    found = find_job()
    if found is None:
        return "single process"
    how, kwargs = found
    join_s = watchdog_s or JOIN_S_WITHOUT_WATCHDOG
    peer_s = min(PEER_TIMEOUT_S, watchdog_s / 2) if watchdog_s else PEER_TIMEOUT_S
    address = kwargs.get("coordinator_address") or "(found by JAX)"
    n, i = kwargs.get("num_processes", "?"), kwargs.get("process_id", "?")
    if i == 0 and (busy := port_in_use(address)):  # JAX's runtime would crash on it (a segfault)
        raise ConfigError(f"process 0 hosts the job's coordinator at {address}, but that port is in use on this host "
                          f"({busy}): another job or an earlier run holds it; free it, or choose another port "
                          f"(JAX_COORDINATOR_ADDRESS's, or JAX_COORDINATOR_PORT under Slurm)")
    with watchdog.Watchdog(join_s, stacks=False) as wd:
        wd.mark(f"the job's {n} processes to join through the coordinator at {address} (this is process {i})",
                lambda: _join_advice(address, i))
        try:
            # The runtime's own limits come after ours, so that our line, not its abort, ends the log. Its
            # heartbeat check may fire after only half its timeout (seen: 11 s of 20), hence 4x ours.
            jax.distributed.initialize(**kwargs, initialization_timeout=join_s + 60,
                                       heartbeat_timeout_seconds=math.ceil(RUNTIME_HEARTBEAT * peer_s))
            # Joining started JAX's preemption notifier, whose handler took SIGTERM: a signal from now on
            # would only be logged ("SIGTERM caught"). Take it back at once (maxlm.preemption).
            preemption.reclaim()
        except Exception as e:  # noqa: BLE001 - the job must not silently run as N single processes
            raise ConfigError(f"{how} says this is a multi-process job, but jax.distributed.initialize failed: "
                              f"{str(e).strip().splitlines()[0]}") from None
        line = (f"process {jax.process_index()} of {jax.process_count()} ({how}); "  # also waits for every
                f"{jax.local_device_count()} local of {jax.device_count()} devices")  # process's devices
    global _monitor
    address = jax_distributed.global_state.coordinator_address
    _monitor = PeerMonitor(jax_distributed.global_state.client, jax.process_index(), jax.process_count(), address,
                           peer_s)
    _monitor.start()
    preemption.joined()
    if jax.process_index():
        watchdog.start_reporter(address, jax.process_index(), jax.process_count())
    return line


def port_in_use(address: str) -> str | None:
    """Why the coordinator could not listen on address's port here (as it does: every interface, port reuse
    allowed), or None."""
    family = socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET  # IPv6's wildcard also covers IPv4
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", int(address.rsplit(":", 1)[1])))
        except OSError as e:
            return e.strerror or str(e)
    return None


def _join_advice(address: str, process) -> str:
    if process == 0:
        return ("not every process connected to it: check that all of them were started, with the same "
                "coordinator address and process count; raise watchdog_s if they start further apart")
    if ":" not in address:  # found by JAX's cluster detection, after our deadline passed
        return "check that every process was started and that this host can reach process 0"
    why = watchdog.reachable(address)
    if why:
        return (f"the coordinator cannot be reached ({why}): check that process 0 is running and that this host "
                f"can reach {address}")
    return ("the coordinator answers, but not every process joined: check that all of them were started, with "
            "the same process count; raise watchdog_s if they start further apart")


_monitor = None  # this process's PeerMonitor, once joined


def collective_failed(e: Exception) -> NoReturn:
    """A device computation failed in a multi-process job (on CPU, gloo reports a peer's closed connection
    at once; on GPU, NCCL may instead hang until the watchdog). That is almost always a lost process: wait
    for the peer monitor to name it (the verdict takes its timeout), then end with its one line and exit 5,
    a retry code. Leaving through Python instead would print a traceback and then wait in JAX's shutdown
    barrier until the runtime aborted the process."""
    verdict = _monitor.wait_verdict(_monitor.timeout + 3 * _monitor.period)
    if verdict:
        watchdog.die(verdict)
    watchdog.die(f"the step failed on process {_monitor.process} of {_monitor.n} and no process was found lost "
                 f"({str(e).strip().splitlines()[0][:300]}); {PeerMonitor.ADVICE}")


def joined() -> bool:
    """Whether this process is one of a multi-process job's (and its peers are watched)."""
    return _monitor is not None


class PeerMonitor:
    """Every `timeout`/10 s (at most 5) each process bumps a heartbeat counter in the coordinator's store.
    Process 0 reads them all: a counter that has not moved for `timeout` seconds is a lost process. It
    publishes the verdict, which the others read at their next beat, and every process exits 5 with the
    same line. A process whose calls to the coordinator fail exits naming it. The runtime's own heartbeat
    timeout is four times ours (`initialize`), so this line comes first.

    Each beat is a few quick calls and the wait between beats is a Python one: at exit the thread stops
    at once, and never sits in a C++ call while the interpreter shuts down (that aborts the process)."""

    BEAT, LOST = "maxlm/beat/", "maxlm/lost"
    ADVICE = "the job cannot continue: restart it, and it resumes from its last checkpoint"

    def __init__(self, client, process: int, n: int, address: str, timeout: float):
        self.client, self.process, self.n, self.address, self.timeout = client, process, n, address, timeout
        self.period = min(max(timeout / 10, 0.5), 5.0)
        self.seen: dict[int, tuple[str, float]] = {}  # process -> (its last counter, when that changed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="maxlm-peers", daemon=True)

    def start(self) -> None:
        atexit.register(self.stop)  # runs before JAX's own clean-up, registered earlier (last in, first out)
        self._thread.start()

    def stop(self) -> None:
        """A finished process is not a lost one: stop beating, and say so."""
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            self.client.key_value_set(f"{self.BEAT}{self.process}", "done", allow_overwrite=True)
        except jax.errors.JaxRuntimeError:
            pass  # the coordinator is gone: there is nobody left to tell

    def _run(self) -> None:
        beats = 0
        # A coordinator that stops answering without failing (a hung host: calls never return) is a stall too.
        with watchdog.Watchdog(self.timeout * 1.5, stacks=False) as answered:
            while not self._stop.wait(self.period):
                answered.mark(f"an answer from the coordinator at {self.address} (process 0 of {self.n})",
                              f"it stopped answering; {self.ADVICE}")
                try:
                    verdict = self._verdict()
                    if verdict:
                        watchdog.die(verdict)
                    self._quit()
                    beats += 1
                    if self.process:
                        self.client.key_value_set(f"{self.BEAT}{self.process}", str(beats), allow_overwrite=True)
                    else:
                        self._judge()
                except jax.errors.JaxRuntimeError as e:
                    if self._stop.is_set():
                        return
                    watchdog.die(self._coordinator_lost(e))

    def wait_verdict(self, seconds: float) -> str | None:
        """The job's verdict on a lost process, waiting up to `seconds` for one (process 0's monitor thread
        publishes it). A coordinator that no longer answers is the lost process: the failed step was its
        peers' first sight of that, often before this process's monitor thread beats again."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                verdict = self._verdict()
                self._quit()  # a process quit before its first step: this step's failure is that
            except jax.errors.JaxRuntimeError as e:
                return self._coordinator_lost(e)
            if verdict:
                return verdict
            time.sleep(0.2)
        return None

    def _coordinator_lost(self, e: Exception) -> str:
        return (f"lost process 0 of {self.n}, the coordinator at {self.address} ({str(e).strip().splitlines()[0]}); "
                f"{self.ADVICE}")

    def _quit(self) -> None:
        """A process was signalled before its first step and quit: quit too (maxlm.preemption.QUIT)."""
        if not preemption.owning():  # not a training run's process (a test's monitor)
            return
        try:
            published = self.client.key_value_try_get(preemption.QUIT)
        except jax.errors.JaxRuntimeError as e:
            if str(e).startswith("NOT_FOUND"):
                return
            raise
        preemption.quit_for(published)

    def _verdict(self) -> str | None:
        try:
            return self.client.key_value_try_get(self.LOST)
        except jax.errors.JaxRuntimeError as e:
            if str(e).startswith("NOT_FOUND"):
                return None
            raise

    def _judge(self) -> None:
        now = time.monotonic()
        for key, value in self.client.key_value_dir_get(self.BEAT):
            k = int(key.rsplit("/", 1)[1])
            if self.seen.get(k, ("",))[0] != value:
                self.seen[k] = (value, now)
        for k in range(1, self.n):
            value, since = self.seen.setdefault(k, ("", now))  # not seen yet: counted from the first look
            if value != "done" and now - since > self.timeout:
                verdict = (f"lost process {k} of {self.n} (its heartbeats stopped {now - since:.0f}s ago: it was "
                           f"killed, crashed, or its host went away); {self.ADVICE}")
                self.client.key_value_set(self.LOST, verdict, allow_overwrite=True)
                time.sleep(self.period + 0.5)  # the others read the verdict before their coordinator (this process) goes
                watchdog.die(verdict)



class HostGather:
    """Small integer vectors from every process, through the coordination service's key-value store: no
    device computation, so gathering never waits for the step in flight (process_allgather would queue
    behind it and hold the host until the step ends). Each call publishes this process's vector under a
    key numbered by the call and blocks for the others'; a key is deleted two calls later, by which time
    every process has read it."""

    def __init__(self, name: str, timeout_s: float = 1800):
        self.prefix, self.timeout_ms, self.calls = f"maxlm/gather/{name}/", int(timeout_s * 1000), 0
        self.client = jax_distributed.global_state.client

    def __call__(self, values) -> "np.ndarray":
        import numpy as np

        me, n, k = jax.process_index(), jax.process_count(), self.calls
        self.calls += 1
        self.client.key_value_set(f"{self.prefix}{k}/{me}", ",".join(str(int(v)) for v in np.ravel(values)))
        rows = [np.array([int(x) for x in self.client.blocking_key_value_get(f"{self.prefix}{k}/{i}",
                                                                              self.timeout_ms).split(",")])
                for i in range(n)]
        if k >= 2:
            self.client.key_value_delete(f"{self.prefix}{k - 2}/{me}")
        return np.stack(rows)
