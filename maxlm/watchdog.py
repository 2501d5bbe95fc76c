"""Stop a process that stopped making progress: at once, saying what it waited for, with exit code 5.

A stalled step, a lost peer or an unreachable coordinator otherwise hangs a job until a person notices;
on a large or preemptible job that is hours of accelerators doing nothing, and a scheduler that sees a
process exit can restart the job (it resumes from its last checkpoint). Each way out ends the process's
log with one `maxlm: error:` line:
  - `Watchdog`: the training loop marks what it starts waiting for (data for step N, step N on device,
    a checkpoint save, an evaluation, joining the job); no new mark within `watchdog_s` seconds prints
    every thread's stack and exits 5.
  - the peer monitor in `maxlm.distributed`: another process's heartbeats stopped.
  - `start_reporter`: when the coordinator's process dies, the JAX runtime aborts every other process
    from a C++ thread within a millisecond, before any Python code can run. A small helper process
    outlives this one and prints the line after the runtime's own.

Standard library only: `start_reporter` runs this file as a script.
"""

import faulthandler
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import NoReturn

EXIT_STALLED = 5  # the job stopped making progress: a stall, a lost peer, an unreachable coordinator

_dying = threading.Lock()
_helper = None  # start_reporter's helper process


def die(msg: str, stacks: bool = False, code: int = EXIT_STALLED) -> NoReturn:
    """End this process now, from any thread, with `maxlm: error: msg` as its last line and exit `code`.

    The main thread may be blocked in C++ (a collective, a read) and never return to Python, so nothing
    is unwound: os._exit. The line goes straight to file descriptor 2, which no Python lock can hold up.
    The first caller wins; a second waits for the exit."""
    _dying.acquire()
    if stacks:
        faulthandler.dump_traceback(file=sys.stderr.fileno(), all_threads=True)
    os.write(2, f"maxlm: error: {msg}\n".encode())
    os._exit(code)


class Watchdog:
    """`mark(what, fix)` whenever the caller starts waiting for something new; `seconds` without another
    mark ends the process (`die`) naming `what`, with `fix` (a string, or a function called then) as the
    advice. Armed by `with`, disarmed on leaving it; seconds=0 never arms."""

    def __init__(self, seconds: float, stacks: bool = True):
        self.seconds, self.stacks = seconds, stacks
        self._phase = ("the first mark", "", time.monotonic())  # (what, fix, since): replaced whole, never torn
        self._off = threading.Event()

    def __enter__(self):
        if self.seconds:
            self._off.clear()
            self._phase = (*self._phase[:2], time.monotonic())
            threading.Thread(target=self._watch, name="maxlm-watchdog", daemon=True).start()
        return self

    def __exit__(self, *exc):
        self._off.set()

    def mark(self, what: str, fix) -> None:
        self._phase = (what, fix, time.monotonic())

    def _watch(self) -> None:
        # Polling (not a Timer per mark): marks come every step, and a poll costs nothing.
        while not self._off.wait(min(self.seconds / 10, 5.0)):
            what, fix, since = self._phase
            if time.monotonic() - since > self.seconds and not self._off.is_set():
                fix = fix() if callable(fix) else fix
                stacks = " (every thread's stack is above)" if self.stacks else ""
                die(f"no progress for {self.seconds:g}s while waiting for {what}{stacks}; {fix}", self.stacks)


def reachable(address: str, timeout: float = 5.0) -> str | None:
    """None if a TCP connection to host:port opens, else why not ("Connection refused", ...)."""
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
        return None
    except OSError as e:
        return e.strerror or str(e) or type(e).__name__


def start_reporter(address: str, process: int, n: int) -> None:
    """Leave a helper process that reports this one's death by the runtime's abort when the cause is the
    coordinator's death (it cannot be reached any more). It learns of the abort through faulthandler,
    whose SIGABRT dump goes into the helper's stdin; any other end (a normal exit, `die`, a kill) sends
    nothing, and the helper leaves silently when the pipe closes."""
    global _helper
    read, write = os.pipe()
    forward = faulthandler.is_enabled()  # PYTHONFAULTHANDLER asked for the dump in the log: pass it on
    _helper = subprocess.Popen([sys.executable, "-P", __file__, address, str(process), str(n), str(int(forward))],
                               stdin=read, stdout=subprocess.DEVNULL)
    os.close(read)
    faulthandler.enable(file=write, all_threads=True)  # the write end stays open until the process ends


def _report(address: str, process: int, n: int, forward: bool) -> int:
    """The helper: wait until the trainer has exited; speak only for a runtime abort with the coordinator gone."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # a job's signals are for the trainer, which decides
        signal.signal(sig, signal.SIG_IGN)
    dump = sys.stdin.buffer.read()  # returns when the trainer's write end closes: when it has exited
    if forward and dump:
        os.write(2, dump)
    why = reachable(address) if b"Fatal Python error" in dump else None
    if why:
        os.write(2, (f"maxlm: error: lost process 0 of {n}, the coordinator at {address} ({why}); the JAX runtime "
                     f"ended process {process} at once (the lines above are its own). The job cannot continue: "
                     f"restart it, and it resumes from its last checkpoint\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(_report(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"))
