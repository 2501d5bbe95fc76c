"""The training run, top to bottom: mesh, state spec, compile, data, state, loop, outputs."""

import functools
import json
import sys
import time
from pathlib import Path

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from maxlm import aot, config, mesh as mesh_lib, metrics, sharding
from maxlm.data import make_loader
from maxlm.data.corpus import byte_detokenize
from maxlm.sample import greedy
from maxlm.state import StateSpec
from maxlm.step import train_step

SAMPLE_PROMPT = "The "


def log(msg: str) -> None:
    print(f"maxlm: {msg}", flush=True)


def compile_step(cfg, ss: StateSpec, the_mesh, rule_table):
    """AOT-compile the train step against abstract state and batch: nothing is allocated."""
    step_fn = jax.jit(functools.partial(train_step, cfg=cfg, tx=ss.tx),
                      in_shardings=(ss.shardings, ss.batch_sharding),
                      out_shardings=(ss.shardings, NamedSharding(the_mesh, P())),
                      donate_argnums=0)
    with sharding.use(the_mesh, rule_table):
        lowered = step_fn.lower(ss.abstract, ss.abstract_batch)
        try:
            return lowered.compile()
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            # The TPU compiler refuses a step that cannot fit; keep its one-line reason.
            reason = str(e).split("RESOURCE_EXHAUSTED:", 1)[1].strip().splitlines()[0]
            raise config.ConfigError(f"the train step does not fit in device memory: {reason} Shard more "
                                     f"(mesh.fsdp), use remat=full, or lower global_batch_size / raise microbatches") from None


def run(cfg) -> int:
    log(f"config:\n{config.to_yaml(cfg)}")

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

    # ---- State spec and compile -------------------------------------------------------------------
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
    if cfg.dry_run:
        log("dry run: the step compiles and fits; exiting without training")
        return 0

    # ---- Run directory ----------------------------------------------------------------------------
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yml").write_text(config.to_yaml(cfg))

    # ---- Data and state ---------------------------------------------------------------------------
    loader = make_loader(cfg, ss.batch_sharding)
    log(f"data: {cfg.data.source}, {loader.tokens_in_corpus:,} tokens, {loader.n_windows:,} windows of {cfg.seq_len}")
    state = ss.init_fn(cfg.seed)()

    # ---- Loop -------------------------------------------------------------------------------------
    # Step s's metrics are read right after step s+1 is dispatched: the device never idles on the host,
    # and the host never queues more than one step ahead (deep queues deadlock CPU collectives).
    logger = metrics.Logger(run_dir, cfg.steps, 0)
    timer, pending = metrics.StepTimer(), None
    n_dev = len(devices)
    tokens_per_step = cfg.global_batch_size * cfg.seq_len
    peak = metrics.peak_flops(devices[0].device_kind)
    if peak is None:
        log(f"MFU: no peak FLOP/s known for `{devices[0].device_kind}`; reported as null")

    host_s = None  # the host's own time in the previous loop iteration

    def record(step: int, m_dev: dict, data_wait: float, t_iter: float) -> None:
        nonlocal host_s
        t_block = time.perf_counter()
        m = {k: float(v) for k, v in jax.device_get(m_dev).items()}  # waits for the step to finish
        t_ready = time.perf_counter()
        dt = timer.lap()
        tflops = flops_tok * tokens_per_step / dt / n_dev / 1e12
        m.update(step_time_s=dt, tokens_per_sec=tokens_per_step / dt, tokens_per_sec_per_device=tokens_per_step / dt / n_dev,
                 tflops_per_device=tflops, mfu=tflops * 1e12 / peak if peak else None, data_wait_s=data_wait,
                 host_time_s=host_s)
        logger.step(step, m, log=step % cfg.log_every == 0 or step == cfg.steps or step == 1)
        # The host's own time in this loop iteration (data + dispatch + logging, not the wait); it is
        # reported with the next step, since logging is part of it. Near step_time_s = host-bound.
        host_s = (t_block - t_iter) + (time.perf_counter() - t_ready)

    t_loop = time.perf_counter()
    timer.lap()
    for step in range(cfg.steps):
        t_iter = time.perf_counter()
        wait0 = loader.wait_s
        batch = next(loader)
        state, m_dev = compiled(state, batch)
        if pending:
            record(*pending, t_iter)
        pending = (step + 1, m_dev, loader.wait_s - wait0)
    record(*pending, time.perf_counter())
    loop_s = time.perf_counter() - t_loop
    logger.close()

    # ---- Outputs ----------------------------------------------------------------------------------
    plot = logger.plot()
    first, last = logger.history[0][1], logger.history[-1][1]
    log(f"trained {cfg.steps} steps in {loop_s:.1f}s; loss {first:.4f} -> {last:.4f}; data wait "
        f"{loader.wait_s:.2f}s; outputs in {run_dir} (metrics.jsonl, tb/, {plot.name if plot else 'no plot'})")
    if cfg.sample_tokens:
        prompt = list(SAMPLE_PROMPT.encode())
        out = greedy(state.params, cfg, prompt, cfg.sample_tokens)
        log(f"greedy sample:\n{SAMPLE_PROMPT}{byte_detokenize(out)}")
    (run_dir / "summary.json").write_text(json.dumps({"steps": cfg.steps, "first_loss": first, "final_loss": last,
                                                     "loop_seconds": loop_s}))
    sys.stdout.flush()
    return 0
