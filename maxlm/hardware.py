"""The hardware a run is on: the devices (local, or a topology to compile for), their memory limit and the
mesh; and what the run's built recipe does on them, checked and said in the log before anything compiles."""

import jax

from maxlm import aot, config, mesh as mesh_lib, remat, sharding
from maxlm.layers import attention, dispatch, gmm
from maxlm.log import log


# On CPU the Hopper kernels run only in the Mosaic GPU interpreter, which the kernel and model tests call
# directly on one device. A run is refused: jax 0.11.2's interpreter checks every device's barriers from one
# process-wide table at each kernel's end (so several devices fail "Barrier remains allocated"), and on one
# device of 2 cores its warpgroups exhaust XLA:CPU's intra-op threads and hang. Neither is the kernel's.
MOSAIC_ON_CPU = ("attention=mosaic is the Hopper GPU kernels, which run on CPU only in the Mosaic GPU interpreter "
                 "that tests call directly; the interpreter cannot run them on several devices and starves on one "
                 "(docs/attention.md). Use attention=flash (the Pallas kernels in interpret mode) or xla on CPU, and "
                 "mosaic on an H100/H200")


class Hardware:
    """The devices (local, or a TPU topology to compile for), their memory limit, and the mesh."""

    def __init__(self, cfg):
        if cfg.compile_topology:
            self.devices, self.limit, self.limit_src = aot.topology_devices(cfg.compile_topology, cfg.mesh.slices)
        else:
            self.devices = jax.devices()
            self.limit, self.limit_src = aot.device_memory_limit(self.devices[0])
        sizes = mesh_lib.mesh_shape(cfg, len(self.devices))
        mesh_lib.check_divisibility(cfg, sizes)
        self.mesh = mesh_lib.make_mesh(sizes, self.devices, cfg.mesh.slices)
        self.rules = sharding.rules(cfg)
        self.kind = self.devices[0].device_kind
        self.platform = self.devices[0].platform
        slices = (f", {cfg.mesh.slices} slices joined over {mesh_lib.dcn_axis(sizes, cfg.mesh.slices)}"
                  if cfg.mesh.slices > 1 else "")
        log(f"mesh {mesh_lib.describe(self.mesh)} over {len(self.devices)} x {self.kind} "
            f"({len({d.process_index for d in self.devices})} process(es){slices})")


def describe(cfg, hw: Hardware, recipe) -> None:
    """Check what the recipe does on this hardware, and say it: the attention kernel, the pipeline, the
    sequence split, remat, MoE dispatch; a transform refuses a device it cannot run on (one line)."""
    platform, sizes = hw.platform, hw.mesh.shape
    if cfg.attention == "mosaic" and platform == "cpu":
        raise config.ConfigError(MOSAIC_ON_CPU)
    impl, warning = attention.resolve(cfg.attention, platform, cfg.model, cfg.dtype)
    log(f"attention: {impl}" + (f" (auto on {platform})" if cfg.attention == "auto" else ""))
    if warning:
        log(f"warning: {warning}")
    if sizes["stage"] > 1 and cfg.remat == "offload" and platform == "tpu":
        raise config.ConfigError(f"mesh.stage={sizes['stage']} with remat=offload: libtpu fails to compile host "
                                 f"offload inside the pipeline's schedule (INTERNAL: a bitcast across memory spaces, "
                                 f"seen on v5p); use remat=full")
    m = cfg.model
    many = lambda n, what: f"{n} {what}" + ("s" if n > 1 else "")  # noqa: E731
    whole = ("embedding", "head", *([many(m.dense_layers, "dense layer")] if m.dense_layers else []),
             *([many(m.mtp_depth, "MTP module")] if m.mtp_depth else []))
    line = recipe.schedule.describe(config.pipelined_layers(m)[0], whole)
    if line:
        log(line)
    if sizes["context"] > 1:
        c = cfg.seq_len // (2 * sizes["context"])
        log(f"context parallel: each sequence split over {sizes['context']} devices (mesh.context), attention "
            f"as a ring, each device holding two zig-zag chunks of {c} tokens")
    if remat.describe(cfg.remat, platform):
        log(remat.describe(cfg.remat, platform))
    if m.n_experts:
        why = gmm.refusal(m.grouped_gemm, platform, hw.kind)
        if why:
            raise config.ConfigError(why)
        kernel = gmm.resolve(m.grouped_gemm, platform, hw.kind)
        log(dispatch.describe(platform, dispatch.expert_shards(hw.mesh, hw.rules), m.ep_slack, kernel))
        if platform == "gpu" and kernel == "xla":
            log(f"warning: {dispatch.GPU_RAGGED_DOT}")
    for t in recipe.transforms:
        t.check(hw.devices[0])
