"""Setting up a run, before its first step: the hardware and mesh, the run directory and its lock, the
checkpoints to resume from, the compiled steps, and the state (restored, or initialised).

Every function here either returns what the run needs or raises a ConfigError naming the fix; none of
them trains.
"""

import contextlib
import functools
import json
import time

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from maxlm import aot, checkpoint as ckpt, config, mesh as mesh_lib, metrics, pipeline, remat, runlock, sharding, storage, transforms
from maxlm.convert import peft
from maxlm.evaluation import compile_eval
from maxlm.layers import attention, dispatch
from maxlm.state import StateSpec
from maxlm.step import train_step


def log(msg: str) -> None:
    if jax.process_index() == 0:  # one log for the job, not one per process
        print(f"maxlm: {msg}", flush=True)


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
        slices = (f", {cfg.mesh.slices} slices joined over {mesh_lib.dcn_axis(sizes, cfg.mesh.slices)}"
                  if cfg.mesh.slices > 1 else "")
        log(f"mesh {mesh_lib.describe(self.mesh)} over {len(self.devices)} x {self.kind} "
            f"({len({d.process_index for d in self.devices})} process(es){slices})")
        platform = self.devices[0].platform
        impl, warning = attention.resolve(cfg.attention, platform, cfg.model, cfg.dtype)
        log(f"attention: {impl}" + (f" (auto on {platform})" if cfg.attention == "auto" else ""))
        if warning:
            log(f"warning: {warning}")
        if sizes["stage"] > 1:
            if cfg.remat == "offload" and platform == "tpu":
                raise config.ConfigError(f"mesh.stage={sizes['stage']} with remat=offload: libtpu fails to compile "
                                         f"host offload inside the pipeline's schedule (INTERNAL: a bitcast across "
                                         f"memory spaces, seen on v5p); use remat=full")
            m = cfg.model
            many = lambda n, what: f"{n} {what}" + ("s" if n > 1 else "")  # noqa: E731
            whole = ("embedding", "head", *([many(m.dense_layers, "dense layer")] if m.dense_layers else []),
                     *([many(m.mtp_depth, "MTP module")] if m.mtp_depth else []))
            log(pipeline.describe(sizes["stage"], config.pipelined_layers(m)[0], cfg.microbatches, cfg.pipeline_repeats,
                                  whole))
        if sizes["context"] > 1:
            c = cfg.seq_len // (2 * sizes["context"])
            log(f"context parallel: each sequence split over {sizes['context']} devices (mesh.context), attention "
                f"as a ring, each device holding two zig-zag chunks of {c} tokens")
        if remat.describe(cfg.remat, platform):
            log(remat.describe(cfg.remat, platform))
        if cfg.model.n_experts:
            log(dispatch.describe(platform, dispatch.expert_shards(self.mesh, self.rules), cfg.model.ep_slack))
            if platform == "gpu":
                log(f"warning: {dispatch.GPU_RAGGED_DOT}")
        for t in transforms.build(cfg):
            t.check(self.devices[0])


