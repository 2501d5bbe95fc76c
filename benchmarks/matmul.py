"""The measured matmul ceiling: TFLOP/s of one N x N x N GEMM, the figure MFU is read against beside the
datasheet peak (an H100 measured 689-717 TFLOP/s in bf16 against the datasheet's 989: benchmarks/RESULTS.md).

    python benchmarks/matmul.py                       # bf16 and fp8 at 8192^3 on the first device
    python benchmarks/matmul.py --size 1024 --dtypes bfloat16

fp8 multiplies e4m3 x e4m3 into bf16, as quantization=fp8's forward matmuls do; on a GPU with FP8
tensor cores XLA makes it a cuBLASLt FP8 GEMM, and the script says whether the compiled HLO holds one.
On CPU the numbers only show that the script runs. Timing: one second of warm-up calls, then the median
over 5 rounds of the mean time of --repeat calls dispatched back to back.
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from maxlm import cli  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from maxlm import fp8, metrics  # noqa: E402

DTYPES = {"bfloat16": (jnp.bfloat16, jnp.bfloat16), "fp8": (jnp.float8_e4m3fn, jnp.bfloat16),
          "float32": (jnp.float32, jnp.float32)}


def time_gemm(n: int, dtype: str, repeat: int) -> tuple[float, bool]:
    """(median seconds of one n^3 GEMM, whether the compiled HLO holds a cuBLASLt FP8 GEMM)."""
    in_dt, out_dt = DTYPES[dtype]
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.float32).astype(in_dt)
    b = jax.random.normal(kb, (n, n), jnp.float32).astype(in_dt)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=out_dt)).lower(a, b).compile()
    f8_gemm = bool(fp8.F8_GEMM.search(f.as_text()))
    # Warm up for a second, then time rounds of `repeat` GEMMs dispatched back to back and blocked on once:
    # blocking on each 1.5 ms GEMM charges it the host's round trip. On the first H100 run, per-call
    # blocking read 608-647 TFLOP/s where pipelined calls (and torch, timed with CUDA events) read 715.
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 1.0:
        f(a, b).block_until_ready()
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(repeat):
            out = f(a, b)
        out.block_until_ready()
        rounds.append((time.perf_counter() - t) / repeat)
    return statistics.median(rounds), f8_gemm


def main() -> None:
    p = cli.Parser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--dtypes", default="bfloat16,fp8", help=f"comma-separated: {', '.join(DTYPES)}")
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()
    dev = jax.devices()[0]
    peak = metrics.peak_flops(dev.device_kind)
    print(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}; {args.size}^3 GEMM, median of 5 rounds of {args.repeat}")
    print(f"{'dtype':<10} {'ms':>9} {'TFLOP/s':>9} {'of bf16 peak':>13}  cuBLASLt FP8 GEMM")
    for dtype in args.dtypes.split(","):
        if dtype not in DTYPES:
            sys.exit(f"error: --dtypes: unknown `{dtype}`; choose from {', '.join(DTYPES)}")
        s, f8_gemm = time_gemm(args.size, dtype, args.repeat)
        tflops = 2 * args.size ** 3 / s / 1e12
        of_peak = f"{tflops * 1e12 / peak:.1%}" if peak else "n/a"
        print(f"{dtype:<10} {s * 1e3:9.3f} {tflops:9.1f} {of_peak:>13}  {'yes' if f8_gemm else 'no'}")


if __name__ == "__main__":
    sys.exit(cli.run(main))
