"""Steady-state step time, tokens/s, TFLOP/s and MFU for any config on the local devices.

    python benchmarks/step_time.py CONFIG.yml [key=value ...] [--steps N]
    python benchmarks/step_time.py CONFIG.yml [key=value ...] --compile-layers 4 32

It measures two things, both excluding compilation:
  device  the compiled step alone: N calls on one resident batch, blocking after each call.
  loop    maxlm's real training loop (`maxlm.train.run`: data, dispatch, metrics, logging), from the
          step_time_s it writes to metrics.jsonl; the first 3 steps are dropped as warm-up.
Host overhead = host_time_s / step_time_s of the loop, where host_time_s (also in metrics.jsonl) is the
loop's own wall time per iteration minus the time it waits for the device and the dispatch call (which on
a GPU holds the wait: benchmarks/dispatch.py): data, bookkeeping, logging.
(loop - device) / loop is printed too, as a cross-check; on a busy CPU its noise is several %.
With --compile-layers it only times lower+compile of the train step at each depth.
MFU = 6 x (matmul params, unembedding included) + 12 x layers x heads x head_dim x (keys per query: seq/2
causal), per token, times tokens/s, over the device's datasheet bf16 peak. With --ceiling it is also read
against the measured bf16 GEMM ceiling of this device (benchmarks/matmul.py, 8192^3), timed in the same run.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from maxlm import cli  # noqa: E402

import jax  # noqa: E402

from maxlm import aot, config, mesh as mesh_lib, metrics, recipe as recipe_lib, sharding, train  # noqa: E402
from maxlm.data import make_loader  # noqa: E402
from maxlm.state import StateSpec  # noqa: E402


def setup(cfg):
    devices = jax.devices()
    sizes = mesh_lib.mesh_shape(cfg, len(devices))
    mesh_lib.check_divisibility(cfg, sizes)
    m = mesh_lib.make_mesh(sizes, devices)
    rules = sharding.rules(cfg)
    return m, rules, StateSpec(recipe_lib.build(cfg, m), m, rules)


def compile_time(cfg) -> float:
    m, rules, ss = setup(cfg)
    t = time.perf_counter()
    aot.compile_step(cfg, ss)
    return time.perf_counter() - t


def device_step_time(cfg, steps: int) -> list[float]:
    m, rules, ss = setup(cfg)
    compiled = aot.compile_step(cfg, ss)
    batch = next(make_loader(cfg, ss.abstract_batch))
    state = ss.init_fn(cfg.seed)()
    times = []
    for _ in range(steps + 3):
        t = time.perf_counter()
        state, out = compiled(state, batch)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t)
    return times[3:]


def loop_step_time(cfg_path, overrides, steps: int) -> list[float]:
    with tempfile.TemporaryDirectory() as d:
        cfg = config.load(cfg_path, overrides + [f"steps={steps + 3}", "log_every=1", "sample_tokens=0", f"run_dir={d}"])
        train.run(cfg)
        rows = [json.loads(line) for line in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in rows[3:]], [r["host_time_s"] for r in rows[3:]]


def main() -> None:
    ap = cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--compile-layers", type=int, nargs="+")
    ap.add_argument("--ceiling", action="store_true", help="also time the bf16 GEMM ceiling (8192^3) and report MFU against it")
    a = ap.parse_intermixed_args()  # overrides may come after --steps
    dev = jax.devices()[0]
    print(f"# jax {jax.__version__}, {len(jax.devices())} x {dev.device_kind} ({dev.platform})")
    if a.compile_layers:
        for n in a.compile_layers:
            cfg = config.load(a.config, a.overrides + [f"model.n_layers={n}"])
            print(f"compile n_layers={n:<3} {compile_time(cfg):6.2f} s")
        return
    cfg = config.load(a.config, a.overrides)
    loop, host = loop_step_time(a.config, a.overrides, a.steps)
    device = device_step_time(cfg, a.steps)
    t_loop, t_dev = statistics.median(loop), statistics.median(device)
    tokens = cfg.global_batch_size * cfg.seq_len
    n = len(jax.devices())
    tflops = metrics.flops_per_token(cfg.model, cfg.seq_len) * tokens / t_loop / n / 1e12
    peak = metrics.peak_flops(dev.device_kind)
    print(f"params {sum(x.size for x in jax.tree.leaves(setup(cfg)[2].abstract.params)):,}  "
          f"tokens/step {tokens:,}  steps timed {a.steps}")
    print(f"device step  median {t_dev * 1e3:8.2f} ms  (min {min(device) * 1e3:.2f}, max {max(device) * 1e3:.2f})")
    print(f"loop step    median {t_loop * 1e3:8.2f} ms  (min {min(loop) * 1e3:.2f}, max {max(loop) * 1e3:.2f})")
    print(f"host time    median {statistics.median(host) * 1e3:8.2f} ms  (max {max(host) * 1e3:.2f})")
    print(f"host overhead {100 * statistics.median(host) / t_loop:6.2f} % of the loop step "
          f"(cross-check (loop - device) / loop: {100 * (t_loop - t_dev) / t_loop:+.2f} %)")
    print(f"tokens/s {tokens / t_loop:,.0f}  tokens/s/device {tokens / t_loop / n:,.0f}  TFLOP/s/device {tflops:.4f}  "
          f"MFU {'%.1f%%' % (100 * tflops * 1e12 / peak) if peak else 'n/a (no peak known for ' + dev.device_kind + ')'}")
    if a.ceiling:
        from matmul import time_gemm  # benchmarks/matmul.py, beside this script
        ceiling = 2 * 8192 ** 3 / time_gemm(8192, "bfloat16", 10)[0] / 1e12
        print(f"measured bf16 GEMM ceiling {ceiling:.1f} TFLOP/s (8192^3)  MFU of the ceiling {100 * tflops / ceiling:.1f}%")


if __name__ == "__main__":
    sys.exit(cli.run(main))
