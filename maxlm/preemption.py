"""SIGTERM and SIGINT ask the loop to stop at the next step boundary; it then saves and exits.

Schedulers (Kubernetes, Slurm, TPU maintenance) send SIGTERM and wait a grace period before SIGKILL, so
the handler only sets a flag: the loop finishes the step in flight, saves it, flushes metrics and
exits. A second signal means "now": the process exits at once without saving.
"""

import os
import signal
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils

# Exit codes. SIGINT is a person choosing to stop: success. SIGTERM is the system taking the machine
# away: the run is not finished, and a non-zero code makes Kubernetes/Slurm retry it (it resumes)
# rather than mark the job complete.
EXIT_CODES = {signal.SIGINT: 0, signal.SIGTERM: 128 + signal.SIGTERM}


class StopRequest:
    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def __enter__(self):
        for sig in EXIT_CODES:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        if self.signum is not None:
            print(f"maxlm: second {signal.Signals(signum).name}: exiting now without saving", file=sys.stderr,
                  flush=True)
            os._exit(128 + signum)
        self.signum = signum
        print(f"maxlm: {signal.Signals(signum).name} received: saving at the end of this step, then exiting "
              f"(send it again to exit at once)", file=sys.stderr, flush=True)

    def requested(self) -> bool:
        """True on every process once any process has been signalled. With several processes this is a
        small all-gather per step: they must agree on the step they save, or the collective save hangs."""
        if jax.process_count() == 1:
            return self.signum is not None
        flags = multihost_utils.process_allgather(np.int32(self.signum or 0))
        if self.signum is None and flags.any():
            self.signum = int(flags.max())
            if jax.process_index() == 0:
                print(f"maxlm: another process received {self.name}: saving at the end of this step, then exiting",
                      file=sys.stderr, flush=True)
        return bool(flags.any())

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signum, 0)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name
