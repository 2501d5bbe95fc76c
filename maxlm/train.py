"""The training run, top to bottom: job and mesh, inputs checked, compile, data and state, loop, outputs.

`run(cfg)` builds the run in that order; every check that can fail on a user's mistake comes before
the compile. The loop itself is a `Trainer`: it owns the compiled step, the metrics rows, the NaN
policy and the checkpoint cadence.
"""

import contextlib
import functools
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from maxlm import aot, checkpoint as ckpt, config, distributed, mesh as mesh_lib, metrics, quiet, remat, runlock, sharding, storage, transforms
from maxlm.convert import hf, peft
from maxlm.data import chat, make_loader, preflight
from maxlm.evaluation import Evaluator, compile_eval
from maxlm.generate import generate
from maxlm.layers import attention, dispatch
from maxlm.preemption import Boundary, Interrupted, StopRequest
from maxlm.state import StateSpec
from maxlm.step import train_step
from maxlm.watchdog import Watchdog

SAMPLE_PROMPT = "The "
SAMPLE_QUESTION = "What can you tell me about Python?"


def log(msg: str) -> None:
    if jax.process_index() == 0:  # one log for the job, not one per process
        print(f"maxlm: {msg}", flush=True)


class TrainingStopped(Exception):
    """The run stopped itself (nan_policy); exit code 3, one line, checkpoints intact."""


