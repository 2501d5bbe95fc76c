"""A launch, checked: the job's shape from the flags, the config against that shape, and the one command
every process runs. Nothing here writes a file or touches a device; `compile_for` is the one step that
compiles (and needs jax, and libtpu or jax's CUDA plugin).

The job runs `python train.py CONFIG k=v ...` exactly as given here, from the directory that holds this
checkout (the image's working directory, the Slurm submit directory, the copy on each TPU VM), so
relative paths mean the same there as here. What the run writes (run_dir, checkpoint.dir) and a maxlm
checkpoint it starts from (init_from) stay gs:// URLs: maxlm and Orbax write and read GCS natively,
and a preempted job finds its checkpoints there. The inputs read as files (data.path, data.tokenizer,
eval.path, init_from=hf:gs://...) become read-only GCS FUSE mounts at /gcs/BUCKET, and the command names
the mounted path (docs/storage.md says why FUSE is safe only for those).
"""

import dataclasses
import difflib
import os
import re
import shlex
from pathlib import Path

from maxlm import config, topology
from maxlm.errors import ConfigError

TARGETS = ("gke", "xpk", "tpu-vm", "slurm")
MOUNT = "/gcs"
PORT = 8476  # jax.distributed's coordinator port in a pod (JAX's own default for TPU pods)
# Checked with fullmatch: `$` also matches before a final newline, and a name or image ending in one would
# break the files it is written into (in a Slurm script, the rest of the header line becomes a command).
_NAME = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?")
# A container image reference (Docker's grammar): [registry[:port]/]path[:tag][@digest].
_IMAGE = re.compile(r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*"
                    r"(?::[0-9]+)?/)?[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
                    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*"
                    r":[0-9a-fA-F]{32,})?")
# GKE's accelerator labels for GPU nodes (cloud.google.com/gke-accelerator): a pod selecting any other
# matches no node and waits forever. h100, h200 and b200 also have compile targets (topology.GPU_KINDS).
GKE_GPUS = ("nvidia-h100-80gb", "nvidia-h100-mega-80gb", "nvidia-h200-141gb", "nvidia-b200", "nvidia-gb200",
            "nvidia-a100-80gb", "nvidia-tesla-a100", "nvidia-l4", "nvidia-tesla-t4", "nvidia-tesla-v100",
            "nvidia-tesla-p100", "nvidia-tesla-p4", "nvidia-rtx-pro-6000")


@dataclasses.dataclass(frozen=True)
class Job:
    target: str
    name: str
    cfg: object                     # the validated config, as this machine reads it
    argv: tuple[str, ...]           # train.py's arguments in the job: config path, overrides, rewrites
    tpu: topology.Slice | None
    slices: int
    nodes: int                      # hosts per slice (TPU) or GPU nodes
    gpus_per_node: int
    buckets: tuple[str, ...]        # gs:// buckets of inputs, mounted read-only at /gcs/BUCKET
    workdir: str                    # where the job runs train.py from (this checkout)
    gpu: str = "nvidia-h100-80gb"   # GKE's accelerator label for GPU nodes
    processes_per_node: int = 1     # GPU: 1, or gpus_per_node for Slurm's --process-per gpu

    @property
    def processes(self) -> int:
        return self.slices * self.nodes if self.tpu else self.nodes * self.processes_per_node

    @property
    def devices(self) -> int:
        return self.tpu.chips * self.slices if self.tpu else self.nodes * self.gpus_per_node

    def command(self, python: str = "python") -> list[str]:
        return [python, "train.py", *self.argv]

    def shell(self, python: str = "python") -> str:
        return shlex.join(self.command(python))

    def describe(self) -> str:
        if self.tpu:
            return (f"{self.slices} x {self.tpu.name} ({self.tpu.chips} chips, {self.tpu.hosts} host(s) of "
                    f"{self.tpu.chips_per_host} chips each) = {self.devices} chips, {self.processes} process(es)")
        return f"{self.nodes} node(s) x {self.gpus_per_node} GPUs = {self.devices} GPUs, {self.processes} process(es)"


