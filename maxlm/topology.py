"""TPU slices and GPU targets as tables: every name maxlm accepts, with its chips, hosts and physical shape.

A launcher that guesses host counts submits jobs that never start (Levanter counted 0 hosts on a
v5litepod-4), so nothing here is computed from a name: a slice is in the table or it is an error.

Rows come from the public Cloud TPU pages (cloud.google.com/tpu/docs/v4, v5e, v5p, v6e and
supported-tpu-configurations, as of 2026-11). "Host" means what a job runs one process on: one VM,
one GKE node, one pod. v4 and v5p names count TensorCores (two per chip, e.g. v5p-64 = 32 chips);
v5e and v6e names count chips (v5e is also spelled v5litepod). Multi-host v5e and v6e slices use
4-chip VMs (ct5lp-hightpu-4t, ct6e-standard-4t), so v6e-16 is 4 hosts, not the 2 physical
machines the v6e page also lists. Only the TPU VM (training) machine types are listed.

No jax here: the config and the launcher read it before anything touches a device.
"""

import dataclasses
import math

from maxlm.errors import ConfigError

GiB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Generation:
    cores_per_chip: int       # 2 where slice names count TensorCores
    hbm_bytes: int            # per chip, from the datasheet (a topology cannot report its own memory)
    gke_accelerator: str      # the node label cloud.google.com/gke-tpu-accelerator
    machine: str              # GKE machine type, `{n}` = chips per host
    runtime: str              # TPU VM software version for `gcloud compute tpus tpu-vm create --version`


GENERATIONS = {
    "v4": Generation(2, 32 * GiB, "tpu-v4-podslice", "ct4p-hightpu-{n}t", "tpu-ubuntu2204-base"),
    "v5e": Generation(1, 16 * GiB, "tpu-v5-lite-podslice", "ct5lp-hightpu-{n}t", "v2-alpha-tpuv5-lite"),
    "v5p": Generation(2, 95 * GiB, "tpu-v5p-slice", "ct5p-hightpu-{n}t", "v2-alpha-tpuv5"),
    "v6e": Generation(1, 32 * GiB, "tpu-v6e-slice", "ct6e-standard-{n}t", "v2-alpha-tpuv6e"),
}
ALIASES = {"v5litepod": "v5e"}
NAMES = {"v5e": "v5litepod"}  # what gcloud and xpk call the generation in accelerator types

# generation -> rows of (physical shape, hosts). Chips are the shape's product.
_SHAPES = {
    "v4": [("2x2x1", 1), ("2x2x2", 2), ("2x2x4", 4), ("2x4x4", 8), ("4x4x4", 16), ("4x4x8", 32), ("4x8x8", 64),
           ("8x8x8", 128), ("8x8x16", 256), ("8x16x16", 512)],
    "v5p": [("2x2x1", 1), ("2x2x2", 2), ("2x2x4", 4), ("2x4x4", 8), ("4x4x4", 16), ("4x4x8", 32), ("4x8x8", 64),
            ("8x8x8", 128), ("8x8x16", 256), ("8x16x16", 512), ("16x16x16", 1024), ("16x16x24", 1536)],
    "v5e": [("1x1", 1), ("2x2", 1), ("2x4", 1), ("4x4", 4), ("4x8", 8), ("8x8", 16), ("8x16", 32), ("16x16", 64)],
    "v6e": [("1x1", 1), ("2x2", 1), ("2x4", 1), ("4x4", 4), ("4x8", 8), ("8x8", 16), ("8x16", 32), ("16x16", 64)],
}


@dataclasses.dataclass(frozen=True)
class Slice:
    name: str       # the Cloud TPU accelerator type, e.g. v5p-64, v5litepod-16 (what gcloud and xpk take)
    generation: str
    shape: str      # physical chip grid, e.g. 2x4x4 (the GKE label cloud.google.com/gke-tpu-topology)
    chips: int
    hosts: int

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts

    @property
    def gen(self) -> Generation:
        return GENERATIONS[self.generation]

    @property
    def machine_type(self) -> str:
        return self.gen.machine.format(n=self.chips_per_host)

    @property
    def host_bounds(self) -> list[int]:
        """The chips of one host as a grid: the whole slice on one host, else 2x2x1 (4-chip hosts)."""
        if self.hosts > 1:
            return [2, 2, 1]
        dims = [int(d) for d in self.shape.split("x")]
        return dims + [1] * (3 - len(dims))

    @property
    def compile_args(self) -> tuple[str, dict]:
        """What `jax.experimental.topologies.get_topology_desc` takes to lay out exactly this slice: its
        hosts (libtpu assumes 4-chip hosts otherwise) and, on v4, one device per chip as a v4 VM shows
        them (libtpu's default counts TensorCores)."""
        kwargs = {"chips_per_host_bounds": self.host_bounds}
        if self.generation == "v4":
            kwargs["chip_config_name"] = "megacore"
        return f"{self.generation}:{self.shape}", kwargs


