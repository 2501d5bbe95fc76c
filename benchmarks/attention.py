"""Causal attention forward and forward+backward TFLOP/s: maxlm flash (Triton) and mosaic (the Hopper
kernels) vs cuDNN vs XLA. The first run on an H100 decides `attention=auto` there: it prints mosaic's
fwd+bwd speed over flash's (auto keeps flash until that ratio is above 1).

    python benchmarks/attention.py                      # GPU: seq 1k..16k, bf16, head_dim 128
    python benchmarks/attention.py --tiny               # CPU: correctness of every path at a tiny size

Each implementation is first checked against XLA (output and dq/dk/dv, max|Δ|/max|ref|) on one row of
up to 2048 tokens, small enough for XLA's L x L scores at every seq; one that fails the check is
reported and not timed. Batch x heads fill the GPU: batch = tokens / seq
(default 64k tokens, 16 heads). FLOPs are the causal count: forward 2 matmuls over half the L x L scores,
4 * B * H * L^2 * D / 2; backward 2.5x that (5 matmuls: FlashAttention-2's convention), so forward+backward
is 3.5x. The bf16 matmul ceiling is measured on this device (a large square matmul), and the flash
forward is printed as a fraction of it. Nothing is estimated: a path that cannot run here (cuDNN off
NVIDIA, an out-of-memory XLA) says so in its row.
"""

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from maxlm import cli  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from maxlm.layers.attention import reference_attention  # noqa: E402


def implementations(platform: str) -> dict:
    """name -> (fn(q, k, v) -> o, or a string saying why it cannot run here)."""
    seg = lambda q: jnp.ones(q.shape[:2], jnp.int32)  # noqa: E731  (one document per row)
    if platform == "tpu":
        from maxlm.kernels_pallas.flash_tpu import flash_attention
        flash = lambda q, k, v: flash_attention(q, k, v, seg(q))  # noqa: E731
    else:
        from maxlm.kernels_pallas.flash_gpu import flash_attention
        flash = lambda q, k, v: flash_attention(q, k, v, seg(q), interpret=platform == "cpu")  # noqa: E731
    cudnn = (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")) \
        if platform == "gpu" else f"needs an NVIDIA GPU (this is {platform})"
    mosaic = f"needs an NVIDIA Hopper GPU (this is {platform}; tests/test_flash_mgpu.py checks it in the interpreter)"
    if platform == "gpu":
        from maxlm.kernels_pallas import flash_mgpu
        mosaic = lambda q, k, v: flash_mgpu.flash_attention(q, k, v, seg(q))  # noqa: E731
    xla = lambda q, k, v: reference_attention(q, k, v, seg(q), seg(q))  # noqa: E731  (maxlm's attention=xla)
    return {"flash": flash, "mosaic": mosaic, "cudnn": cudnn, "xla": xla}


def fwd_bwd(fn):
    def loss(q, k, v, do):
        o, vjp = jax.vjp(fn, q, k, v)
        return vjp(do)
    return jax.jit(loss)


def inputs(B, L, H, K, D, dtype, seed=0):
    kq, kk, kv, ko = jax.random.split(jax.random.key(seed), 4)
    n = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype)  # noqa: E731
    return n(kq, (B, L, H, D)), n(kk, (B, L, K, D)), n(kv, (B, L, K, D)), n(ko, (B, L, H, D))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)) if np.isfinite(a).all() else float("nan")


CHECK_LEN = 2048


def outputs(fn, args) -> list:
    q, k, v, do = args
    return [jax.jit(fn)(q, k, v), *fwd_bwd(fn)(q, k, v, do)]


def check(fn, refs, args) -> float:
    """Worst of output, dq, dk, dv relative errors against the reference's `refs` (NaN if any is non-finite)."""
    errs = [rel_err(a, b) for a, b in zip(outputs(fn, args), refs)]
    return float("nan") if any(np.isnan(errs)) else max(errs)


def timed(f, *args, iters: int) -> float:
    """Seconds per call, compiled and warmed up first: the median over 3 rounds of `iters` calls dispatched
    back to back and blocked on once (blocking on every call adds the host's round trip to each)."""
    jax.block_until_ready(f(*args))
    rounds = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(iters):
            out = f(*args)
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - t) / iters)
    return statistics.median(rounds)