def plan(target: str, config_path: str, overrides: list[str], *, name: str, topology_name: str | None, slices: int,
         nodes: int | None, gpus_per_node: int | None, image: str | None, gpu: str = "nvidia-h100-80gb",
         process_per_gpu: bool = False) -> Job:
    """The job, or a ConfigError naming the flag or key that makes it impossible. process_per_gpu: one
    process per GPU rather than per node (Slurm only)."""
    if target not in TARGETS:
        raise ConfigError(f"unknown target `{target}`; choose one of {', '.join(TARGETS)}")
    if not _NAME.fullmatch(name or ""):
        raise ConfigError(f"--name {_shown(name)}: use 1-40 lowercase letters, digits and '-', starting with a letter "
                          f"(it names pods, hosts and VMs)")
    tpu, nodes, gpus = _shape(target, topology_name, slices, nodes, gpus_per_node)
    if target in ("gke", "xpk") and not image:
        raise ConfigError(f"{target} runs a container: pass --image (an image holding this checkout at its "
                          f"working directory; see docs/launch.md)")
    if target in ("tpu-vm", "slurm") and image:
        raise ConfigError(f"--image is for gke and xpk; {target} runs this checkout itself")
    if image and (len(image) > 255 or not _IMAGE.fullmatch(image)):
        raise ConfigError(f"--image {_shown(image)} is not a container image reference; give one like "
                          f"us-docker.pkg.dev/PROJECT/REPO/maxlm:TAG")
    if not tpu and target in ("gke", "xpk") and gpu not in GKE_GPUS:
        near = difflib.get_close_matches(gpu, GKE_GPUS, n=1)
        raise ConfigError(f"--gpu {_shown(gpu)} is not a GKE GPU type" + (f" (did you mean {near[0]}?)" if near else "") +
                          f"; the pods would select nodes labelled with it, and none is: use one of "
                          f"{', '.join(GKE_GPUS)}")
    if process_per_gpu and target != "slurm":
        raise ConfigError(f"--process-per gpu is for slurm; a {target} job runs one process per host")
    workdir = os.getcwd()
    _check_config_path(config_path, target)
    if any(o.partition("=")[0] == "mesh.slices" for o in overrides):
        raise ConfigError("the job's slices come from --slices; drop `mesh.slices=` from the overrides")
    cfg = config.load(config_path, overrides)
    if cfg.mesh.slices not in (1, slices):
        raise ConfigError(f"{config_path} sets mesh.slices={cfg.mesh.slices} but --slices is {slices}; make them agree")
    cfg = config.replace(cfg, {"mesh": {"slices": slices}})
    if cfg.dry_run or cfg.compile_topology:
        raise ConfigError("dry_run and compile_topology are for local compiles; the launcher compiles for the "
                          "job's topology itself")
    argv, buckets = _job_argv(target, config_path, overrides, cfg, slices, multi_host=(tpu.hosts * slices > 1
                                                                                      if tpu else nodes > 1))
    job = Job(target, name, cfg, tuple(argv), tpu, slices, tpu.hosts if tpu else nodes, gpus, tuple(buckets), workdir,
              gpu, gpus if process_per_gpu else 1)
    _check_mesh(job)
    return job


def _shown(value) -> str:
    """A flag's value for a one-line message: as given in backticks, or Python's repr if it holds a newline
    or another unprintable character."""
    return f"`{value}`" if str(value).isprintable() else repr(value)


def _shape(target, topology_name, slices, nodes, gpus_per_node):
    if slices < 1:
        raise ConfigError(f"--slices must be >= 1, got {slices}")
    if topology_name and (nodes or gpus_per_node):
        raise ConfigError("give either --topology (TPU) or --nodes and --gpus-per-node (GPU), not both")
    if topology_name:
        if target == "tpu-vm" and slices > 1:
            raise ConfigError("multi-slice TPU VMs need queued resources, which tpu-vm does not create; use gke or "
                              "xpk for --slices > 1")
        if target == "slurm":
            raise ConfigError("slurm runs GPU jobs: pass --nodes N --gpus-per-node G instead of --topology")
        return topology.lookup(topology_name, "--topology"), 0, 0
    if target == "tpu-vm":
        raise ConfigError("tpu-vm needs --topology, e.g. --topology v5p-64")
    if not nodes or not gpus_per_node:
        raise ConfigError("the job's shape is missing: pass --topology NAME [--slices N] for TPU, or --nodes N "
                          "--gpus-per-node G for GPU")
    if nodes < 1 or not 1 <= gpus_per_node <= 16:
        raise ConfigError(f"--nodes must be >= 1 and --gpus-per-node 1..16, got {nodes} and {gpus_per_node}")
    if slices > 1 and nodes % slices:
        raise ConfigError(f"--slices {slices} must divide --nodes {nodes}: a GPU slice is a group of whole nodes")
    return None, nodes, gpus_per_node


