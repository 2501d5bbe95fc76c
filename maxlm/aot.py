"""Ahead-of-time compilation: the train and eval steps compiled against abstract state before anything is
allocated (`compile_step`, `compile_all`), TPU topologies and GPU targets to compile for without the
hardware, and the per-device memory checks.

A GPU compile needs no GPU: jax's CUDA plugin (jax-cuda13-plugin and -pjrt, which carry ptxas) compiles
for a device described by XLA's GpuTargetConfigProto. It checks what a TPU compile checks (SPMD
partitioning, memory per device) plus the kernels' code generation: Triton and Mosaic GPU lowering,
ptxas, shared-memory and register limits. It proves nothing about numerics or speed, and runs no
autotuning (docs/dry-run.md)."""

import functools
import os
import time
from pathlib import Path

import jax
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec as P

from maxlm import metrics, platforms, sharding, topology
from maxlm.errors import ConfigError
from maxlm.evaluation import compile_eval
from maxlm.layers import attention
from maxlm.log import log
from maxlm.step import train_step

GiB = 1024 ** 3


def topology_devices(name: str, slices: int = 1) -> tuple[list, int, str]:
    """Compile-only devices for `compile_topology` (a TPU slice, `slices` times, or a GPU target), the bytes
    one device may use, and where that figure comes from."""
    gpu = topology.lookup_gpu(name)
    if gpu:
        if slices > 1:
            raise ConfigError("mesh.slices is for TPU slices joined over the data-center network; a GPU job's "
                              "nodes are in the target's name (h100-8x4: 4 nodes of 8)")
        return gpu_devices(gpu)
    tpu = topology.lookup(name, "compile_topology")
    name, kwargs = tpu.compile_args
    if slices > 1:
        kwargs["num_slices"] = slices
    platforms.compile_only_tpu(tpu.name)
    try:
        desc = topologies.get_topology_desc(name, "tpu", **kwargs)
    except Exception as e:  # libtpu missing, busy, or the shape unknown: say which
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "lockfile" in first:
            raise ConfigError(f"libtpu is busy: another process ({_lock_holders()}) holds {LIBTPU_LOCK}, and only "
                              f"one process at a time may load libtpu; wait for it to finish, or stop it") from None
        raise ConfigError(f"cannot build TPU topology {name} ({first}); compile_topology needs libtpu: "
                          f"pip install 'jax[tpu]=={jax.__version__}'") from None
    return list(desc.devices), tpu.gen.hbm_bytes, f"{tpu.name} HBM per chip"


# Where `make test` installs the CUDA plugin, outside the venv's site-packages, so that ordinary runs on a
# CPU machine never start it (it looks for cuDNN and GPUs, and says so at length).
CUDA_PLUGIN_ENV = "MAXLM_CUDA_PLUGIN"
# The share of a GPU's memory XLA's client takes for itself at start (its default; the variable changes it).
MEM_FRACTION_ENV, MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75


def prepare(name: str) -> str | None:
    """Before jax starts its backends (the first jax.devices() or jax.process_index()): for a TPU topology,
    check its name and keep libtpu quiet; for a GPU target, make the CUDA plugin findable and keep it from
    looking for a GPU. Returns a line for the log when the
    compile differs from what a GPU would build."""
    import sys

    if not topology.lookup_gpu(name):
        # A TPU topology: its name checked before libtpu loads, and libtpu told it compiles only, so jax
        # starting its backends prints none of the warnings of a TPU VM it cannot find.
        platforms.compile_only_tpu(topology.lookup(name, "compile_topology").name)
        return None
    plugin_dir = os.environ.get(CUDA_PLUGIN_ENV)
    if plugin_dir and plugin_dir not in sys.path:
        sys.path.insert(0, plugin_dir)  # found by jax's plugin discovery, which runs with the backends
    if not os.environ.get("JAX_PLATFORMS"):
        # With GPU platforms allowed, the plugin's start-up looks for a GPU and cuDNN, fails, and is not
        # registered; compiling for a target needs neither.
        jax.config.update("jax_platforms", "cpu")
    if NO_CUB_SORT in os.environ.get("XLA_FLAGS", ""):
        return None
    # XLA:GPU asks the CUDA runtime for CUB's scratch size while compiling a large sort (an MoE's
    # tokens x top-k rows: 32,768 per device for qwen3-30b-a3b), and with no GPU that fails with
    # `cudaErrorInvalidDevice: invalid device ordinal`. XLA's own sort compiles anywhere.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {NO_CUB_SORT}".strip()
    return (f"compiling for {name} without a GPU: large sorts use XLA's own kernel, not CUB's radix sort, which "
            f"needs a GPU to compile ({NO_CUB_SORT}); a GPU's program may differ there")


NO_CUB_SORT = "--xla_gpu_enable_cub_radix_sort=false"


def gpu_devices(gpu: topology.GpuTarget) -> tuple[list, int, str]:
    """Compile-only GPU devices for `gpu` (nodes x GPUs, one process per node), from its target spec."""
    spec = (Path(__file__).parent / "gpu_specs" / gpu.spec.spec).read_text()
    try:
        desc = topologies.get_topology_desc("", "cuda", target_config=spec, topology=f"1x{gpu.nodes}x{gpu.gpus_per_node}")
    except Exception as e:  # noqa: BLE001 - no plugin, or one of another version: say which
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"cannot compile for {gpu.name} ({first[:200]}); a GPU compile needs jax's CUDA plugin: "
                          f"pip install --no-deps jax-cuda13-plugin=={jax.__version__} jax-cuda13-pjrt=={jax.__version__} "
                          f"(with JAX_PLATFORMS=cpu on a machine without a GPU), or set {CUDA_PLUGIN_ENV} to the "
                          f"directory it was installed in (`make test` puts it in .venv/cuda)") from None
    fraction = float(os.environ.get(MEM_FRACTION_ENV) or MEM_FRACTION)
    limit = int(gpu.spec.memory_bytes * fraction)
    return list(desc.devices), limit, f"{fraction:.0%} of the {desc.devices[0].device_kind}'s memory ({MEM_FRACTION_ENV})"


