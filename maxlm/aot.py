"""Ahead-of-time compilation facts: TPU topologies without hardware, and per-device memory checks."""

import os
from pathlib import Path

import jax
from jax.experimental import topologies

from maxlm.config import ConfigError

GiB = 1024 ** 3
# HBM per chip, from vendor datasheets; topology devices cannot report their own memory.
TPU_HBM = {"v4": 32 * GiB, "v5e": 16 * GiB, "v5p": 95 * GiB, "v6e": 32 * GiB}
_ALIASES = {"v5litepod": "v5e", "v6": "v6e", "v5": "v5p"}


def _shape_3d(chips: int) -> list[int]:
    if chips == 4:
        return [2, 2, 1]
    dims = [2, 2, 2]
    while dims[0] * dims[1] * dims[2] < chips:
        i = max(j for j in range(3) if dims[j] == min(dims))
        dims[i] *= 2
    return dims


def _shape_2d(chips: int) -> list[int]:
    a = 1
    while a * a * 4 <= chips:
        a *= 2
    return [a, chips // a]


def parse_topology(name: str) -> tuple[str, str]:
    """`v5p-8` (TensorCores, as Cloud TPU names slices), `v6e-8` (chips) or `v5p:2x2x1` -> (generation,
    topology string for `get_topology_desc`)."""
    if ":" in name:
        gen, topo = name.split(":", 1)
    else:
        gen, _, n = name.partition("-")
        gen = _ALIASES.get(gen, gen)
        if gen not in TPU_HBM or not n.isdigit() or int(n) & (int(n) - 1):
            raise ConfigError(f"compile_topology `{name}`: expected e.g. v5p-8, v5p-32, v6e-8, v5e-16, v4-8 "
                              f"(a power of two) or an explicit v5p:2x2x2")
        if gen in ("v4", "v5p"):
            chips = int(n) // 2  # these are named by TensorCores, two per chip
            if chips < 4:
                raise ConfigError(f"compile_topology `{name}`: the smallest {gen} slice is {gen}-8")
            topo = "x".join(map(str, _shape_3d(chips)))
        else:
            topo = "x".join(map(str, _shape_2d(int(n))))
    gen = _ALIASES.get(gen, gen)
    if gen not in TPU_HBM:
        raise ConfigError(f"compile_topology `{name}`: unknown TPU generation `{gen}`; known: {', '.join(TPU_HBM)}")
    return gen, f"{gen}:{topo}"


def topology_devices(name: str) -> tuple[list, int]:
    """TPU devices of a topology (no TPU needed, only libtpu) and the HBM bytes of one chip."""
    gen, topo = parse_topology(name)
    try:
        desc = topologies.get_topology_desc(topo, "tpu")
    except Exception as e:  # libtpu missing, busy, or the shape unknown: say which
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "lockfile" in first:
            raise ConfigError(f"libtpu is busy: another process ({_lock_holders()}) holds {LIBTPU_LOCK}, and only "
                              f"one process at a time may load libtpu; wait for it to finish, or stop it") from None
        raise ConfigError(f"cannot build TPU topology {topo} ({first}); compile_topology needs libtpu: "
                          f"pip install 'jax[tpu]=={jax.__version__}'") from None
    return list(desc.devices), TPU_HBM[gen]


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