def _rows() -> dict[str, Slice]:
    table = {}
    for gen, rows in _SHAPES.items():
        for shape, hosts in rows:
            chips = math.prod(int(d) for d in shape.split("x"))
            name = f"{NAMES.get(gen, gen)}-{chips * GENERATIONS[gen].cores_per_chip}"
            table[name] = Slice(name, gen, shape, chips, hosts)
    return table


SLICES = _rows()


def lookup(name: str, source: str = "TPU") -> Slice:
    """A slice by its accelerator type (v5p-64, v6e-256, v5litepod-16) or generation:shape (v5p:2x4x4);
    `source` names where the name came from, for the error line."""
    text = str(name).strip().lower()
    if ":" in text:
        gen, shape = text.split(":", 1)
        gen = ALIASES.get(gen, gen)
        found = [s for s in SLICES.values() if (s.generation, s.shape) == (gen, shape)]
    else:
        gen, _, n = text.partition("-")
        gen = ALIASES.get(gen, gen)
        found = [s for s in SLICES.values() if s.generation == gen and s.name.endswith(f"-{n}")]
    if found:
        return found[0]
    if gen not in GENERATIONS:
        raise ConfigError(f"{source} `{name}`: unknown generation `{gen}`; maxlm knows {', '.join(GENERATIONS)} "
                          f"(v5e is also spelled v5litepod)")
    names = [s.name for s in SLICES.values() if s.generation == gen]
    unit = "TensorCores, two per chip" if GENERATIONS[gen].cores_per_chip == 2 else "chips"
    raise ConfigError(f"{source} `{name}` is not a {gen} slice maxlm knows ({gen} names count {unit}); use one of "
                      f"{', '.join(names)}, or {gen}:SHAPE with a shape from docs/launch.md")


# ---- GPUs ---------------------------------------------------------------------------------------------
# A GPU compile target: a device described by XLA's GpuTargetConfigProto (maxlm/gpu_specs/, copied from
# openxla/xla with its commit noted) and the job's nodes x GPUs per node. Names: h100-8 (one node of 8),
# h100-8x4 (4 nodes of 8). Memory per GPU is the datasheet's; XLA's client reserves a fraction of it
# (aot.gpu_memory_limit).


@dataclasses.dataclass(frozen=True)
class GpuKind:
    spec: str              # file in maxlm/gpu_specs/
    memory_bytes: int      # per GPU, as the driver reports it (the spec's device_memory_size)
    arch: str              # what ptxas compiles for


GPU_KINDS = {
    "h100": GpuKind("h100_sxm.txtpb", 84942979072, "sm_90a"),
    "h200": GpuKind("h200.txtpb", 151397597184, "sm_90a"),
    "b200": GpuKind("b200.txtpb", 191514411008, "sm_100a"),
}


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    name: str          # h100-8x4
    kind: str          # h100
    gpus_per_node: int
    nodes: int

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def spec(self) -> GpuKind:
        return GPU_KINDS[self.kind]


def lookup_gpu(name: str, source: str = "compile_topology") -> GpuTarget | None:
    """A GPU target (h100-8, h200-8x4), None if the name is not a GPU one, or a ConfigError naming the fix."""
    text = str(name).strip().lower()
    kind, _, rest = text.partition("-")
    if kind not in GPU_KINDS:
        return None
    per_node, _, nodes = rest.partition("x")
    if not per_node.isdigit() or not (nodes or "1").isdigit() or int(per_node) not in (1, 2, 4, 8) or int(nodes or 1) < 1:
        raise ConfigError(f"{source} `{name}`: a GPU target is KIND-GPUS or KIND-GPUSxNODES with 1, 2, 4 or 8 GPUs "
                          f"per node, e.g. {kind}-8 (one node of 8) or {kind}-8x4 (4 nodes of 8)")
    return GpuTarget(text, kind, int(per_node), int(nodes or 1))
