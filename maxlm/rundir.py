"""The run directory: made, or checked writable, before anything compiles; and held by one job at a time."""

import contextlib

import jax
import numpy as np
from jax.experimental import multihost_utils

from maxlm import config, runlock, storage
from maxlm.log import log


def make_dirs(cfg, run_dir: str) -> None:
    """Make run_dir (and a local checkpoint.dir), or check that a gs:// one can be written: a path that
    cannot be one is a one-line error before anything compiles."""
    note = storage.use_emulator()
    if note:
        log(note)
    for key, d in (("run_dir", run_dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        if not d:
            continue
        if "://" in d:  # on every process, as each writes its own checkpoint shards
            storage.check_writable(key, d)
        else:
            storage.prepare_dir(key, d)


@contextlib.contextmanager
def job_lock(cfg, run_dir: str):
    """One job per run_dir: process 0 takes the lock once the job has joined, and every process learns
    whether it got it (so a refused job stops everywhere, not only on process 0)."""
    if "://" in cfg.checkpoint.dir:
        log(f"note: checkpoint.dir {cfg.checkpoint.dir} cannot be locked; the lock on run_dir guards it only "
            f"against jobs that share this run_dir")
    if jax.process_count() == 1:
        with runlock.hold(run_dir, log):
            yield
        return
    with contextlib.ExitStack() as stack:
        error = ""
        if jax.process_index() == 0:
            try:
                stack.enter_context(runlock.hold(run_dir, log))
            except config.ConfigError as e:
                error = str(e)
        if not multihost_utils.broadcast_one_to_all(np.int32(not error)):
            raise config.ConfigError(error or f"`run_dir` {run_dir} is in use by another job (process 0 says so)")
        yield
