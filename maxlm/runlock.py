"""One job per run directory, held for the whole run by process 0 of the job (the processes of one
multi-host job share a run_dir by design, so only the job, not each process, takes it). The holder's
record (job, pid, host, start time) lets a refusal name the other job.

A local run_dir: `flock` on `<run_dir>/.lock`, which the kernel releases when the holder dies; the next
job takes the file over and says so.

A gs:// run_dir: a lease object `<run_dir>/.lease`, created only if absent and renewed every RENEW_S
seconds only if unchanged since our last write (GCS generation preconditions), so two jobs can never
both hold it. A lease not renewed for TTL_S seconds is a dead job's and is taken over. A job that finds a
live-looking lease waits until it is either renewed (a live job: refused) or expired (taken over). The
launcher names each job in MAXLM_JOB (Slurm jobs are named by SLURM_JOB_ID): a lease held under this
job's own name is its previous attempt's, taken over at once. A holder whose renewal finds the lease
taken, or that cannot renew before it expires, exits at once: another job may be writing.
"""

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path

from maxlm import storage, watchdog
from maxlm.errors import ConfigError

NAME, LEASE = ".lock", ".lease"
TTL_S, RENEW_S = 90.0, 15.0


def job_name() -> str:
    """This job's name, the same in every attempt of it: MAXLM_JOB (the launcher sets it), or Slurm's job id."""
    if os.environ.get("MAXLM_JOB"):
        return os.environ["MAXLM_JOB"]
    return f"slurm-{os.environ['SLURM_JOB_ID']}" if os.environ.get("SLURM_JOB_ID") else ""


def _describe(holder: dict) -> str:
    if not holder.get("pid"):
        return "an unknown writer (the lock's record is not maxlm's)"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    job = f"job {holder['job']}: " if holder.get("job") else ""
    return f"{job}pid {holder['pid']} on host {holder.get('host', '?')}, started {started}"


def _record(started: float | None = None) -> str:
    return json.dumps({"job": job_name(), "pid": os.getpid(), "host": socket.gethostname(),
                       "started": started or time.time()})


@contextlib.contextmanager
def hold(run_dir, log):
    """Hold the run directory for the duration; ConfigError if another live job holds it."""
    if storage.is_gcs(run_dir):
        lease = Lease(str(run_dir), log)
        lease.acquire()
        try:
            yield
        finally:
            lease.release()
        return
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
        f.write(_record())
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


class Lease:
    """The lease object of a gs:// run_dir (see the module's docstring)."""

    def __init__(self, run_dir: str, log):
        self.url, self.log = storage.join(run_dir, LEASE), log
        bucket, name = storage.split(self.url)
        self.blob = storage.client().bucket(bucket).blob(name)
        self.generation, self.started = None, time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name="maxlm-lease", daemon=True)

    def acquire(self) -> None:
        from google.api_core import exceptions as api

        deadline, seen = None, None
        while True:
            try:
                self._write(if_generation_match=0)  # only if there is none
                break
            except api.PreconditionFailed:
                pass
            holder, generation, age = self._read()
            if holder is None:
                continue  # released in between: try again
            mine = job_name() and holder.get("job") == job_name()
            if mine or age > TTL_S:
                try:
                    self._write(if_generation_match=generation)
                except api.PreconditionFailed:
                    continue  # it changed under us: look again
                why = "this job's previous attempt" if mine else f"a job that stopped renewing it {age:.0f}s ago"
                self.log(f"took over the lease of {self.url} from {why} ({_describe(holder)})")
                break
            if seen is not None and generation != seen:
                raise ConfigError(f"`run_dir` {self.url.rsplit('/', 1)[0]} is in use by another job "
                                  f"({_describe(holder)}; it renewed its lease {age:.0f}s ago); wait for it to "
                                  f"finish or stop it, or choose another run_dir")
            if deadline is None:
                deadline = time.monotonic() + TTL_S - age + 1
                self.log(f"{self.url} is held by {_describe(holder)}, renewed {age:.0f}s ago: waiting up to "
                         f"{TTL_S - age + 1:.0f}s to see whether that job is alive (it renews every {RENEW_S:.0f}s)")
            seen = generation
            time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=RENEW_S + 5)
        try:
            self.blob.delete(if_generation_match=self.generation, timeout=30)
        except Exception:  # noqa: BLE001 - it expires on its own; the run itself is done
            pass

    def _write(self, if_generation_match) -> None:
        try:
            self.blob.upload_from_string(_record(self.started), if_generation_match=if_generation_match, timeout=30)
        except Exception as e:  # noqa: BLE001
            from google.api_core import exceptions as api
            if isinstance(e, api.PreconditionFailed):
                raise
            raise storage.gcs_error(e, self.url) from None
        self.generation = self.blob.generation

    def _read(self) -> tuple[dict | None, int | None, float]:
        """(holder's record, generation, seconds since its last write by the server's clock) or Nones."""
        try:
            blob = self.blob.bucket.get_blob(self.blob.name, timeout=30)
            if blob is None:
                return None, None, 0.0
            text = blob.download_as_text(if_generation_match=blob.generation, timeout=30)
        except Exception as e:  # noqa: BLE001
            from google.api_core import exceptions as api
            if isinstance(e, (api.NotFound, api.PreconditionFailed)):
                return None, None, 0.0  # gone or rewritten while we read it: look again
            raise storage.gcs_error(e, self.url) from None
        try:
            holder = json.loads(text)
        except ValueError:
            holder = {}
        age = (datetime.datetime.now(datetime.timezone.utc) - blob.updated).total_seconds()
        return holder, blob.generation, max(age, 0.0)

    def _renew_loop(self) -> None:
        from google.api_core import exceptions as api

        renewed = time.monotonic()
        while not self._stop.wait(RENEW_S):
            try:
                self._write(if_generation_match=self.generation)
                renewed = time.monotonic()
            except api.PreconditionFailed:
                holder, _, _ = self._read()
                watchdog.die(f"lost the lease of {self.url} to {_describe(holder or {})}: another job now writes "
                             f"this run_dir; stopping at once, without saving", code=2)
            except Exception as e:  # noqa: BLE001 - GCS unreachable: keep trying until the lease would expire
                if time.monotonic() - renewed > TTL_S - RENEW_S:
                    watchdog.die(f"cannot renew the lease of {self.url} ({e}) and it is about to expire, after which "
                                 f"another job may take this run_dir; stopping at once, without saving", code=4)
                self.log(f"warning: renewing the lease of {self.url} failed ({e}); trying again in {RENEW_S:.0f}s")
