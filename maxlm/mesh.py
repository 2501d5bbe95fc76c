"""Devices -> Mesh(('stage', 'data', 'fsdp', 'tensor', 'expert', 'context')), with every size checked before compile.

Multi-slice (`mesh.slices` > 1): one outer axis is split into slices x per-slice. Normally that is
`data`, so the only traffic between slices (over the data-centre network, DCN) is the gradient
all-reduce of the data axis; fsdp, tensor and expert collectives stay on each slice's fast interconnect
(ICI). With pipeline stages (mesh.stage a multiple of mesh.slices) it is `stage`, so only the stage
boundary's activations cross DCN. The sharding table does not change: the device grid decides which
links carry each axis.
"""

import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from maxlm.config import MESH_AXES, pipelined_layers
from maxlm.errors import ConfigError


def mesh_shape(cfg, n_devices: int) -> dict[str, int]:
    """Resolve the configured axis sizes (-1 fills) against `n_devices`."""
    sizes = {ax: cfg.mesh[ax] for ax in MESH_AXES}
    fixed = math.prod(s for s in sizes.values() if s != -1)
    fill = [ax for ax, s in sizes.items() if s == -1]
    shown = " x ".join(f"{ax}={s}" for ax, s in sizes.items() if ax != "stage" or s != 1)
    if fill:
        if n_devices % fixed:
            raise ConfigError(f"mesh {shown}: {n_devices} devices are not divisible by the fixed axes' product {fixed}")
        sizes[fill[0]] = n_devices // fixed
    elif fixed != n_devices:
        raise ConfigError(f"mesh {shown} has {fixed} devices but {n_devices} are available; "
                          f"make the product {n_devices} or set one axis to -1")
    slices = cfg.mesh.slices
    if sizes["data"] % slices and dcn_axis(sizes, slices) != "stage":
        raise ConfigError(f"mesh {shown} resolves to data={sizes['data']}, which is not a multiple of "
                          f"mesh.slices={slices}; the data axis spans the slices, so set mesh.data={slices} (or a multiple)")
    return sizes


def check_divisibility(cfg, sizes: dict[str, int]) -> None:
    """Batch and model dimensions must split evenly over the mesh axes they are sharded on."""
    m = cfg.model
    n, what = pipelined_layers(m)
    if n % sizes["stage"]:
        raise ConfigError(f"{what} is not divisible by mesh stage={sizes['stage']}: each stage runs n_layers/stage "
                          f"consecutive layers; choose a stage count that divides {n}")
    dp = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    micro = cfg.global_batch_size // cfg.microbatches
    if micro % dp:
        raise ConfigError(f"global_batch_size/microbatches = {micro} sequences per microbatch must be divisible "
                          f"by the data-parallel size data*fsdp*expert = {dp}")
    cp = sizes["context"]
    if cp > 1 and cfg.seq_len % (2 * cp):
        raise ConfigError(f"seq_len={cfg.seq_len} must split into 2 x mesh.context = {2 * cp} equal chunks: each "
                          f"device holds a chunk from each end of the sequence (causal load balance); make seq_len "
                          f"a multiple of {2 * cp}")
    if cp > 1 and cfg.attention == "cudnn":  # said here, before compiling, rather than when the step traces
        raise ConfigError("attention=cudnn cannot run a context-parallel ring (its API returns no log-sum-exp); "
                          "use attention=flash or xla with mesh.context > 1")
    tp = sizes["tensor"]
    for key in ("n_heads", "n_kv_heads"):
        if m[key] % tp:
            raise ConfigError(f"`model.{key}`={m[key]} must be divisible by `mesh.tensor`={tp}")


