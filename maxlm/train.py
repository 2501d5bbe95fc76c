"""The training run, top to bottom: mesh, state spec, compile, data, state, loop, outputs."""

import contextlib
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import jax
from jax.experimental import multihost_utils
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from maxlm import aot, checkpoint as ckpt, config, distributed, mesh as mesh_lib, metrics, quiet, runlock, sharding
from maxlm.convert import hf
from maxlm.data import make_loader, preflight
from maxlm.evaluation import Evaluator, compile_eval
from maxlm.generate import generate
from maxlm.layers import attention
from maxlm.preemption import StopRequest
from maxlm.state import StateSpec
from maxlm.step import train_step

SAMPLE_PROMPT = "The "


def log(msg: str) -> None:
    if jax.process_index() == 0:  # one log for the job, not one per process
        print(f"maxlm: {msg}", flush=True)


class TrainingStopped(Exception):
    """The run stopped itself (nan_policy); exit code 3, one line, checkpoints intact."""


class NonFinite(Exception):
    def __init__(self, msg: str, step: int, metrics: dict):
        super().__init__(msg)
        self.msg, self.step, self.metrics = msg, step, metrics


def open_checkpoints(cfg, run_dir: Path) -> tuple[ckpt.Checkpointer, int | None]:
    """The run's checkpoint directory, and the step to resume from (None: start fresh). Never starts
    fresh over existing checkpoints unless told to (resume=never), and then moves them aside."""
    directory = cfg.checkpoint.dir or str(run_dir / "checkpoints")
    ck = ckpt.Checkpointer(directory, cfg.checkpoint.keep, cfg.checkpoint.keep_every)
    partials = ck.remove_partials()
    if partials:
        log(f"ignoring and removing {len(partials)} partial checkpoint(s) left by an interrupted save: {', '.join(partials)}")
    steps = ck.steps()
    if steps and cfg.resume == "never":
        ck.close()
        moved = ckpt.archive_name(ck.dir)
        if jax.process_index() == 0:
            ck.dir.rename(moved)
        if jax.process_count() > 1:  # nobody recreates the directory before it has moved
            multihost_utils.sync_global_devices("maxlm: checkpoints moved aside")
        log(f"resume=never: moved {len(steps)} existing checkpoint(s) (steps {steps[0]}..{steps[-1]}) to {moved}")
        return ckpt.Checkpointer(directory, cfg.checkpoint.keep, cfg.checkpoint.keep_every), None
    if not steps:
        log(f"no checkpoint in {ck.dir}: starting from step 0")
        return ck, None
    if steps[-1] > cfg.steps:
        raise config.ConfigError(f"{ck.dir} holds step {steps[-1]}, beyond steps={cfg.steps}; raise `steps`, "
                                 f"or start over with resume=never or a new run_dir")
    if cfg.init_from:
        log(f"init_from={cfg.init_from} is not used: this run's own checkpoints take precedence")
    return ck, steps[-1]


def log_changes(meta: dict, cfg, the_mesh) -> None:
    """Say what differs from the run that wrote the checkpoint: mesh, versions, config."""
    now = ckpt.metadata(config.to_dict(cfg), the_mesh, 0, 0)
    if (meta["mesh"], meta["devices"], meta["processes"]) != (now["mesh"], now["devices"], now["processes"]):
        log(f"mesh changed: the checkpoint was saved on {' x '.join(f'{k}={v}' for k, v in meta['mesh'].items())} "
            f"({meta['devices']} devices, {meta['processes']} process(es)); restored resharded onto "
            f"{mesh_lib.describe(the_mesh)} ({now['devices']} devices, {now['processes']} process(es))")
    for key in ("maxlm_version", "jax_version"):
        if meta[key] != now[key]:
            log(f"{key} changed: {meta[key]} -> {now[key]}")
    diffs = config.diff(meta["config"], json.loads(json.dumps(now["config"])))
    if diffs:
        log(f"config changed since the checkpoint: {'; '.join(diffs)}")


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
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            # The TPU compiler refuses a step that cannot fit; keep its one-line reason.
            reason = str(e).split("RESOURCE_EXHAUSTED:", 1)[1].strip().splitlines()[0]
            raise config.ConfigError(f"the train step does not fit in device memory: {reason} Shard more "
                                     f"(mesh.fsdp), use remat=full, or lower global_batch_size / raise microbatches") from None


