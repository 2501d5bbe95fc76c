"""One job per run directory: a lock file that the kernel releases when the holder dies.

`flock` on `<run_dir>/.lock` is held for the whole run by process 0 of the job (the processes of one
multi-host job share a run_dir by design, so only the job, not each process, takes it). The file says
who holds it (pid, host, start time), so a refusal can name the other job. A file left behind by a job
that died unlocks by itself: the next job takes it over and says so.
"""

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from maxlm.config import ConfigError

NAME = ".lock"


def _describe(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {started}"


@contextlib.contextmanager
def hold(run_dir: Path, log):
    """Hold the run directory's lock for the duration; ConfigError if another live job holds it."""
    path = Path(run_dir) / NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(f"`run_dir` {run_dir} is not writable: cannot create {path} ({e.strerror})") from None
    f = os.fdopen(fd, "r+")
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(f)
            raise ConfigError(f"`run_dir` {run_dir} is in use by another job ({_describe(holder)}); wait for it "
                              f"to finish or stop it, or choose another run_dir") from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            log(f"warning: cannot lock {path} on this file system ({e.strerror}); make sure only one job uses "
                f"this run_dir")
            yield
            return
        if not path.exists() or os.stat(path).st_ino != os.fstat(f.fileno()).st_ino:
            # The job we waited on removed the file between our open and our lock: lock the new one.
            f.close()
            with hold(run_dir, log):
                yield
            return
        stale = _read(f)
        if stale:
            log(f"took over the lock of {run_dir} from a job that is gone ({_describe(stale)})")
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}))
        f.flush()
        try:
            yield
        finally:
            path.unlink(missing_ok=True)  # a clean exit leaves no lock behind; a crash leaves a stale one
    finally:
        f.close()


def _read(f) -> dict:
    f.seek(0)
    try:
        return json.loads(f.read() or "{}")
    except ValueError:
        return {"pid": "?", "host": "?"}