def make_dirs(cfg, run_dir: str) -> None:
    """Make run_dir (and a local checkpoint.dir), or check that a gs:// one can be written: a path that
    cannot be one is a one-line error before anything compiles."""
    note = storage.use_emulator()
    if note:
        log(note)
    for key, d in (("run_dir", run_dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        if not d:
            continue
        if "://" in d:  # on every process, as each writes its own checkpoint shards
            storage.check_writable(key, d)
        else:
            storage.prepare_dir(key, d)


@contextlib.contextmanager
def job_lock(cfg, run_dir: str):
    """One job per run_dir: process 0 takes the lock once the job has joined, and every process learns
    whether it got it (so a refused job stops everywhere, not only on process 0)."""
    if "://" in cfg.checkpoint.dir:
        log(f"note: checkpoint.dir {cfg.checkpoint.dir} cannot be locked; the lock on run_dir guards it only "
            f"against jobs that share this run_dir")
    if jax.process_count() == 1:
        with runlock.hold(run_dir, log):
            yield
        return
    with contextlib.ExitStack() as stack:
        error = ""
        if jax.process_index() == 0:
            try:
                stack.enter_context(runlock.hold(run_dir, log))
            except config.ConfigError as e:
                error = str(e)
        if not multihost_utils.broadcast_one_to_all(np.int32(not error)):
            raise config.ConfigError(error or f"`run_dir` {run_dir} is in use by another job (process 0 says so)")
        yield


@contextlib.contextmanager
def open_checkpoints(cfg, run_dir: str):
    """(the run's Checkpointer, the step to resume from or None), closed on the way out. Never starts
    fresh over existing checkpoints unless told to (resume=never), and then moves them aside."""
    directory = cfg.checkpoint.dir or storage.join(run_dir, "checkpoints")
    ck = ckpt.Checkpointer(directory, cfg.checkpoint.keep, cfg.checkpoint.keep_every, every=cfg.checkpoint.every)
    partials = ck.remove_partials()
    if partials:
        log(f"ignoring and removing {len(partials)} partial checkpoint(s) left by an interrupted save: {', '.join(partials)}")
    steps = ck.steps()
    if steps and cfg.resume == "never":
        if storage.is_gcs(directory):  # moving them aside would copy every object
            ck.close()
            raise config.ConfigError(f"resume=never: {directory} holds {len(steps)} checkpoint(s) (steps {steps[0]}.."
                                     f"{steps[-1]}), and object storage cannot move them aside; delete them "
                                     f"(gcloud storage rm -r {directory}) or choose a new run_dir")
        ck.close()
        moved = ckpt.archive_name(ck.dir)
        if jax.process_index() == 0:
            ck.dir.rename(moved)
        if jax.process_count() > 1:  # nobody recreates the directory before it has moved
            multihost_utils.sync_global_devices("maxlm: checkpoints moved aside")
        log(f"resume=never: moved {len(steps)} existing checkpoint(s) (steps {steps[0]}..{steps[-1]}) to {moved}")
        ck, steps = ckpt.Checkpointer(directory, cfg.checkpoint.keep, cfg.checkpoint.keep_every, every=cfg.checkpoint.every), []
    try:
        if not steps:
            log(f"no checkpoint in {ck.dir}: starting from step 0")
        elif steps[-1] > cfg.steps:
            raise config.ConfigError(f"{ck.dir} holds step {steps[-1]}, beyond steps={cfg.steps}; raise `steps`, "
                                     f"or start over with resume=never or a new run_dir")
        elif cfg.init_from:
            log(f"init_from={cfg.init_from} is not used: this run's own checkpoints take precedence")
        yield ck, (steps[-1] if steps else None)
    finally:
        ck.close()


def compile_step(cfg, ss: StateSpec, the_mesh, rule_table):
    """AOT-compile the train step against abstract state and batch: nothing is allocated."""
    step_fn = jax.jit(functools.partial(train_step, cfg=cfg, tx=ss.tx),
                      in_shardings=(ss.shardings, ss.batch_sharding),
                      out_shardings=(ss.shardings, NamedSharding(the_mesh, P())),
                      donate_argnums=0)
    with sharding.use(the_mesh, rule_table):
        try:
            return step_fn.lower(ss.abstract, ss.abstract_batch).compile()
        except (jax.errors.JaxRuntimeError, RuntimeError) as e:
            if "overflow in static extent product" in str(e):  # e.g. seq_len=100000000: an L x L score tensor
                raise config.ConfigError(f"the train step cannot be built at this size: an array would have more "
                                         f"than 2**63 elements (seq_len={cfg.seq_len}, global_batch_size="
                                         f"{cfg.global_batch_size}); lower them") from None
            if any(limit in str(e) for limit in attention.KERNEL_LIMITS):
                reason = str(e).strip().splitlines()[0]
                device = the_mesh.devices.flat[0]
                raise config.ConfigError(attention.kernel_resource_error(reason, cfg.model, cfg.dtype, device)) from None
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            # The TPU compiler refuses a step that cannot fit; keep its one-line reason.
            reason = str(e).split("RESOURCE_EXHAUSTED:", 1)[1].strip().splitlines()[0]
            raise config.ConfigError(f"the train step does not fit in device memory: {reason} Shard more "
                                     f"(mesh.fsdp), use remat=full, or lower global_batch_size / raise microbatches") from None


def compile_all(cfg, hw: Hardware, ss: StateSpec):
    """The compiled train (and eval) steps, with parameters, FLOPs and memory logged and checked."""
    platform = hw.devices[0].platform
    for tr in ss.transforms:
        note = tr.describe(platform)
        if note:
            log(note)
    log(f"parameters {ss.n_params:,} ({metrics.matmul_params(cfg.model):,} in matmuls); FLOPs/token "
        f"{metrics.flops_per_token(cfg.model, cfg.seq_len):.4g} causal, "
        f"{metrics.flops_per_token(cfg.model, cfg.seq_len, causal=False):.4g} non-causal")
    t = time.perf_counter()
    step_fn = compile_step(cfg, ss, hw.mesh, hw.rules)
    mem = aot.memory_report(step_fn)
    for tr in ss.transforms:
        note = tr.compiled(step_fn.as_text, platform, on_device=not cfg.compile_topology)
        if note:
            log(note)
    log(f"train step compiled in {time.perf_counter() - t:.1f}s; memory per device:\n"
        f"{aot.format_report(mem, hw.limit, hw.limit_src)}")
    aot.check_fits(mem, hw.limit, hw.limit_src)
    eval_fn = None
    if cfg.eval.every:
        t = time.perf_counter()
        eval_fn = compile_eval(cfg, ss, hw.mesh, hw.rules)
        log(f"eval step compiled in {time.perf_counter() - t:.1f}s")
    return step_fn, eval_fn


def describe_data(cfg, loader) -> None:
    log(f"data: {loader.describe()}; tokenizer {loader.tokenizer.name}")
    if loader.steps_per_epoch is not None:
        log(f"data: {loader.steps_per_epoch:,} steps per epoch of {cfg.global_batch_size} x {cfg.seq_len}")
        if cfg.data.epochs and cfg.data.epochs * loader.steps_per_epoch < cfg.steps:
            log(f"data.epochs={cfg.data.epochs} lasts about {cfg.data.epochs * loader.steps_per_epoch:,} steps, fewer "
                f"than steps={cfg.steps}: the run will end when the data does")


def initial_state(cfg, the_mesh, ss: StateSpec, ck, resume_step, loader, saved_cfg):
    """(state, skipped steps so far): restored from the run's checkpoint (`resume_step`, written by
    `saved_cfg`, check_resume's answer), or initialised (from another run's or a Hugging Face checkpoint's
    parameters with init_from)."""
    if resume_step is not None:
        t = time.perf_counter()
        state, data_state, meta = ck.restore(resume_step, ss.saved_under(saved_cfg), order=ss.order)
        loader.set_state(data_state)
        state, notes = ss.resumed(state, saved_cfg)  # a transform switched on (fresh state) or off (dropped)
        for note in notes:
            log(note)
        if any(not e.saved for e in ss.extra_specs.values()):  # never checkpointed: rebuilt as the run started
            state = state.replace(extras={**state.extras, **ss.rebuilt_fn(cfg.seed)(*base_params(cfg, the_mesh, ss))})
        log(f"resuming from step {resume_step} ({ck.step_path(resume_step)}), restored in {time.perf_counter() - t:.1f}s")
        log_changes(meta, cfg, the_mesh, f"checkpoint step {resume_step} at {ck.step_path(resume_step)}")
        return state, meta["skips_total"]
    t = time.perf_counter()
    base = base_params(cfg, the_mesh, ss)
    state = ss.from_params_fn(cfg.seed)(*base) if base else ss.init_fn(cfg.seed)()
    what = "the LoRA base" if cfg.lora.rank else "parameters"
    if cfg.init_from.startswith("hf:"):
        log(f"initialised {what} from the Hugging Face checkpoint {cfg.init_from[3:]} in "
            f"{time.perf_counter() - t:.1f}s (init_from); optimizer state fresh")
    elif cfg.init_from:
        src, src_step = ckpt.resolve_init_from(cfg.init_from)
        try:
            log(f"initialised {what} from step {src_step} of {src.dir} (init_from); optimizer state fresh")
            if src.trained_with_router_bias(src_step):
                log("warning: init_from's run balanced its MoE experts with a router bias (model.router_bias_rate), "
                    "which is train state, not params: this run starts from a zero bias, so its first steps route differently")
        finally:
            src.close()
    elif cfg.lora.rank:
        log(f"warning: lora.rank={cfg.lora.rank} without init_from: the frozen base is random (seed={cfg.seed}); "
            f"adapters on it only make sense in tests")
    return state, 0


def check_resume(cfg, ss: StateSpec, ck, step: int):
    """The config of the run that wrote checkpoint `step`, or a refusal of a checkpoint this run cannot resume
    (another optimizer, model or process count; a damaged one) from its metadata alone: called before the
    compile, so that a mistake costs no compile of a large model."""
    where = f"checkpoint step {step} at {ck.step_path(step)}"
    saved_cfg = config.from_saved(ck.meta(step)["config"], where, lambda _: None)
    if saved_cfg.optim.name != cfg.optim.name:  # its state would not fit the other optimizer's
        raise config.ConfigError(
            f"{where} was trained with optim.name={saved_cfg.optim.name}; a resume keeps its optimizer: set "
            f"optim.name={saved_cfg.optim.name}, or start a new run_dir with init_from={ck.step_path(step)} "
            f"(its parameters, a fresh {cfg.optim.name} state)")
    ck.check(step, ss.saved_under(saved_cfg))
    return saved_cfg


def base_params(cfg, the_mesh, ss: StateSpec) -> tuple:
    """The model's parameters named by init_from (the LoRA base, or DPO's reference), as a 1-tuple, or ()
    when the run starts from `seed` (init_fn and rebuilt_fn then draw them)."""
    if not cfg.init_from:
        return ()
    return (peft.base(cfg, lambda _: ss.base_shardings, the_mesh, sharding.rules(cfg)),)


def log_changes(meta: dict, cfg, the_mesh, where: str) -> None:
    """Say what differs from the run that wrote the checkpoint: mesh, versions, config (read back as
    `config.from_saved` reads it: a key added since takes its default and is named, a removed key is
    an error)."""
    saved = config.to_dict(config.from_saved(meta["config"], where, log))
    now = ckpt.metadata(config.to_dict(cfg), the_mesh, 0, 0)
    saved_mesh = {**{ax: 1 for ax in now["mesh"]}, **meta["mesh"]}  # an axis added since was not split
    if (saved_mesh, meta["devices"], meta["processes"]) != (now["mesh"], now["devices"], now["processes"]):
        log(f"mesh changed: the checkpoint was saved on {' x '.join(f'{k}={v}' for k, v in saved_mesh.items())} "
            f"({meta['devices']} devices, {meta['processes']} process(es)); restored resharded onto "
            f"{mesh_lib.describe(the_mesh)} ({now['devices']} devices, {now['processes']} process(es))")
    for key in ("maxlm_version", "jax_version"):
        if meta[key] != now[key]:
            log(f"{key} changed: {meta[key]} -> {now[key]}")
    diffs = config.diff(json.loads(json.dumps(saved)), json.loads(json.dumps(now["config"])))
    if diffs:
        log(f"config changed since the checkpoint: {'; '.join(diffs)}")


