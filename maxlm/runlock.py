"""One job per run directory, held for the whole run by process 0 of the job (the processes of one
multi-host job share a run_dir by design, so only the job, not each process, takes it). The holder's
record (job, attempt, pid, host, start time) lets a refusal name the other job.

A local run_dir: `flock` on `<run_dir>/.lock`, which the kernel releases when the holder dies; the next
job takes the file over and says so.

A gs:// run_dir: a lease object `<run_dir>/.lease`, created only if absent and renewed every RENEW_S
seconds only if unchanged since our last write (GCS generation preconditions), so two jobs can never
both hold it. Its record names the job (MAXLM_JOB, set by the launcher; Slurm jobs are named by
SLURM_JOB_ID) and the attempt (ATTEMPT, a random id per process start). A job that finds the lease held
takes it over only once the holder is shown gone, i.e. it has not renewed it for:
  - stale_s() = RENEW_S + GRACE_S (one renewal interval and a grace) if the holder is an attempt of this same job (its previous
    attempt, restarted by the launcher), so a restart waits at most that long;
  - TTL_S if it is another job's.
A renewal while it waits shows a live holder: the job is refused (two live copies of one job, e.g. one
launcher --name started twice, would delete each other's checkpoints in flight and drop metrics rows).
The holder retries a failed renewal every RETRY_S and gives up (exit 4) hold_s() = TTL_S - MARGIN_S after its last renewal,
before any other job could take the lease over; one whose renewal finds the lease rewritten by another
attempt exits 2 at once. A takeover from a holder that renewed less than TTL_S ago is remembered
(`previous_holder_may_write`), so that partial checkpoints it may still be writing are left alone.
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
import uuid
from pathlib import Path

from maxlm import storage, watchdog
from maxlm.errors import ConfigError

NAME, LEASE = ".lock", ".lease"
TTL_S, RENEW_S = 90.0, 15.0  # another job takes over a lease not renewed for TTL_S; the holder renews every RENEW_S
GRACE_S = 10.0  # beyond RENEW_S, for a slow renewal (and its retry) before a same-job attempt takes over
RETRY_S = 3.0  # a failed renewal is retried this soon
MARGIN_S = 30.0  # the holder gives up this long before its lease could expire (clock skew, a slow exit)
TIMEOUT_S = (5.0, 10.0)  # (connect, read) seconds of one renewal request


def stale_s() -> float:
    """How long a lease held by another attempt of this job goes unrenewed before it is taken over."""
    return RENEW_S + GRACE_S


def hold_s() -> float:
    """How long the holder keeps going without a successful renewal: MARGIN_S short of TTL_S, when another
    job may take its lease over. (This job's next attempt may take it over sooner, after stale_s: the holder
    learns so at its next try, within RETRY_S, and stops; the new attempt leaves alone the partial
    checkpoints it may have been writing.)"""
    return max(TTL_S - MARGIN_S, TTL_S / 2)


def _new_attempt() -> None:
    global ATTEMPT
    ATTEMPT = uuid.uuid4().hex[:12]


ATTEMPT = ""
_new_attempt()
os.register_at_fork(after_in_child=_new_attempt)  # a forked child is another attempt
_taken_over: dict[str, float] = {}  # run_dir -> until when (time.time()) a holder we took over from may still write


def previous_holder_may_write() -> float:
    """Seconds for which a holder this process took a lease over from may still be writing (its last renewal
    was less than TTL_S before), or 0: a partial checkpoint may then be its save in flight."""
    return max([until - time.time() for until in _taken_over.values()] + [0.0])


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


def _record(started: float | None = None, token: str = "") -> str:
    record = {"job": job_name(), "attempt": ATTEMPT, "pid": os.getpid(), "host": socket.gethostname(),
              "started": started or time.time()}
    return json.dumps({**record, "token": token} if token else record)


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
        self.run_dir = str(run_dir).rstrip("/")
        self.url, self.log = storage.join(self.run_dir, LEASE), log
        bucket, name = storage.split(self.url)
        self.blob = storage.client().bucket(bucket).blob(name)
        self.generation, self.started = None, time.time()
        self.token = uuid.uuid4().hex[:12]  # this hold's, to recognise our own write whose answer was lost
        self.renewed = time.monotonic()  # when the last successful write started
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name="maxlm-lease", daemon=True)
        self._fence = threading.Thread(target=self._fence_loop, name="maxlm-lease-fence", daemon=True)

    def acquire(self) -> None:
        from google.api_core import exceptions as api

        watched, seen, said = None, None, False  # since when (monotonic) we have seen the holder's generation `seen`
        while True:
            try:
                self._write(if_generation_match=0)  # only if there is none
                break
            except api.PreconditionFailed:
                pass
            holder, generation, age = self._read()
            if holder is None:
                continue  # released in between: try again
            if holder.get("token") == self.token:  # our own write, whose answer was lost
                break
            if seen is not None and generation != seen:
                raise ConfigError(self._in_use(holder, age))  # renewed while we watched: its holder is alive
            if generation != seen:
                watched, seen = time.monotonic(), generation
            same = bool(job_name()) and holder.get("job") == job_name()
            limit = stale_s() if same else TTL_S
            # Gone: not renewed for `limit` by the server's clock, or for that long while we watched (our clock).
            if age > limit or time.monotonic() - watched > limit:
                try:
                    self._write(if_generation_match=generation)
                except api.PreconditionFailed:
                    continue  # it changed under us: look again
                if age < TTL_S:
                    _taken_over[self.run_dir] = time.time() - age + TTL_S
                why = (f"this job's previous attempt, which stopped renewing it {age:.0f}s ago" if same else
                       f"a job that stopped renewing it {age:.0f}s ago")
                self.log(f"took over the lease of {self.url} from {why} ({_describe(holder)})")
                break
            if not said:
                said = True
                left = min(limit - age, limit - (time.monotonic() - watched)) + 1
                whose = (f"this job's attempt {holder.get('attempt', '?')} ({_describe(holder)})" if same else
                         _describe(holder))
                self.log(f"{self.url} belongs to {whose}, renewed {age:.0f}s ago: waiting up to {left:.0f}s for a "
                         f"renewal, which would show it still running (it renews every {RENEW_S:.0f}s)")
            time.sleep(max(0.05, min(2.0, RENEW_S / 4, limit - age + 0.05)))
        self.renewed = time.monotonic()
        self._thread.start()
        self._fence.start()

    def _in_use(self, holder: dict, age: float) -> str:
        run_dir = self.run_dir
        if job_name() and holder.get("job") == job_name():
            return (f"`run_dir` {run_dir} is in use by another live copy of this job, {job_name()} "
                    f"({_describe(holder).split(': ', 1)[-1]}; it renewed its lease {age:.0f}s ago): the same job "
                    f"was started twice; stop one copy, or give the other another job name (MAXLM_JOB) or run_dir")
        return (f"`run_dir` {run_dir} is in use by another job ({_describe(holder)}; it renewed its lease "
                f"{age:.0f}s ago); wait for it to finish or stop it, or choose another run_dir")

    def release(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=sum(TIMEOUT_S) + 5)
        try:
            self.blob.delete(if_generation_match=self.generation, timeout=TIMEOUT_S, retry=None)
        except Exception:  # noqa: BLE001 - it expires on its own; the run itself is done
            pass

    def _write(self, if_generation_match, timeout=None) -> None:
        from google.api_core import exceptions as api

        def call(t):
            self.blob.upload_from_string(_record(self.started, self.token), if_generation_match=if_generation_match,
                                         timeout=timeout or t, retry=None)
        if timeout is not None:
            call(timeout)  # the renewal loop's own: it retries, and handles every failure, itself
        else:
            storage.attempts("the run lease's write", self.url, call, say=self._say, keep=(api.PreconditionFailed,))
        self.generation = self.blob.generation

    def _read(self) -> tuple[dict | None, int | None, float]:
        """(holder's record, generation, seconds since its last write by the server's clock) or Nones."""
        from google.api_core import exceptions as api

        def call(t):
            blob = self.blob.bucket.get_blob(self.blob.name, timeout=t, retry=None)
            if blob is None:
                return None, None
            return blob, blob.download_as_text(if_generation_match=blob.generation, timeout=t, retry=None)

        try:
            blob, text = storage.attempts("the run lease's read", self.url, call, say=self._say,
                                          keep=(api.NotFound, api.PreconditionFailed))
        except (api.NotFound, api.PreconditionFailed):
            return None, None, 0.0  # gone or rewritten while we read it: look again
        if blob is None:
            return None, None, 0.0
        try:
            holder = json.loads(text)
        except ValueError:
            holder = {}
        age = (datetime.datetime.now(datetime.timezone.utc) - blob.updated).total_seconds()
        return holder, blob.generation, max(age, 0.0)

    def _say(self, msg: str) -> None:
        self.log(f"warning: {msg}")

    def _renew_loop(self) -> None:
        from google.api_core import exceptions as api

        wait = RENEW_S
        while not self._stop.wait(wait):
            start = time.monotonic()
            left = self.renewed + hold_s() - start
            try:
                self._write(if_generation_match=self.generation, timeout=(min(TIMEOUT_S[0], max(left, 0.1)),
                                                                         min(TIMEOUT_S[1], max(left, 0.1))))
                self.renewed, wait = start, RENEW_S
            except api.PreconditionFailed:
                holder, generation, _ = self._read_quietly()
                if holder is not None and holder.get("token") == self.token:  # our last write landed; its answer was lost
                    self.generation, wait = generation, 0.0
                    continue
                watchdog.die(f"lost the lease of {self.url} to {_describe(holder or {})}: another job now writes "
                             f"this run_dir; stopping at once, without saving", code=2)
            except Exception as e:  # noqa: BLE001 - GCS not answering: retry until hold_s(), when the fence stops us
                wait = RETRY_S
                self.log(f"warning: renewing the lease of {self.url} failed ({storage.why(e)}); retrying in "
                         f"{RETRY_S:.0f}s (this job stops in {max(left, 0):.0f}s if no renewal succeeds, before the "
                         f"lease could expire)")

    def _read_quietly(self):
        try:
            return self._read()
        except Exception:  # noqa: BLE001
            return None, None, 0.0

    def _fence_loop(self) -> None:
        """Stop the process hold_s() after the last successful renewal, however long a request hangs."""
        while True:
            left = self.renewed + hold_s() - time.monotonic()
            if left <= 0:
                watchdog.die(f"cannot renew the lease of {self.url}: GCS has not answered for {hold_s():.0f}s, and "
                             f"the lease expires {TTL_S:.0f}s after its last renewal, when another job may take this "
                             f"run_dir; stopping now, without saving (re-run to resume)", code=4)
            if self._stop.wait(left):
                return
