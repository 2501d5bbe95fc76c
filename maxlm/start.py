"""The state a run starts from: its own checkpoint's (checked from its metadata before the compile,
restored after), or a fresh one, from init_from's parameters or from the seed."""

import json
import time

from maxlm import checkpoint as ckpt, config, mesh as mesh_lib, recipe as recipe_lib, transforms
from maxlm.convert import peft
from maxlm.log import log
from maxlm.state import StateSpec


def check_resume(cfg, ss: StateSpec, ck, step: int) -> tuple:
    """The transforms of the run that wrote checkpoint `step` (what its state holds), or a refusal of a
    checkpoint this run cannot resume (another optimizer, model or process count; a damaged one) from its
    metadata alone: called before the compile, so that a mistake costs no compile of a large model."""
    where = f"checkpoint step {step} at {ck.step_path(step)}"
    saved_cfg = config.from_saved(ck.meta(step)["config"], where, lambda _: None)
    if saved_cfg.optim.name != cfg.optim.name:  # its state would not fit the other optimizer's
        raise config.ConfigError(
            f"{where} was trained with optim.name={saved_cfg.optim.name}; a resume keeps its optimizer: set "
            f"optim.name={saved_cfg.optim.name}, or start a new run_dir with init_from={ck.step_path(step)} "
            f"(its parameters, a fresh {cfg.optim.name} state)")
    saved_ts = recipe_lib.saved_transforms(saved_cfg, ss.base_specs)
    ss.check(ck, step, ss.saved_under(saved_ts))
    return saved_ts


def check_finished(ss: StateSpec, ck, step: int) -> None:
    """Refuse a finished run's last checkpoint that is not this run's (its model or transforms differ)."""
    saved_cfg = config.from_saved(ck.meta(step)["config"], f"checkpoint step {step} at {ck.step_path(step)}", log)
    ss.check(ck, step, ss.saved_under(recipe_lib.saved_transforms(saved_cfg, ss.base_specs)))


def initial_state(cfg, ss: StateSpec, ck, resume_step, loader, saved_ts):
    """(state, skipped steps so far): restored from the run's checkpoint (`resume_step`, whose run had the
    transforms `saved_ts`, check_resume's answer), or initialised (from another run's or a Hugging Face
    checkpoint's parameters with init_from)."""
    if resume_step is not None:
        t = time.perf_counter()
        state, data_state, meta = ss.restore(ck, resume_step, ss.saved_under(saved_ts))
        loader.set_state(data_state)
        state, notes = ss.resumed(state, saved_ts)  # a transform switched on (fresh state) or off (dropped)
        for note in notes:
            log(note)
        if any(not e.saved for e in ss.extra_specs.values()):  # never checkpointed: rebuilt as the run started
            state = state.replace(extras={**state.extras, **ss.rebuilt_fn(cfg.seed)(*base_params(cfg, ss))})
        log(f"resuming from step {resume_step} ({ck.step_path(resume_step)}), restored in {time.perf_counter() - t:.1f}s")
        log_changes(meta, cfg, ss.mesh, f"checkpoint step {resume_step} at {ck.step_path(resume_step)}")
        return state, meta["skips_total"]
    t = time.perf_counter()
    base = base_params(cfg, ss)
    state = ss.from_params_fn(cfg.seed)(*base) if base else ss.init_fn(cfg.seed)()
    what = "the LoRA base" if cfg.lora.rank else "parameters"
    if cfg.init_from.startswith("hf:"):
        log(f"initialised {what} from the Hugging Face checkpoint {cfg.init_from[3:]} in "
            f"{time.perf_counter() - t:.1f}s (init_from); optimizer state fresh")
    elif cfg.init_from:
        src, src_step = ckpt.resolve_init_from(cfg.init_from)
        try:
            log(f"initialised {what} from step {src_step} of {src.dir} (init_from); optimizer state fresh")
            if transforms.router_bias_in(src.meta(src_step)["config"]):
                log("warning: init_from's run balanced its MoE experts with a router bias (model.router_bias_rate), "
                    "which is train state, not params: this run starts from a zero bias, so its first steps route differently")
        finally:
            src.close()
    elif cfg.lora.rank:
        log(f"warning: lora.rank={cfg.lora.rank} without init_from: the frozen base is random (seed={cfg.seed}); "
            f"adapters on it only make sense in tests")
    return state, 0


def base_params(cfg, ss: StateSpec) -> tuple:
    """The model's parameters named by init_from (the LoRA base, or the objective's reference), as a 1-tuple,
    or () when the run starts from `seed` (init_fn and rebuilt_fn then draw them)."""
    if not cfg.init_from:
        return ()
    return (peft.base(cfg, ss.base_specs, lambda _: ss.base_shardings, ss.mesh, ss.rule_table),)


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