def run(cfg, notes=()) -> int:
    if cfg.init_from.startswith("hf:"):  # the architecture is the checkpoint's; logged with the config below
        cfg = hf.with_hf_model(cfg, cfg.init_from[3:])
    if not cfg.compile_topology:
        notes = [*notes, quiet.skip_absent_tpu()]
    joined = "compiling only" if cfg.compile_topology else distributed.initialize()
    log(f"config:\n{config.to_yaml(cfg)}")
    for note in filter(None, notes):
        log(note)
    log(f"processes: {joined}")

    # ---- Mesh -------------------------------------------------------------------------------------
    if cfg.compile_topology:
        devices, hbm = aot.topology_devices(cfg.compile_topology)
        limit, limit_src = hbm, f"{devices[0].device_kind} HBM per chip"
    else:
        devices = jax.devices()
        limit, limit_src = aot.device_memory_limit(devices[0])
    sizes = mesh_lib.mesh_shape(cfg, len(devices))
    mesh_lib.check_divisibility(cfg, sizes)
    the_mesh = mesh_lib.make_mesh(sizes, devices)
    rule_table = sharding.rules(cfg)
    log(f"mesh {mesh_lib.describe(the_mesh)} over {len(devices)} x {devices[0].device_kind} "
        f"({jax.process_count()} process(es))")
    impl, warning = attention.resolve(cfg.attention, devices[0].platform, cfg.model, cfg.dtype)
    log(f"attention: {impl}" + (f" (auto on {devices[0].platform})" if cfg.attention == "auto" else ""))
    if warning:
        log(f"warning: {warning}")
    if cfg.dry_run:
        _compile(cfg, the_mesh, rule_table, devices, limit, limit_src)
        return 0

    # ---- Inputs and outputs, checked before anything compiles -------------------------------------
    preflight(cfg)  # data paths, tokenizer, vocab: a missing file must not cost a compile
    if cfg.init_from and not cfg.init_from.startswith("hf:"):
        ckpt.resolve_init_from(cfg.init_from)[0].close()
    run_dir = Path(cfg.run_dir)
    _make_dirs(cfg, run_dir)
    with _job_lock(cfg, run_dir):
        ck, resume_step = open_checkpoints(cfg, run_dir)
        if resume_step == cfg.steps:
            ck.close()
            log(f"nothing to train: {ck.step_path(resume_step)} is step {resume_step} and steps={cfg.steps}; raise "
                f"`steps` to train further, or start over with resume=never")
            return 0
        try:
            compiled, compiled_eval, ss = _compile(cfg, the_mesh, rule_table, devices, limit, limit_src)
        except BaseException:
            ck.close()
            raise
        return _train(cfg, run_dir, ck, resume_step, the_mesh, ss, compiled, compiled_eval, devices)


def _make_dirs(cfg, run_dir: Path) -> None:
    """Create run_dir (and a local checkpoint.dir); a path that cannot be one is a one-line error."""
    dirs = [("run_dir", run_dir)]
    if cfg.checkpoint.dir and "://" not in cfg.checkpoint.dir:
        dirs.append(("checkpoint.dir", Path(cfg.checkpoint.dir)))
    for key, d in dirs:
        if d.exists() and not d.is_dir():
            raise config.ConfigError(f"`{key}` {d} is a file, not a directory; choose a directory")
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise config.ConfigError(f"`{key}` {d} cannot be created ({e.strerror}); choose a writable "
                                     f"directory") from None
        if not os.access(d, os.W_OK | os.X_OK):
            raise config.ConfigError(f"`{key}` {d} is not writable; choose a writable directory")


@contextlib.contextmanager
def _job_lock(cfg, run_dir: Path):
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
        ok = multihost_utils.broadcast_one_to_all(np.int32(not error))
        if not ok:
            raise config.ConfigError(error or f"`run_dir` {run_dir} is in use by another job (process 0 says so)")
        yield