def check_sizes(sizes: dict[str, int], n_devices: int) -> tuple[int, ...]:
    """The mesh shape in MESH_AXES order (an axis not named has size 1), or one line naming what is wrong:
    numpy's reshape error would name neither the axes nor the devices."""
    if not isinstance(sizes, dict):
        raise ConfigError(f"mesh sizes must be a dict of {', '.join(MESH_AXES)} -> size, got {type(sizes).__name__}")
    shown = " x ".join(f"{ax}={n}" for ax, n in sizes.items())
    if set(sizes) - set(MESH_AXES):
        raise ConfigError(f"mesh sizes {shown or '{}'} name an unknown axis; the axes are {', '.join(MESH_AXES)}")
    sizes = {ax: sizes.get(ax, 1) for ax in MESH_AXES}  # an axis left out is not split
    bad = [ax for ax in MESH_AXES if not isinstance(sizes[ax], (int, np.integer)) or sizes[ax] < 1]
    if bad:
        raise ConfigError(f"mesh {shown}: `{bad[0]}` must be a positive integer (resolve -1 with mesh_shape first)")
    shape = tuple(int(sizes[ax]) for ax in MESH_AXES)
    if math.prod(shape) != n_devices:
        hint = f" (or pass devices=jax.devices()[:{math.prod(shape)}])" if math.prod(shape) < n_devices else ""
        raise ConfigError(f"mesh {shown} has product {math.prod(shape)} but {n_devices} devices are given; make the "
                          f"product {n_devices}{hint}")
    return shape


def make_mesh(sizes: dict[str, int], devices=None, slices: int = 1) -> Mesh:
    """A mesh in the classic GSPMD (Auto) mode: XLA propagates shardings between our constraints."""
    devices = jax.devices() if devices is None else list(devices)
    shape = check_sizes(sizes, len(devices))
    ax = MESH_AXES.index(dcn_axis(dict(zip(MESH_AXES, shape)), slices))
    ici = tuple(n // slices if a == ax else n for a, n in enumerate(shape))
    dcn = tuple(slices if a == ax else 1 for a in range(len(shape)))
    try:
        if _slice_count(devices, slices):  # TPU: each device knows its slice
            grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
        else:
            grid = np.concatenate([_ici_grid(ici, g) for g in _blocks(devices, slices)], axis=ax)
    except (AssertionError, NotImplementedError, ValueError) as e:
        raise ConfigError(f"cannot lay mesh {shape} out on {len(devices)} {devices[0].device_kind} devices "
                          f"({slices} slice(s)): {e}") from None
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def dcn_axis(sizes: dict[str, int], slices: int) -> str:
    """The axis that spans the slices: `stage` when the stages split evenly over them (only boundary
    activations then cross DCN), else `data`."""
    return "stage" if slices > 1 and sizes["stage"] > 1 and sizes["stage"] % slices == 0 else "data"


def _ici_grid(shape: tuple[int, ...], devices: list) -> np.ndarray:
    """One slice's devices laid out on its physical interconnect (TPU/GPU); CPU devices in plain order."""
    if devices[0].platform == "cpu":
        return np.array(devices).reshape(shape)
    return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)


def _slice_count(devices: list, slices: int) -> int:
    """How many TPU slices the devices span (0 where devices do not know their slice). A job spanning more
    slices than mesh.slices says would send fsdp and tensor collectives over DCN without a word."""
    found = {getattr(d, "slice_index", None) for d in devices} - {None}
    if found and len(found) != slices:
        raise ConfigError(f"the devices span {len(found)} TPU slice(s) but mesh.slices={slices}; set "
                          f"mesh.slices={len(found)} so that only the data axis crosses between slices")
    return len(found) if found and slices > 1 else 0


def _blocks(devices: list, slices: int) -> list[list]:
    """Where devices do not know their slice (GPU nodes, CPU tests), a slice is a consecutive block of
    processes, as Slurm and JobSet number them node by node."""
    if slices == 1:
        return [devices]
    n_proc = len({d.process_index for d in devices})
    if len(devices) % slices or (n_proc > 1 and n_proc % slices):
        raise ConfigError(f"mesh.slices={slices} must divide the {len(devices)} devices and the {n_proc} processes")
    ordered, per = sorted(devices, key=lambda d: (d.process_index, d.id)), len(devices) // slices
    return [ordered[i * per:(i + 1) * per] for i in range(slices)]


def describe(mesh: Mesh) -> str:
    """`data=2 x fsdp=4 x ...`; the stage axis only when pipelined, so other runs' lines read as before."""
    return " x ".join(f"{ax}={n}" for ax, n in mesh.shape.items() if ax != "stage" or n > 1)
