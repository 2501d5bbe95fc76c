"""Where a run's bytes go: a local directory or a Google Cloud Storage bucket (gs://BUCKET/PATH), written
natively in both cases.

Object storage has no appends and no renames, and a GCS FUSE mount only pretends to (gcsfuse refuses a
directory rename, so Orbax's commit fails, and `flock` there locks one node only). So:
  - every file maxlm writes is written whole (`write`): locally into a temporary file renamed over the
    target, on GCS as one upload; a reader never sees half a file, and nothing is appended to an object;
  - checkpoints go to gs:// through Orbax and tensorstore, which commit a step there with
    commit_success.txt (locally, by renaming the step's temporary directory);
  - a run_dir on a GCS FUSE mount is refused, naming the gs:// path to pass instead.
A missing credential, bucket or permission is found before anything compiles (`check_writable`), in one
line. STORAGE_EMULATOR_HOST points google-cloud-storage and gcsfs at a GCS emulator; maxlm points
tensorstore and array_record at the same one (docs/storage.md).
"""

import functools
import os
import socket
from pathlib import Path

from maxlm.errors import ConfigError

# gcsfs's default file system asks the storage-control API for each bucket's layout (hierarchical or
# flat), which fails without that API's permission and then logs a warning on every call; maxlm neither
# renames nor lists folders, which is all that layout changes. Set before gcsfs is imported (by etils).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

MOUNTS = "/proc/mounts"
GCS_FIX = ("run `gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS; on GKE give the "
           "pod's Kubernetes service account access to the bucket (Workload Identity)")


class StorageError(Exception):
    """A write failed (disk full, permissions, the storage unreachable): the run stops with one line naming
    the path and the cause (exit 4, a retry code). Every step reported as committed before it is intact."""


def is_gcs(path) -> bool:
    return str(path).startswith("gs://")


def split(url: str) -> tuple[str, str]:
    """gs://bucket/a/b -> ("bucket", "a/b")."""
    bucket, _, name = url[len("gs://"):].partition("/")
    return bucket, name.strip("/")


def path(p):
    """A path object for a local path or a gs:// URL (etils.epath: gcsfs for gs://)."""
    if is_gcs(p):
        from etils import epath
        return epath.Path(p)
    return Path(p)


def use_emulator() -> str | None:
    """With STORAGE_EMULATOR_HOST (which google-cloud-storage and gcsfs read), point tensorstore (which
    writes the checkpoints' arrays and reads prepared shards) and array_record's GCS client (google-cloud-cpp,
    which reads an older maxlm's prepared shards) at the same server; a line for the log, or None."""
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if not host:
        return None
    os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", host)
    os.environ.setdefault("CLOUD_STORAGE_EMULATOR_ENDPOINT", host)
    os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")  # tensorstore wants some credential
    return f"storage: gs:// goes to the GCS emulator at {host} (STORAGE_EMULATOR_HOST)"


BUCKET_RULE = ("a GCS bucket name is 3-63 characters (up to 222 with dots, 63 between them) of lowercase letters, "
               "digits, '-', '_' and '.', starting and ending with a letter or digit, not an IP address, not starting "
               "with `goog` nor containing `google`")


def bucket_problem(bucket: str) -> str | None:
    """What is wrong with a bucket name by GCS's naming rules, or None (checked before any request: GCS
    answers a bad name with an error the client cannot explain)."""
    import re

    if not bucket:
        return "names no bucket"
    bad = sorted(set(re.sub(r"[a-z0-9._-]", "", bucket)))
    if bad:
        return f"has {', '.join(repr(c) for c in bad)}" + (" (upper case)" if any(c.isupper() for c in bad) else "")
    if not (bucket[0].isalnum() and bucket[-1].isalnum()):
        return "does not start and end with a letter or digit"
    parts = bucket.split(".")
    if len(bucket) < 3 or len(bucket) > (222 if len(parts) > 1 else 63) or any(len(p) > 63 for p in parts):
        return f"is {len(bucket)} characters long"
    if "" in parts:
        return "has '..'"
    if len(parts) == 4 and all(p.isdigit() for p in parts):
        return "is an IP address"
    if bucket.startswith("goog") or "google" in bucket:
        return "starts with `goog` or contains `google`"
    return None


def check_bucket(key: str, url: str) -> None:
    """A gs:// URL's bucket name follows GCS's naming rules, or one line saying which rule it breaks."""
    bucket = split(url)[0]
    why = bucket_problem(bucket)
    if why:
        name = f"bucket name `{bucket}`" if bucket else "it"
        raise ConfigError(f"`{key}` {url}: {name} {why}; {BUCKET_RULE}: fix the path")


