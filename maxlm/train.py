"""The training run, top to bottom: job and mesh, what it computes, inputs checked, compile, data and
state, loop, outputs.

`run(cfg)` builds the run in that order; every check that can fail on a user's mistake comes before the
compile. Everything the run computes with is built once, here, from the config and the mesh
(maxlm.recipe), and passed in: the state's spec, the compiled steps and the loop read no config.
"""

import contextlib
import json
import math
import os
import sys
import time

import jax

from maxlm import aot, checkpoint as ckpt, config, distributed, hardware, metrics, platforms, recipe as recipe_lib
from maxlm import preemption, storage, tracking
from maxlm.aot import compile_all
from maxlm.convert import hf, peft
from maxlm.data import chat, make_loader, preflight
from maxlm.evaluation import Evaluator
from maxlm.generate import generate
from maxlm.hardware import Hardware
from maxlm.layers import gmm
from maxlm.log import log
from maxlm.loop import NanPolicy, Plan, Profiler, Trainer
from maxlm.models import params as P_
from maxlm.rundir import job_lock, make_dirs
from maxlm.start import check_finished, check_resume, initial_state
from maxlm.state import StateSpec
from maxlm.watchdog import Watchdog

SAMPLE_PROMPT = "The "
SAMPLE_QUESTION = "What can you tell me about Python?"


def start_job(cfg, notes=(), explicit=()) -> tuple:
    """This process's part of the job: the architecture read from an hf: checkpoint (`explicit`: the model
    keys the command line set, which must agree with it), jax's backends told what to start (a compile-only
    target, or no absent TPU), the processes joined and the config logged. Returns the config and the
    start-up costs so far."""
    if cfg.init_from.startswith("hf:"):  # the architecture is the checkpoint's; logged with the config below
        cfg = hf.with_hf_model(cfg, cfg.init_from[3:], explicit)
        notes = [*notes, hf.import_note(cfg.init_from[3:])]
    if cfg.compile_topology:
        notes = [*notes, aot.prepare(cfg.compile_topology)]
    else:
        notes = [*notes, platforms.skip_absent_tpu()]
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
    return cfg, startup


def run(cfg, notes=(), explicit=()) -> int:
    """Train `cfg`. `explicit`: the keys the command line set (an hf: checkpoint's architecture must agree
    with the model keys among them)."""
    # From here to the end this process's SIGTERM, SIGINT and SIGHUP are the run's: before the loop's first
    # step boundary one ends the process at once, in the loop the step in flight is saved first, after
    # it the last save finishes (maxlm.preemption).
    with preemption.owned():
        return _run(cfg, notes, explicit)


