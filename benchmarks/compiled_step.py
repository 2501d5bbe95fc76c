"""The compiled train step, measured: memory by kind, collectives by kind (loop-aware, with a ring estimate
of the bytes each device sends), matmul FLOPs against the analytic count, and kernel calls. Per device,
per step, for any config and topology, compiled ahead of time (libtpu or the CUDA plugin; no accelerator).

    TPU_LIBRARY_PATH=$PWD/.venv/tpu/libtpu/libtpu.so JAX_PLATFORMS=cpu .venv/bin/python \\
        benchmarks/compiled_step.py configs/models/llama3-8b.yml --topology v5p-8 \\
        --set seq_len=8192 global_batch_size=4 remat=full attention=splash [--json OUT] [--hlo OUT.hlo.txt]
    python benchmarks/compiled_step.py --from-hlo STEP.hlo.txt        # count a saved module again

Counts follow `hlo_count`: every op as often as its loops run (XLA's cost_analysis counts a loop body
once). Matmul FLOPs are the `dot` and `convolution` ops' (libtpu writes matmuls as convolutions), split
into what remat recomputes and the rest; attention inside a Pallas kernel is a custom call, counted
separately, so the rest is compared with the weights' analytic share, 6 N per token (N: the matmul
parameters, maxlm.metrics.matmul_params). Above 1, the step multiplies a weight more often than its
forward and backward need (maxlm's chunked loss recomputes its logits in the backward: 2 N_vocab).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from maxlm import cli  # noqa: E402

import hlo_count  # noqa: E402

GiB = 2 ** 30


def measure(hlo: str) -> dict:
    return {"collectives": hlo_count.collectives(hlo), "matmul_flops": hlo_count.matmul_flops(hlo),
            "custom_calls": hlo_count.custom_calls(hlo)}


def compile_case(config: str, topology: str, overrides: list[str]) -> tuple[dict, str]:
    from maxlm import aot, config as config_lib, hardware, mesh as mesh_lib, metrics, recipe as recipe_lib
    from maxlm.state import StateSpec

    cfg = config_lib.load(config, [*overrides, "dry_run=true", f"compile_topology={topology}"])
    hw = hardware.Hardware(cfg)
    step = aot.compile_step(cfg, StateSpec(recipe_lib.build(cfg, hw.mesh), hw.mesh, hw.rules))
    hlo = step.as_text()
    tokens = cfg.global_batch_size * cfg.seq_len / len(hw.devices)
    # On TPU and GPU an MoE's grouped matmuls are kernels (custom calls), outside the counted ops.
    weights = None if cfg.model.n_experts else 6 * metrics.matmul_params(cfg.model) * tokens
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
    f = r["matmul_flops"]
    line = f"  matmul TFLOPs/step {f['all'] / 1e12:.3f}, of which remat recomputes {f['recomputed'] / 1e12:.3f}"
    if r.get("analytic_weight_flops") is None and "analytic_weight_flops" in r:
        line += "; the experts' grouped matmuls run as kernels, which this count omits: no analytic comparison"
    elif r.get("analytic_weight_flops"):
        rest = [(f["all"] - f["recomputed"] - x) / r["analytic_weight_flops"] for x in (f["unnamed"], 0)]
        line += f"; the rest = {rest[0]:.4f} x 6 N per token (the weights' forward and backward)"
        if f["unnamed"]:
            line += f", {rest[1]:.4f} x with the {f['unnamed'] / 1e12:.3f} TFLOPs whose ops carry no jax op name"
    out.append(line)
    out.append("  kernel calls/step: " + (", ".join(f"{k} {v}" for k, v in sorted(r["custom_calls"].items())) or "none"))
    return "\n".join(out)


def _tiles(text: str) -> tuple[int, ...]:
    parts = text.split(",")
    if len(parts) != 6 or not all(p.isdigit() and int(p) > 0 and int(p) % 128 == 0 for p in parts):
        raise argparse.ArgumentTypeError(f"must be six positive multiples of 128, comma-separated, got {text!r}")
    return tuple(int(p) for p in parts)


def main() -> None:
    ap = cli.Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?")
    ap.add_argument("--topology", default="v5p-8")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides, key=value")
    ap.add_argument("--json", help="write the measures here as JSON")
    ap.add_argument("--hlo", help="keep the optimized HLO here")
    ap.add_argument("--from-hlo", help="count a saved optimized HLO module instead of compiling")
    ap.add_argument("--splash-tiles", type=_tiles, metavar="Q,KV,Q_DKV,KV_DKV,Q_DQ,KV_DQ",
                    help="TPU flash attention's block sizes for every chip and head_dim, instead of its table")
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
    if a.splash_tiles:
        from maxlm.kernels_pallas import flash_tpu
        flash_tpu.TILES, flash_tpu.DEFAULT_TILES = {}, flash_tpu.Tiles(*a.splash_tiles)
    r, hlo = compile_case(a.config, a.topology, a.set)
    if a.splash_tiles:
        r["splash_tiles"] = a.splash_tiles
    print(report(r))
    if a.hlo:
        Path(a.hlo).write_text(hlo)
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    sys.exit(cli.run(main))
