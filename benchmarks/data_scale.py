"""Start-up and memory of the data loader against corpus size: for corpora of 10^5, 10^6 and 10^7
documents, raw JSONL (streaming) or prepared (maxlm.data.prepare, indexed), in fresh processes (1, or 2 joined
with jax.distributed on this host, one device each, each loading its half of every batch), it prints
per process

- the loader's build time and the time to the first batch;
- the bytes this process read (/proc/self/io rchar) by each of those points;
- peak RSS;
- tokens/s of `next(loader)` in steady state (byte tokenizer, rows of 2048, batches of 64).

The corpora are written under --dir (default: a temporary directory, deleted after), 16 files each, of
documents of 100..1000 characters: about 4 GiB of JSONL at 10^7. `--kind prepared` runs
`maxlm.data.prepare` (byte tokenizer) on each JSONL corpus first, into DIR/prepared-N, unless it is
there. Nothing is committed and CI builds none.

    python benchmarks/data_scale.py [--kind jsonl|prepared] [--processes 1|2] [--sizes 100000,1000000,10000000]
        [--seconds 10] [--steps 200] [--dir DIR] [--gcs gs://BUCKET/PREFIX]

Record runs in benchmarks/RESULTS.md.
"""

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from maxlm import cli  # noqa: E402
FILES = 16


def corpus(d: Path, n_docs: int) -> int:
    """n_docs JSONL documents of 100..1000 characters over FILES files; returns the bytes written."""
    import numpy as np

    words = np.array("the of and to in is that for it as with was on be by at this are from or an which".split())
    rng = np.random.default_rng(n_docs)
    d.mkdir(parents=True, exist_ok=True)
    total = 0
    for f in range(FILES):
        n = n_docs // FILES + (f < n_docs % FILES)
        with open(d / f"part-{f:02d}.jsonl", "w") as out:
            for start in range(0, n, 10_000):  # vectorised per block: 10^7 documents in about a minute
                m = min(10_000, n - start)
                lengths = rng.integers(20, 200, m)
                w = words[rng.integers(0, len(words), int(lengths.sum()))]
                cut = np.cumsum(lengths)[:-1]
                lines = [json.dumps({"text": f"doc {start + i} " + " ".join(p)}) for i, p in enumerate(np.split(w, cut))]
                total += out.write("\n".join(lines) + "\n")
    return total


def rchar() -> int:
    return int(dict(x.split(": ") for x in open("/proc/self/io").read().splitlines())["rchar"])


def child(path: str, seconds: float, kind: str, processes: int, rank: int, port: int) -> None:
    """One measurement, in this (fresh) process; prints one JSON line."""
    t0 = time.perf_counter()
    import jax

    if processes > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", processes, rank)
    from maxlm import mesh as mesh_lib, sharding
    from maxlm.config import load
    from maxlm.data import make_loader, pipeline  # noqa: F401 - imported here, so module files are not counted below

    source = "prepared" if kind == "prepared" else "jsonl"
    cfg = load(str(ROOT / "configs/tiny.yml"), [f"data.source={source}", f"data.path={path}", "seq_len=2048",
                                                 "global_batch_size=64"])
    mesh = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, processes), jax.devices())
    t1, r1 = time.perf_counter(), rchar()
    ld = make_loader(cfg, sharding.named(mesh, ("batch", "length"), sharding.rules(cfg)), log=lambda m: None)
    t2, r2 = time.perf_counter(), rchar()
    jax.block_until_ready(next(ld))
    t3, r3 = time.perf_counter(), rchar()
    steps = 0
    # Two streaming processes agree on every batch (a collective per step), so they run the same number of
    # steps: as many as 1 process gets through in `seconds` would differ between them.
    fixed = int(os.environ.get("DATA_SCALE_STEPS", "0"))
    while (steps < fixed) if fixed else (time.perf_counter() - t3 < seconds):
        jax.block_until_ready(next(ld))
        steps += 1
    dt = time.perf_counter() - t3
    ld.close()
    print(json.dumps(dict(imports_s=t1 - t0, build_s=t2 - t1, first_batch_s=t3 - t2, build_read=r2 - r1,
                          first_read=r3 - r1, rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                          tokens_per_s=steps * 64 * 2048 / processes / dt, steps=steps)))


def main() -> int:
    ap = cli.Parser()
    ap.add_argument("--sizes", default="100000,1000000,10000000")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--dir", default="")
    ap.add_argument("--kind", choices=("jsonl", "prepared"), default="jsonl")
    ap.add_argument("--steps", type=int, default=200, help="steady-state steps with 2 processes (1: --seconds)")
    ap.add_argument("--processes", type=int, choices=(1, 2), default=1)
    ap.add_argument("--gcs", default="", help="gs://BUCKET/PREFIX: copy each corpus there and read it from there "
                                              "(STORAGE_EMULATOR_HOST for the emulator)")
    ap.add_argument("--child", default="")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.seconds, a.kind, a.processes, a.rank, a.port)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(a.dir or tmp)
        print(f"{a.kind}, {a.processes} process(es); per process:")
        print(f"{'documents':>12} {'MiB':>8} {'process':>7} {'build s':>8} {'1st batch s':>11} {'read by build':>14} "
              f"{'read by 1st':>12} {'peak RSS MiB':>12} {'tokens/s':>11}", flush=True)
        for n in map(int, a.sizes.split(",")):
            d = base / f"jsonl-{n}"
            if not d.exists():
                corpus(d, n)
            if a.kind == "prepared":
                d = prepared(d, base / f"prepared-{n}")
            size = sum(p.stat().st_size for p in d.iterdir())
            if a.gcs:  # the same files in a bucket, copied once; the children read them from there
                d = upload(d, f"{a.gcs.rstrip('/')}/{d.name}")
            env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
                       DATA_SCALE_STEPS=str(a.steps if a.processes > 1 else 0))
            port = 20000 + n % 9973
            procs = [subprocess.Popen([sys.executable, __file__, "--child", str(d), "--seconds", str(a.seconds),
                                       "--kind", a.kind, "--processes", str(a.processes), "--rank", str(r), "--port",
                                       str(port)], env=env, stdout=subprocess.PIPE, text=True)
                     for r in range(a.processes)]
            for r, proc in enumerate(procs):
                out, _ = proc.communicate()
                if proc.returncode:
                    raise SystemExit(f"process {r} failed ({proc.returncode})")
                m = json.loads(out.strip().splitlines()[-1])
                print(f"{n:>12,} {size / 2**20:>8,.0f} {r:>7} {m['build_s']:>8.2f} {m['first_batch_s']:>11.2f} "
                      f"{m['build_read'] / 2**20:>11,.1f} MiB {m['first_read'] / 2**20:>9,.1f} MiB "
                      f"{m['rss'] / 2**20:>12,.0f} {m['tokens_per_s']:>11,.0f}", flush=True)
    return 0


def upload(d: Path, url: str) -> str:
    from maxlm import storage

    storage.use_emulator()
    if not storage.listdir(url):
        for f in sorted(d.iterdir()):
            storage.write(f"{url}/{f.name}", f.read_bytes())
    return url


def prepared(src: Path, out: Path) -> Path:
    """`maxlm.data.prepare` of a JSONL corpus with the byte tokenizer (once; kept under --dir)."""
    if not (out / "dataset.json").exists():
        subprocess.run([sys.executable, "-m", "maxlm.data.prepare", str(src), "--tokenizer", "byte", "--out", str(out)],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return out


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(cli.run(main))