def run(cfg, notes=()) -> int:
    # ---- Job ----------------------------------------------------------------------------------------
    if cfg.init_from.startswith("hf:"):  # the architecture is the checkpoint's; logged with the config below
        cfg = hf.with_hf_model(cfg, cfg.init_from[3:])
    if cfg.compile_topology:
        notes = [*notes, aot.prepare(cfg.compile_topology)]
    else:
        notes = [*notes, quiet.skip_absent_tpu()]
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        # Fake CPU devices share XLA:CPU's intra-op pool of max(cores, devices) threads, and each device
        # waiting at a collective holds one: with several collectives in flight in one step, all threads
        # can end up waiting for devices that have no thread left (a deadlock no timeout cures). Read
        # once, when the backend starts; tests/conftest.py sets the same.
        os.environ.setdefault("PJRT_NPROC", "64")
    t = time.perf_counter()
    joined = "compiling only" if cfg.compile_topology else distributed.initialize(cfg.watchdog_s)
    startup = {"join": time.perf_counter() - t}  # the start-up cost, logged with the first step
    log(f"config:\n{config.to_yaml(cfg)}")
    for note in filter(None, notes):
        log(note)
    log(f"processes: {joined}")

    # ---- Mesh ---------------------------------------------------------------------------------------
    hw = Hardware(cfg)
    if cfg.dry_run:
        compile_all(cfg, hw, StateSpec(cfg, hw.mesh, hw.rules))
        log("dry run: the step compiles and fits; exiting without training")
        return 0

    # ---- Inputs and outputs, checked before anything compiles ---------------------------------------
    preflight(cfg)  # data paths, tokenizer, vocabulary: a missing file must not cost a compile
    if cfg.init_from and not cfg.init_from.startswith("hf:"):
        ckpt.resolve_model(cfg.init_from)[0].close()
    run_dir = cfg.run_dir  # a local directory or gs://BUCKET/PATH
    make_dirs(cfg, run_dir)
    ss = StateSpec(cfg, hw.mesh, hw.rules)  # shapes only: nothing is allocated or compiled
    with job_lock(cfg, run_dir), open_checkpoints(cfg, run_dir) as (ck, resume_step):
        if resume_step == cfg.steps:  # a finished run: check that it is this run, then stop at once
            where = f"checkpoint step {resume_step} at {ck.step_path(resume_step)}"
            config.from_saved(ck.check(resume_step, ss.saved)["config"], where, log)
            log(f"nothing to train: {ck.step_path(resume_step)} is step {resume_step} and steps={cfg.steps}; raise "
                f"`steps` to train further, or start over with resume=never")
            return 0

        # ---- Compile --------------------------------------------------------------------------------
        t = time.perf_counter()
        step_fn, eval_fn = compile_all(cfg, hw, ss)
        startup["compile"] = time.perf_counter() - t

        # ---- Data and state: resume, or init (optionally from other parameters) ---------------------
        if jax.process_index() == 0:
            storage.write(storage.join(run_dir, "config.yml"), f"{config.RUN_CONFIG_MARK}: what this run used; `python "
                          f"train.py <this file>` resumes it here, wherever the directory is now\n" + config.to_yaml(cfg))
        with contextlib.ExitStack() as closing:
            loader = make_loader(cfg, ss.batch_sharding)
            closing.callback(loader.close)
            describe_data(cfg, loader)
            t = time.perf_counter()
            state, skips_total = initial_state(cfg, hw.mesh, ss, ck, resume_step, loader)
            startup["restore" if resume_step is not None else "init"] = time.perf_counter() - t
            evaluator = None
            if cfg.eval.every:
                evaluator = Evaluator(cfg, eval_fn, ss.batch_sharding)
                closing.callback(evaluator.close)
                log(f"eval every {cfg.eval.every} steps and after the last: {evaluator.describe()}")

            # ---- Loop -------------------------------------------------------------------------------
            trainer = Trainer(cfg, hw, ss, step_fn, ck, loader, evaluator, resume_step or 0, skips_total, startup)
            state, stop = trainer.run(state)

        # ---- Outputs --------------------------------------------------------------------------------
        if stop.signum is not None and trainer.done < cfg.steps:
            kept = (f"stopped after step {trainer.done} and saved it" if trainer.done > trainer.start else
                    f"stopped before training a step; {f'step {trainer.done} is saved' if trainer.done else 'nothing to save'}")
            log(f"{stop.name}: {kept}; exiting with code {stop.exit_code} (re-run the same command to resume)")
            return stop.exit_code
        write_outputs(cfg, run_dir, trainer, state, loader.tokenizer)
        return 0


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
        slices = f", {cfg.mesh.slices} slices joined over data" if cfg.mesh.slices > 1 else ""
        log(f"mesh {mesh_lib.describe(self.mesh)} over {len(self.devices)} x {self.kind} "
            f"({len({d.process_index for d in self.devices})} process(es){slices})")
        platform = self.devices[0].platform
        impl, warning = attention.resolve(cfg.attention, platform, cfg.model, cfg.dtype)
        log(f"attention: {impl}" + (f" (auto on {platform})" if cfg.attention == "auto" else ""))
        if warning:
            log(f"warning: {warning}")
        if sizes["context"] > 1:
            c = cfg.seq_len // (2 * sizes["context"])
            log(f"context parallel: each sequence split over {sizes['context']} devices (mesh.context), attention "
                f"as a ring, each device holding two zig-zag chunks of {c} tokens")
        if remat.describe(cfg.remat, platform):
            log(remat.describe(cfg.remat, platform))
        if cfg.model.n_experts:
            log(dispatch.describe(platform, dispatch.expert_shards(self.mesh, self.rules)))
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
    ck = ckpt.Checkpointer(directory, cfg.checkpoint.keep, cfg.checkpoint.keep_every)
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
        ck, steps = ckpt.Checkpointer(directory, cfg.checkpoint.keep, cfg.checkpoint.keep_every), []
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
        note = tr.compiled(step_fn.as_text, platform)
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


def initial_state(cfg, the_mesh, ss: StateSpec, ck, resume_step, loader):
    """(state, skipped steps so far): restored from the run's checkpoint, or initialised (from another
    run's or a Hugging Face checkpoint's parameters with init_from)."""
    if resume_step is not None:
        t = time.perf_counter()
        where = f"checkpoint step {resume_step} at {ck.step_path(resume_step)}"
        saved_cfg = config.from_saved(ck.meta(resume_step)["config"], where, lambda _: None)
        state, data_state, meta = ck.restore(resume_step, ss.saved_under(saved_cfg))
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


class NonFinite(Exception):
    def __init__(self, msg: str, step: int, metrics: dict):
        super().__init__(msg)
        self.msg, self.step, self.metrics = msg, step, metrics


