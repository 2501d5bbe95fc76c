"""Features that change what trains, or what the model runs with, as transforms over a plain model.

A transform implements one small protocol (torchtitan's model converters are the model for it):
  specs(specs)                  the trained parameters' spec tree, rewritten (LoRA: only the adapters)
  extras                        the state it keeps beside the params, by name: `Extra`s, either
                                checkpointed or rebuilt from the model's parameters at every start
  attach(params, extras, key)   what the model runs with: the params with the extras put in place
  update(extras, step)          the extras' next values after a train step (`step`: step.Grads)
  check(device)                 refuse, in one line, a device it cannot run on (its config is checked
                                as it is built)
  compiled(hlo_text, platform, on_device)  check the compiled train step (FP8: that its GEMMs are FP8)
  resumed(on)                   the log line for a resume that switches it on (True) or off (False); its
                                checkpointed extras then start fresh, or are dropped
  describe(...)                 one line for the log
`build(cfg, ...)` lists a run's transforms in the order they attach: LoRA (adapters on the base), FP8
(the weights, LoRA's base included, in FP8), the router bias. The step, the state and the checkpoint see
only the list, so a new feature of this kind is one class here and a line in `build`.
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from maxlm import fp8, lora
from maxlm.models import params as P_

# A checkpoint (layout 1, maxlm.checkpoint) holds a slot for each of these extras, None when its run did not
# keep it: they were TrainState fields when the layout was fixed. An extra added since is written only when
# a run keeps it.
CHECKPOINT_SLOTS = ("router_bias", "frozen", "fp8")


class Extra(NamedTuple):
    """One piece of train state beside the params: no gradient step, no AdamW, no weight decay."""
    specs: Any                     # Param-spec tree: shapes, logical axes (the rule table lays it out), initial values
    saved: bool = True             # checkpointed; else rebuilt from the model's parameters at every start
    dtypes: Any = None             # a dtype per leaf (default float32)
    merge: Callable | None = None  # set: the state is differentiated through, its "gradient" is its next value
                                   # (FP8's convention), and microbatches combine by `merge`


class Transform:
    name = ""
    extras: dict[str, Extra] = {}
    wants_key = False     # attach needs a per-step random key (LoRA dropout)
    on_reference = False  # also attaches to DPO's reference model

    def specs(self, specs):
        return specs

    def attach(self, params, extras: dict, key=None):
        return params

    def update(self, extras: dict, step) -> dict:
        return {}

    def check(self, device) -> None:
        pass

    def resumed(self, on: bool) -> str | None:
        return None

    def describe(self, platform: str) -> str | None:
        return None

    def compiled(self, hlo_text: Callable[[], str], platform: str, on_device: bool = True) -> str | None:
        """Check the compiled train step (its HLO text, on demand; `on_device` false when compiled for a
        `compile_topology` with no such device here); a line for the log, or None."""
        return None


def _frozen(base_specs, dtype) -> Extra:
    """The model's weights, never trained: matrices and tables in `dtype` (float32 buys nothing without an
    update), norm gains and biases in float32 as the trained model has them. Rebuilt at every start from
    init_from (or the seed), never checkpointed."""
    dtypes = jax.tree.map(lambda s: jnp.dtype(dtype if P_.is_drawn(s) else jnp.float32), base_specs, is_leaf=P_.is_param)
    return Extra(base_specs, saved=False, dtypes=dtypes)


class LoRA(Transform):
    """Low-rank adapters are the trained params; the base rides as the `frozen` extra (maxlm.lora)."""
    name = "lora"

    def __init__(self, cfg, base_specs):
        self.lc, self.scale, self.dtype = cfg.lora, lora.scale_of(cfg.lora), cfg.dtype
        self.extras = {"frozen": _frozen(base_specs, cfg.dtype)}
        self.wants_key = bool(cfg.lora.dropout)  # fold_in(rng, step): a resumed run draws the same masks
        self.n_base, self.n_trained = P_.count(base_specs), P_.count(lora.specs(base_specs, cfg.lora))

    def specs(self, specs):
        return lora.specs(specs, self.lc)

    def attach(self, params, extras, key=None):
        return lora.attach(extras["frozen"], params, self.scale, self.lc.dropout, key)

    def describe(self, platform):
        return (f"LoRA rank {self.lc.rank} on {', '.join(self.lc.targets)}: {self.n_trained:,} trained parameters "
                f"({self.n_trained / self.n_base:.3%} of the model); the base is frozen, in {self.dtype}")


class Reference(Transform):
    """The reference model an objective compares with (DPO's): the model as the run started (init_from),
    forward only. Under LoRA it is LoRA's own frozen base, so it costs no second copy."""
    name = "dpo reference"

    def __init__(self, cfg, base_specs):
        self.extras = {"frozen": _frozen(base_specs, cfg.dtype)}


class FP8(Transform):
    """Delayed-scaling FP8 on the layers' weight matmuls; the scaling state is the `fp8` extra (maxlm.fp8)."""
    name = "fp8"

    def __init__(self, cfg, base_specs):
        self.extras = {"fp8": Extra(fp8.specs(base_specs), merge=fp8.merge_microbatches)}
        self.targets, self.dtype = fp8.targets(base_specs), cfg.dtype

    def attach(self, params, extras, key=None):
        return fp8.attach(params, extras["fp8"])

    def update(self, extras, step):
        return {"fp8": step.next_extras["fp8"]}

    def check(self, device):
        fp8.check_device(device)

    def resumed(self, on):
        return ("quantization none -> fp8 at this resume: the FP8 scaling state starts fresh (scales 1 for the first step)"
                if on else f"quantization fp8 -> none at this resume: the checkpoint's FP8 scaling state is dropped; the "
                           f"matmuls run in {self.dtype} from here")

    def describe(self, platform):
        return ("warning: " if platform == "cpu" else "") + fp8.describe(self.targets, platform, self.dtype)

    def compiled(self, hlo_text, platform, on_device=True):
        return fp8.check_compiled(hlo_text(), platform, 3 * len(self.targets), on_device)


class RouterBias(Transform):
    """DeepSeek-V3's loss-free balancing: each MoE layer's expert-selection bias [MoE layers, n_experts],
    moved each step toward even load; the MoE router reads it as params["layers"]["router_bias"] (the
    `layers` stack holds the MoE layers: all of them but deepseek_v3's dense first ones)."""
    name = "router bias"
    on_reference = True

    def __init__(self, cfg, base_specs, layout):
        self.rate, self.layout = cfg.model.router_bias_rate, layout
        L = base_specs["layers"]["router"].shape[0]
        self.extras = {"router_bias": Extra(P_.Param((L, cfg.model.n_experts), (None, None), P_.zeros))}

    def attach(self, params, extras, key=None):
        # The bias is kept in layer order, like the loads that move it; the stack it joins is in the schedule's
        # layout (a circular pipeline's storage order), so it is attached in that order (a tree of shardings as
        # it is).
        bias = extras["router_bias"]
        if hasattr(bias, "reshape"):
            bias = self.layout.store_stack(bias)
        return {**params, "layers": {**params["layers"], "router_bias": bias}}

    def update(self, extras, step):
        # the load's first rows are the `layers` stack's; multi-token prediction's MoE layers follow them
        bias = extras["router_bias"]
        return {"router_bias": balance_bias(bias, step.moe["load"][:bias.shape[0]], self.rate)}

    def resumed(self, on):
        return (f"model.router_bias_rate 0 -> {self.rate} at this resume: the router bias starts at zero" if on else
                f"model.router_bias_rate {self.rate} -> 0 at this resume: the checkpoint's router bias is dropped; "
                f"experts are chosen by score alone from here")


def balance_bias(router_bias, load_LE, rate: float):
    """DeepSeek-V3's loss-free balancing step: each expert's bias moves by `rate` toward even load, up
    when it had fewer assignments than its layer's mean, down when more (the step's whole batch)."""
    return router_bias + rate * jnp.sign(jnp.mean(load_LE, axis=-1, keepdims=True) - load_LE)


def build(cfg, base_specs, layout, reference: bool = False) -> tuple[Transform, ...]:
    """The run's transforms, in the order they attach: `base_specs` the model's, `layout` the schedule's
    (maxlm.schedules), `reference` whether the objective needs a reference model."""
    out = []
    if cfg.lora.rank:
        out.append(LoRA(cfg, base_specs))
    elif reference:
        out.append(Reference(cfg, base_specs))
    if cfg.quantization == "fp8":
        out.append(FP8(cfg, base_specs))
    if cfg.model.n_experts and cfg.model.router_bias_rate:
        out.append(RouterBias(cfg, base_specs, layout))
    return tuple(out)


def router_bias_in(saved_config: dict) -> bool:
    """Whether a checkpoint's run (its saved config) balanced its MoE experts with a router bias, which is
    train state beside the params: its params alone would route differently."""
    return bool(saved_config.get("model", {}).get("router_bias_rate"))


def extras(ts) -> dict[str, Extra]:
    """Every extra the transforms keep, by name (LoRA's base and DPO's reference are one `frozen`)."""
    return {name: e for t in ts for name, e in t.extras.items()}


def trained_specs(ts, base_specs):
    for t in ts:
        base_specs = t.specs(base_specs)
    return base_specs


def attach(ts, params, extras_: dict, key=None):
    """What the model runs with: the trained params with every transform's state attached. Works on trees
    of shardings and abstract arrays too."""
    for t in ts:
        params = t.attach(params, extras_, key)
    return params


def merges(ts) -> dict[str, Callable]:
    """The extras whose gradient is their next value, with how microbatches combine them, by name."""
    return {k: e.merge for k, e in extras(ts).items() if e.merge}


def reference(ts, extras_: dict):
    """The objective's reference model: the frozen weights with the transforms that also shape it (the router bias)."""
    return attach([t for t in ts if t.on_reference], extras_["frozen"], extras_)


def update(ts, extras_: dict, step) -> dict:
    """The extras' next values after a train step (only those that change)."""
    return {k: v for t in ts for k, v in t.update(extras_, step).items()}
