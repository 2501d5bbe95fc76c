"""Cross-entropy forward+backward: plain (whole float32 logits) vs chunked (maxlm.layers.loss).

    python benchmarks/loss.py                         # CPU-sized defaults, ~2 minutes on 2 cores
    python benchmarks/loss.py --sizes 8192x4096x256000 --dtype bfloat16 --repeat 10   # an accelerator

Each size is tokens x d_model x vocab (one row of `tokens`). Timed: the jitted value_and_grad w.r.t.
x and w of the summed loss, `--warmup` calls, then the median of `--repeat`, each blocked until ready.
Also printed: the compiled temp memory (memory_analysis().temp_size_in_bytes), which for the plain loss
holds the [tokens, vocab] float32 logits and their gradient, the chunk plan chosen, and the chunked dw's
largest difference from the plain one relative to the plain one's largest entry.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from maxlm import cli  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from maxlm.layers import loss  # noqa: E402

DEFAULT_SIZES = "2048x256x32000,4096x128x32768,512x128x256000"  # ~17 G multiply-adds each: ~2 minutes on 2 CPU cores


def step(fn):
    return jax.jit(jax.value_and_grad(lambda x, w, t, m: jnp.sum(fn(x, w, t, m)), argnums=(0, 1)))


def measure(compiled, args, warmup: int, repeat: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated TOKENSxDxV")
    ap.add_argument("--dtype", default="float32", help="activation dtype (w stays float32)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, {dev.platform} ({dev.device_kind}), x dtype {args.dtype}, "
          f"median of {args.repeat} after {args.warmup} warm-up")
    print(f"{'tokens x D x V':>22} {'plan (n, nv)':>12} {'plain ms':>9} {'chunked ms':>10} {'ratio':>6} "
          f"{'plain temp MiB':>14} {'chunked temp MiB':>16} {'dw rel err':>10}")
    rng = np.random.default_rng(0)
    for size in args.sizes.split(","):
        T, D, V = (int(s) for s in size.split("x"))
        x = jnp.asarray(rng.standard_normal((1, T, D), np.float32) / np.sqrt(D)).astype(args.dtype)
        w = jnp.asarray(rng.standard_normal((D, V), np.float32))
        t, m = jnp.asarray(rng.integers(0, V, (1, T), np.int32)), jnp.ones((1, T), bool)
        row, temp, results = [], [], []
        for fn in (loss.reference, loss.cross_entropy):
            compiled = step(fn).lower(x, w, t, m).compile()
            temp.append(compiled.memory_analysis().temp_size_in_bytes / 2**20)
            row.append(measure(compiled, (x, w, t, m), args.warmup, args.repeat))
            results.append(compiled(x, w, t, m)[1][1])
        err = float(jnp.max(jnp.abs(results[1] - results[0])) / jnp.max(jnp.abs(results[0])))
        print(f"{size:>22} {str(loss.plan(1, T, V)):>12} {row[0]:9.1f} {row[1]:10.1f} {row[1] / row[0]:6.2f} "
              f"{temp[0]:14.1f} {temp[1]:16.1f} {err:10.1e}")


if __name__ == "__main__":
    sys.exit(cli.run(main))