class NanPolicy:
    """nan_policy on one step's metrics: `stop` raises at the first non-finite loss or gradient norm;
    `skip` counts the steps the jitted step discarded and raises after max_consecutive_skips in a row."""

    def __init__(self, cfg, skips_total: int):
        self.policy, self.limit = cfg.nan_policy, cfg.max_consecutive_skips
        self.in_row, self.total = 0, skips_total

    def check(self, step: int, m: dict) -> None:
        bad = f"non-finite loss or gradient at step {step} (loss {m['loss']}, grad_norm {m['grad_norm']})"
        if self.policy == "stop":
            if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
                raise NonFinite(f"{bad} (nan_policy=stop)", step, m)
            return
        self.in_row = self.in_row + 1 if m["skipped"] else 0
        self.total += bool(m["skipped"])
        m["skips_total"] = self.total
        if m["skipped"]:
            log(f"{bad}: update skipped ({self.in_row} in a row, max_consecutive_skips={self.limit})")
        if self.in_row >= self.limit:
            raise NonFinite(f"{bad}: {self.in_row} steps skipped in a row (max_consecutive_skips={self.limit})", step, m)


def metrics_row(m_dev: dict, dt: float, *, tokens: int, flops_per_token: float, n_dev: int, peak: float | None,
                data_wait: float, host_s: float | None, skips: dict) -> dict:
    """One step's metrics: the device's scalars plus throughput, TFLOP/s, MFU and host timings."""
    m = {k: float(v) for k, v in m_dev.items()}
    tflops = flops_per_token * tokens / dt / n_dev / 1e12
    m.update(step_time_s=dt, tokens_per_sec=tokens / dt, tokens_per_sec_per_device=tokens / dt / n_dev,
             tflops_per_device=tflops, mfu=tflops * 1e12 / peak if peak else None, data_wait_s=data_wait,
             host_time_s=host_s, **{f"data_skipped_{k}": v for k, v in skips.items() if v})
    return m


class Profiler:
    """A jax.profiler trace of steps first..last (`profile_steps`), for TensorBoard or Perfetto. The
    trace starts before step `first` is dispatched and stops once step `last` has finished on device.
    For a gs:// run_dir it is traced into a local directory and its files uploaded whole at the end."""

    def __init__(self, steps, out: str):
        self.first, self.last = (steps[0], steps[1]) if steps else (None, None)
        self.out, self.on = out, False
        self.local = tempfile.mkdtemp(prefix="maxlm-profile-") if steps and storage.is_gcs(out) else out

    def before(self, step: int) -> None:
        if step == self.first:
            jax.profiler.start_trace(self.local)
            self.on = True

    def after(self, step: int, m_dev) -> None:
        if self.on and step >= self.last:
            jax.block_until_ready(m_dev)
            jax.profiler.stop_trace()
            self.on = False
            if self.local != self.out:
                storage.upload(self.local, self.out)
            log(f"profile of steps {self.first}-{min(step, self.last)} written to {self.out} (tensorboard --logdir "
                f"{self.out}, or open the .xplane.pb / .trace.json.gz in Perfetto)")