def _check_config_path(path: str, target: str) -> None:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {path}")
    if target != "slurm" and (p.is_absolute() or ".." in p.parts):
        raise ConfigError(f"config `{path}`: give a path inside this checkout, relative to it (the job runs "
                          f"`python train.py {path}` from its copy of the checkout)")


def _job_argv(target, config_path, overrides, cfg, slices, multi_host):
    """train.py's argv in the job: the user's, plus mesh.slices and gs:// inputs moved onto their mounts."""
    argv = [config_path, *overrides]
    if slices > 1:
        argv.append(f"mesh.slices={slices}")
    remote = target != "slurm"  # Slurm runs on the cluster's shared file system, where these paths already are
    run_dir = _as_given(cfg.run_dir)
    if not remote and "://" in run_dir:
        raise ConfigError(f"run_dir `{run_dir}` is a URL; a slurm job writes run_dir on the cluster's shared file "
                          f"system: pass run_dir=/shared/path")
    if remote and not run_dir.startswith("gs://") and (target in ("gke", "xpk") or multi_host):
        why = "a pod's disk is gone when it is rescheduled" if target in ("gke", "xpk") else \
            "every host must write the same checkpoint"
        raise ConfigError(f"run_dir `{run_dir}` is local, but a {target} job needs shared storage ({why}, and a "
                          f"preempted job must find its checkpoints): pass run_dir=gs://BUCKET/PATH")
    if remote:
        _check_inputs_reachable(target, cfg)
    buckets, moved = [], {}
    if remote:
        moved = {key: _mounted(value, buckets) for key, value in _gs_paths(cfg) if not _native(key, value)}
    argv = [a for a in argv if a.partition("=")[0] not in moved] + [f"{k}={v}" for k, v in moved.items()]
    return argv, buckets


def _local_inputs(cfg):
    """(key, path) for every local file the job reads: the keys of config.PATHS it does not write, with the
    mixture's components and the lm-eval task files."""
    d = config.to_dict(cfg)
    data, ev = d["data"], d["eval"]
    init = d["init_from"]
    pairs = [("init_from", init.removeprefix("hf:")), ("data.path", data["path"]), ("eval.path", ev["path"]),
             ("eval.harness.include", ev["harness"]["include"])]
    if data["tokenizer"] != "byte":
        pairs.append(("data.tokenizer", data["tokenizer"]))
    pairs += [(f"data.mixture.{n}.path", c.get("path", "")) for n, c in data["mixture"].items()]
    pairs += [("eval.harness.tasks", t) for t in ev["harness"]["tasks"] if t.endswith((".yaml", ".yml"))]
    for key, value in pairs:
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str) and v and "://" not in v:
                yield key, v


def _check_inputs_reachable(target, cfg) -> None:
    """A pod (gke, xpk) or TPU VM has this checkout (the image's, or the copy tpu-vm makes) and gs://, and
    nothing else of this machine: a local input outside the checkout would be missing there."""
    here = os.path.realpath(os.getcwd())
    for key, path in _local_inputs(cfg):
        real = os.path.realpath(path)
        if os.path.commonpath([here, real]) != here:
            where = "pods see" if target in ("gke", "xpk") else "TPU VMs get a copy of"
            raise ConfigError(f"`{key}` {_as_given(path)} is outside this checkout ({here}), and a {target} job's "
                              f"{where} only the checkout and gs://: copy it to a bucket and pass "
                              f"{key}=gs://BUCKET/PATH, or move it into the checkout")


def _as_given(path: str) -> str:
    """A path as the user wrote it, near enough: config.load made local paths absolute against here."""
    return os.path.relpath(path) if "://" not in path and path.startswith(os.getcwd()) else path


# Path keys that stay gs:// in the job: what the run writes, and the Orbax checkpoint it may start from.
NATIVE = ("run_dir", "checkpoint.dir", "init_from")


def _native(key: str, value) -> bool:
    """Whether maxlm reads or writes this gs:// path itself (an hf: checkpoint is read as files)."""
    return key in NATIVE and not str(value).startswith("hf:")


