"""What Muon costs in the compiled train step, against AdamW: compiled ahead of time for a TPU topology (libtpu,
no TPU needed), per chip: FLOPs (the compiler's cost analysis), memory, and each kind of collective with its
count and bytes, so the all-gathers that the Newton-Schulz iterations add under fsdp and tensor sharding show.

    TPU_LIBRARY_PATH=$PWD/.venv/tpu/libtpu/libtpu.so JAX_PLATFORMS=cpu PYTHONPATH=. .venv/bin/python \\
        benchmarks/muon_hlo.py configs/models/llama3-8b.yml --topology v5p-8 --mesh mesh.fsdp=4 \\
        --mesh "mesh.fsdp=2 mesh.tensor=2"

The analytic count beside it: per m x n matrix (m <= n) and step, 5 Newton-Schulz iterations of
X X^T (2 m^2 n), A A (2 m^3) and (bA + cA^2) X (2 m^2 n), each done whole on every chip that holds a
shard of it unless the compiler splits it.
"""

import collections
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from maxlm import cli  # noqa: E402

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
BYTES = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "f16": 2, "s8": 1, "u8": 1, "pred": 1}


def collectives(hlo: str) -> dict:
    """{kind: (count, bytes)} of the collectives' results in the optimized HLO (async pairs counted once)."""
    out = collections.defaultdict(lambda: [0, 0])
    for line in hlo.splitlines():
        m = re.search(r"= (\(?[^=]*?\)?) (" + "|".join(COLLECTIVES) + r")(-start)?\(", line)
        if not m:
            continue
        shapes = re.findall(r"(\w+)\[([0-9,]*)\]", m.group(1))
        if m.group(3):  # an async start's tuple holds the operand and the result: count the result
            shapes = shapes[-1:]
        n = sum(BYTES.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d) for t, dims in shapes)
        out[m.group(2)][0] += 1
        out[m.group(2)][1] += n
    return {k: tuple(v) for k, v in out.items()}


def newton_schulz_flops(specs) -> float:
    import jax

    from maxlm import optim
    from maxlm.models import params as P_

    total = 0.0
    for d, s in zip(jax.tree.leaves(optim.muon_dims(specs), is_leaf=optim._is_dims),
                    jax.tree.leaves(specs, is_leaf=P_.is_param)):
        if d is None:
            continue
        fan_in = math.prod(s.shape[i] for i in d.reduction_axis)
        fan_out = math.prod(s.shape[i] for i in d.output_axis)
        m, n = sorted((fan_in, fan_out))
        batch = math.prod(s.shape) // (m * n)
        total += batch * optim.NS_STEPS * (4 * m * m * n + 2 * m ** 3)
    return total


def compile_case(config: str, topology: str, extra: list[str]) -> dict:
    from maxlm import aot, config as config_lib, hardware, metrics, recipe as recipe_lib
    from maxlm.state import StateSpec

    cfg = config_lib.load(config, ["dry_run=true", f"compile_topology={topology}", *extra])
    hw = hardware.Hardware(cfg)
    ss = StateSpec(recipe_lib.build(cfg, hw.mesh), hw.mesh, hw.rules)
    step = aot.compile_step(cfg, ss)
    cost = step.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    tokens = cfg.global_batch_size * cfg.seq_len
    return dict(flops=cost.get("flops", float("nan")), memory=aot.memory_report(step), coll=collectives(step.as_text()),
                ns=newton_schulz_flops(ss.specs), chips=len(hw.devices), tokens=tokens,
                model=metrics.flops_per_token(cfg.model, cfg.seq_len) * tokens / len(hw.devices))


def main() -> None:
    ap = cli.Parser()
    ap.add_argument("config")
    ap.add_argument("--topology", default="v5p-8")
    ap.add_argument("--mesh", action="append", default=None, help="overrides of one mesh case, space-separated")
    ap.add_argument("--set", action="append", default=[], help="overrides for every case")
    a = ap.parse_args()
    from maxlm import aot
    print(aot.prepare(a.topology) or "")
    import jax
    print(f"jax {jax.__version__}; {a.config} {' '.join(a.set)} on {a.topology}, per chip")
    for mesh in a.mesh or ["mesh.fsdp=-1"]:
        rows = {}
        for opt in ("adamw", "muon"):
            rows[opt] = compile_case(a.config, a.topology, [*a.set, *mesh.split(), f"optim.name={opt}"])
        adam, muon = rows["adamw"], rows["muon"]
        gib = 2 ** 30
        print(f"\n[{mesh}] {adam['chips']} chips, {adam['tokens']:,} tokens per step")
        # XLA's cost analysis counts a loop body once: the layer scan's FLOPs are 1/L of theirs, so the step's
        # own count is the analytic one; the optimizer update is outside any loop and counted whole.
        added = muon["flops"] - adam["flops"]
        print(f"  Muon's added FLOPs per chip (compiled, muon - adamw): {added:.4e} = {100 * added / adam['model']:.1f}% of "
              f"the model's {adam['model']:.4e} (6N + attention per token, analytic); Newton-Schulz on whole matrices "
              f"split evenly: {muon['ns'] / adam['chips']:.4e}")
        for k in ("total", "temp", "argument"):
            key = next((x for x in adam["memory"] if x.startswith(k)), None)
            if key:
                print(f"  memory {key}: adamw {adam['memory'][key] / gib:.2f} GiB, muon {muon['memory'][key] / gib:.2f} GiB")
        for kind in COLLECTIVES:
            (n0, b0), (n1, b1) = adam["coll"].get(kind, (0, 0)), muon["coll"].get(kind, (0, 0))
            if n0 or n1:
                print(f"  {kind:>18}: adamw {n0:4d} ops {b0 / gib:8.3f} GiB   muon {n1:4d} ops {b1 / gib:8.3f} GiB")


if __name__ == "__main__":
    sys.exit(cli.run(main))