def _run(cfg, notes=(), explicit=()) -> int:
    # ---- Job ----------------------------------------------------------------------------------------
    cfg, startup = start_job(cfg, notes, explicit)

    # ---- Mesh, and what the run computes on it ------------------------------------------------------
    if cfg.dry_run:
        dry_run(cfg)
        log("dry run: the step compiles and fits; exiting without training")
        return 0
    hw = Hardware(cfg)
    recipe = recipe_lib.build(cfg, hw.mesh)
    hardware.describe(cfg, hw, recipe)

    # ---- Inputs and outputs, checked before anything compiles ---------------------------------------
    preflight(cfg)  # data paths, tokenizer, vocabulary: a missing file must not cost a compile
    tracking.check(cfg.tracking)  # the wandb package and a login
    harness = None
    if cfg.eval.harness.every:  # lm_eval installed and every task known, before anything compiles
        from maxlm.eval_harness import Harness
        harness = Harness(cfg, recipe, hw.mesh, hw.rules, log)
    ss = StateSpec(recipe, hw.mesh, hw.rules)  # shapes only: nothing is allocated or compiled
    if cfg.init_from and not cfg.init_from.startswith("hf:"):  # there, a whole model, with this run's shapes
        peft.check_model(cfg.init_from, P_.abstract(ss.base_specs))
    run_dir = cfg.run_dir  # a local directory or gs://BUCKET/PATH
    make_dirs(cfg, run_dir)
    c = cfg.checkpoint
    with job_lock(cfg, run_dir), ckpt.opened(c.dir or storage.join(run_dir, "checkpoints"), cfg.resume, cfg.steps, log,
                                              keep=c.keep, keep_every=c.keep_every, every=c.every,
                                              minutes=c.minutes) as (ck, resume_step):
        if resume_step is not None and cfg.init_from:
            log(f"init_from={cfg.init_from} is not used: this run's own checkpoints take precedence")
        if resume_step == cfg.steps:  # a finished run: check that it is this run, then stop at once
            check_finished(ss, ck, resume_step)
            log(f"nothing to train: {ck.step_path(resume_step)} is step {resume_step} and steps={cfg.steps}; raise "
                f"`steps` to train further, or start over with resume=never")
            return 0
        # A checkpoint this run cannot resume is refused before the compile.
        saved_ts = None if resume_step is None else check_resume(cfg, ss, ck, resume_step)

        # ---- Compile --------------------------------------------------------------------------------
        t = time.perf_counter()
        step_fn, eval_fn = compile_fitting(cfg, hw, ss)
        startup["compile"] = time.perf_counter() - t

        # ---- Data and state: resume, or init (optionally from other parameters) ---------------------
        if jax.process_index() == 0:
            storage.write(storage.join(run_dir, "config.yml"), f"{config.RUN_CONFIG_MARK}: what this run used; `python "
                          f"train.py <this file>` resumes it here, wherever the directory is now\n" + config.to_yaml(cfg))
        with contextlib.ExitStack() as closing:
            # The trainer whose state a rollout reads when it starts is made below.
            loader = batch_source(cfg, recipe, ss, lambda: trainer.state)
            closing.callback(loader.close)
            describe_data(cfg, loader)
            t = time.perf_counter()
            state, skips_total = initial_state(cfg, ss, ck, resume_step, loader, saved_ts)
            startup["restore" if resume_step is not None else "init"] = time.perf_counter() - t
            evaluator = None
            if cfg.eval.every:
                evaluator = Evaluator(cfg, eval_fn, ss.abstract_batch, log)
                closing.callback(evaluator.close)
                log(f"eval every {cfg.eval.every} steps and after the last: {evaluator.describe()}")

            # ---- Loop -------------------------------------------------------------------------------
            trainer = make_trainer(cfg, hw, ss, step_fn, ck, loader, resume_step or 0, skips_total,
                                   evaluator=evaluator, harness=harness, startup=startup)
            state, stop = trainer.run(state)

        # ---- Outputs --------------------------------------------------------------------------------
        if stop.signum is not None and trainer.done < cfg.steps:
            kept = (f"stopped after step {trainer.done} and saved it" if trainer.done > trainer.start else
                    f"stopped before training a step; {f'step {trainer.done} is saved' if trainer.done else 'nothing to save'}")
            log(f"{stop.name}: {kept}; exiting with code {stop.exit_code} (re-run the same command to resume)")
            return stop.exit_code
        write_outputs(cfg, run_dir, trainer, state, loader.tokenizer, sample=not stop.requested())
        return 0


def compile_fitting(cfg, hw, ss):
    """compile_all. An MoE step that does not fit on Hopper with XLA's grouped matmul (a product masked per
    expert on GPU) is compiled once more with tokamax's kernel, and the refusal says what that one needs."""
    try:
        return compile_all(cfg, hw, ss)
    except aot.DoesNotFit as e:
        m = cfg.model
        if not (m.n_experts and gmm.is_hopper(hw.kind) and gmm.resolve(m.grouped_gemm, hw.platform, hw.kind) == "xla"):
            raise
        other = config.replace(cfg, {"model": {"grouped_gemm": "tokamax"}})
        mem = aot.memory_report(aot.compile_step(other, StateSpec(recipe_lib.build(other, hw.mesh), hw.mesh, hw.rules)))
        need, spare = mem["total"] / aot.GiB, (hw.limit - mem["total"]) / aot.GiB
        fits = f"fits, {spare:.2f} GiB to spare" if spare >= 0 else f"does not fit either ({-spare:.2f} GiB over)"
        raise config.ConfigError(f"{e}; with model.grouped_gemm=tokamax (tokamax's grouped kernel, whose gradients "
                                 f"no GPU has checked yet: docs/moe.md) it needs {need:.2f} GiB, which {fits}") from None


