"""Ahead-of-time compilation facts: TPU topologies without hardware, and per-device memory checks."""

import os
from pathlib import Path

import jax
from jax.experimental import topologies

from maxlm import quiet, topology
from maxlm.config import ConfigError

GiB = 1024 ** 3


def topology_devices(name: str, slices: int = 1) -> tuple[list, int]:
    """TPU devices of `slices` copies of a slice (no TPU needed, only libtpu) and the HBM bytes of one chip."""
    tpu = topology.lookup(name, "compile_topology")
    name, kwargs = tpu.compile_args
    if slices > 1:
        kwargs["num_slices"] = slices
    quiet.compile_only_tpu(tpu.name)
    try:
        desc = topologies.get_topology_desc(name, "tpu", **kwargs)
    except Exception as e:  # libtpu missing, busy, or the shape unknown: say which
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "lockfile" in first:
            raise ConfigError(f"libtpu is busy: another process ({_lock_holders()}) holds {LIBTPU_LOCK}, and only "
                              f"one process at a time may load libtpu; wait for it to finish, or stop it") from None
        raise ConfigError(f"cannot build TPU topology {name} ({first}); compile_topology needs libtpu: "
                          f"pip install 'jax[tpu]=={jax.__version__}'") from None
    return list(desc.devices), tpu.gen.hbm_bytes


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


def check_fits(mem: dict, limit: int | None, where: str) -> None:
    if limit is not None and mem["total"] > limit:
        raise ConfigError(f"the train step needs {mem['total'] / GiB:.2f} GiB per device but {where} has "
                          f"{limit / GiB:.2f} GiB; shard more (mesh.fsdp), use remat=full, or lower "
                          f"global_batch_size / raise microbatches")
