"""The experts' grouped matmul on a GPU (model.grouped_gemm): XLA's `lax.ragged_dot`, or tokamax's Mosaic
GPU kernel for Hopper.

jax 0.11.2's XLA:GPU lowers `ragged_dot` to a product masked per expert: every row meets every local
expert's weights, with temporaries of rows x experts x d_in (Qwen3-30B-A3B, 2 layers on 8 x H100: 53 GiB;
benchmarks/RESULTS.md). Tokamax's sm90 kernel multiplies each row by its own expert only. It comes with
three traps, each handled here rather than left to the caller:
  - tokamax picks the kernel, the architecture and its tiles from jax's default device, which is the CPU
    in a compile without a GPU: `sharding.use` makes the mesh's first device the default while tracing;
  - with no implementation named it silently compiles XLA's dense path: `mosaic_gpu` is always named;
  - it never writes rows past the last group, and its dw for an expert with no rows is not guaranteed
    to be zero (tokamax 0.0.13's Triton variant returned garbage or NaN there): `tokamax_grouped` zeroes both.

`auto` stays on XLA until `benchmarks/gpu_check.sh grouped` has checked the Mosaic kernel's dw against
float64 on a GPU and benchmarks/RESULTS.md records it; the device kinds so checked go in VERIFIED."""

import jax
import jax.numpy as jnp

# Device kinds on which gpu_check.sh's grouped stage has checked tokamax's forward, dx and dw against
# float64 (benchmarks/RESULTS.md): `auto` picks tokamax there. None yet: no GPU has run it.
VERIFIED: frozenset = frozenset()
HOPPER = ("H100", "H200", "H800", "GH200")  # sm90: the architecture tokamax's grouped kernel and its dw run on
BLACKWELL = ("B200", "B300")  # sm100 (GB200, GB300 included): tokamax 0.0.17 has a forward there, no backward


def is_hopper(device_kind: str) -> bool:
    return any(h in device_kind for h in HOPPER)


def resolve(choice: str, platform: str, device_kind: str) -> str:
    """The kernel `choice` runs as on this device: "xla" or "tokamax"."""
    if choice == "auto":
        return "tokamax" if platform == "gpu" and device_kind in VERIFIED else "xla"
    return choice


def refusal(choice: str, platform: str, device_kind: str) -> str | None:
    """Why `choice` cannot run on this device (one line), or None."""
    if choice != "tokamax" or (platform == "gpu" and is_hopper(device_kind)):
        return None
    if platform == "gpu" and any(b in device_kind for b in BLACKWELL):
        return (f"model.grouped_gemm=tokamax runs on Hopper GPUs (sm90); on the {device_kind} tokamax's grouped "
                f"matmul has no backward (\"Only default ragged_dot_dimension_numbers supported\"); use "
                f"model.grouped_gemm=xla with expert parallelism (mesh.expert) to keep the experts per device few")
    if platform == "gpu":
        return (f"model.grouped_gemm=tokamax runs on Hopper GPUs (sm90), and this run is on the {device_kind}; use "
                f"model.grouped_gemm=xla")
    return (f"model.grouped_gemm=tokamax is tokamax's Mosaic GPU kernel for Hopper GPUs; this run is on {platform}, "
            f"where the grouped matmul is XLA's (model.grouped_gemm=auto or xla)")


def tokamax_grouped(x_RD, w_EDF, groups_E, block_N=None, implementation: str = "mosaic_gpu"):
    """`dense.grouped`'s contract by tokamax's kernel: rows sorted by expert times each row's expert's
    matrix, rows past the last group zero, and an expert with no rows gets exactly zero dw. `block_N`
    (XLA:CPU's blocked layout) never reaches here. `implementation` is tokamax's name; the tests run
    its Triton variant, which interprets on CPU, to check the masking of dw."""
    import tokamax  # only a run that chose it pays for the import

    assert block_N is None, "tokamax's grouped matmul runs on GPU meshes, which do not block"

    def kernel(x, w, g):
        return tokamax.ragged_dot(x, w, g, preferred_element_type=x.dtype, implementation=implementation)

    def rows(y, g):
        return jnp.where((jnp.arange(y.shape[0]) < jnp.sum(g))[:, None], y, 0)

    @jax.custom_vjp
    def mm(x, w, g):
        return rows(kernel(x, w, g), g)

    def fwd(x, w, g):
        y, vjp = jax.vjp(lambda x, w: kernel(x, w, g), x, w)
        return rows(y, g), (vjp, g)

    def bwd(res, ct):
        vjp, g = res
        dx, dw = vjp(ct)
        return rows(dx, g), jnp.where((g > 0)[:, None, None], dw, 0), None

    mm.defvjp(fwd, bwd)
    return mm(x_RD, w_EDF.astype(x_RD.dtype), groups_E)