CREDENTIAL_TYPES = ("service_account", "authorized_user", "external_account", "external_account_authorized_user",
                    "impersonated_service_account", "gdch_service_account")


def check_credentials_file() -> None:
    """GOOGLE_APPLICATION_CREDENTIALS, when set, names a readable JSON credentials file: google-auth says only
    that there are no credentials, or fails with its own error, in the middle of a request."""
    import json

    path = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if not path:
        return
    fix = ("point it at a service-account key (JSON) or the file `gcloud auth application-default login` writes, or "
           "unset it")
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 20)
    except OSError as e:
        raise ConfigError(f"GOOGLE_APPLICATION_CREDENTIALS={path}: cannot read it ({e.strerror or e}); {fix}") from None
    try:
        obj = json.loads(raw)
    except ValueError:
        raise ConfigError(f"GOOGLE_APPLICATION_CREDENTIALS={path} is not a credentials file (not JSON); {fix}") from None
    kind = obj.get("type") if isinstance(obj, dict) else None
    if kind not in CREDENTIAL_TYPES:
        raise ConfigError(f"GOOGLE_APPLICATION_CREDENTIALS={path} is not a credentials file (its `type` is {kind!r}, not "
                          f"one of {', '.join(CREDENTIAL_TYPES)}); {fix}")


def client():
    """The google-cloud-storage client (cached), or a ConfigError if there is no credential."""
    global _client
    if _client is None:
        import google.auth.exceptions
        from google.cloud import storage

        check_credentials_file()
        try:
            _client = storage.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT") or "maxlm")
        except google.auth.exceptions.DefaultCredentialsError as e:
            if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):  # the file is there and JSON, but google-auth refuses it
                why = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
                raise ConfigError(f"GOOGLE_APPLICATION_CREDENTIALS={os.environ['GOOGLE_APPLICATION_CREDENTIALS']} is not "
                                  f"usable ({why}); point it at a service-account key (JSON), or unset it") from None
            raise ConfigError(f"no Google Cloud credentials for gs:// paths: {GCS_FIX}") from None
    return _client


_client = None


def gcs_error(e: BaseException, url: str) -> Exception:
    """A google-cloud-storage failure on `url` as one line: a ConfigError (exit 2) for what the user must
    fix (no bucket, no permission, no credential), a StorageError (exit 4, retried) for the rest."""
    from google.api_core import exceptions as api
    import google.auth.exceptions

    bucket = split(url)[0]
    if isinstance(e, api.NotFound):
        return ConfigError(f"{url}: bucket `{bucket}` does not exist (or is in another project); create it, or "
                           f"fix the path")
    if isinstance(e, (api.Forbidden, api.Unauthorized, google.auth.exceptions.RefreshError)):
        why = getattr(e, "message", None) or str(e).splitlines()[0]
        return ConfigError(f"{url}: permission denied ({why[:300]}); grant the job's account "
                           f"roles/storage.objectUser on bucket `{bucket}`, or {GCS_FIX}")
    if isinstance(e, google.auth.exceptions.DefaultCredentialsError):
        return ConfigError(f"no Google Cloud credentials for {url}: {GCS_FIX}")
    return StorageError(f"{url}: {type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}")


# A GCS call that must not sit silent in the client's own retries (up to 120 s for an endpoint that refuses
# connections): each attempt is one request with a short timeout, each wait before the next is one line, and
# after RETRY_FOR_S the failure is one line (exit 4).
TIMEOUT_S = (5.0, 20.0)  # (connect, read) seconds of one attempt
RETRY_FOR_S = 30.0  # give up once the next attempt would start later than this after the first


def transient(e: BaseException) -> bool:
    """Whether a google-cloud-storage failure is worth another attempt: no answer, or a server's 429/5xx."""
    import google.auth.exceptions
    import requests
    from google.api_core import exceptions as api

    return isinstance(e, (requests.ConnectionError, requests.Timeout, ConnectionError, TimeoutError,
                          google.auth.exceptions.TransportError, api.TooManyRequests, api.InternalServerError,
                          api.BadGateway, api.ServiceUnavailable, api.GatewayTimeout))