def process_age() -> float | None:
    """Seconds since this process started (Linux), or None: imports and the config count as start-up too."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return time.clock_gettime(time.CLOCK_BOOTTIME) - int(after_name[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def startup_report(t: dict) -> tuple[str, dict]:
    """The cost of a (re)start, which preemptible jobs pay again and again (their "goodput" is what is
    left): a line for the log and fields for the first metrics row. `t` holds seconds: join, compile,
    restore or init, first_step (loop start to its metrics), total (process start to then, or None)."""
    state = t.get("restore", t.get("init"))
    fields = {"startup_join_s": t["join"], "startup_compile_s": t["compile"], "startup_restore_s": state,
              "startup_first_step_s": t["first_step"], "startup_total_s": t["total"]}
    total = f"; {t['total']:.1f}s from process start to the first step" if t["total"] is not None else ""
    line = (f"start-up: joined in {t['join']:.1f}s, compiled in {t['compile']:.1f}s, state "
            f"{'restored' if 'restore' in t else 'initialised'} in {state:.1f}s, first step in {t['first_step']:.1f}s{total}")
    return line, fields


# What to check when the watchdog finds the loop waiting too long (maxlm/watchdog.py), by what it waited for.
FIX_COORDINATOR = ("the job's coordinator (process 0) did not answer: check that process 0 is alive and reachable "
                   "(its log's last lines say what it waits for)")
FIX_DATA = ("the data pipeline produced no batch: check that the storage behind data.path answers (a stalled "
            "network file system or bucket) and that data workers are alive; raise watchdog_s if a batch "
            "legitimately takes this long")
FIX_STEP = ("the step did not finish on the device: in a multi-process job another process is usually stuck or gone "
            "(the last lines of its log say what it waits for); otherwise the device or its driver hangs. Raise "
            "watchdog_s only if one step legitimately takes this long")
FIX_SAVE = ("the checkpoint storage did not take the save: check that the storage behind checkpoint.dir answers; "
            "raise watchdog_s if a save legitimately takes this long")
FIX_EVAL = ("the evaluation did not finish (it is one wait, however many batches): check the held-out data's "
            "storage, or lower eval.steps; raise watchdog_s if an evaluation legitimately takes this long")


class Trainer:
    """The loop: data -> step -> metrics -> checkpoint, with evaluation and signals at step boundaries.

    Step s's metrics are read right after step s+1 is dispatched: the device never idles on the host,
    and the host never queues more than one step ahead (deep queues deadlock CPU collectives). Before
    each wait the loop tells its watchdog what it waits for."""

    def __init__(self, cfg, hw: Hardware, ss: StateSpec, step_fn, ck, loader, evaluator, start: int, skips_total: int,
                 startup: dict | None = None):
        self.cfg, self.step_fn, self.ck, self.loader, self.evaluator = cfg, step_fn, ck, loader, evaluator
        self.model_params, self.to_save = ss.model_params, ss.to_save
        self.start = self.done = start
        self.mesh, self.n_dev = hw.mesh, len(hw.devices)
        self.nan = NanPolicy(cfg, skips_total)
        self.flops_tok = metrics.flops_per_token(cfg.model, cfg.seq_len)
        self.peak = metrics.peak_flops(hw.kind)
        if self.peak is None:
            log(f"MFU: no peak FLOP/s known for `{hw.kind}`; reported as null")
        note = metrics.trim_history(cfg.run_dir, start) if jax.process_index() == 0 else None
        if note:
            log(note)
        self.logger = metrics.Logger(cfg.run_dir, cfg.steps, start, write=jax.process_index() == 0)
        self.timer = metrics.StepTimer()
        self.expert_load = metrics.ExpertLoad()
        self.cfg_dict = config.to_dict(cfg)
        self.host_s = None  # the host's own time in the previous loop iteration
        self.saved = {start} if start else set()
        self.profiler = Profiler(cfg.profile_steps, storage.join(cfg.run_dir, "profile"))
        self.state = None
        self.data_state = None  # the data position before a wait for a batch that a signal cut short
        self.startup = startup  # start-up seconds, reported with the first step
        self.watchdog = Watchdog(cfg.watchdog_s)

    def run(self, state):
        """Train from `start` to `steps` (or a signal, or the end of the data); return (state, stop)."""
        self.state, self.t0 = state, time.perf_counter()
        try:
            # Armed only now: compiling, restoring and starting the data take as long as they take.
            with self.watchdog:
                with StopRequest() as stop:
                    self._loop(stop)
                self.watchdog.mark(f"the checkpoint save of step {self.done} to finish", FIX_SAVE)
                self._committed(self.ck.wait())
            log(f"checkpoints in {self.ck.dir} (the last save finished {time.perf_counter() - self._t_end:.1f}s "
                f"after the loop)")
        except NonFinite as e:
            self._committed(self.ck.wait())  # saves already in flight are good: let them commit
            self.logger.step(e.step, e.metrics, log=True)
            last = self.ck.steps()
            keep = (f"the last good checkpoint is step {last[-1]} ({self.ck.step_path(last[-1])})" if last
                    else "no checkpoint was saved")
            raise TrainingStopped(f"{e.msg}; stopped; {keep}") from None
        finally:
            self.logger.close()
        self.loop_s = self._t_end - self.t0
        return self.state, stop

    def _loop(self, stop) -> None:
        cfg, pending = self.cfg, None
        self.boundary = Boundary(stop, cfg.checkpoint.minutes)
        self.timer.lap()
        for step in range(self.start, cfg.steps):
            if jax.process_count() > 1:
                self.watchdog.mark(f"the coordinator to answer at step {step + 1} (the step-boundary check)",
                                   FIX_COORDINATOR)
            halt, timed_save = self.boundary.at(self.done)
            if timed_save and pending:  # checkpoint.minutes: save the state after step `done`
                m = self._collect(*pending, time.perf_counter())
                pending = None
                m["checkpoint_block_s"] = self._save(self.done)
                self._emit(self.done, m, force=True)
            if halt:
                break
            self.watchdog.mark(f"data for step {step + 1}", FIX_DATA)
            t_iter, wait0 = time.perf_counter(), self.loader.wait_s
            self.data_state = self.loader.get_state()  # what a save after step `done` records
            try:
                with stop.interruptible():
                    batch = next(self.loader)
            except StopIteration:
                self.data_state = None  # the position at the end of the data, as before
                self._drain_messages()
                log(f"the data ran out: data.epochs={cfg.data.epochs} ended after step {self.done}; saving it and "
                    f"finishing early")
                break
            except Interrupted:  # the loader may be mid-batch: the save takes the position from before the wait
                log(f"{stop.name} while waiting for data for step {step + 1}: stopping after step {self.done}")
                break
            self.data_state = None
            self._drain_messages()
            self.profiler.before(step + 1)
            self.watchdog.mark(f"step {step + 1} on device", FIX_STEP)
            t_dispatch = time.perf_counter()
            self.state, m_dev = self.step_fn(self.state, batch)
            dispatch_s = time.perf_counter() - t_dispatch
            self.done = step + 1
            self.profiler.after(self.done, m_dev)
            self._committed(self.ck.committed())
            if pending:
                self._emit(pending[0], self._collect(*pending, t_iter, dispatch_s))
            pending = (self.done, m_dev, self.loader.wait_s - wait0)
            save_now = cfg.checkpoint.every and self.done % cfg.checkpoint.every == 0 and self.done < cfg.steps
            eval_now = self.evaluator is not None and self.done % cfg.eval.every == 0 and self.done < cfg.steps
            if save_now or eval_now:
                # The step must be checked before it is saved (nan_policy) or evaluated, and both wait for
                # it anyway: collect it now. The eval reads the state before the next step donates it.
                m = self._collect(*pending, time.perf_counter())
                pending = None
                if save_now:
                    m["checkpoint_block_s"] = self._save(self.done)
                if eval_now:
                    m.update(self._evaluate(self.done))
                self._emit(self.done, m, force=True)
        if pending:  # the final step, or the one a signal stopped us after: always saved
            m = self._collect(*pending, time.perf_counter())
            if self.done not in self.saved:
                m["checkpoint_block_s"] = self._save(self.done)
            if self.evaluator is not None and not stop.requested():  # a signal asks for a quick exit
                m.update(self._evaluate(self.done))
            self._emit(self.done, m, force=True)
        self.profiler.after(cfg.steps, None)  # a run that ended early closes its trace
        self._t_end = time.perf_counter()

    def _collect(self, step: int, m_dev: dict, data_wait: float, t_iter: float, dispatch_s: float = 0.0) -> dict:
        """Wait for step `step`, apply the NaN policy, and return its metrics row. `dispatch_s`: how long
        this iteration's call of the next step took to return."""
        self.watchdog.mark(f"step {step} on device", FIX_STEP)
        t_block = time.perf_counter()
        m_host = jax.device_get(m_dev)  # waits for the step to finish
        load = m_host.pop("moe_load", None)
        t_ready = time.perf_counter()
        if self.startup is not None and "first_step" not in self.startup:
            self.startup.update(first_step=t_ready - self.t0, total=process_age())
        m = metrics_row(m_host, self.timer.lap(), tokens=self.cfg.global_batch_size * self.cfg.seq_len,
                        flops_per_token=self.flops_tok, n_dev=self.n_dev, peak=self.peak, data_wait=data_wait,
                        host_s=self.host_s, skips=self.loader.skips)
        # The host's own time in this loop iteration (data, bookkeeping, logging), reported with the next
        # step, since logging is part of it; near step_time_s = host-bound. Neither the wait nor the
        # dispatch counts: on a GPU the call of step N+1 returns only once step N has finished (measured
        # on an H100, docs/metrics.md), so its time there is the device's, not the host's.
        self.host_s = (t_block - t_iter - dispatch_s) + (time.perf_counter() - t_ready)
        if load is not None:
            fields, lines = self.expert_load(load)
            m.update(fields)
            for line in lines:
                log(line)
        self.nan.check(step, m)
        return m

    def _emit(self, step: int, m: dict, force: bool = False) -> None:
        every = step % self.cfg.log_every == 0 or step == self.cfg.steps or step == self.start + 1
        report = None
        if self.startup is not None:  # the first step is always written: its row carries the start-up cost
            report, fields = startup_report(self.startup)
            m.update(fields)
            self.startup = None
        # a forced row comes with a save, an eval or the end: make the rows so far durable with it
        self.logger.step(step, m, log=force or every, flush=force)
        if report:
            log(report)

    def _committed(self, step: int | None) -> None:
        if step is not None:
            log(f"checkpoint step {step} committed")

    def _save(self, step: int) -> float:
        self.watchdog.mark(f"the checkpoint save of step {step}", FIX_SAVE)
        self._committed(self.ck.wait())  # Orbax would wait for the previous save anyway: report it as it commits
        meta = ckpt.metadata(self.cfg_dict, self.mesh, step, self.nan.total)
        data = self.data_state if self.data_state is not None else self.loader.get_state()
        block = self.ck.save(step, self.to_save(self.state), data, meta)
        self.saved.add(step)
        self.boundary.saved()
        log(f"saving step {step} to {self.ck.step_path(step)} (async; the loop was blocked {block:.2f}s)")
        return block

    def _evaluate(self, step: int) -> dict:
        """eval_loss and eval_ppl of the parameters after `step` (the state the loop holds now)."""
        self.watchdog.mark(f"the evaluation after step {step}", FIX_EVAL)
        e = self.evaluator(self.model_params(self.state))
        for msg in self.evaluator.messages:
            log(msg)
        self.evaluator.messages.clear()
        log(f"eval at step {step}: loss {e['eval_loss']:.4f}, ppl {e['eval_ppl']:.3f} ({e['eval_tokens']:,.0f} tokens, "
            f"{e['eval_time_s']:.2f}s)")
        self.timer.lap()  # the next step's time starts after the eval: step_time_s stays the training's
        return e

    def _drain_messages(self) -> None:
        for msg in self.loader.messages:
            log(msg)
        self.loader.messages.clear()


