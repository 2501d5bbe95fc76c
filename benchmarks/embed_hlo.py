"""The embedding lookup per device (maxlm/layers/embed.py) against GSPMD's partition of the plain lookup, in the
compiled train step: ahead of time for a TPU or GPU topology (libtpu or jax's CUDA plugin, no accelerator
needed), per chip: memory, and each kind of collective with its count and bytes.

    JAX_PLATFORMS=cpu MAXLM_CUDA_PLUGIN=$PWD/.venv/cuda PYTHONPATH=. .venv/bin/python benchmarks/embed_hlo.py \\
        configs/models/llama3-8b.yml --topology h100-8 --mesh "mesh.fsdp=4 mesh.tensor=2" --mesh mesh.fsdp=8

Counts are of the optimized HLO's collective ops (a loop body's once), as benchmarks/muon_hlo.py counts them.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from maxlm import cli  # noqa: E402

from muon_hlo import COLLECTIVES, collectives  # noqa: E402


def compile_case(config: str, topology: str, extra: list[str], plain: bool) -> dict:
    from maxlm import aot, config as config_lib, hardware, recipe as recipe_lib
    from maxlm.models import decoder
    from maxlm.state import StateSpec

    cfg = config_lib.load(config, ["dry_run=true", f"compile_topology={topology}", *extra])
    hw = hardware.Hardware(cfg)
    ss = StateSpec(recipe_lib.build(cfg, hw.mesh), hw.mesh, hw.rules)
    per_device = decoder.per_device
    if plain:  # what GSPMD makes of the plain lookup
        decoder.per_device = lambda *a: None
    try:
        step = aot.compile_step(cfg, ss)
    finally:
        decoder.per_device = per_device
    return dict(memory=aot.memory_report(step), coll=collectives(step.as_text()), chips=len(hw.devices))


def main() -> None:
    ap = cli.Parser()
    ap.add_argument("config")
    ap.add_argument("--topology", default="h100-8")
    ap.add_argument("--mesh", action="append", default=None, help="overrides of one mesh case, space-separated")
    a = ap.parse_args()
    from maxlm import aot
    print(aot.prepare(a.topology) or "")
    import jax
    print(f"jax {jax.__version__}; {a.config} on {a.topology}, per chip")
    gib = 2 ** 30
    for mesh in a.mesh or ["mesh.fsdp=-1"]:
        rows = {name: compile_case(a.config, a.topology, mesh.split(), name == "gspmd") for name in ("gspmd", "per_device")}
        print(f"\n[{mesh}] {rows['gspmd']['chips']} chips")
        for k in ("total", "temp"):
            key = next((x for x in rows["gspmd"]["memory"] if x.startswith(k)), None)
            if key:
                print(f"  memory {key}: gspmd {rows['gspmd']['memory'][key] / gib:.3f} GiB, "
                      f"per_device {rows['per_device']['memory'][key] / gib:.3f} GiB")
        for kind in COLLECTIVES:
            (n0, b0), (n1, b1) = (rows[r]["coll"].get(kind, (0, 0)) for r in ("gspmd", "per_device"))
            if n0 or n1:
                print(f"  {kind:>18}: gspmd {n0:4d} ops {b0 / gib:8.3f} GiB   per_device {n1:4d} ops {b1 / gib:8.3f} GiB")


if __name__ == "__main__":
    sys.exit(cli.run(main))