def why(e: BaseException) -> str:
    """A failure as a short phrase: the innermost reason of a connection error, not urllib3's whole chain."""
    import re

    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    inner = re.findall(r"(\[Errno -?\d+\] [^'\")]+|timed out|Read timed out)", text)
    return f"{type(e).__name__}: {inner[-1] if inner else text[:200]}"


def attempts(what: str, url: str, call, say=None, keep: tuple = ()):
    """call(timeout) (one request, no retry of its own) until it answers: a transient failure is retried, each
    wait announced in one line (`say`, or stderr), for RETRY_FOR_S; then, or at once for any other failure,
    gcs_error (the exceptions in `keep` are raised as they are, for the caller to handle)."""
    import sys
    import time

    say = say or (lambda msg: print(f"maxlm: warning: {msg}", file=sys.stderr, flush=True))
    start, wait, n = time.monotonic(), 2.0, 1
    host = os.environ.get("STORAGE_EMULATOR_HOST") or "storage.googleapis.com"
    while True:
        try:
            return call(TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - every failure becomes one line
            if keep and isinstance(e, keep):
                raise
            if not transient(e):
                raise gcs_error(e, url) from None
            spent = time.monotonic() - start
            wait = min(wait, RETRY_FOR_S - spent)
            if wait < 0.5:
                raise StorageError(f"{url}: GCS at {host} did not answer {what} ({n} attempt(s) over {spent:.0f}s; "
                                   f"{why(e)}); check the network and the endpoint, then re-run (it resumes)") from None
            say(f"{url}: GCS at {host} did not answer {what} ({why(e)}); retrying in {wait:.0f}s (attempt {n + 1}, "
                f"giving up {RETRY_FOR_S:.0f}s after the first)")
            time.sleep(wait)
            wait, n = min(wait * 2, 16.0), n + 1


def check_writable(key: str, url: str) -> None:
    """Write and delete a small object under `url` (as every process writes its checkpoint shards): the
    credential, the bucket and the permission are checked before anything compiles. This is a run's first
    request to GCS: an endpoint that does not answer is said at once, each retry in one line (`attempts`)."""
    if not is_gcs(url):
        raise ConfigError(f"`{key}` {url}: only gs:// URLs are supported; use gs://BUCKET/PATH or a local path")
    bucket, name = split(url)
    if not bucket:
        raise ConfigError(f"`{key}` {url} names no bucket; use gs://BUCKET/PATH")
    check_bucket(key, url)
    blob = client().bucket(bucket).blob(f"{name}/.maxlm-write-check-{socket.gethostname()}-{os.getpid()}".lstrip("/"))
    attempts("a probe write", url, lambda t: blob.upload_from_string(b"", timeout=t, retry=None))
    attempts("the probe's deletion", url, lambda t: _delete(blob, t))


def _delete(blob, timeout) -> None:
    from google.api_core import exceptions as api

    try:
        blob.delete(timeout=timeout, retry=None)
    except api.NotFound:  # an earlier attempt deleted it, and its answer was lost
        pass


def fuse_mount(local: str) -> tuple[str, str] | None:
    """(bucket, mount point) if `local` lies on a GCS FUSE mount, else None."""
    try:
        lines = Path(MOUNTS).read_text().splitlines()
    except OSError:
        return None
    real, best = os.path.realpath(local), None
    for line in lines:
        parts = line.split()
        if len(parts) < 3 or parts[2] != "fuse.gcsfuse":
            continue
        point = parts[1].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and (best is None or len(point) > len(best[1])):
            best = (parts[0], point)
    return best


def prepare_dir(key: str, local: str) -> None:
    """A local directory maxlm will write: made, checked writable, and refused on GCS FUSE."""
    fuse = fuse_mount(local)
    if fuse:
        bucket, point = fuse
        rel = os.path.relpath(os.path.realpath(local), point)
        url = f"gs://{bucket}" + ("" if rel == "." else f"/{rel}")
        raise ConfigError(f"`{key}` {local} is on a GCS FUSE mount of bucket {bucket} ({point}), which cannot rename "
                          f"directories or lock files, so checkpoints would never commit; pass {key}={url} instead "
                          f"(maxlm writes gs:// natively)")
    make_dir(key, local)


def make_dir(key: str, local: str) -> None:
    """A local directory maxlm will write: made (with its parents) and checked writable by writing a file
    there (`os.access` says yes to root on a read-only file system), or one line naming why not."""
    d = Path(local)
    if d.exists() and not d.is_dir():
        raise ConfigError(f"`{key}` {d} is a file, not a directory; choose a directory")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"`{key}` {d} cannot be created ({e.strerror or e}); choose a writable directory") from None
    probe = d / f".maxlm-write-check-{os.getpid()}"
    try:
        if not os.access(d, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"`{key}` {d} is not writable ({e.strerror or e}); choose a writable directory") from None


