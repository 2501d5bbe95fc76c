"""The compiled train step, measured: memory by kind, collectives by kind (loop-aware, with a ring estimate
of the bytes each device sends), matmul FLOPs against the analytic count, and kernel calls. Per device,
per step, for any config and topology, compiled ahead of time (libtpu or the CUDA plugin; no accelerator).

    TPU_LIBRARY_PATH=$PWD/.venv/tpu/libtpu/libtpu.so JAX_PLATFORMS=cpu .venv/bin/python \\
        benchmarks/compiled_step.py configs/models/llama3-8b.yml --topology v5p-8 \\
        --set seq_len=8192 global_batch_size=4 remat=full attention=splash [--json OUT] [--hlo OUT.hlo.txt]
    python benchmarks/compiled_step.py --from-hlo STEP.hlo.txt        # count a saved module again

Counts follow `hlo_count`: every op as often as its loops run (XLA's cost_analysis counts a loop body
once). Matmul FLOPs are the `dot` ops'; attention inside a Pallas kernel is a custom call, counted
separately, so the analytic figure compared is the weights' share: 6 N per token (8 N under remat=full,
whose backward recomputes the forward).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from maxlm import cli  # noqa: E402

import hlo_count  # noqa: E402

GiB = 2 ** 30


def measure(hlo: str) -> dict:
    return {"collectives": hlo_count.collectives(hlo), "dot_flops": hlo_count.dot_flops(hlo),
            "custom_calls": hlo_count.custom_calls(hlo)}


def compile_case(config: str, topology: str, overrides: list[str]) -> tuple[dict, str]:
    from maxlm import aot, config as config_lib, hardware, mesh as mesh_lib, metrics, recipe as recipe_lib
    from maxlm.state import StateSpec

    cfg = config_lib.load(config, [*overrides, "dry_run=true", f"compile_topology={topology}"])
    hw = hardware.Hardware(cfg)
    step = aot.compile_step(cfg, StateSpec(recipe_lib.build(cfg, hw.mesh), hw.mesh, hw.rules))
    hlo = step.as_text()
    tokens = cfg.global_batch_size * cfg.seq_len / len(hw.devices)
    weights = 6 * metrics.matmul_params(cfg.model) * tokens * (8 / 6 if cfg.remat == "full" else 1)
    return {"config": config, "topology": topology, "overrides": overrides, "mesh": mesh_lib.describe(hw.mesh),
            "devices": len(hw.devices), "memory": aot.memory_report(step), "analytic_weight_flops": weights,
            **measure(hlo)}, hlo


def report(r: dict) -> str:
    out = []
    if "memory" in r:
        out.append(f"{r['config']} on {r['topology']} ({r['mesh']}), per device: "
                   + ", ".join(f"{k} {v / GiB:.2f}" for k, v in r["memory"].items()) + " GiB")
    out.append(f"  {'collective':<20}{'ops/step':>10}{'GiB/step':>12}{'ring sent GiB':>15}")
    total = [0, 0.0, 0.0]
    for kind, c in r["collectives"].items():
        if c["ops"]:
            out.append(f"  {kind:<20}{c['ops']:>10}{c['bytes'] / GiB:>12.3f}{c['sent'] / GiB:>15.3f}")
            total = [total[0] + c["ops"], total[1] + c["bytes"], total[2] + c["sent"]]
    out.append(f"  {'all':<20}{total[0]:>10}{total[1] / GiB:>12.3f}{total[2] / GiB:>15.3f}")
    line = f"  matmul TFLOPs/step {r['dot_flops'] / 1e12:.3f}"
    if not r["dot_flops"]:
        line = "  matmul FLOPs: pending (libtpu writes matmuls as convolutions, which hlo_count does not count)"
    elif r.get("analytic_weight_flops"):
        line += f" = {r['dot_flops'] / r['analytic_weight_flops']:.3f} x the weights' analytic count"
    out.append(line)
    out.append("  kernel calls/step: " + (", ".join(f"{k} {v}" for k, v in sorted(r["custom_calls"].items())) or "none"))
    return "\n".join(out)


def main() -> None:
    ap = cli.Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?")
    ap.add_argument("--topology", default="v5p-8")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides, key=value")
    ap.add_argument("--json", help="write the measures here as JSON")
    ap.add_argument("--hlo", help="keep the optimized HLO here")
    ap.add_argument("--from-hlo", help="count a saved optimized HLO module instead of compiling")
    a = ap.parse_args()
    if a.from_hlo:
        print(report(measure(Path(a.from_hlo).read_text())))
        return
    if not a.config:
        ap.error("give a CONFIG, or --from-hlo FILE")
    from maxlm import aot
    note = aot.prepare(a.topology)
    if note:
        print(note)
    import jax
    print(f"jax {jax.__version__}")
    r, hlo = compile_case(a.config, a.topology, a.set)
    print(report(r))
    if a.hlo:
        Path(a.hlo).write_text(hlo)
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    sys.exit(cli.run(main))
