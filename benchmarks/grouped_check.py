"""On a Hopper GPU: tokamax's grouped matmul as maxlm calls it (layers.gmm.tokamax_grouped), forward, dx and
dw, against float64 on the host, over group sizes with experts that get no rows (first, middle, last)
and rows past the last group; then its time beside XLA's `lax.ragged_dot` at one MoE layer's shapes.
This is the check `model.grouped_gemm=auto` waits for: it exits 1 if any error is over its bound, and
when it passes on a device kind, that kind goes into layers.gmm.VERIFIED with its RESULTS.md entry.

    python3 benchmarks/grouped_check.py            (benchmarks/gpu_check.sh grouped)
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from maxlm import cli  # noqa: E402
from maxlm.errors import ConfigError  # noqa: E402
from maxlm.layers import gmm  # noqa: E402

# (rows, experts, d_in, d_out, group sizes or None for a random split): small ones with empty experts,
# then one device's Qwen3-30B-A3B layer (8 x 4096 tokens x top-8 over 128 experts).
CASES = [(512, 8, 256, 384, [0, 100, 0, 90, 60, 0, 40, 0]), (512, 8, 256, 384, [0] * 7 + [300]),
         (1024, 16, 512, 256, [64] * 16), (32768, 128, 2048, 768, None)]
# bfloat16 inputs, float32 accumulation, bfloat16 outputs: the error relative to the largest reference value.
BOUND = 2 ** -7


def reference(x, w, g, ct):
    """float64 on the host: y, dx and dw of y = x @ w[expert of row], rows past the groups zero."""
    x, w, ct = (np.asarray(a, np.float64) for a in (x, w, ct))
    y, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
    start = 0
    for e, n in enumerate(np.asarray(g)):
        rows = slice(start, start + n)
        y[rows], dx[rows], dw[e] = x[rows] @ w[e], ct[rows] @ w[e].T, x[rows].T @ ct[rows]
        start += n
    return y, dx, dw


def check(rows, experts, d_in, d_out, sizes, rng) -> bool:
    if sizes is None:
        sizes = np.bincount(rng.integers(0, experts, rows - rows // 8), minlength=experts)  # 1/8 past the groups
    g = jnp.asarray(sizes, jnp.int32)
    x = jnp.asarray(rng.standard_normal((rows, d_in)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((experts, d_in, d_out)) / np.sqrt(d_in), jnp.bfloat16)
    ct = jnp.asarray(rng.standard_normal((rows, d_out)), jnp.bfloat16)

    @jax.jit
    def run(x, w, ct):
        y, vjp = jax.vjp(lambda x, w: gmm.tokamax_grouped(x, w, g), x, w)
        return (y, *vjp(ct))

    got = [np.asarray(a, np.float64) for a in run(x, w, ct)]
    ok = True
    for name, a, b in zip(("y", "dx", "dw"), got, reference(x, w, g, ct)):
        err = np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)
        exact = (all(np.all(a[e] == 0) for e in range(experts) if sizes[e] == 0) if name == "dw" else
                 bool(np.all(a[int(np.sum(sizes)):] == 0)))
        ok &= bool(err <= BOUND and exact and np.isfinite(a).all())
        print(f"  {rows}x{experts}x{d_in}x{d_out} {name}: max error {err:.2e} of the largest value (bound "
              f"{BOUND:.1e}); {'empty experts exactly 0' if name == 'dw' else 'rows past the groups exactly 0'}: "
              f"{bool(exact)}")
    return ok


def timed(f, *args, repeat=20) -> float:
    jax.block_until_ready(f(*args))
    t = time.perf_counter()
    for _ in range(repeat):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / repeat


def main() -> int:
    cli.Parser(description=__doc__.split("\n\n")[0]).parse_args()
    kind = jax.devices()[0].device_kind
    if jax.devices()[0].platform != "gpu" or not gmm.is_hopper(kind):
        raise ConfigError(f"needs a Hopper GPU (tokamax's sm90 kernel); this machine's first device is {kind}")
    import tokamax
    print(f"{kind}, jax {jax.__version__}, tokamax {tokamax.__version__}")
    rng = np.random.default_rng(0)
    ok = all([check(*c, rng) for c in CASES])
    rows, experts, d_in, d_out, _ = CASES[-1]
    g = jnp.asarray(np.bincount(rng.integers(0, experts, rows), minlength=experts), jnp.int32)
    x = jnp.asarray(rng.standard_normal((rows, d_in)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((experts, d_in, d_out)), jnp.bfloat16)
    flops = 2 * rows * d_in * d_out
    for name, mm in (("tokamax", gmm.tokamax_grouped), ("xla ragged_dot", lambda x, w, g: jax.lax.ragged_dot(x, w, g))):
        s = timed(jax.jit(lambda x, w: mm(x, w, g)), x, w)
        print(f"  forward {rows}x{experts}x{d_in}x{d_out}, {name}: {s * 1e3:.3f} ms, {flops / s / 1e12:.1f} TFLOP/s")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(cli.run(main))