def dry_run(cfg) -> None:
    """The run's steps compiled for its devices (or compile_topology's), the memory they need logged and
    checked against the device's: what a job must pass before it queues."""
    hw = Hardware(cfg)
    recipe = recipe_lib.build(cfg, hw.mesh)
    hardware.describe(cfg, hw, recipe)
    ss = StateSpec(recipe, hw.mesh, hw.rules)
    compile_fitting(cfg, hw, ss)
    if cfg.objective == "grpo":  # and what the rollouts run
        from maxlm.rl.rollout import compile_programs

        t, lines, cols = time.perf_counter(), [], ("arguments", "temporaries", "total")
        for name, compiled in compile_programs(cfg, ss):
            mem = aot.memory_report(compiled)
            lines.append(f"  {name:<40} " + "".join(f"{mem[k] / aot.GiB:12.3f}" for k in cols))
            aot.check_fits(mem, hw.limit, hw.limit_src)
        log(f"rollout programs compiled in {time.perf_counter() - t:.1f}s; memory per device (GiB):\n"
            f"  {'':<40} " + "".join(f"{k:>12}" for k in cols) + "\n" + "\n".join(lines))


def batch_source(cfg, recipe, ss: StateSpec, state):
    """Where the step's batches come from: the data's packed rows, or for objective=grpo rollouts sampled from
    the policy as it trains (`state()`: the train state now)."""
    if cfg.objective != "grpo":
        return make_loader(cfg, ss.abstract_batch, log)
    from maxlm.data import checks
    from maxlm.rl.rollout import Rollouts

    return Rollouts(cfg, recipe, ss, checks.load_tokenizer(cfg), checks.check_chat(cfg), state, log)


def describe_data(cfg, loader) -> None:
    log(f"data: {loader.describe()}; tokenizer {loader.tokenizer.name}")
    if loader.steps_per_epoch is not None:
        log(f"data: {loader.steps_per_epoch:,} steps per epoch of {cfg.global_batch_size} x {cfg.seq_len}")
        if cfg.data.epochs and cfg.data.epochs * loader.steps_per_epoch < cfg.steps:
            log(f"data.epochs={cfg.data.epochs} lasts about {cfg.data.epochs * loader.steps_per_epoch:,} steps, fewer "
                f"than steps={cfg.steps}: the run will end when the data does")


def make_trainer(cfg, hw: Hardware, ss: StateSpec, step_fn, ck, loader, start: int, skips_total: int,
                 **parts) -> Trainer:
    """The loop and what it reports to, built from the config: its plan, the NaN policy, the metrics
    logger (after an earlier attempt, with the rows past `start` trimmed), the profiler and the watchdog.
    `parts`: the evaluator, the harness and the start-up costs."""
    peak = metrics.peak_flops(hw.kind)
    if peak is None:
        log(f"MFU: no peak FLOP/s known for `{hw.kind}`; reported as null")
    writer = jax.process_index() == 0
    wandb = None
    if writer and "wandb" in cfg.tracking:  # before the trim: the rows say what the last attempt logged
        through = max((r["step"] for r in metrics.read_rows(cfg.run_dir)), default=0)
        wandb = tracking.Wandb(cfg.run_dir, start, through, config.to_dict(cfg), log)
    note = metrics.trim_history(cfg.run_dir, start) if writer else None
    if note:
        log(note)
    logger = metrics.Logger(cfg.run_dir, cfg.steps, start, write=writer, tensorboard="tensorboard" in cfg.tracking,
                            wandb=wandb)
    plan = Plan(cfg.steps, cfg.log_every, cfg.global_batch_size * cfg.seq_len, metrics.flops_per_token(cfg.model, cfg.seq_len),
                peak, len(hw.devices), hw.mesh, config.to_dict(cfg))
    return Trainer(plan, ss, step_fn, ck, loader, start, nan=NanPolicy(cfg.nan_policy, cfg.max_consecutive_skips,
                   skips_total, log), logger=logger, profiler=Profiler(cfg.profile_steps, storage.join(cfg.run_dir, "profile"),
                   log), watchdog=Watchdog(cfg.watchdog_s), log=log, **parts)


