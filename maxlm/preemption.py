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

From the start of `maxlm.train.run` to its end, this module owns SIGTERM, SIGINT and SIGHUP (`owned`).
Before the loop (joining the job, checking inputs, restoring, compiling, starting the data) and at the
loop's start, up to its first step boundary, a signal ends the process at once: there is nothing new to
save, and a scheduler's grace time must not be spent compiling. A thread that reads the signal from
Python's wakeup fd acts on it, so a main thread blocked in C++ (a join, a compile, a restore) does not
delay it. In a job of several processes the first to quit publishes it (QUIT) and every other process
quits too, as soon as its peer monitor, its step boundary or a failed collective sees it; process 0, the
coordinator, exits last, since the runtime aborts every other process when it goes. Joining the job
(`jax.distributed.initialize`) starts JAX's preemption notifier, which takes SIGTERM for itself (it logs
"SIGTERM caught" and nothing else happens): `reclaim` takes it back at once. SIGHUP (a closed terminal or
SSH session) is SIGTERM: save, exit 143. After the loop a signal lets the last save finish.
"""

import contextlib
import json
import os
import signal
import stat
import sys
import threading
import time

import jax

# Exit codes. SIGINT is a person choosing to stop: success. SIGTERM is the system taking the machine
# away: the run is not finished, and a non-zero code makes Kubernetes/Slurm retry it (it resumes)
# rather than mark the job complete.
# SIGHUP (the terminal or SSH session closed) is SIGTERM: nobody chose to stop the run.
EXIT_CODES = {signal.SIGINT: 0, signal.SIGTERM: 128 + signal.SIGTERM, signal.SIGHUP: 128 + signal.SIGTERM}
# When Slurm ends a job (a preemption without GraceTime, the time limit), it sends the job's processes
# SIGTERM twice (not always), milliseconds apart (its notice, then its kill), and SIGKILL only KillWait (30 s by
# default) later. Taking the second as "now" lost that time: a SIGTERM this soon after the first is the
# same request. Seen 11 ms apart on a real Slurm (docs/launch.md, "Slurm: signals and requeues").
DUPLICATE_S = 1.0
AHEAD = 2  # a published target is this many steps past its publisher's (see the module's docstring)
QUIT = "maxlm/boundary/quit"  # a process quit before the first step: every process quits (under Boundary.KEY)
GONE = "maxlm/gone/"  # + process index: that process quit (process 0 waits for them before it goes)


def _kind(signum: int) -> int:
    """What a signal asks for: SIGHUP asks what SIGTERM does."""
    return signal.SIGTERM if signum == signal.SIGHUP else signum


def _say(line: str) -> None:
    """A line on stderr that never raises (the terminal may be gone: SIGHUP)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError, RuntimeError):  # RuntimeError: a print in progress that the signal cut into
        try:
            os.write(2, (line + "\n").encode())
        except OSError:
            pass


def _terminal_gone() -> None:
    """After SIGHUP the terminal is closed: writes to it would fail (EIO) and end the run before its save.
    Standard output and error that are a terminal go to /dev/null from now on (as nohup would have)."""
    devnull = None
    for fd in (1, 2):
        try:
            st = os.fstat(fd)
            if stat.S_ISCHR(st.st_mode) and os.path.realpath(f"/proc/self/fd/{fd}") != os.devnull:
                devnull = devnull if devnull is not None else os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, fd)
        except OSError:
            pass
    if devnull is not None:
        os.close(devnull)


class Interrupted(BaseException):
    """A stop request that came while the loop waited for data (see `StopRequest.interruptible`). A
    BaseException, so that no `except Exception` in a data library swallows it."""


