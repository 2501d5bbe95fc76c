"""SIGTERM and SIGINT ask the loop to stop at a step boundary; it then saves and exits. The checkpointer's
time cadence (`checkpoint.minutes`) asks for a save. Every process of a job acts after the same step.

Schedulers (Kubernetes, Slurm, TPU maintenance) send SIGTERM and wait a grace period before SIGKILL, so
the handler only sets a flag: the loop finishes the steps in flight, saves, flushes metrics and exits. A
second signal means "now": the process exits at once without saving, unless it is a SIGTERM that
follows the first within DUPLICATE_S (see there).

Several processes must stop (and save) after the same step, or the collective save hangs. They agree
through the coordination service's key-value store, never through a device: a device computation and
its fetch would queue behind the step in flight, so the host could not dispatch step s+1 before step s
ended. A process that must stop (a signal) or save (process 0's clock) publishes a target step two past
its own; each process reads the store once per step. Why two suffices: a process's loop collects step
s-1 before it dispatches step s+1, and step s-1 cannot finish before every process has dispatched it,
so no process is ever more than one step ahead of another's dispatches, and none can pass the target
without reading the store at a boundary before it.
"""

import contextlib
import json
import os
import signal
import sys
import time

import jax

# Exit codes. SIGINT is a person choosing to stop: success. SIGTERM is the system taking the machine
# away: the run is not finished, and a non-zero code makes Kubernetes/Slurm retry it (it resumes)
# rather than mark the job complete.
EXIT_CODES = {signal.SIGINT: 0, signal.SIGTERM: 128 + signal.SIGTERM}
# When Slurm ends a job (a preemption without GraceTime, the time limit), it sends the job's processes
# SIGTERM twice (not always), milliseconds apart (its notice, then its kill), and SIGKILL only KillWait (30 s by
# default) later. Taking the second as "now" lost that time: a SIGTERM this soon after the first is the
# same request. Seen 11 ms apart on a real Slurm (docs/launch.md, "Slurm: signals and requeues").
DUPLICATE_S = 1.0
AHEAD = 2  # a published target is this many steps past its publisher's (see the module's docstring)


class Interrupted(BaseException):
    """A stop request that came while the loop waited for data (see `StopRequest.interruptible`). A
    BaseException, so that no `except Exception` in a data library swallows it."""


class StopRequest:
    def __init__(self):
        self.signum: int | None = None
        self._since = 0.0  # when the first signal came (time.monotonic)
        self._previous = {}
        self._interruptible = False

    def __enter__(self):
        for sig in EXIT_CODES:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        if signum == self.signum == signal.SIGTERM and time.monotonic() - self._since < DUPLICATE_S:
            print(f"maxlm: SIGTERM again {time.monotonic() - self._since:.3f}s later: the same request (Slurm "
                  f"sends two when it ends a job); still saving", file=sys.stderr, flush=True)
            return
        if self.signum is not None:
            print(f"maxlm: second {signal.Signals(signum).name}: exiting now without saving", file=sys.stderr,
                  flush=True)
            os._exit(128 + signum)
        self.signum, self._since = signum, time.monotonic()
        print(f"maxlm: {signal.Signals(signum).name} received: saving at the end of this step, then exiting "
              f"(send it again to exit at once)", file=sys.stderr, flush=True)
        if self._interruptible:
            raise Interrupted

    @contextlib.contextmanager
    def interruptible(self):
        """Around the wait for the next batch: a signal that comes during it raises `Interrupted` out of
        it, rather than waiting for a batch that may never come (a stalled file system, a source that
        filters everything out). A signal that came before is `Boundary`'s to act on. In a job of several
        processes the wait is not cut short: they must stop after the step they agreed on (a stalled one
        is the watchdog's, exit 5)."""
        self._interruptible = jax.process_count() == 1
        try:
            yield
        finally:
            self._interruptible = False

    def requested(self) -> bool:
        """This process was signalled (the job's agreement on when to stop is `Boundary`'s)."""
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signum, 0)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class Boundary:
    """At each step boundary, whether to stop (a signal) and whether to save (the checkpointer's time
    cadence, as process 0 sees it): the same answers on every process, agreed as the module's docstring
    says."""

    KEY = "maxlm/boundary/"

    def __init__(self, stop: StopRequest):
        self.stop = stop
        self.client = None
        if jax.process_count() > 1:
            from jax._src import distributed
            self.client = distributed.global_state.client
        self.stop_at = self.save_at = None
        self._published_stop = False

    def at(self, done: int, due: bool) -> tuple[bool, bool]:
        """(stop now, save now), after step `done`; `due`: this process's checkpointer wants a time save."""
        if self.client is None:
            return self.stop.requested(), due
        if self.stop.requested() and not self._published_stop:
            self._published_stop = True
            self._publish("stop", json.dumps({"step": done + AHEAD, "signal": self.stop.signum,
                                              "process": jax.process_index()}), overwrite=False)
        if due and jax.process_index() == 0 and (self.save_at is None or self.save_at < done):
            self._publish("save", str(done + AHEAD), overwrite=True)
        found = dict((k.rsplit("/", 1)[1], v) for k, v in self.client.key_value_dir_get(self.KEY))
        if "stop" in found:
            agreed = json.loads(found["stop"])
            if self.stop.signum is None:  # another process was signalled: stop as it was asked to
                self.stop.signum = agreed["signal"]
                if jax.process_index() == 0:
                    print(f"maxlm: process {agreed['process']} received {self.stop.name}: saving after step "
                          f"{agreed['step']}, then exiting", file=sys.stderr, flush=True)
            self.stop_at = agreed["step"]
        if "save" in found:
            self.save_at = int(found["save"])
        return (self.stop_at is not None and done >= self.stop_at), self.save_at == done

    def _publish(self, name: str, value: str, overwrite: bool) -> None:
        try:
            self.client.key_value_set(self.KEY + name, value, allow_overwrite=overwrite)
        except jax.errors.JaxRuntimeError as e:
            if "ALREADY_EXISTS" not in str(e):  # another process published first: its target stands
                raise