def _gs_paths(cfg):
    d = config.to_dict(cfg)
    for key in config.PATHS:
        section, _, leaf = key.rpartition(".")
        value = d[section][leaf] if section else d[leaf]
        prefix = "hf:" if isinstance(value, str) and value.startswith("hf:gs://") else ""
        values = value if isinstance(value, list) else [value[len(prefix):]]
        if any(isinstance(v, str) and v.startswith("gs://") for v in values):
            yield key, [prefix + v for v in values] if isinstance(value, list) else prefix + values[0]


def _mounted(value, buckets: list):
    if isinstance(value, list):
        return "[" + ",".join(_mounted(v, buckets) for v in value) + "]"
    prefix = "hf:" if value.startswith("hf:") else ""
    bucket, _, rest = value[len(prefix) + len("gs://"):].partition("/")
    if bucket not in buckets:
        buckets.append(bucket)
    return f"{prefix}{MOUNT}/{bucket}/{rest}".rstrip("/")


def _check_mesh(job: Job) -> None:
    """The config's mesh must fill exactly the job's devices, and its batch and heads split over it.

    The batch is not checked against the process count: once it divides by the data-parallel size, every
    device holds whole rows, so every process does, and processes that hold the same rows (a tensor or
    context axis across processes) each load them whole (maxlm/data/pipeline.py). 2 processes with
    mesh.tensor=2 train on global_batch_size=1."""
    from maxlm import mesh as mesh_lib  # imports jax: after the cheap checks

    sizes = mesh_lib.mesh_shape(job.cfg, job.devices)
    mesh_lib.check_divisibility(job.cfg, sizes)


def gpu_target(job: Job) -> str | None:
    """The compile_topology name of a GPU job's nodes (h100-8x2), from its GPU type, or None if maxlm has
    no target spec for that GPU."""
    kind = next((k for k in topology.GPU_KINDS if f"-{k}" in job.gpu), None)
    return f"{kind}-{job.gpus_per_node}x{job.nodes}" if kind else None


def compile_for(job: Job, log) -> None:
    """Compile the train step for the job's devices (a TPU topology, slices included, or its GPU nodes) and
    refuse one that would not fit (the memory report is logged): a job that cannot run must not wait hours
    in a queue."""
    if not job.tpu:
        return _compile_for_gpus(job, log)
    from maxlm import train

    cfg = config.replace(job.cfg, {"dry_run": True, "compile_topology": job.tpu.name})
    try:
        train.dry_run(cfg)
    except ConfigError as e:
        if "needs libtpu" in str(e) or "libtpu is busy" in str(e):
            raise ConfigError(f"{e}; or pass --no-compile to skip the check") from None
        raise
    log(f"the train step compiles for {job.describe()} and fits in HBM")


def _compile_for_gpus(job: Job, log) -> None:
    """A GPU compile runs `train.py dry_run=true compile_topology=...` in a child process: jax's CUDA plugin
    registers only when jax starts its backends, which in this process may have happened already."""
    import subprocess
    import sys
    import tempfile

    target = gpu_target(job)
    if not target:
        raise ConfigError(f"maxlm has no compile target for --gpu {job.gpu} (it has {', '.join(topology.GPU_KINDS)}); "
                          f"pass --no-compile to submit without compiling")
    # The config as validated here, compiled as one group of nodes: a GPU compile target has no slices, and
    # the devices per GPU do not change with them. init_from is not read: the architecture is the config's.
    cfg = config.replace(job.cfg, {"mesh": {"slices": 1}, "init_from": "", "dry_run": True, "compile_topology": target})
    with tempfile.NamedTemporaryFile("w", suffix=".yml", prefix=f"{job.name}-") as f:
        f.write(config.to_yaml(cfg))
        f.flush()
        log(f"compiling the train step for {target} ({job.describe()}) in a child process")
        r = subprocess.run([sys.executable, str(Path(__file__).parents[2] / "train.py"), f.name], capture_output=True,
                           text=True)
    shown = False
    for line in r.stdout.splitlines():  # the trainer's log without its config dump
        shown = line.startswith("maxlm: ") and not line.startswith("maxlm: config:") or (shown and line.startswith(" "))
        if shown:
            print(line, flush=True)
    if r.returncode:
        last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1].removeprefix("maxlm: error: ")
        plugin = "CUDA plugin" in last
        raise ConfigError(f"the train step does not compile for {target}: {last}" +
                          ("; or pass --no-compile to skip the check" if plugin else ""))
    log(f"the train step compiles for {job.describe()} and fits in GPU memory")