def write_outputs(cfg, run_dir: str, trainer: Trainer, state, tokenizer, sample: bool = True) -> None:
    """The loss plot, a summary line, a greedy sample (not after a signal: it asks for a quick exit) and
    summary.json."""
    logger = trainer.logger
    plot = logger.plot()
    first, last = (logger.history[0][1], logger.history[-1][1]) if logger.history else (math.nan, math.nan)
    attempt = logger.attempt()  # this process's steps: after a resume, from the resumed step on
    a_first, a_last = (attempt[0][1], attempt[-1][1]) if attempt else (math.nan, math.nan)
    trained = f"trained steps {trainer.start + 1}-{trainer.done}" if trainer.done > trainer.start else "trained no step"
    plot_name = plot.rsplit("/", 1)[-1] if plot else "no plot"
    rewards = logger.attempt(logger.reward_history)
    reward = f"; reward {rewards[0][1]:.3f} -> {rewards[-1][1]:.3f}" if rewards else ""
    log(f"{trained} in {trainer.loop_s:.1f}s; loss {a_first:.4f} -> {a_last:.4f}{reward}; data wait "
        f"{trainer.loader.wait_s:.2f}s; outputs in {run_dir} "
        f"({'metrics/' if storage.is_gcs(run_dir) else metrics.METRICS}, {'tb/, ' * ('tensorboard' in cfg.tracking)}"
        f"{plot_name})")
    if cfg.sample_tokens and sample:
        text, stops = SAMPLE_PROMPT, None
        template = chat.load_template(cfg.data, required=cfg.data.format in ("chat", "preference")) \
            if cfg.data.format != "text" else None
        if template is not None:  # a chat model answers a user turn, and stops at its end-of-turn token
            text = template.render([{"role": "user", "content": SAMPLE_QUESTION}], True)
            stops = chat.stop_ids(tokenizer, template) or None
        elif cfg.data.format == "prompt":  # a plain prompt model stops at its EOS, as its rollouts did
            stops = chat.stop_ids(tokenizer) or None
        prompt = [int(t) for t in tokenizer.encode(text)]
        n = min(cfg.sample_tokens, cfg.model.max_positions - len(prompt))  # a KV cache of n + prompt slots
        if n < cfg.sample_tokens:
            log(f"greedy sample: {max(n, 0)} of sample_tokens={cfg.sample_tokens} tokens, as the prompt's "
                f"{len(prompt)} and the sample fill model.max_positions={cfg.model.max_positions}")
        if n > 0:  # the run is saved; a prompt longer than the positions leaves nothing to sample
            out = generate(trainer.ss.natural_params(state), cfg.model, [prompt], n, dtype=cfg.dtype, eos_id=stops)[0]
            log(f"greedy sample:\n{text}{tokenizer.decode(out)}")
    if jax.process_index() == 0:
        storage.write(storage.join(run_dir, "summary.json"), json.dumps(
            {"steps": trainer.done, "first_loss": first, "final_loss": last, "loop_seconds": trainer.loop_s}))
    sys.stdout.flush()