def main(argv=None) -> None:
    p = cli.Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--tokens", type=int, default=65536, help="batch * seq per call")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=0, help="0: = heads (MHA)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="CPU-sized run of every path (seq 200, 2 heads, head_dim 64)")
    a = p.parse_args(argv)
    if a.tiny:
        a.seqs, a.tokens, a.heads, a.head_dim, a.iters = [200], 400, 2, 64, 2
    platform = jax.default_backend()
    dev = jax.devices()[0]
    dtype = jnp.dtype(a.dtype)
    H, K, D = a.heads, a.kv_heads or a.heads, a.head_dim
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    print(f"device: {dev.device_kind} ({platform}); jax {jax.__version__}; {a.dtype}, heads {H}/{K}, head_dim {D}, "
          f"{a.tokens} tokens per call")
    ceiling = None
    if platform != "cpu":
        from matmul import time_gemm  # benchmarks/matmul.py, beside this script
        ceiling = 2 * 8192 ** 3 / time_gemm(8192, "bfloat16", a.iters)[0] / 1e12
        print(f"measured bf16 matmul ceiling (8192^3): {ceiling:.1f} TFLOP/s")
    if platform == "gpu":
        from maxlm.kernels_pallas.flash_gpu import describe_tiles
        print(f"flash kernel tiles: {describe_tiles(D, dtype)}")
    impls = implementations(platform)
    rows = []
    for L in a.seqs:
        B = max(1, a.tokens // L)
        args = inputs(B, L, H, K, D, dtype)
        fwd_flops = 4 * B * H * L * L * D / 2
        # Checked on one row of at most CHECK_LEN tokens, so XLA's L x L reference fits even where XLA
        # itself cannot run the timed size; computed once for every implementation.
        small = [x[:1, :CHECK_LEN] for x in args]
        refs = outputs(impls["xla"], small)
        for name, fn in impls.items():
            row = {"impl": name, "seq": L, "batch": B}
            if isinstance(fn, str):
                row["skipped"] = fn
            else:
                try:
                    err = check(fn, refs, small) if name != "xla" else 0.0
                    row["max_rel_err_vs_xla"] = err
                    if not err <= tol:
                        row["skipped"] = f"wrong: max rel err {err:.3g} > {tol}"
                    else:
                        t_f = timed(jax.jit(fn), *args[:3], iters=a.iters)
                        t_fb = timed(fwd_bwd(fn), *args, iters=a.iters)
                        row.update(fwd_ms=t_f * 1e3, fwd_bwd_ms=t_fb * 1e3, fwd_tflops=fwd_flops / t_f / 1e12,
                                   fwd_bwd_tflops=3.5 * fwd_flops / t_fb / 1e12)
                except Exception as e:  # an OOM or a refused shape is a result too; say which
                    row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(f"\n| seq | batch | impl | fwd TFLOP/s | fwd+bwd TFLOP/s | fwd ms | fwd+bwd ms | max rel err vs xla |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['seq']} | {r['batch']} | {r['impl']} | {r['skipped']} | | | | |")
        else:
            print(f"| {r['seq']} | {r['batch']} | {r['impl']} | {r['fwd_tflops']:.3g} | {r['fwd_bwd_tflops']:.3g} | "
                  f"{r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | {r['max_rel_err_vs_xla']:.2g} |")
    by = {(r["impl"], r["seq"]): r for r in rows if "skipped" not in r}
    for L in a.seqs:
        f, c, m = by.get(("flash", L)), by.get(("cudnn", L)), by.get(("mosaic", L))
        parts = []
        if f and c:
            parts.append(f"flash/cudnn fwd+bwd {f['fwd_bwd_tflops'] / c['fwd_bwd_tflops']:.2f}x")
        if f and m:
            parts.append(f"mosaic/flash fwd+bwd {m['fwd_bwd_tflops'] / f['fwd_bwd_tflops']:.2f}x")
        if f and ceiling:
            parts.append(f"flash fwd {100 * f['fwd_tflops'] / ceiling:.0f}% of the matmul ceiling")
        if parts:
            print(f"seq {L}: " + "; ".join(parts))


if __name__ == "__main__":
    sys.exit(cli.run(main))