class StopRequest:
    """The loop's signals: the first asks for a stop at a step boundary (a flag), a second for an exit now.
    Under `owned` (a training run) it takes the signals from the process's owner while the loop runs;
    alone (a test), it installs its own handlers."""

    def __init__(self):
        self.signum: int | None = None
        self._since = 0.0  # when the first signal came (time.monotonic)
        self._previous = {}
        self._interruptible = False
        self._after = False  # the loop has ended: a signal lets the last save finish
        self._started = False  # the loop passed its first step boundary (Boundary.at): signals stop it there
        self._owner = None

    def __enter__(self):
        self._owner = _owner
        if self._owner is not None:
            self._owner.enter(self)
        else:
            for sig in _signals():
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        if self._owner is not None:
            self._owner.leave(self)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        if signum == signal.SIGHUP:
            _terminal_gone()
        if self.signum is not None and _kind(signum) == _kind(self.signum) == signal.SIGTERM and \
                time.monotonic() - self._since < DUPLICATE_S:
            _say(f"maxlm: {signal.Signals(signum).name} again {time.monotonic() - self._since:.3f}s later: the same "
                 f"request (Slurm sends two when it ends a job); still saving")
            return
        if self.signum is not None:
            _say(f"maxlm: second {signal.Signals(signum).name}: exiting now without saving")
            os._exit(128 + _kind(signum))
        if self._owner is not None and not self._started:  # nothing dispatched yet: nothing to save
            self._owner.quit(signum)
        self.signum, self._since = signum, time.monotonic()
        if self._after:
            _say(f"maxlm: {signal.Signals(signum).name} received after the last step: letting its save finish, "
                 f"then exiting (send it again to exit at once)")
            return
        _say(f"maxlm: {signal.Signals(signum).name} received: saving at the end of this step, then exiting "
             f"(send it again to exit at once)")
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
        if not self.stop._started:  # the loop's first boundary: a signal until now quits (StopRequest._handle)
            self.stop._started = True
            if self.stop.requested() and self.stop._owner is not None:
                self.stop._owner.quit(self.stop.signum)
        if self.client is None:
            return self.stop.requested(), due
        if self.stop.requested() and not self._published_stop:
            self._published_stop = True
            self._publish("stop", json.dumps({"step": done + AHEAD, "signal": self.stop.signum,
                                              "process": jax.process_index()}), overwrite=False)
        if due and jax.process_index() == 0 and (self.save_at is None or self.save_at < done):
            self._publish("save", str(done + AHEAD), overwrite=True)
        found = dict((k.rsplit("/", 1)[1], v) for k, v in self.client.key_value_dir_get(self.KEY))
        if "quit" in found:  # a process quit before its first step: this step cannot finish without it
            quit_for(found["quit"])
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


class _Owner:
    """The process's SIGTERM, SIGINT and SIGHUP while a training run runs (`owned`). Python's C handler
    writes each signal's number to a pipe (signal.set_wakeup_fd) that a thread reads: it acts on a signal
    before the loop, whatever the main thread is blocked in. The loop's StopRequest takes the signals
    while the loop runs (`enter`, `leave`): the Python-level handler passes them on to it."""

    def __init__(self):
        self.loop: StopRequest | None = None  # the loop's, while it runs
        self.last: StopRequest | None = None  # the loop's, after it ended
        self.pending = None  # a signal the Python-level handler saw before the loop (the thread quits for it)
        self._quitting = threading.Lock()
        self._previous = {}
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._old_wakeup = None
        self._thread = threading.Thread(target=self._watch, name="maxlm-signals", daemon=True)

    def install(self) -> None:
        for sig in _signals():
            self._previous[sig] = signal.signal(sig, self._handle)
        self._old_wakeup = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread.start()

    def uninstall(self) -> None:
        if self.pending is not None and self.loop is None and self.last is None:  # the thread has yet to act
            self.quit(self.pending)
        signal.set_wakeup_fd(self._old_wakeup)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        os.close(self._write)  # the thread's read returns b"": it ends

    def reclaim(self) -> None:
        """Take the signals back from whatever installed a C-level handler over ours (JAX's preemption
        notifier, when the job is joined). signal.signal always installs Python's C handler again."""
        for sig in self._previous:
            signal.signal(sig, self._handle)

    def enter(self, stop: StopRequest) -> None:
        self.loop = stop
        if self.pending is not None:  # seen by the handler before the loop, maybe not yet by the thread
            self.quit(self.pending)

    def leave(self, stop: StopRequest) -> None:
        stop._after = True
        self.last, self.loop = stop, None

    def _handle(self, signum, frame) -> None:
        """The Python-level handler (the main thread, between bytecodes)."""
        stop = self.loop or self.last
        if stop is not None:
            stop._handle(signum, frame)
        else:
            self.pending = signum  # the thread quits for it

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._read, 64)
            except OSError:
                return
            if not data:
                os.close(self._read)
                return
            for signum in data:
                if signum in EXIT_CODES and self.loop is None and self.last is None:
                    self.quit(signum)

    def quit(self, signum: int, by: int | None = None) -> None:
        """End the process now, before its first step, with one line: `signum` came to this process, or
        (by) to process `by` of the job. Every process of a job quits; process 0 goes last."""
        self._quitting.acquire()  # the first caller wins; any other waits for the exit
        name, code = signal.Signals(signum).name, EXIT_CODES[signum]
        if signum == signal.SIGHUP and by is None:
            _terminal_gone()
        client, me, n = _job()
        if client is not None and by is None:
            try:
                client.key_value_set(QUIT, json.dumps({"process": me, "signal": signum}), allow_overwrite=False)
            except Exception:  # noqa: BLE001 - another process published first, or the coordinator is gone
                pass
        who = f"{name} received" if by is None else f"process {by} of {n} received {name}"
        _say(f"maxlm: {who} before the first step: exiting now with code {code}; nothing new to save (re-run the "
             f"same command to resume)")
        if client is not None:
            if me:
                with contextlib.suppress(Exception):
                    client.key_value_set(f"{GONE}{me}", "1", allow_overwrite=True)
            else:  # the coordinator goes last: the runtime aborts every other process when it goes
                end = time.monotonic() + QUIT_WAIT_S
                while time.monotonic() < end:
                    try:
                        if len(client.key_value_dir_get(GONE)) >= n - 1:
                            time.sleep(0.3)  # their os._exit, after their key
                            break
                    except Exception:  # noqa: BLE001
                        break
                    time.sleep(0.05)
        os._exit(code)