def _compile(cfg, the_mesh, rule_table, devices, limit, limit_src):
    """State spec, FLOPs and the compiled steps (train, and eval if configured); memory checked."""
    ss = StateSpec(cfg, the_mesh, rule_table)
    flops_tok = metrics.flops_per_token(cfg.model, cfg.seq_len)
    log(f"parameters {ss.n_params:,} ({metrics.matmul_params(cfg.model):,} in matmuls); FLOPs/token "
        f"{flops_tok:.4g} causal, {metrics.flops_per_token(cfg.model, cfg.seq_len, causal=False):.4g} non-causal")
    t = time.perf_counter()
    compiled = compile_step(cfg, ss, the_mesh, rule_table)
    mem = aot.memory_report(compiled)
    log(f"train step compiled in {time.perf_counter() - t:.1f}s; memory per device:\n"
        f"{aot.format_report(mem, limit, limit_src)}")
    aot.check_fits(mem, limit, limit_src)
    compiled_eval = None
    if cfg.eval.every:
        t = time.perf_counter()
        compiled_eval = compile_eval(cfg, ss, the_mesh, rule_table)
        log(f"eval step compiled in {time.perf_counter() - t:.1f}s")
    if cfg.dry_run:
        log("dry run: the step compiles and fits; exiting without training")
    return compiled, compiled_eval, ss


