"""Pipeline stages against data parallelism across TPU slices: what crosses the data-centre network (DCN).

Each case compiles CONFIG ahead of time for `--topology` x `--slices` slices (libtpu, no TPU needed) and
prints, per chip: memory, the bytes libtpu's megascale transfers send between slices per step (read from
the optimized HLO's `send` ops, which carry `_xla_megascale_transfer_type`), and the compiler's own
`optimal_seconds` (cost analysis: a roofline lower bound that charges collectives as HBM traffic only, so
it does not see DCN's bandwidth, the bubble's idle ticks, or overlap).

    TPU_LIBRARY_PATH=$PWD/.venv/tpu/libtpu/libtpu.so JAX_PLATFORMS=cpu PYTHONPATH=. .venv/bin/python \\
        benchmarks/pipeline_dcn.py configs/models/llama3.1-70b.yml --topology v5p-64 --slices 2 \\
        --case "stage:mesh.stage=2 mesh.fsdp=-1 global_batch_size=128 microbatches=4" \\
        --case "data:mesh.data=2 mesh.fsdp=-1 global_batch_size=128 microbatches=2"
    python benchmarks/pipeline_dcn.py --from-hlo DIR/*.hlo.txt     # HLO kept by PIPELINE_DCN_HLO=DIR
"""

import math
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from maxlm import cli  # noqa: E402

from hlo_count import BYTES, computations, runs  # noqa: E402

GiB = 2 ** 30


def dcn(hlo: str) -> dict:
    """{transfer type: (sends per step, bytes per step)} of libtpu's megascale sends between slices, each
    counted as often as the loops around it run."""
    comps = computations(hlo)
    n_runs, out = runs(comps), {}
    for name, lines in comps.items():
        if name == "ENTRY":
            continue
        for line in lines:
            m = re.search(r"= (.*?) send\(.*_xla_megascale_transfer_type=\"(\w+)\"", line)
            if m:  # a send's result is a tuple (data, context, token): the data is its first shape
                t, dims = re.findall(r"(\w+)\[([0-9,]*)\]", m.group(1))[0]
                n = BYTES.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d)
                sends, total = out.get(m.group(2), (0, 0))
                out[m.group(2)] = (sends + n_runs[name], total + n * n_runs[name])
    return out


def compile_case(config: str, topology: str, slices: int, extra: list[str]) -> dict:
    from maxlm import aot, config as config_lib, hardware, mesh as mesh_lib, recipe as recipe_lib
    from maxlm.state import StateSpec

    cfg = config_lib.load(config, ["dry_run=true", f"compile_topology={topology}", f"mesh.slices={slices}", *extra])
    hw = hardware.Hardware(cfg)
    step = aot.compile_step(cfg, StateSpec(recipe_lib.build(cfg, hw.mesh), hw.mesh, hw.rules))
    cost = step.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    hlo = step.as_text()
    if os.environ.get("PIPELINE_DCN_HLO"):  # keep each case's optimized HLO for a closer look
        keep = Path(os.environ["PIPELINE_DCN_HLO"])
        keep.mkdir(parents=True, exist_ok=True)
        (keep / f"{'_'.join(extra)}.hlo.txt").write_text(hlo)
    return dict(mesh=mesh_lib.describe(hw.mesh), memory=aot.memory_report(step), dcn=dcn(hlo),
                optimal=cost.get("optimal_seconds", float("nan")), chips=len(hw.devices))


def main() -> None:
    if sys.argv[1:2] == ["--from-hlo"]:  # re-read saved HLO (PIPELINE_DCN_HLO=DIR) without compiling again
        for f in sys.argv[2:]:
            sends = dcn(Path(f).read_text())
            print(f, ", ".join(f"{k} {n} sends {b / GiB:.3f} GiB" for k, (n, b) in sorted(sends.items())) or "none")
        return
    ap = cli.Parser()
    ap.add_argument("config")
    ap.add_argument("--topology", default="v5p-64")
    ap.add_argument("--slices", type=int, default=2)
    ap.add_argument("--case", action="append", required=True, help="NAME:overrides, space-separated")
    a = ap.parse_args()
    from maxlm import aot
    print(aot.prepare(a.topology) or "")
    import jax
    print(f"jax {jax.__version__}; {a.config} on {a.slices} x {a.topology}, per chip")
    for case in a.case:
        name, _, over = case.partition(":")
        r = compile_case(a.config, a.topology, a.slices, over.split())
        sends = ", ".join(f"{k} {n} sends {b / GiB:.3f} GiB" for k, (n, b) in sorted(r["dcn"].items())) or "none"
        print(f"[{name}] {over}: {r['mesh']}, {r['chips']} chips")
        print(f"  memory total {r['memory']['total'] / GiB:.2f} GiB (arguments {r['memory']['arguments'] / GiB:.2f}, "
              f"temporaries {r['memory']['temporaries'] / GiB:.2f}); DCN per step: {sends}; "
              f"optimal_seconds {r['optimal']:.3f}")


if __name__ == "__main__":
    sys.exit(cli.run(main))
