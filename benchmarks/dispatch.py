"""Where the train loop's host waits: per iteration, the time of next(loader), of the call that dispatches
the step, and of reading the previous step's metrics.

    python benchmarks/dispatch.py CONFIG.yml [key=value ...]

With asynchronous dispatch the call returns at once and the read waits for the device. On the first H100
run (2026-11-24, benchmarks/RESULTS.md) the call itself blocked for a whole step (270 ms at Llama-3-8B
width, 2 layers, seq 4096), with or without XLA's command buffers, so the loop does not run ahead there.
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from maxlm import cli  # noqa: E402

import jax  # noqa: E402

from maxlm import config  # noqa: E402
from maxlm.data import make_loader  # noqa: E402
from maxlm.aot import compile_step  # noqa: E402
from step_time import setup  # noqa: E402  (benchmarks/step_time.py, beside this script)


def main() -> None:
    cfg = config.load(sys.argv[1], sys.argv[2:])
    m, rules, ss = setup(cfg)
    step = compile_step(cfg, ss)
    loader = make_loader(cfg, ss.abstract_batch)
    state, prev, rows = ss.init_fn(cfg.seed)(), None, []
    for i in range(10):
        t0 = time.perf_counter()
        batch = next(loader)
        t1 = time.perf_counter()
        state, out = step(state, batch)
        t2 = time.perf_counter()
        if prev is not None:
            jax.device_get(prev)
        t3 = time.perf_counter()
        prev = out
        rows.append((t1 - t0, t2 - t1, t3 - t2))
        print(f"iteration {i}: next(loader) {1e3 * rows[-1][0]:8.1f} ms  dispatch {1e3 * rows[-1][1]:8.1f} ms  "
              f"read previous {1e3 * rows[-1][2]:8.1f} ms", flush=True)
    jax.device_get(prev)
    loader.close()
    med = [statistics.median(r[k] for r in rows[2:]) * 1e3 for k in range(3)]
    print(f"median of iterations 2-9: next(loader) {med[0]:.1f} ms, dispatch {med[1]:.1f} ms, read {med[2]:.1f} ms "
          f"({jax.devices()[0].device_kind})")


if __name__ == "__main__":
    sys.exit(cli.run(main))