def _train(cfg, run_dir: Path, ck, resume_step, the_mesh, ss, compiled, compiled_eval, devices) -> int:
    primary = jax.process_index() == 0  # process 0 writes the run's files; Orbax coordinates checkpoints
    if primary:
        (run_dir / "config.yml").write_text(f"{config.RUN_CONFIG_MARK}: what this run used; `python train.py "
                                            f"<this file>` resumes it here, wherever the directory is now\n"
                                            + config.to_yaml(cfg))
    flops_tok = metrics.flops_per_token(cfg.model, cfg.seq_len)

    # ---- Data and state: resume, or init (optionally from another run's parameters) ---------------
    loader = make_loader(cfg, ss.batch_sharding)
    log(f"data: {loader.describe()}; tokenizer {loader.tokenizer.name}")
    if loader.steps_per_epoch is not None:
        log(f"data: {loader.steps_per_epoch:,} steps per epoch of {cfg.global_batch_size} x {cfg.seq_len}")
        if cfg.data.epochs and cfg.data.epochs * loader.steps_per_epoch < cfg.steps:
            log(f"data.epochs={cfg.data.epochs} lasts about {cfg.data.epochs * loader.steps_per_epoch:,} steps, fewer "
                f"than steps={cfg.steps}: the run will end when the data does")
    skips_total = 0
    if resume_step is not None:
        t = time.perf_counter()
        state, data_state, meta = ck.restore(resume_step, ss.abstract)
        loader.set_state(data_state)
        skips_total = meta["skips_total"]
        log(f"resuming from step {resume_step} ({ck.step_path(resume_step)}), restored in {time.perf_counter() - t:.1f}s")
        log_changes(meta, cfg, the_mesh)
    elif cfg.init_from.startswith("hf:"):
        t = time.perf_counter()
        state = ss.from_params_fn(cfg.seed)(hf.load_params(cfg.init_from[3:], cfg, the_mesh, sharding.rules(cfg)))
        log(f"initialised parameters from the Hugging Face checkpoint {cfg.init_from[3:]} in "
            f"{time.perf_counter() - t:.1f}s (init_from); optimizer state fresh")
    elif cfg.init_from:
        src, src_step = ckpt.resolve_init_from(cfg.init_from)
        state = ss.from_params_fn(cfg.seed)(src.restore_params(src_step, ss.abstract.params))
        src.close()
        log(f"initialised parameters from step {src_step} of {src.dir} (init_from); optimizer state fresh")
    else:
        state = ss.init_fn(cfg.seed)()
    start_step = resume_step or 0
    note = metrics.trim_history(run_dir, start_step) if primary else None
    if note:
        log(note)

    # ---- Held-out evaluation ----------------------------------------------------------------------
    evaluator = Evaluator(cfg, compiled_eval, ss.batch_sharding) if cfg.eval.every else None
    if evaluator is not None:
        log(f"eval every {cfg.eval.every} steps and after the last: {evaluator.describe()}")

    # ---- Loop -------------------------------------------------------------------------------------
    # Step s's metrics are read right after step s+1 is dispatched: the device never idles on the host,
    # and the host never queues more than one step ahead (deep queues deadlock CPU collectives).
    logger = metrics.Logger(run_dir, cfg.steps, start_step, write=primary)
    timer = metrics.StepTimer()
    n_dev = len(devices)
    tokens_per_step = cfg.global_batch_size * cfg.seq_len
    peak = metrics.peak_flops(devices[0].device_kind)
    if peak is None:
        log(f"MFU: no peak FLOP/s known for `{devices[0].device_kind}`; reported as null")
    cfg_dict = config.to_dict(cfg)
    host_s = None  # the host's own time in the previous loop iteration
    skips_in_row = 0
    saved = {resume_step} if resume_step is not None else set()

    def collect(step: int, m_dev: dict, data_wait: float, t_iter: float) -> dict:
        """Wait for step `step`, apply the NaN policy, and return its metrics row."""
        nonlocal host_s, skips_in_row, skips_total
        t_block = time.perf_counter()
        m = {k: float(v) for k, v in jax.device_get(m_dev).items()}  # waits for the step to finish
        t_ready = time.perf_counter()
        dt = timer.lap()
        tflops = flops_tok * tokens_per_step / dt / n_dev / 1e12
        m.update(step_time_s=dt, tokens_per_sec=tokens_per_step / dt, tokens_per_sec_per_device=tokens_per_step / dt / n_dev,
                 tflops_per_device=tflops, mfu=tflops * 1e12 / peak if peak else None, data_wait_s=data_wait,
                 host_time_s=host_s, **{f"data_skipped_{k}": v for k, v in loader.skips.items() if v})
        # The host's own time in this loop iteration (data + dispatch + logging, not the wait); it is
        # reported with the next step, since logging is part of it. Near step_time_s = host-bound.
        host_s = (t_block - t_iter) + (time.perf_counter() - t_ready)
        bad = f"non-finite loss or gradient at step {step} (loss {m['loss']}, grad_norm {m['grad_norm']})"
        if cfg.nan_policy == "skip" and m["skipped"]:
            skips_in_row, skips_total = skips_in_row + 1, skips_total + 1
            m["skips_total"] = skips_total
            log(f"{bad}: update skipped ({skips_in_row} in a row, max_consecutive_skips={cfg.max_consecutive_skips})")
            if skips_in_row >= cfg.max_consecutive_skips:
                raise NonFinite(f"{bad}: {skips_in_row} steps skipped in a row (max_consecutive_skips="
                                f"{cfg.max_consecutive_skips})", step, m)
        elif cfg.nan_policy == "skip":
            skips_in_row = 0
            m["skips_total"] = skips_total
        elif not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
            raise NonFinite(f"{bad} (nan_policy=stop)", step, m)
        return m

    def drain_messages() -> None:
        for msg in loader.messages:
            log(msg)
        loader.messages.clear()

    def emit(step: int, m: dict, force: bool = False) -> None:
        logger.step(step, m, log=force or step % cfg.log_every == 0 or step == cfg.steps or step == start_step + 1)

    def evaluate(step: int) -> dict:
        """eval_loss and eval_ppl of the parameters after `step` (the state the loop holds now)."""
        e = evaluator(state.params)
        for msg in evaluator.messages:
            log(msg)
        evaluator.messages.clear()
        log(f"eval at step {step}: loss {e['eval_loss']:.4f}, ppl {e['eval_ppl']:.3f} ({e['eval_tokens']:,.0f} tokens, "
            f"{e['eval_time_s']:.2f}s)")
        timer.lap()  # the next step's time starts after the eval: step_time_s stays the training's
        return e

    def committed(step: int | None) -> None:
        if step is not None:
            log(f"checkpoint step {step} committed")

    def save(step: int) -> float:
        committed(ck.wait())  # Orbax would wait for the previous save anyway: report it as it commits
        block = ck.save(step, state, loader.get_state(), ckpt.metadata(cfg_dict, the_mesh, step, skips_total))
        saved.add(step)
        log(f"saving step {step} to {ck.step_path(step)} (async; the loop was blocked {block:.2f}s)")
        return block

    done, pending = start_step, None
    t_loop = time.perf_counter()
    timer.lap()
    with StopRequest() as stop:
        try:
            for step in range(start_step, cfg.steps):
                if stop.requested():
                    break
                t_iter = time.perf_counter()
                wait0 = loader.wait_s
                try:
                    batch = next(loader)
                except StopIteration:
                    drain_messages()
                    log(f"the data ran out: data.epochs={cfg.data.epochs} ended after step {done}; saving it and "
                        f"finishing early")
                    break
                drain_messages()
                state, m_dev = compiled(state, batch)
                done = step + 1
                committed(ck.committed())
                if pending:
                    emit(pending[0], collect(*pending, t_iter))
                pending = (done, m_dev, loader.wait_s - wait0)
                save_now = cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done < cfg.steps
                eval_now = evaluator is not None and done % cfg.eval.every == 0 and done < cfg.steps
                if save_now or eval_now:
                    # The step must be checked before it is saved (nan_policy) or evaluated, and both wait
                    # for it anyway: collect it now. The eval reads `state` before the next step donates it.
                    m = collect(*pending, time.perf_counter())
                    pending = None
                    if save_now:
                        m["checkpoint_block_s"] = save(done)
                    if eval_now:
                        m.update(evaluate(done))
                    emit(done, m, force=True)
            if pending:  # the final step, or the one a signal stopped us after: always saved
                m = collect(*pending, time.perf_counter())
                if done not in saved:
                    m["checkpoint_block_s"] = save(done)
                if evaluator is not None and not stop.requested():  # a signal asks for a quick exit
                    m.update(evaluate(done))
                emit(done, m, force=True)
            t = time.perf_counter()
            committed(ck.wait())
            log(f"checkpoints in {ck.dir} (the last save finished {time.perf_counter() - t:.1f}s after the loop)")
        except NonFinite as e:
            committed(ck.wait())  # saves already in flight are good: let them commit
            logger.step(e.step, e.metrics, log=True)
            last = ck.steps()
            keep = f"the last good checkpoint is step {last[-1]} ({ck.step_path(last[-1])})" if last else "no checkpoint was saved"
            raise TrainingStopped(f"{e.msg}; stopped; {keep}") from None
        finally:
            logger.close()
            ck.close()
            loader.close()
            if evaluator is not None:
                evaluator.close()
    loop_s = time.perf_counter() - t_loop
    if stop.signum is not None and done < cfg.steps:
        log(f"{stop.name}: stopped after step {done} and saved it; exiting with code {stop.exit_code} "
            f"(re-run the same command to resume)")
        return stop.exit_code

    # ---- Outputs ----------------------------------------------------------------------------------
    plot = logger.plot()
    first, last = (logger.history[0][1], logger.history[-1][1]) if logger.history else (math.nan, math.nan)
    trained = f"trained steps {start_step + 1}-{done}" if done > start_step else "trained no step"
    log(f"{trained} in {loop_s:.1f}s; loss {first:.4f} -> {last:.4f}; data wait "
        f"{loader.wait_s:.2f}s; outputs in {run_dir} (metrics.jsonl, tb/, {plot.name if plot else 'no plot'})")
    if cfg.sample_tokens:
        prompt = [int(t) for t in loader.tokenizer.encode(SAMPLE_PROMPT)]
        n = min(cfg.sample_tokens, cfg.model.max_positions - len(prompt))  # a KV cache of n + prompt slots
        out = generate(state.params, cfg.model, [prompt], n, dtype=cfg.dtype)[0]
        log(f"greedy sample:\n{SAMPLE_PROMPT}{loader.tokenizer.decode(out)}")
    if primary:
        (run_dir / "summary.json").write_text(json.dumps({"steps": done, "first_loss": first, "final_loss": last,
                                                         "loop_seconds": loop_s}))
    sys.stdout.flush()
    return 0