def write(target, data: str | bytes) -> None:
    """Write a whole file or object; a reader sees the old content or the new, never a part."""
    data = data.encode() if isinstance(data, str) else data
    target = str(target)
    if is_gcs(target):
        _to_blob(target, lambda blob: blob.upload_from_string(data, timeout=120))
        return
    tmp = f"{target}.tmp-{os.getpid()}"
    try:
        Path(target).parent.mkdir(parents=True, exist_ok=True)  # as on GCS, where a prefix needs no making
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise StorageError(f"writing {target} failed: {e.strerror or e}") from None


def upload(local: str, target: str) -> None:
    """Copy every file under the local directory `local` to `target`, each written whole (a tool that only
    writes local files, TensorBoard's or the profiler's, feeding a gs:// run_dir)."""
    for f in sorted(Path(local).rglob("*")):
        if f.is_file():
            write(join(target, str(f.relative_to(local))), f.read_bytes())


def put(local: str, target: str) -> None:
    """Put a finished local file in place whole: renamed (a local target), or uploaded and then deleted
    (gs://, streamed from the file: a prepared shard can be hundreds of MB)."""
    if not is_gcs(target):
        os.replace(local, target)
        return
    _to_blob(target, lambda blob: blob.upload_from_filename(local, timeout=600))
    os.unlink(local)


def _to_blob(target: str, upload) -> None:
    """upload(blob) for the object `target`; a failure is one line (a write that fails is retried: exit 4)."""
    bucket, name = split(target)
    try:
        upload(client().bucket(bucket).blob(name))
    except Exception as e:  # noqa: BLE001
        err = gcs_error(e, target)
        raise (StorageError(str(err)) if isinstance(err, ConfigError) else err) from None


def read_bytes(source) -> bytes | None:
    """A whole file or object, or None if there is none."""
    source = str(source)
    if is_gcs(source):
        bucket, name = split(source)
        try:
            blob = client().bucket(bucket).get_blob(name, timeout=60)
            return None if blob is None else blob.download_as_bytes(timeout=120)
        except Exception as e:  # noqa: BLE001
            raise gcs_error(e, source) from None
    try:
        return Path(source).read_bytes()
    except FileNotFoundError:
        return None


def read_text(source) -> str | None:
    """A whole file or object as text, or None if there is none."""
    source = str(source)
    if is_gcs(source):
        data = read_bytes(source)
        try:
            return None if data is None else data.decode()
        except UnicodeDecodeError as e:  # as the client's download_as_text fails: one line, naming the object
            raise gcs_error(e, source) from None
    try:
        return Path(source).read_text()
    except FileNotFoundError:
        return None


# Local files read_range keeps open (pread needs no lock): never closed while a reader may hold one, so
# bounded instead; past the bound a file is opened for its read alone.
_FDS: dict[str, int] = {}
_MAX_FDS = 256


def read_range(source: str, lo: int, hi: int) -> bytes:
    """Bytes lo..hi of a file or object: one pread, or one ranged GET. Shorter where the file ends."""
    return read_ranges([(source, lo, hi)])[0]


def read_ranges(ranges: list[tuple[str, int, int]]) -> list[bytes]:
    """read_range of each (source, lo, hi); the GETs of gs:// ones are all in flight at once, so a row
    packed from several documents waits for one round trip, not one per document."""
    pending = [_get(*r) if is_gcs(r[0]) and r[2] > r[1] else None for r in ranges]
    return [_got(f, *r) if f is not None else _pread(*r) for f, r in zip(pending, ranges)]


def _get(source: str, lo: int, hi: int | None):
    bucket, name = split(source)
    return _kvstore(bucket).read(name, byte_range=slice(lo, hi))


def _got(future, source: str, lo: int, hi: int | None) -> bytes:
    try:
        got = future.result()
    except Exception as e:  # noqa: BLE001 - tensorstore's own error: one line naming the object
        why = str(e).strip().splitlines()[0][:300]
        if "PERMISSION_DENIED" in why or "UNAUTHENTICATED" in why:
            raise ConfigError(f"{source}: permission denied ({why}); grant the job's account "
                              f"roles/storage.objectViewer on bucket `{split(source)[0]}`, or {GCS_FIX}") from None
        if "OUT_OF_RANGE" in why:  # a range past the end, which tensorstore refuses: read to the end (if lo is before it)
            return _got(_get(source, lo, None), source, lo, None) if hi is not None else b""
        raise StorageError(f"{source}: {why}") from None
    return got.value if got.state == "value" else b""


