"""Long-context headroom: peak memory per TPU chip with each long-context feature on and off.

    python benchmarks/headroom.py configs/models/llama3-8b.yml --topology v5p-64 --set seq_len=131072 \\
        --preset context                        # mesh.context = 1, 2, 4, 8; one sequence per data-parallel group
    python benchmarks/headroom.py configs/models/gemma2-9b.yml --topology v5p-8 --preset loss     # chunked_loss on/off
    python benchmarks/headroom.py CONFIG --topology v5p-8 --preset offload                         # remat full/offload/none
    python benchmarks/headroom.py CONFIG --topology v5p-64 --case "c8:mesh.context=8 global_batch_size=4" --case ...

Every case compiles the SAME config (CONFIG plus every --set) for the topology ahead of time, as
`train.py ... dry_run=true compile_topology=T` does, with the case's own overrides last. No TPU is
needed, only libtpu. Each case runs in a fresh process (libtpu state, and so a case the TPU compiler
refuses, or one that crashes, is a row of the table rather than the end of the run). Figures are
`compiled.memory_analysis()` per chip; total = arguments + outputs + temporaries + code - aliased (what
must fit in HBM); host = temporaries the program keeps in the host's pinned memory (remat=offload).
"""

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from maxlm import cli  # noqa: E402
GiB = 1024 ** 3
MARK = "HEADROOM "


def presets(preset: str, chips: int) -> list[tuple[str, list[str]]]:
    """Named case sets. `context` keeps one sequence per data-parallel group (global batch = chips / C,
    the fewest tokens per chip each mesh allows), so per-chip tokens are seq_len / C."""
    if preset == "loss":
        return [("chunked_loss=true", ["chunked_loss=true"]), ("chunked_loss=false", ["chunked_loss=false"])]
    if preset == "offload":
        return [(f"remat={r}", [f"remat={r}"]) for r in ("full", "offload", "none")]
    if preset == "context":
        return [(f"context={c}", [f"mesh.context={c}", "mesh.fsdp=-1", f"global_batch_size={chips // c}"])
                for c in (1, 2, 4, 8) if chips % c == 0]
    raise SystemExit(f"unknown preset {preset}; choose loss, offload or context")


def worker(path: str, topology: str, overrides: list[str]) -> None:
    """One case, in this process: compile and print one JSON line (the parent parses it)."""
    from maxlm import aot, config, hardware, mesh as mesh_lib, recipe as recipe_lib
    from maxlm.state import StateSpec

    cfg = config.load(path, [*overrides, "dry_run=true", f"compile_topology={topology}"])
    hw = hardware.Hardware(cfg)
    t = time.perf_counter()
    compiled = aot.compile_step(cfg, StateSpec(recipe_lib.build(cfg, hw.mesh), hw.mesh, hw.rules))
    print(MARK + json.dumps({"mesh": mesh_lib.describe(hw.mesh), "compile_s": time.perf_counter() - t,
                             "limit": hw.limit, "host": compiled.memory_analysis().host_temp_size_in_bytes,
                             **aot.memory_report(compiled)}), flush=True)


def versions() -> str:
    import importlib.metadata as md
    import jax
    libtpu = "not found"
    lib = os.environ.get("TPU_LIBRARY_PATH")
    for d in ([Path(lib).parent.parent] if lib else []) + [Path(p) for p in sys.path if p]:
        hits = sorted(d.glob("libtpu-*.dist-info")) if d.is_dir() else []
        if hits:
            libtpu = hits[0].name[len("libtpu-"):-len(".dist-info")]
            break
    return f"jax {jax.__version__}, jaxlib {md.version('jaxlib')}, libtpu {libtpu}"


def run_case(args, name: str, overrides: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--worker", args.config, "--topology", args.topology, *args.set, *overrides]
    t = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout,
                           env={"JAX_PLATFORMS": "cpu", **os.environ})  # compile for TPU; never start one
        out, err, rc = r.stdout, r.stderr, r.returncode
    except subprocess.TimeoutExpired:
        out, err, rc = "", f"timed out after {args.timeout} s", -1
    got = {"case": name, "wall_s": time.perf_counter() - t}
    line = next((ln for ln in out.splitlines() if ln.startswith(MARK)), None)
    if line:
        return {**got, **json.loads(line[len(MARK):])}
    last = (err.strip() or out.strip() or f"exit {rc}").splitlines()[-1]
    need = re.search(r"required for (.*?) \(([0-9.]+\w?)\) exceeds available HBM \(([0-9.]+\w?)\)", err)
    if "does not fit" in last or "RESOURCE_EXHAUSTED" in err:  # the TPU compiler refused it
        return {**got, "error": "does not fit" + (f": {need[1]} {need[2]} > HBM {need[3]}" if need else ""),
                "detail": last}
    return {**got, "error": f"failed (exit {rc})", "detail": last}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        ap = cli.Parser()
        ap.add_argument("config")
        ap.add_argument("--topology", required=True)
        a, overrides = ap.parse_known_args(sys.argv[2:])
        return worker(a.config, a.topology, overrides)
    ap = cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--topology", required=True, help="a TPU slice to compile for: v5p-64, v6e-8, v5p:4x4x4, ...")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every case")
    ap.add_argument("--case", action="append", default=[], metavar="NAME:K=V[ K=V...]",
                    help="a case: its name, a colon, then its overrides (shell-quoted words)")
    ap.add_argument("--preset", choices=("loss", "offload", "context"), help="a built-in case set (before --case)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per case")
    args = ap.parse_args()
    from maxlm import topology
    chips = topology.lookup(args.topology, "--topology").chips
    cases = presets(args.preset, chips) if args.preset else []
    for c in args.case:
        name, _, rest = c.partition(":")
        cases.append((name, shlex.split(rest)))
    if not cases:
        raise SystemExit("no cases: give --preset and/or --case")
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {versions()}")
    print(f"# topology {args.topology} ({chips} chips), compiled ahead of time on {os.uname().nodename} "
          f"({os.cpu_count()} CPUs)")
    print(f"# command: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(f"# common overrides: {' '.join(args.set) or '(none)'}\n")
    print("| case | mesh | compile | arguments | temporaries | total per chip | HBM | fits | host (offloaded) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, overrides in cases:
        r = run_case(args, name, overrides)
        if "error" in r:
            print(f"| {name} | | {r['wall_s']:.0f} s | | | | | {r['error']} | |", flush=True)
            print(f"#   {name}: {r['detail'][:400]}", file=sys.stderr, flush=True)
            continue
        fits = "yes" if r["total"] <= r["limit"] else "no"
        print(f"| {name} | {r['mesh']} | {r['compile_s']:.0f} s | {r['arguments'] / GiB:.2f} GiB | "
              f"{r['temporaries'] / GiB:.2f} GiB | {r['total'] / GiB:.2f} GiB | {r['limit'] / GiB:.0f} GiB | {fits} | "
              f"{r['host'] / GiB:.2f} GiB |", flush=True)


if __name__ == "__main__":
    sys.exit(cli.run(main))