QUIT_WAIT_S = 20.0  # process 0 waits this long for the others to quit before it goes (their monitors beat every <= 5 s)
_owner: _Owner | None = None


def _signals() -> list[int]:
    """The signals a run handles: SIGHUP only where it is not ignored (nohup: the user wants the run to go on)."""
    sigs = [signal.SIGINT, signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
        sigs.append(signal.SIGHUP)
    return sigs


_joined = False  # maxlm.distributed has joined this process to a multi-process job (it says so: `joined`)


def joined() -> None:
    """Called by maxlm.distributed once every process has joined and is watched: from then on a quit before
    the first step is the whole job's."""
    global _joined
    _joined = True


def _job():
    """(the coordination client, this process's index, the process count), or (None, 0, 1) alone or while
    still joining."""
    if not _joined:
        return None, 0, 1
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client, jax.process_index(), jax.process_count()


@contextlib.contextmanager
def owned():
    """This process's signals belong to the training run inside: before the loop a signal ends the process
    at once (exit 143 for SIGTERM and SIGHUP, 0 for SIGINT); in the loop, StopRequest's. In the main thread
    only (elsewhere, a no-op: signals reach only the main thread's handlers); nested, the outer one owns."""
    global _owner
    if _owner is not None or threading.current_thread() is not threading.main_thread():
        yield
        return
    owner = _Owner()
    owner.install()
    _owner = owner
    try:
        yield
    finally:
        _owner = None
        owner.uninstall()


def owning() -> bool:
    """Whether a training run owns this process's signals now."""
    return _owner is not None


def reclaim() -> None:
    """After jax.distributed.initialize: its preemption notifier took SIGTERM; take it back."""
    if _owner is not None:
        _owner.reclaim()


def quit_for(published: str) -> None:
    """Another process quit before its first step (`published`: QUIT's value): quit too, now. Called from
    the peer monitor, a step boundary and a failed collective. Outside a run (`owned`), it does nothing."""
    if _owner is None:
        return
    agreed = json.loads(published)
    _owner.quit(agreed["signal"], by=agreed["process"])


def _at_fork_child() -> None:
    """A forked child (a data worker) is not the run: it gets the signals' previous handlers back, and does
    not write into the run's pipe."""
    global _owner
    owner, _owner = _owner, None
    if owner is not None:
        with contextlib.suppress(Exception):
            signal.set_wakeup_fd(-1)
            for sig, handler in owner._previous.items():
                signal.signal(sig, handler)


os.register_at_fork(after_in_child=_at_fork_child)