def _pread(source: str, lo: int, hi: int) -> bytes:
    if hi <= lo:
        return b""
    fd = _FDS.get(source)
    if fd is not None:
        return os.pread(fd, hi - lo, lo)
    fd = os.open(source, os.O_RDONLY)
    if len(_FDS) < _MAX_FDS and _FDS.setdefault(source, fd) == fd:  # two threads opening at once keep one
        return os.pread(fd, hi - lo, lo)
    try:  # past the bound (or the other thread's was kept): opened for this read only
        return os.pread(fd, hi - lo, lo)
    finally:
        os.close(fd)


@functools.cache
def _kvstore(bucket: str):
    """tensorstore's GCS store for ranged reads: a request costs about a seventh of google-cloud-storage's
    (0.57 against 4.0 ms against the emulator), which is what reading prepared data a row at a time needs."""
    import tensorstore as ts

    return ts.KvStore.open({"driver": "gcs", "bucket": bucket}).result()


def size(source: str) -> int | None:
    """A file's or object's size in bytes, or None if there is none."""
    if is_gcs(source):
        bucket, name = split(source)
        try:
            blob = client().bucket(bucket).get_blob(name, timeout=60)
        except Exception as e:  # noqa: BLE001
            raise gcs_error(e, source) from None
        return None if blob is None else blob.size
    try:
        return os.stat(source).st_size
    except FileNotFoundError:
        return None


def _forget_after_fork() -> None:  # a forked child must not share its parent's HTTP connections
    global _client
    _client = None
    _kvstore.cache_clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def listdir(directory) -> list[str]:
    """Names directly under a local directory or a gs:// prefix (files and subdirectories), sorted."""
    directory = str(directory)
    if is_gcs(directory):
        bucket, name = split(directory)
        prefix = f"{name}/" if name else ""
        try:
            it = client().bucket(bucket).list_blobs(prefix=prefix, delimiter="/", timeout=60)
            names = [b.name[len(prefix):] for b in it]
            names += [p[len(prefix):].rstrip("/") for p in it.prefixes]
        except Exception as e:  # noqa: BLE001
            raise gcs_error(e, directory) from None
        return sorted(n for n in names if n)
    d = Path(directory)
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def listsizes(directory) -> dict[str, int]:
    """{name: size in bytes} of the files directly under a local directory or a gs:// prefix: one listing
    (on gs://, one list request per 1000 objects), no object opened."""
    directory = str(directory)
    if is_gcs(directory):
        bucket, name = split(directory)
        prefix = f"{name}/" if name else ""
        try:
            return {b.name[len(prefix):]: b.size for b in client().bucket(bucket).list_blobs(
                prefix=prefix, delimiter="/", timeout=60) if len(b.name) > len(prefix)}
        except Exception as e:  # noqa: BLE001
            raise gcs_error(e, directory) from None
    try:
        with os.scandir(directory) as it:
            return {e.name: e.stat().st_size for e in it if e.is_file()}
    except (FileNotFoundError, NotADirectoryError):
        return {}


def find(prefix: str) -> list[str]:
    """Every object under a gs:// prefix taken as a directory (recursively), as gs:// URLs, sorted: one
    listing, where a recursive glob through gcsfs is refused."""
    bucket, name = split(prefix)
    try:
        blobs = client().bucket(bucket).list_blobs(prefix=f"{name}/" if name else "", timeout=60)
        return sorted(f"gs://{bucket}/{b.name}" for b in blobs if not b.name.endswith("/"))
    except Exception as e:  # noqa: BLE001
        raise gcs_error(e, prefix) from None


def remove(target) -> None:
    """Delete a file or object if it exists."""
    target = str(target)
    if is_gcs(target):
        from google.api_core import exceptions as api
        bucket, name = split(target)
        try:
            client().bucket(bucket).blob(name).delete(timeout=60)
        except api.NotFound:
            pass
        except Exception as e:  # noqa: BLE001
            raise gcs_error(e, target) from None
        return
    Path(target).unlink(missing_ok=True)


def join(base, *names) -> str:
    return "/".join([str(base).rstrip("/"), *names])