LIBTPU_LOCK = "/tmp/libtpu_lockfile"


def _lock_holders() -> str:
    """The pids that have libtpu's lock file open, found the way `fuser` does, for the error line."""
    pids = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == LIBTPU_LOCK for fd in fd_dir.iterdir()):
                pids.append(fd_dir.parent.name)
        except OSError:
            continue
    pids = [p for p in pids if int(p) != os.getpid()]
    return f"pid {', '.join(pids)}" if pids else "pid unknown"


def device_memory_limit(device) -> tuple[int | None, str]:
    """Bytes one device may use, and where that figure came from."""
    if device.platform == "cpu":
        # Fake CPU devices share host RAM.
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        n = len(jax.local_devices())
        return total // n, f"host RAM / {n} CPU devices"
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:
        limit = None
    return limit, f"{device.device_kind} memory_stats" if limit else f"{device.device_kind}: unknown"


def memory_report(compiled) -> dict:
    ma = compiled.memory_analysis()
    total = (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
             + ma.generated_code_size_in_bytes - ma.alias_size_in_bytes)
    return {"arguments": ma.argument_size_in_bytes, "outputs": ma.output_size_in_bytes,
            "aliased": ma.alias_size_in_bytes, "temporaries": ma.temp_size_in_bytes,
            "code": ma.generated_code_size_in_bytes, "total": total}


def format_report(mem: dict, limit: int | None, source: str) -> str:
    lines = [f"  {k:<12} {v / GiB:10.3f} GiB" for k, v in mem.items()]
    lines.append(f"  {'limit':<12} {limit / GiB:10.3f} GiB ({source})" if limit else f"  limit        unknown ({source})")
    return "\n".join(lines)


class DoesNotFit(ConfigError):
    """The compiled step needs more memory than the device has."""


def check_fits(mem: dict, limit: int | None, where: str) -> None:
    if limit is not None and mem["total"] > limit:
        raise DoesNotFit(f"the train step needs {mem['total'] / GiB:.2f} GiB per device but {where} has "
                          f"{limit / GiB:.2f} GiB; shard more (mesh.fsdp), use remat=full, or lower "
                          f"global_batch_size / raise microbatches")


def compile_step(cfg, ss):
    """AOT-compile the train step of `ss` (a StateSpec: its recipe, mesh and rules) against abstract state
    and batch: nothing is allocated. A step that cannot be built or cannot fit is one line, naming `cfg`'s
    keys to change."""
    batch_sh = {k: a.sharding for k, a in ss.abstract_batch.items()}
    step_fn = jax.jit(functools.partial(train_step, recipe=ss.recipe), in_shardings=(ss.shardings, batch_sh),
                      out_shardings=(ss.shardings, NamedSharding(ss.mesh, P())), donate_argnums=0)
    with sharding.use(ss.mesh, ss.rule_table):
        try:
            return step_fn.lower(ss.abstract, ss.abstract_batch).compile()
        except (jax.errors.JaxRuntimeError, RuntimeError) as e:
            if "overflow in static extent product" in str(e):  # e.g. seq_len=100000000: an L x L score tensor
                raise ConfigError(f"the train step cannot be built at this size: an array would have more than 2**63 "
                                  f"elements (seq_len={cfg.seq_len}, global_batch_size={cfg.global_batch_size}); "
                                  f"lower them") from None
            if any(limit in str(e) for limit in attention.KERNEL_LIMITS):
                reason = str(e).strip().splitlines()[0]
                device = ss.mesh.devices.flat[0]
                raise ConfigError(attention.kernel_resource_error(reason, cfg.model, cfg.dtype, device)) from None
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            # The TPU compiler refuses a step that cannot fit; keep its one-line reason.
            reason = str(e).split("RESOURCE_EXHAUSTED:", 1)[1].strip().splitlines()[0]
            raise ConfigError(f"the train step does not fit in device memory: {reason} Shard more (mesh.fsdp), use "
                              f"remat=full, or lower global_batch_size / raise microbatches") from None


def compile_all(cfg, hw, ss):
    """The compiled train (and eval) steps on `hw` (hardware.Hardware), with parameters, FLOPs and memory
    logged and checked."""
    for tr in ss.transforms:
        note = tr.describe(hw.platform)
        if note:
            log(note)
    log(f"parameters {ss.n_params:,} ({metrics.matmul_params(cfg.model):,} in matmuls); FLOPs/token "
        f"{metrics.flops_per_token(cfg.model, cfg.seq_len):.4g} causal, "
        f"{metrics.flops_per_token(cfg.model, cfg.seq_len, causal=False):.4g} non-causal")
    t = time.perf_counter()
    step_fn = compile_step(cfg, ss)
    mem = memory_report(step_fn)
    for tr in ss.transforms:
        note = tr.compiled(step_fn.as_text, hw.platform, on_device=not cfg.compile_topology)
        if note:
            log(note)
    log(f"train step compiled in {time.perf_counter() - t:.1f}s; memory per device:\n"
        f"{format_report(mem, hw.limit, hw.limit_src)}")
    check_fits(mem, hw.limit, hw.limit_src)
    eval_fn = None
    if cfg.eval.every:
        t = time.perf_counter()
        eval_fn = compile_eval(ss)
        log(f"eval step compiled in {time.perf_counter() - t:.1f}s")
    return step_fn, eval_fn