def write_outputs(cfg, run_dir: str, trainer: Trainer, state, tokenizer) -> None:
    """The loss plot, a summary line, a greedy sample and summary.json."""
    logger = trainer.logger
    plot = logger.plot()
    first, last = (logger.history[0][1], logger.history[-1][1]) if logger.history else (math.nan, math.nan)
    attempt = logger.attempt()  # this process's steps: after a resume, from the resumed step on
    a_first, a_last = (attempt[0][1], attempt[-1][1]) if attempt else (math.nan, math.nan)
    trained = f"trained steps {trainer.start + 1}-{trainer.done}" if trainer.done > trainer.start else "trained no step"
    plot_name = plot.rsplit("/", 1)[-1] if plot else "no plot"
    log(f"{trained} in {trainer.loop_s:.1f}s; loss {a_first:.4f} -> {a_last:.4f}; data wait "
        f"{trainer.loader.wait_s:.2f}s; outputs in {run_dir} "
        f"({'metrics/' if storage.is_gcs(run_dir) else metrics.METRICS}, tb/, {plot_name})")
    if cfg.sample_tokens:
        text, stops = SAMPLE_PROMPT, None
        if cfg.data.format != "text":  # a chat model answers a user turn, and stops at its end-of-turn token
            text = chat.load_template(cfg.data).render([{"role": "user", "content": SAMPLE_QUESTION}], True)
            stops = chat.stop_ids(tokenizer, chat.load_template(cfg.data)) or None
        prompt = [int(t) for t in tokenizer.encode(text)]
        n = min(cfg.sample_tokens, cfg.model.max_positions - len(prompt))  # a KV cache of n + prompt slots
        out = generate(trainer.model_params(state), cfg.model, [prompt], n, dtype=cfg.dtype, eos_id=stops)[0]
        log(f"greedy sample:\n{text}{tokenizer.decode(out)}")
    if jax.process_index() == 0:
        storage.write(storage.join(run_dir, "summary.json"), json.dumps(
            {"steps": trainer.done, "first_loss": first, "final_loss": last, "loop_seconds": trainer.loop_s}))
    sys.stdout.flush()
