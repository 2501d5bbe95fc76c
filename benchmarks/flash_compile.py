"""Compile the GPU flash-attention kernels, forward and backward, for every head_dim x dtype x mask cell,
on any machine: `python benchmarks/flash_compile.py h100` (or h200, b200) compiles for a device
described by XLA's target spec through jax's CUDA plugin (MAXLM_CUDA_PLUGIN names where it is installed);
`local` compiles for the GPU this machine has. A compile runs Triton and ptxas and checks shared memory
and registers against the device; it proves nothing about numerics or speed (tests/test_flash_gpu.py
and benchmarks/gpu_check.sh do those on a GPU).

One line per cell: `ok` with the tiles, `refused` with the one-line reason maxlm gives a user, or `FAIL`
with the compiler's reason; exit 1 if any cell failed. Every cell carries packed-segment ids: the kernel
has no unpacked mode. `--kernel mosaic` compiles the Mosaic GPU (Hopper) kernels instead, whose compile
checks shared memory against the device as well (sm_90a only: they use wgmma); `--kernel triton,mosaic`
compiles both in one process."""

import argparse
import itertools
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from maxlm import cli  # noqa: E402

HEAD_DIMS = (64, 96, 128, 256, 512)
DTYPES = ("bfloat16", "float32")
MASKS = {"causal": {}, "window": {"window": 128}, "softcap": {"softcap": 30.0},
         # both masks' code at once (Gemma 2 trains with both): the cell the fast tests compile, since its kernels
         # carry every instruction the causal, window and soft-cap kernels do, at the same tiles
         "both": {"window": 128, "softcap": 30.0}}


def main(argv=None) -> int:
    p = cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="h100 | h200 | b200 (compile-only, any machine) | local (this machine's GPU)")
    p.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--masks", default="causal,window,softcap", help="of: " + ", ".join(MASKS))
    p.add_argument("--kernel", default="triton", help="triton, mosaic, or both as triton,mosaic (one start-up)")
    a = p.parse_args(argv)
    bad = set(a.kernel.split(",")) - {"triton", "mosaic"} or set(a.masks.split(",")) - set(MASKS)
    if bad:
        p.error(f"unknown kernel or mask {sorted(bad)}: kernels are triton and mosaic, masks {', '.join(MASKS)}")
    from maxlm import aot, topology

    if a.target != "local":
        aot.prepare(f"{a.target}-1")
    import jax

    from maxlm.kernels_pallas import flash_gpu, flash_mgpu

    devices = jax.devices() if a.target == "local" else aot.gpu_devices(topology.lookup_gpu(f"{a.target}-1"))[0]
    mesh = jax.sharding.Mesh(devices[:1], ("x",))
    failed = 0
    for name in a.kernel.split(","):
        kernels = {"triton": flash_gpu, "mosaic": flash_mgpu}[name]
        print(f"{name} flash kernels, forward and backward, for {devices[0].device_kind} (jax {jax.__version__})",
              flush=True)
        failed += compile_cells(kernels, mesh, a)
    return 1 if failed else 0


def compile_cells(kernels, mesh, a) -> int:
    """Compile each head_dim x dtype x mask cell, printing a line per cell; returns the number that failed."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    failed = 0
    for D, dtype, mask in itertools.product([int(d) for d in a.head_dims.split(",")], a.dtypes.split(","),
                                            a.masks.split(",")):
        cell = f"head_dim {D:>3} {dtype:<8} {mask:<7}"
        why = kernels.unsupported(D, dtype)
        if why:
            print(f"{cell} refused: {why}", flush=True)
            continue
        B, L, H, K = 1, 512, 4, 2
        spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P()))
        args = (spec((B, L, H, D), dtype), spec((B, L, K, D), dtype), spec((B, L, K, D), dtype), spec((B, L), jnp.int32))

        def loss(q, k, v, seg):
            return kernels.flash_attention(q, k, v, seg, **MASKS[mask]).astype(jnp.float32).sum()
        t = time.perf_counter()
        try:
            with jax.set_mesh(mesh):
                jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
        except Exception as e:  # noqa: BLE001 - report the compiler's reason and go on to the next cell
            failed += 1
            print(f"{cell} FAIL: {(str(e).strip().splitlines() or [type(e).__name__])[0][:300]}", flush=True)
            continue
        print(f"{cell} ok ({kernels.describe_tiles(D, dtype)}; {time.perf_counter() - t:.1f}s)", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(cli.run(main))
