"""Config: YAML files chained by `base_config`, then `key=value` overrides, into one frozen object.

`configs/base.yml` is the schema: it lists every key with its default, and the default's type is the
key's type. Files and overrides may only set keys that exist there.

Why ml_collections: the result is a `FrozenConfigDict`, so it is immutable, hashable (usable as a static
jit argument) and attribute-addressed (`cfg.model.d_model`), which a plain dict is not. We do the
type checking ourselves, against base.yml, because ConfigDict's own errors neither name the file nor
suggest the nearest key.

This module must not import jax: it runs, and fails, before anything touches a device.
"""

import difflib
import math
import os
import re
from pathlib import Path
from typing import Any

import ml_collections
import yaml

from maxlm import families
from maxlm.errors import ConfigError  # noqa: F401 - raised here, and re-exported for callers

BASE = Path(__file__).resolve().parent.parent / "configs" / "base.yml"

DTYPES = ("float32", "bfloat16")
REMAT = ("none", "full", "save_dots", "save_dots_no_batch", "offload")
ATTENTION = ("auto", "xla", "flash", "mosaic", "cudnn")
QUANTIZATION = ("none", "fp8")
TRACKERS = ("tensorboard", "wandb")
SCHEDULES = ("cosine", "constant", "wsd")
OPTIMIZERS = ("adamw", "muon")
DECAY_SHAPES = ("linear", "sqrt", "cosine")  # wsd's (maxlm.optim.DECAY_SHAPES)
SOURCES = ("pydoc", "synthetic", "text", "jsonl", "parquet", "prepared", "mixture")
PATH_KEYS = ("data.path", "eval.path")  # a path, or a list of them
FREE_KEYS = ("data.mixture", "rl.rewards")  # mappings whose keys the user names
MESH_AXES = ("stage", "data", "fsdp", "tensor", "expert", "context")  # stage outermost: across slices
RESUME = ("auto", "never")
NAN_POLICIES = ("stop", "skip")
OBJECTIVES = ("lm", "dpo", "grpo")
DATA_FORMATS = ("text", "chat", "preference", "prompt")
TOO_LONG = ("truncate", "drop")
DPO_LOSSES = ("sigmoid", "simpo")
RL_LOSSES = ("grpo", "dapo", "dr_grpo")  # maxlm.objectives.grpo.LOSSES
REWARD_KEYS = ("reward", "weight", "field", "extract", "pattern")
READS = {"exact": ("weight", "field", "extract"), "math": ("weight", "field"), "format": ("weight", "pattern")}
ROPE_SCALING = ("none", "linear", "llama3", "yarn")
ROUTER_SCORES = ("softmax", "sigmoid")
EXPERT_GRAD_DTYPES = ("float32", "bfloat16")  # model.expert_grad_dtype: what the experts' FSDP gradients are summed in
GROUPED_GEMMS = ("auto", "xla", "tokamax")  # model.grouped_gemm (layers.gmm)
MOE_ONLY = ("router_z_loss", "router_bias_rate", "shared_experts", "capacity_factor", "router_groups",
            "router_topk_groups", "dense_layers", "dense_d_ff")  # 0 unless MoE
# Every logical axis a layer or parameter names; `sharding_rules` maps each onto mesh axes.
LOGICAL_AXES = ("batch", "length", "embed", "vocab", "heads", "kv_heads", "head_dim", "mlp", "layers", "experts",
                "matrices", "stack")  # matrices: the stack axis of Muon's weight matrices (maxlm.optim.whole_matrices);
# stack: a second layer stack that pipeline stages do not split (DeepSeek-V3's dense layers and MTP modules)


class _Loader(yaml.SafeLoader):
    """PyYAML is YAML 1.1, which reads `3e-4` as a string: accept any float spelling as a float. And a key
    given twice in one mapping is an error, not "the last one wins"."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key `{key}` is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(  # appended after int, so `3` stays an int
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?\d[\d_]*(?:\.\d*)?[eE][-+]?\d+$"), list("-+0123456789"))


def parse_value(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def _read_yaml(path: Path) -> dict:
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; give a YAML file in it, e.g. {path}/tiny.yml")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.load(path.read_bytes().decode("utf-8"), Loader=_Loader) or {}
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file; a config is YAML text") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        why = getattr(e, "problem", None) or str(e).strip().splitlines()[0]
        raise ConfigError(f"{path}{where}: invalid YAML ({why})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config must be a mapping of keys, got {type(data).__name__}")
    return data


def _flat_keys(d: dict, prefix: str = "", leaves: bool = False) -> list[str]:
    """Every dotted key of `d` (with `leaves`, only those holding values, not sections)."""
    out = []
    for k, v in d.items():
        section = isinstance(v, dict) and prefix + str(k) not in FREE_KEYS
        if not (leaves and section):
            out.append(prefix + str(k))
        if section:
            out += _flat_keys(v, prefix + str(k) + ".", leaves)
    return out


def _unknown(key: str, schema: dict) -> ConfigError:
    keys = _flat_keys(schema)
    near = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    hint = f"; did you mean `{near[0]}`?" if near else "; every key is listed in configs/base.yml"
    return ConfigError(f"unknown config key `{key}`{hint}")


def _typed(key: str, value: Any, default: Any, raw: str | None = None) -> Any:
    """Return `value` converted to the type of `default`, or raise naming the key and both types."""
    want = type(default)
    if key in PATH_KEYS and isinstance(value, list):
        bad = next((i for i, v in enumerate(value) if not isinstance(v, str)), None)
        if bad is not None:
            fix = [str(v) for v in value]
            raise ConfigError(f"`{key}`: item {bad + 1} of the list is {value[bad]!r} ({type(value[bad]).__name__}), not a "
                              f"path; write every path as a string: {key}={fix}")
        return value
    if want is str and raw is not None and not isinstance(value, str):
        return raw  # `run_dir=2024` on the CLI means the string "2024"
    if key == "tracking" and isinstance(value, str):
        return [value]  # `tracking: wandb` is the list of one
    ok = (
        (want is bool and isinstance(value, bool))
        or (want is int and isinstance(value, int) and not isinstance(value, bool))
        or (want is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (want is str and isinstance(value, str))
        or (want is list and isinstance(value, list))
        or (want is dict and key in FREE_KEYS and isinstance(value, dict))
    )
    if not ok:
        shown = raw if raw is not None else repr(value)
        raise ConfigError(f"`{key}` must be {want.__name__}, got {shown!s} ({type(value).__name__})")
    for name in value if want is dict else ():  # a name becomes a metric's name and a key path: one word
        if not isinstance(name, str) or not re.fullmatch(r"\w[\w-]*", name):
            raise ConfigError(f"`{key}`: the name {name!r} must be a word (letters, digits, '_', '-'; no dots), "
                              f"e.g. web")
    return float(value) if want is float else value


def _merge(schema: dict, into: dict, update: dict, prefix: str, source: str) -> None:
    for k, v in update.items():
        key = prefix + str(k)
        if k not in schema:
            raise _unknown(key, _root_schema())
        if isinstance(schema[k], dict) and key not in FREE_KEYS:
            if not isinstance(v, dict):
                raise ConfigError(f"`{key}` is a section; set its keys, e.g. `{key}.{next(iter(schema[k]))}` ({source})")
            _merge(schema[k], into[k], v, key + ".", source)
        else:
            into[k] = _typed(key, v, schema[k])


_SCHEMA_CACHE: dict = {}


def _root_schema() -> dict:
    if "base" not in _SCHEMA_CACHE:
        _SCHEMA_CACHE["base"] = _read_yaml(BASE)
    return _SCHEMA_CACHE["base"]


def _chain(path: Path, seen: tuple = ()) -> list[tuple[Path, dict]]:
    """The file and its base_config ancestors, root first; base_config is relative to the file."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"base_config cycle: {' -> '.join(str(p) for p in (*seen, path))}")
    data = _read_yaml(path)
    if "base_config" not in data:
        return [(path, data)]
    parent = data.pop("base_config")
    if not isinstance(parent, str) or not parent.strip():
        raise ConfigError(f"{path}: `base_config` must name a YAML file (relative to this one), got {parent!r}")
    return _chain(path.parent / parent, (*seen, path)) + [(path, data)]


def _override(schema: dict, cfg: dict, arg: str) -> None:
    key, eq, text = arg.partition("=")
    if not eq or not key:
        raise ConfigError(f"override `{arg}` must look like key=value (e.g. steps=100)")
    node_s, node_c, parts = schema, cfg, key.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node_s, dict) or part not in node_s:
            raise _unknown(key, schema)
        if i < len(parts) - 1:
            node_s, node_c = node_s[part], node_c[part]
    if isinstance(node_s[part], dict) and key not in FREE_KEYS:
        raise ConfigError(f"`{key}` is a section; override one of its keys, e.g. `{key}.{next(iter(node_s[part]))}=...`")
    try:
        value = parse_value(text)
    except yaml.YAMLError:
        value = text
    node_c[part] = _typed(key, value, node_s[part], raw=text)


# The first line of the config a run saves in its run_dir. Reloading that file runs in the directory the
# file is in now, so a run directory that was moved or copied resumes where it is, not where it was.
RUN_CONFIG_MARK = "# maxlm run config"
# Keys holding local paths (or gs:// URLs): made absolute against the working directory at load time,
# so nothing later (Orbax, a worker process, an export) depends on where the process happens to run.
PATHS = ("run_dir", "checkpoint.dir", "init_from", "data.path", "data.tokenizer", "eval.path")


def load(path: str | Path | None, overrides: list[str] = (), notes: list | None = None,
         model_pending: bool = False) -> ml_collections.FrozenConfigDict:
    """Build the validated config from a YAML file (or only base.yml if None) and CLI overrides.
    Paths come out absolute; `notes` (if given) collects lines worth logging about how the config was made.
    With init_from=hf:DIR (or `model_pending`), the family's checks wait for the checkpoint's model section
    (`validate`)."""
    schema = _root_schema()
    cfg = yaml.load(yaml.safe_dump(schema), Loader=_Loader)  # a deep copy of the defaults
    if path is not None:
        for file, data in _chain(Path(path)):
            if file != BASE:
                _merge(schema, cfg, data, "", str(file))
    keys = [arg.partition("=")[0] for arg in overrides]
    for arg in overrides:
        _override(schema, cfg, arg)
    if path is not None and "run_dir" not in keys and _is_run_config(Path(path)):
        here = str(Path(path).resolve().parent)
        if cfg["run_dir"] != here and notes is not None:
            notes.append(f"run_dir: {here} (the directory of this run config; it was written in {cfg['run_dir']})")
        cfg["run_dir"] = here
    _default_wsd_decay(cfg, notes)
    validate(cfg, model_pending or str(cfg["init_from"]).startswith("hf:"))
    _refuse_unread(cfg, schema)
    resolve_paths(cfg)
    return ml_collections.FrozenConfigDict(cfg)


def _default_wsd_decay(cfg: dict, notes: list | None) -> None:
    """optim.schedule=wsd without decay_steps: the last tenth of the run decays (MaxText's default), said in
    a note. The chosen length is saved with the run's config, so a resume keeps it."""
    o = cfg["optim"]
    if o["schedule"] == "wsd" and o["decay_steps"] == 0 and isinstance(cfg["steps"], int) and cfg["steps"] > 0:
        o["decay_steps"] = max(1, cfg["steps"] // 10)
        if isinstance(o["warmup_steps"], int) and o["warmup_steps"] + o["decay_steps"] > cfg["steps"]:
            raise ConfigError(f"optim.schedule=wsd: warmup_steps={o['warmup_steps']} + decay_steps="
                              f"{o['decay_steps']} (a tenth of steps, the default) exceed steps={cfg['steps']}, so "
                              f"the decay would begin before the warmup ends; shorten the warmup, set "
                              f"optim.decay_steps, or raise steps")
        if notes is not None:
            notes.append(f"optim.decay_steps: {o['decay_steps']} (a tenth of steps={cfg['steps']}, the default for "
                         f"optim.schedule=wsd; set optim.decay_steps to choose the final decay's length)")


def repeated(overrides: list[str]) -> list[str]:
    """A line for each key given more than once on the command line. Scripts layer overrides on purpose
    (a base set, then a change), so the last one applies, as in order; but it is said, never silent."""
    keys = [arg.partition("=")[0] for arg in overrides]
    out = []
    for k in dict.fromkeys(k for k in keys if keys.count(k) > 1):
        given = [a for a in overrides if a.partition("=")[0] == k]
        out.append(f"`{k}` is given {len(given)} times on the command line ({', '.join(given)}); the last one applies")
    return out


def _is_run_config(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.readline().decode("utf-8", "replace").startswith(RUN_CONFIG_MARK)


def absolute(p):
    """A local path made absolute against the working directory (`~` expanded); URLs and '' unchanged."""
    if not isinstance(p, str) or not p or "://" in p:  # a non-string is left for the data checks to name
        return p
    return os.path.abspath(os.path.expanduser(p))


# Keys only some settings read: (key, whether the rest of the config reads it, what does). Set away from
# its default where nothing reads it, a key is refused rather than ignored (a saved run's config is not
# checked: it resumes as it was).
UNREAD = (
    ("data.path", lambda c: c["data"]["source"] not in ("pydoc", "synthetic", "mixture"),
     "data.source text, jsonl, parquet or prepared (a mixture names a path per component)"),
    ("data.chat_template", lambda c: c["data"]["format"] != "text", "data.format chat, preference or prompt"),
    ("eval.path", lambda c: c["eval"]["every"] > 0, "eval.every > 0"),
    ("dpo.gamma", lambda c: c["objective"] == "dpo" and c["dpo"]["loss"] == "simpo", "objective=dpo with dpo.loss=simpo"),
)


def _refuse_unread(cfg: dict, schema: dict) -> None:
    for key, read, by in UNREAD:
        section, name = key.split(".")
        value = cfg[section][name]
        if value != schema[section][name] and not read(cfg):
            raise ConfigError(f"`{key}`={value!r} is read only with {by}; this config would ignore it: remove it "
                              f"or set what reads it")


def resolve_paths(cfg: dict) -> None:
    """Every path key made absolute, in place (validated config dict)."""
    cfg["run_dir"] = absolute(cfg["run_dir"])
    cfg["checkpoint"]["dir"] = absolute(cfg["checkpoint"]["dir"])
    init = cfg["init_from"]
    if init.startswith("hf:") and not init[3:].strip():  # else the working directory, "not a model directory"
        raise ConfigError("`init_from`=hf: names no directory; give the Hugging Face model's: init_from=hf:/path/to/model")
    cfg["init_from"] = "hf:" + absolute(init[3:]) if init.startswith("hf:") else absolute(init)
    d = cfg["data"]
    if d["tokenizer"] != "byte":
        d["tokenizer"] = absolute(d["tokenizer"])
    h = cfg["eval"]["harness"]  # task files and their directory, like data paths
    h["include"] = absolute(h["include"])
    h["tasks"] = [absolute(t) if t.endswith((".yaml", ".yml")) else t for t in h["tasks"]]
    for node in (d, cfg["eval"], *d["mixture"].values()):
        p = node.get("path")
        if isinstance(p, str):
            node["path"] = absolute(p)
        elif isinstance(p, list):
            node["path"] = [absolute(x) for x in p]


RENAMED = {"arrayrecord": "prepared"}  # values that changed name: said so, since a user's old config names them


def _choice(key: str, value: str, options: tuple) -> None:
    if value in RENAMED and RENAMED[value] in options:
        raise ConfigError(f"`{key}`: `{value}` is now called `{RENAMED[value]}` (it reads every directory made by "
                          f"maxlm.data.prepare, old ones too); set {key}={RENAMED[value]}")
    if value not in options:
        near = difflib.get_close_matches(value, options, n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise ConfigError(f"`{key}` must be one of {', '.join(options)}; got `{value}`{hint}")


def _positive(cfg: dict, *keys: str) -> None:
    for key in keys:
        node = cfg
        for part in key.split("."):
            node = node[part]
        if not node > 0:
            raise ConfigError(f"`{key}` must be > 0, got {node}")


def validate(cfg: dict, model_pending: bool = False) -> None:
    """Checks that need no devices. Mesh-vs-devices checks live in maxlm.mesh. `model_pending`: the model
    section is about to come from a Hugging Face checkpoint (init_from=hf:DIR), so the checks that depend on
    its family wait for it (convert.hf.with_hf_model validates the merged config whole)."""
    m, o = cfg["model"], cfg["optim"]
    _numbers_in_range(cfg)
    _choice("dtype", cfg["dtype"], DTYPES)
    _choice("remat", cfg["remat"], REMAT)
    _choice("quantization", cfg["quantization"], QUANTIZATION)
    _choice("attention", cfg["attention"], ATTENTION)
    _validate_optim(cfg)
    _choice("data.source", cfg["data"]["source"], SOURCES)
    _choice("resume", cfg["resume"], RESUME)
    _choice("nan_policy", cfg["nan_policy"], NAN_POLICIES)
    _positive(cfg, "steps", "global_batch_size", "microbatches", "pipeline_repeats", "seq_len", "log_every",
              "model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads", "model.n_kv_heads",
              "model.head_dim", "model.d_ff", "model.rope_theta", "model.norm_eps", "model.init_std", "optim.lr",
              "checkpoint.keep", "max_consecutive_skips")
    _validate_model(m)
    if not model_pending:
        _validate_family(cfg)
    if m["n_heads"] % m["n_kv_heads"]:
        raise ConfigError(f"`model.n_heads`={m['n_heads']} must be a multiple of `model.n_kv_heads`={m['n_kv_heads']}")
    if m["head_dim"] % 2:
        raise ConfigError(f"`model.head_dim`={m['head_dim']} must be even for RoPE")
    if cfg["global_batch_size"] % cfg["microbatches"]:
        raise ConfigError(f"`global_batch_size`={cfg['global_batch_size']} must be divisible by "
                          f"`microbatches`={cfg['microbatches']}")
    if not 0 <= o["min_lr_ratio"] <= 1:
        raise ConfigError(f"`optim.min_lr_ratio` must be in [0, 1], got {o['min_lr_ratio']}")
    for key, v in (("optim.warmup_steps", o["warmup_steps"]), ("optim.decay_steps", o["decay_steps"]),
                   ("optim.weight_decay", o["weight_decay"]), ("optim.grad_clip", o["grad_clip"]),
                   ("sample_tokens", cfg["sample_tokens"]), ("checkpoint.every", cfg["checkpoint"]["every"]),
                   ("checkpoint.keep_every", cfg["checkpoint"]["keep_every"]), ("data.epochs", cfg["data"]["epochs"]),
                   ("checkpoint.minutes", cfg["checkpoint"]["minutes"]),
                   ("watchdog_s", cfg["watchdog_s"])):
        if v < 0:
            raise ConfigError(f"`{key}` must be >= 0, got {v}")
    _validate_data(cfg["data"])
    _validate_eval(cfg)
    _validate_post_training(cfg)
    for ax in MESH_AXES:
        if cfg["mesh"][ax] == 0 or cfg["mesh"][ax] < -1:
            raise ConfigError(f"`mesh.{ax}` must be a positive size or -1 (fill), got {cfg['mesh'][ax]}")
    if cfg["mesh"]["stage"] == -1:  # before the count of fills: the default mesh.fsdp=-1 would be named instead
        raise ConfigError("`mesh.stage`=-1: give the pipeline's stage count explicitly (it must divide model.n_layers); "
                          "-1 fills only the axes that split the batch or the weights")
    fills = [ax for ax in MESH_AXES if cfg["mesh"][ax] == -1]
    if len(fills) > 1:
        raise ConfigError(f"at most one `mesh.*` axis may be -1, and {' and '.join(f'mesh.{a}' for a in fills)} are; "
                          f"give all but one a size")
    slices, data = cfg["mesh"]["slices"], cfg["mesh"]["data"]
    if slices < 1:
        raise ConfigError(f"`mesh.slices` must be >= 1, got {slices}")
    if data != -1 and data % slices and not _stage_spans(cfg["mesh"]):
        raise ConfigError(f"`mesh.data`={data} must be a multiple of `mesh.slices`={slices}: the data axis is the one "
                          f"that spans slices; set mesh.data={slices * max(1, data // slices)} or -1")
    _validate_stages(cfg)
    if cfg["compile_topology"] and not cfg["dry_run"]:
        raise ConfigError("`compile_topology` only compiles; add dry_run=true")
    _validate_rules(cfg["sharding_rules"])
    for key in ("optim.b1", "optim.b2"):
        if not 0 <= o[key[6:]] < 1:
            raise ConfigError(f"`{key}` must be in [0, 1), got {o[key[6:]]}")
    if not o["eps"] > 0:
        raise ConfigError(f"`optim.eps` must be > 0, got {o['eps']}")
    for key in ("seed", "data.seed"):
        v = cfg["seed"] if key == "seed" else cfg["data"]["seed"]
        if not 0 <= v < 2**63:
            raise ConfigError(f"`{key}` must be in 0..2**63-1, got {v}")
    t = cfg["tracking"]
    if not all(x in TRACKERS for x in t) or len(set(t)) < len(t):
        raise ConfigError(f"`tracking` must list each of {', '.join(TRACKERS)} at most once ([] for metrics.jsonl only), "
                          f"got {t}")
    p = cfg["profile_steps"]
    if p and not (len(p) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in p) and 1 <= p[0] <= p[1]):
        raise ConfigError(f"`profile_steps` must be [] or [first, last] step numbers with 1 <= first <= last, got {p}")
    if p and p[1] > cfg["steps"]:  # the trace is written after step `last`: a run that stops before writes none
        raise ConfigError(f"`profile_steps` {p} ends after the run's last step (steps={cfg['steps']}); profile steps "
                          f"within 1..{cfg['steps']}")
    if not cfg["run_dir"].strip():
        raise ConfigError("`run_dir` is empty; name the run's output directory, e.g. run_dir=runs/my_run")
    for key, v in (("run_dir", cfg["run_dir"]), ("checkpoint.dir", cfg["checkpoint"]["dir"])):
        if "://" in v and not v.startswith("gs://"):
            raise ConfigError(f"`{key}` {v}: maxlm writes to local paths and gs:// (Google Cloud Storage) only; "
                              f"use gs://BUCKET/PATH or a local or shared file system path")


def _numbers_in_range(d: dict, prefix: str = "") -> None:
    """No NaN or infinity in any float key, and every int fits int64 (jax, numpy and Orbax need it)."""
    for k, v in d.items():
        key = prefix + str(k)
        if isinstance(v, dict) and key not in FREE_KEYS:
            _numbers_in_range(v, key + ".")
        elif isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"`{key}` must be a finite number, got {v}")
        elif isinstance(v, int) and not isinstance(v, bool) and not -2**63 <= v < 2**63:
            raise ConfigError(f"`{key}`={v} is out of range (it must fit in 64 bits)")


def _validate_optim(cfg: dict) -> None:
    o, default_shape = cfg["optim"], _root_schema()["optim"]["decay_shape"]
    _choice("optim.name", o["name"], OPTIMIZERS)
    _choice("optim.schedule", o["schedule"], SCHEDULES)
    _choice("optim.decay_shape", o["decay_shape"], DECAY_SHAPES)
    if o["schedule"] != "wsd" and o["decay_shape"] != default_shape:
        raise ConfigError(f"`optim.decay_shape`={o['decay_shape']} applies to optim.schedule=wsd, and the schedule is "
                          f"{o['schedule']}; set optim.schedule=wsd or leave decay_shape out")
    if o["schedule"] == "wsd" and o["decay_steps"] <= 0:  # config.load chose one; a saved config holds it
        raise ConfigError(f"optim.schedule=wsd needs `optim.decay_steps` > 0, the length of its final decay "
                          f"(e.g. {max(1, cfg['steps'] // 10)}, a tenth of steps={cfg['steps']})")
    if o["schedule"] == "wsd" and o["warmup_steps"] + o["decay_steps"] > cfg["steps"]:
        raise ConfigError(f"optim.schedule=wsd: warmup_steps={o['warmup_steps']} + decay_steps={o['decay_steps']} "
                          f"exceed steps={cfg['steps']}, so the decay would begin before the warmup ends; shorten them "
                          f"or raise steps")
    # A run that ends within its warmup never reaches the cliff (short test runs pin decay_steps so); a
    # longer one, or the same run resumed with more steps, is refused here.
    if o["schedule"] == "cosine" and 0 < o["decay_steps"] <= o["warmup_steps"] < cfg["steps"]:
        raise ConfigError(f"optim.schedule=cosine: decay_steps={o['decay_steps']} must exceed warmup_steps="
                          f"{o['warmup_steps']} (decay_steps counts from step 0, warmup included), or the learning "
                          f"rate falls from lr to lr * min_lr_ratio in one step when the warmup ends; raise decay_steps "
                          f"(0: steps={cfg['steps']}) or shorten the warmup")
    if o["name"] == "muon" and cfg["lora"]["rank"]:
        raise ConfigError("optim.name=muon with lora.rank > 0: LoRA's adapters are low-rank factors, not the "
                          "weight matrices Muon orthogonalises; train them with optim.name=adamw")


def _stage_spans(mesh: dict) -> bool:
    """Whether the `stage` axis, not `data`, spans the slices (maxlm.mesh lays it out so)."""
    return mesh["slices"] > 1 and mesh["stage"] > 1 and mesh["stage"] % mesh["slices"] == 0


def _validate_stages(cfg: dict) -> None:
    """Pipeline parallelism (mesh.stage > 1, maxlm/schedules/pipeline.py): what the GPipe schedule runs, refused
    in one line otherwise. maxlm.mesh checks the layer count again against the resolved mesh."""
    S, R, m = cfg["mesh"]["stage"], cfg["pipeline_repeats"], cfg["model"]
    if S == 1:
        if R > 1:
            raise ConfigError(f"`pipeline_repeats`={R} needs pipeline stages: set mesh.stage > 1, or pipeline_repeats=1")
        return
    n, what = pipelined_layers(m)
    if n % S:
        raise ConfigError(f"{what} is not divisible by `mesh.stage`={S}: each stage runs n_layers/stage consecutive "
                          f"layers; choose a stage count that divides {n}")
    if n % (S * R):
        raise ConfigError(f"{what} is not divisible by mesh.stage x pipeline_repeats = {S} x {R}: each stage runs {R} "
                          f"chunks of n_layers/(stage x repeats) layers; choose pipeline_repeats dividing {n // S}")
    if R > 1 and cfg["microbatches"] < S:
        raise ConfigError(f"`pipeline_repeats`={R} with `microbatches`={cfg['microbatches']} < mesh.stage={S}: a "
                          f"microbatch must leave the last stage before it enters the first again; raise "
                          f"microbatches to at least {S}")
    rule = dict((r[0], r[1]) for r in cfg["sharding_rules"] if isinstance(r, list) and len(r) == 2).get("layers")
    if rule != "stage" and rule != ["stage"]:
        raise ConfigError(f"mesh.stage={S} needs the sharding rule [layers, stage] (got [layers, {rule}]): "
                          f"each stage holds its own layers")


def pipelined_layers(m) -> tuple[int, str]:
    """The layers pipeline stages split, and how to name them in a message: every layer but DeepSeek-V3's
    first dense ones (`model.dense_layers`), which run whole on every stage, as its MTP modules do."""
    n, k = m["n_layers"], m["dense_layers"]
    return n - k, (f"`model.n_layers` - `model.dense_layers` = {n} - {k} = {n - k} (the MoE layers the stages split)"
                   if k else f"`model.n_layers`={n}")


def _validate_rules(rules: list) -> None:
    """Each rule names a known logical axis, and each mesh axis at most once. A logical axis may have
    further rules, each naming fewer of its mesh axes than the one before: a fallback, for an array in
    which an earlier rule's mesh axes are taken (flax takes the first rule whose axes are all free)."""
    seen = {}
    for rule in rules:
        ok = isinstance(rule, list) and len(rule) == 2 and isinstance(rule[0], str)
        targets = rule[1] if ok and isinstance(rule[1], list) else [rule[1]] if ok else []
        if not ok or any(t is not None and t not in MESH_AXES for t in targets):
            raise ConfigError(f"sharding rule {rule} must be [logical_axis, mesh_axis | [mesh_axes...] | null] "
                              f"with mesh axes from {', '.join(MESH_AXES)}")
        if len(set(targets)) < len(targets):
            raise ConfigError(f"sharding rule {rule} names a mesh axis twice; a dimension can be split over each "
                              f"mesh axis once")
        if rule[0] not in LOGICAL_AXES:
            near = difflib.get_close_matches(rule[0], LOGICAL_AXES, n=1)
            hint = f"; did you mean `{near[0]}`?" if near else f"; the logical axes are {', '.join(LOGICAL_AXES)}"
            raise ConfigError(f"sharding rule {rule}: unknown logical axis `{rule[0]}`{hint}")
        if rule[0] in seen and not set(targets) - {None} < seen[rule[0]]:
            raise ConfigError(f"sharding rule {rule}: logical axis `{rule[0]}` already has a rule; keep one, or make "
                              f"this one a fallback that names fewer of the same mesh axes")
        seen[rule[0]] = set(targets) - {None}


def _validate_family(cfg: dict) -> None:
    """The checks that depend on the family, asked of its facts (maxlm/families.py), never its name."""
    m = cfg["model"]
    f = families.FAMILIES[m["family"]]
    if "L" in m["layer_pattern"] and not m["sliding_window"] and m["layer_pattern"] != f.layer_pattern:
        raise ConfigError(f"`model.layer_pattern`={m['layer_pattern']} has local layers but model.sliding_window=0; "
                          f"set the window, or drop the pattern")
    m["layer_pattern"] = m["layer_pattern"] or f.layer_pattern  # resolved here, so config.yml shows it
    if f.moe != (m["n_experts"] > 0):
        fix = "set model.n_experts > 0" if f.moe else f"model.family={m['family']} is dense; set model.n_experts=0"
        raise ConfigError(f"`model.n_experts`={m['n_experts']} does not fit model.family={m['family']}: {fix}")
    if not f.moe and any(m[k] for k in MOE_ONLY):
        key = next(k for k in MOE_ONLY if m[k])
        raise ConfigError(f"`model.{key}`={m[key]} applies to MoE models, and model.family={m['family']} is dense; "
                          f"remove it")
    if f.moe and not 0 < m["experts_per_token"] <= m["n_experts"]:
        raise ConfigError(f"`model.experts_per_token` must be in 1..n_experts={m['n_experts']}, got {m['experts_per_token']}")
    if not f.moe and m["router_scale"] != 1.0:
        raise ConfigError(f"`model.router_scale`={m['router_scale']} applies to MoE models, and model.family="
                          f"{m['family']} is dense; remove it")
    if not f.moe and m["expert_grad_dtype"] != "float32":
        raise ConfigError(f"`model.expert_grad_dtype`={m['expert_grad_dtype']} applies to MoE models, and model.family="
                          f"{m['family']} is dense; remove it")
    if not f.moe and m["grouped_gemm"] != "auto":
        raise ConfigError(f"`model.grouped_gemm`={m['grouped_gemm']} applies to MoE models, and model.family="
                          f"{m['family']} is dense; remove it")
    if f.moe:
        _validate_routing(m)
    if not m["swiglu_limit"] > 0 or (not f.clamped_glu and m["swiglu_limit"] != 7.0):
        raise ConfigError(f"`model.swiglu_limit`={m['swiglu_limit']}: " + (
            "it must be > 0" if f.clamped_glu else f"it clamps gpt_oss's gated unit, and model.family={m['family']} "
                                                   f"has no clamp; remove it"))
    _validate_mla(m, f)
    _validate_mtp(cfg)
    if f.position_table and cfg["seq_len"] > m["max_positions"]:
        raise ConfigError(f"`seq_len`={cfg['seq_len']} exceeds `model.max_positions`={m['max_positions']}, the rows of "
                          f"{m['family']}'s learned position table; lower seq_len (or, training from scratch, raise "
                          f"max_positions)")


def _validate_routing(m: dict) -> None:
    E, G, TG = m["n_experts"], m["router_groups"], m["router_topk_groups"]
    if not m["router_scale"] > 0:
        raise ConfigError(f"`model.router_scale` must be > 0, got {m['router_scale']}")
    if G:
        fits = [g for g in range(1, E // 2 + 1) if E % g == 0]
        _first_failing([
            (E % G == 0 and E // G >= 2, f"`model.router_groups`={G} needs n_experts={E} split into groups of >= 2 "
                                         f"experts: choose one of {', '.join(map(str, fits))}"),
            (0 < TG <= G, f"`model.router_topk_groups`={TG} must be in 1..router_groups={G} (the groups a token's "
                          f"experts are chosen from)"),
            (m["experts_per_token"] <= TG * (E // G),
             f"`model.experts_per_token`={m['experts_per_token']} is more than the {TG * (E // G)} experts in "
             f"router_topk_groups={TG} groups of {E // G}; raise router_topk_groups or lower experts_per_token"),
        ])
    if TG and not G:
        raise ConfigError(f"`model.router_topk_groups`={TG} needs model.router_groups; set both or neither")
    if m["dense_layers"]:
        _first_failing([
            (m["dense_layers"] < m["n_layers"], f"`model.dense_layers`={m['dense_layers']} needs fewer dense layers "
                                                f"than n_layers={m['n_layers']}"),
            (m["dense_d_ff"] > 0, f"`model.dense_layers`={m['dense_layers']} needs model.dense_d_ff > 0, the dense "
                                  f"layers' hidden width (got {m['dense_d_ff']})"),
        ])


def _validate_mtp(cfg: dict) -> None:
    """Multi-token prediction (deepseek_v3's modules; _validate_mla refuses them elsewhere)."""
    m = cfg["model"]
    w, n = m["mtp_weights"], m["mtp_depth"]
    if n < 0:
        raise ConfigError(f"`model.mtp_depth` must be >= 0, got {n}")
    if not (isinstance(w, list) and len(w) in (1, max(n, 1)) and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in w)):
        raise ConfigError(f"`model.mtp_weights` must be one weight >= 0 (each module gets it / mtp_depth) or one per "
                          f"module ({n}), e.g. [0.3]; got {w}")
    if n and cfg["mesh"]["context"] != 1:
        raise ConfigError("model.mtp_depth with mesh.context > 1: multi-token prediction does not run on the "
                          "context-parallel ring's zig-zag layout yet; set mesh.context=1 or model.mtp_depth=0")
    if n and cfg["objective"] != "lm":
        raise ConfigError(f"model.mtp_depth with objective={cfg['objective']}: multi-token prediction trains on the next "
                          f"tokens of text, not on preference pairs or rollouts; set model.mtp_depth=0")


def _validate_mla(m: dict, f) -> None:
    """deepseek_v3 attends through a latent (model.mla); no other family has one, or dense first layers."""
    a = m["mla"]
    if not f.mla:
        key = next((f"mla.{k}" for k in a if a[k]), "dense_layers" if m["dense_layers"] else
                   "mtp_depth" if m["mtp_depth"] else None)
        if key:
            raise ConfigError(f"`model.{key}` applies to deepseek_v3 (multi-head latent attention), not "
                              f"model.family={m['family']}; remove it")
        return
    _first_failing([
        (a["kv_rank"] > 0, f"`model.mla.kv_rank` must be > 0 for deepseek_v3 (the width of the latent keys and values "
                           f"are projected from), got {a['kv_rank']}"),
        (a["q_rank"] >= 0, f"`model.mla.q_rank` must be >= 0 (0: queries projected directly), got {a['q_rank']}"),
        (a["v_dim"] >= 0, f"`model.mla.v_dim` must be >= 0 (0: head_dim), got {a['v_dim']}"),
        (0 < a["rope_dim"] < m["head_dim"] and a["rope_dim"] % 2 == 0,
         f"`model.mla.rope_dim` must be even and in 1..head_dim-1 (head_dim={m['head_dim']}), got {a['rope_dim']}"),
    ])
    other = next((k for k in ("sliding_window", "layer_pattern", "local_rope_theta", "attn_softcap", "qk_norm",
                              "qkv_bias", "attn_sinks") if m[k]), None)
    if other:
        raise ConfigError(f"`model.{other}`={m[other]!r} is not part of deepseek_v3's latent attention; remove it")
    if m["n_kv_heads"] != m["n_heads"]:
        raise ConfigError(f"deepseek_v3 projects a key and a value for every head from its latent: set "
                          f"model.n_kv_heads={m['n_heads']} (= n_heads), got {m['n_kv_heads']}")


def _first_failing(checks) -> None:
    """Refuse with the line of the first condition that fails, so the line names that condition and the
    values it reads, not the whole section: `checks` is (holds, line) pairs, in the order they are read."""
    for holds, line in checks:
        if not holds:
            raise ConfigError(line)


def _validate_model(m: dict) -> None:
    _choice("model.family", m["family"], families.NAMES)
    _choice("model.rope_scaling.kind", m["rope_scaling"]["kind"], ROPE_SCALING)
    _choice("model.router_score", m["router_score"], ROUTER_SCORES)
    _choice("model.expert_grad_dtype", m["expert_grad_dtype"], EXPERT_GRAD_DTYPES)
    _choice("model.grouped_gemm", m["grouped_gemm"], GROUPED_GEMMS)
    for key in ("sliding_window", "attn_softcap", "final_softcap", "attn_scale", "n_experts", "router_aux_loss",
                *MOE_ONLY):
        if m[key] < 0:
            raise ConfigError(f"`model.{key}` must be >= 0, got {m[key]}")
    if m["ep_slack"] != 0 and not m["ep_slack"] >= 1:  # below 1 a balanced load would already drop
        raise ConfigError(f"`model.ep_slack` must be 0 (the worst case) or >= 1, got {m['ep_slack']}")
    if set(m["layer_pattern"]) - set("LG"):
        raise ConfigError(f"`model.layer_pattern` is a string of L (local) and G (global) layers, repeated over the "
                          f"layers, e.g. LG or LLLLLG; got {m['layer_pattern']!r}")
    if m["local_rope_theta"] < 0:
        raise ConfigError(f"`model.local_rope_theta` must be >= 0, got {m['local_rope_theta']}")
    if m["max_positions"] <= 0:
        raise ConfigError(f"`model.max_positions` must be > 0, got {m['max_positions']}")
    r, kind = m["rope_scaling"], m["rope_scaling"]["kind"]
    if kind == "none":
        return
    rs = "`model.rope_scaling"
    _first_failing([(r["factor"] >= 1, f"{rs}.factor` must be >= 1 for kind={kind}, got {r['factor']}")])
    if kind in ("llama3", "yarn"):
        _first_failing([(r["original_max_positions"] > 0, f"{rs}.original_max_positions` must be > 0 for kind={kind} "
                                                          f"(the context the model was trained at), got "
                                                          f"{r['original_max_positions']}")])
    if kind == "llama3":
        lo, hi = r["low_freq_factor"], r["high_freq_factor"]
        _first_failing([(0 < lo < hi, f"{rs}` (llama3) needs 0 < low_freq_factor < high_freq_factor; got "
                                      f"low_freq_factor={lo} and high_freq_factor={hi}")])
    if kind == "yarn":
        slow, fast = r["beta_slow"], r["beta_fast"]
        _first_failing([(0 < slow < fast, f"{rs}` (yarn) needs 0 < beta_slow < beta_fast; got beta_slow={slow} and "
                                          f"beta_fast={fast}")] +
                       [(r[k] >= 0, f"{rs}.{k}` must be >= 0 for kind=yarn, got {r[k]}")
                        for k in ("mscale", "mscale_all_dim", "attention_factor")])


def _weight_at(w, step: int) -> float:
    """A mixture component's weight at `step`: a number, or the stage {first step: weight} in force."""
    return float(w[str(max(int(k) for k in w if int(k) <= step))]) if isinstance(w, dict) else float(w)


def _validate_data(d: dict) -> None:
    if d["source"] == "mixture":
        if not d["mixture"]:
            raise ConfigError("data.source=mixture needs `data.mixture`: {name: {source, path, weight}, ...}")
        for i, m in d["mixture"].items():
            where = f"`data.mixture.{i}`"
            keys = ("source", "path", "field", "weight")
            if not isinstance(m, dict):
                raise ConfigError(f"{where} must be a mapping with keys source, path, field (optional), weight; got "
                                  f"{type(m).__name__} {m!r}")
            unknown = sorted(map(str, set(m) - set(keys)))
            if unknown:
                near = difflib.get_close_matches(unknown[0], keys, n=1)
                raise ConfigError(f"{where}: unknown key `{unknown[0]}`" + (f" (did you mean `{near[0]}`?)" if near else "")
                                  + "; a component is a mapping with keys source, path, field (optional), weight")
            if "source" not in m:
                raise ConfigError(f"{where} needs a `source` (one of {', '.join(s for s in SOURCES if s != 'mixture')})")
            _choice(f"data.mixture.{i}.source", m["source"], tuple(s for s in SOURCES if s != "mixture"))
            w = m.get("weight", 1.0)
            number = lambda x: not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)  # noqa: E731
            if isinstance(w, dict):  # stages: {first step: weight}
                step = lambda k: int(k) if isinstance(k, int) and not isinstance(k, bool) or str(k).isdigit() else -1  # noqa: E731
                if not w or 0 not in map(step, w) or not all(step(k) >= 0 and number(v) and v >= 0 for k, v in w.items()):
                    raise ConfigError(f"{where}.weight in stages must map steps (integers >= 0, step 0 among them) to "
                                      f"weights >= 0, e.g. {{0: 3, 10000: 1}}; got {w}")
                m["weight"] = {str(step(k)): float(v) for k, v in sorted(w.items(), key=lambda kv: step(kv[0]))}
            elif not number(w) or not w > 0:
                raise ConfigError(f"{where}.weight must be a number > 0, or stages {{step: weight}}; got {w}")
            if m["source"] not in ("pydoc", "synthetic") and not m.get("path"):
                raise ConfigError(f"{where} (source {m['source']}) needs a `path`")
        staged = [i for i, m in d["mixture"].items() if isinstance(m.get("weight"), dict)]
        if staged and d["epochs"] and all(m["source"] in ("pydoc", "synthetic", "prepared") for m in d["mixture"].values()):
            raise ConfigError(f"`data.mixture.{staged[0]}.weight` has stages, which start fresh epochs of a mixture of "
                              f"token sources, so data.epochs={d['epochs']} counts nothing; set data.epochs=0 and end "
                              f"the run with `steps`")
        steps = sorted({int(k) for m in d["mixture"].values() if isinstance(m.get("weight"), dict) for k in m["weight"]})
        for step in steps:
            at = [_weight_at(m.get("weight", 1.0), step) for m in d["mixture"].values()]
            if not sum(at) > 0:
                raise ConfigError(f"`data.mixture`: every weight is 0 from step {step}; give one component a weight > 0")
    elif d["mixture"]:
        raise ConfigError(f"`data.mixture` is set but data.source={d['source']}; set data.source=mixture")
    elif d["source"] not in ("pydoc", "synthetic") and not d["path"]:
        raise ConfigError(f"data.source={d['source']} needs `data.path` (a file, directory, glob or list)")
    for key in ("max_bad_records", "workers"):
        if d[key] < 0:
            raise ConfigError(f"`data.{key}` must be >= 0, got {d[key]}")


def _validate_post_training(cfg: dict) -> None:
    d, lora, dpo = cfg["data"], cfg["lora"], cfg["dpo"]
    _choice("objective", cfg["objective"], OBJECTIVES)
    _choice("data.format", d["format"], DATA_FORMATS)
    _choice("data.too_long", d["too_long"], TOO_LONG)
    _choice("dpo.loss", dpo["loss"], DPO_LOSSES)
    if (cfg["objective"] == "dpo") != (d["format"] == "preference"):
        raise ConfigError(f"objective={cfg['objective']} with data.format={d['format']}: DPO trains on preference pairs "
                          f"and preference pairs only train DPO; set both objective=dpo and data.format=preference, or neither")
    if (cfg["objective"] == "grpo") != (d["format"] == "prompt"):
        raise ConfigError(f"objective={cfg['objective']} with data.format={d['format']}: GRPO samples completions of prompt "
                          f"records and prompt records only feed GRPO; set both objective=grpo and data.format=prompt, or "
                          f"neither")
    if d["format"] == "prompt":
        _validate_rl(cfg)
    elif d["format"] != "text" and d["source"] not in ("jsonl", "prepared", "mixture"):
        raise ConfigError(f"data.format={d['format']} reads JSONL records (or data prepared from them); set "
                          f"data.source=jsonl or prepared (got {d['source']})")
    if d["format"] in ("chat", "preference") and d["tokenizer"] == "byte" and not d["chat_template"]:
        raise ConfigError(f"data.format={d['format']} with the byte tokenizer has no chat template to read; "
                          f"set data.chat_template (chatml, llama3 or a .jinja file)")
    _first_failing([(lora["rank"] >= 0, f"`lora.rank` must be >= 0 (0: off), got {lora['rank']}"),
                    (lora["alpha"] > 0, f"`lora.alpha` must be > 0, got {lora['alpha']}"),
                    (0 <= lora["dropout"] < 1, f"`lora.dropout` must be in [0, 1), got {lora['dropout']}")])
    if lora["rank"] and (not lora["targets"] or not all(isinstance(t, str) for t in lora["targets"])):
        raise ConfigError(f"`lora.targets` must name weights, e.g. [wq, wk, wv, wo]; got {lora['targets']}")
    twice = sorted({t for t in lora["targets"] if lora["targets"].count(t) > 1}, key=str)
    if twice:
        raise ConfigError(f"`lora.targets` names {twice[0]} twice; name each weight once")
    if lora["rank"] > cfg["model"]["d_model"]:  # a product of rank > d_model is no lower-rank than the weight
        raise ConfigError(f"`lora.rank`={lora['rank']} exceeds model.d_model={cfg['model']['d_model']}: the adapter "
                          f"would be no lower-rank than the weight; use a rank well below it (8-64 is usual)")
    if dpo["gamma"] < 0:
        raise ConfigError(f"`dpo.gamma` must be >= 0 (SimPO's target margin), got {dpo['gamma']}")
    if cfg["objective"] == "dpo" and cfg["eval"]["every"]:
        raise ConfigError("eval.every with objective=dpo: held-out DPO evaluation (rewards on held-out pairs) is not "
                          "built yet; set eval.every=0 and watch the training rewards in metrics.jsonl")
    if not dpo["beta"] > 0:
        raise ConfigError(f"`dpo.beta` must be > 0, got {dpo['beta']}")


def _validate_rl(cfg: dict) -> None:
    """objective=grpo: the rollout's shapes, the sampler, the update and the rewards (rl.*)."""
    r, d, B = cfg["rl"], cfg["data"], cfg["global_batch_size"]
    if d["source"] not in ("jsonl", "parquet"):  # prepared data holds tokens, not the fields rewards read
        raise ConfigError(f"data.format=prompt reads prompt records from JSONL or Parquet; set data.source=jsonl or "
                          f"parquet (got {d['source']})")
    _choice("rl.loss", r["loss"], RL_LOSSES)
    if r["group_size"] < 2 or B % r["group_size"]:
        raise ConfigError(f"`rl.group_size`={r['group_size']} must be >= 2 and divide global_batch_size={B}: every batch "
                          f"holds whole groups of completions of one prompt")
    _positive(cfg, "rl.max_prompt_tokens", "rl.max_new_tokens", "rl.updates_per_batch", "rl.reward_timeout_s")
    if r["beta"] > 0 and not cfg["init_from"]:
        raise ConfigError(f"`rl.beta`={r['beta']} keeps the policy near a reference, the model the run starts from, but "
                          f"without init_from the run starts from random weights; set init_from to the model to improve "
                          f"(a run directory, a checkpoint, or hf:DIR), or rl.beta=0")
    if r["dynamic_sampling"] < 0:
        raise ConfigError(f"`rl.dynamic_sampling` is the most extra sampling rounds a rollout may take (0: off); got "
                          f"{r['dynamic_sampling']}")
    need = r["max_prompt_tokens"] + r["max_new_tokens"] - 1
    if cfg["seq_len"] < need:
        raise ConfigError(f"`seq_len`={cfg['seq_len']} cannot hold a prompt and its completion: rl.max_prompt_tokens + "
                          f"rl.max_new_tokens - 1 = {need}; raise seq_len or lower them")
    if not r["temperature"] > 0:
        raise ConfigError(f"`rl.temperature` must be > 0 (a group of greedy completions would all be one), got {r['temperature']}")
    _first_failing([(r["top_k"] >= 0, f"`rl.top_k` must be >= 0 (0: off), got {r['top_k']}"),
                    (0 < r["top_p"] <= 1, f"`rl.top_p` must be in (0, 1], got {r['top_p']}"),
                    (0 <= r["eps_low"] < 1, f"`rl.eps_low` must be in [0, 1), got {r['eps_low']}"),
                    (r["eps_high"] >= 0, f"`rl.eps_high` must be >= 0, got {r['eps_high']}"),
                    (r["beta"] >= 0, f"`rl.beta` must be >= 0 (0: no reference), got {r['beta']}")])
    if not r["rewards"]:
        raise ConfigError("objective=grpo needs `rl.rewards`, e.g. {exact: {field: answer}} (docs/rl.md)")
    for name, e in r["rewards"].items():
        if e is None:
            r["rewards"][name] = e = {}
        if not isinstance(e, dict) or set(e) - set(REWARD_KEYS):
            bad = (f"unknown key `{sorted(map(str, set(e) - set(REWARD_KEYS)))[0]}`" if isinstance(e, dict)
                   else f"{type(e).__name__} {e!r}")
            raise ConfigError(f"`rl.rewards.{name}` must be a mapping of any of {', '.join(REWARD_KEYS)}; got {bad}")
        w = e.get("weight", 1.0)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ConfigError(f"`rl.rewards.{name}.weight` must be a finite number, got {w!r}")
        for key in ("reward", "field", "extract", "pattern"):
            if key in e and (not isinstance(e[key], str) or not e[key]):
                raise ConfigError(f"`rl.rewards.{name}.{key}` must be a non-empty string, got {e[key]!r}")
        kind = e.get("reward", name)
        reads = READS.get(kind, ("weight",))  # a module:function reads the record itself
        unread = sorted(set(e) - {"reward", *reads})
        if unread:
            raise ConfigError(f"`rl.rewards.{name}.{unread[0]}`: the {kind} reward does not read it (it reads "
                              f"{', '.join(reads)}); remove it")
        for key in ("extract", "pattern"):
            try:
                re.compile(e.get(key, ""))
            except re.error as x:
                raise ConfigError(f"`rl.rewards.{name}.{key}` {e[key]!r} is not a valid regular expression ({x})") from None
    if cfg["eval"]["every"]:
        raise ConfigError("eval.every with objective=grpo: held-out evaluation of the rewards is not built yet; set "
                          "eval.every=0 and watch the rewards in metrics.jsonl")
    if cfg["mesh"]["context"] > 1:
        raise ConfigError("objective=grpo with mesh.context > 1: the sampler does not run a context ring; split the "
                          "batch (mesh.fsdp, mesh.data) instead")


def eval_source(cfg) -> str:
    """The source of the held-out data: `eval.source`, or else `data.source`."""
    return cfg["eval"]["source"] or cfg["data"]["source"]


def _validate_eval(cfg: dict) -> None:
    e = cfg["eval"]
    _validate_harness(e["harness"])
    for key in ("every", "steps"):
        if e[key] < 0:
            raise ConfigError(f"`eval.{key}` must be >= 0, got {e[key]}")
    if e["source"]:
        _choice("eval.source", e["source"], tuple(s for s in SOURCES if s != "mixture"))
    if not e["every"]:
        return
    src = eval_source(cfg)
    if src == "mixture":
        raise ConfigError("eval with data.source=mixture needs one held-out source: set eval.source and eval.path "
                          "(e.g. eval.source=prepared eval.path=prep/heldout), or eval.source=pydoc")
    if src in ("pydoc", "synthetic"):
        if e["path"]:
            raise ConfigError(f"`eval.path` is not used with eval source {src}: it holds out its own documents; "
                              f"remove eval.path (or set eval.source to its format)")
    elif not e["path"]:
        raise ConfigError(f"eval.every={e['every']} with source {src} needs `eval.path`: held-out {src} data that "
                          f"training never reads (a file, directory, glob or list)")
    elif e["path"] == cfg["data"]["path"]:
        raise ConfigError("`eval.path` is `data.path`: evaluating on the training data measures nothing held out; "
                          "point eval.path at separate data")


def _validate_harness(h: dict) -> None:
    """eval.harness: lm_eval's own checks (installed, tasks known) wait for the run (maxlm.eval_harness.prepare),
    so that a saved config still loads where lm_eval is absent."""
    for key in ("every", "limit"):
        if h[key] < 0:
            raise ConfigError(f"`eval.harness.{key}` must be >= 0, got {h[key]}")
    if not all(isinstance(t, str) and t.strip() for t in h["tasks"]):
        raise ConfigError(f"`eval.harness.tasks` must be task names or task YAML files, e.g. [hellaswag], got {h['tasks']}")
    if h["every"] and not h["tasks"]:
        raise ConfigError(f"eval.harness.every={h['every']} needs `eval.harness.tasks`, e.g. eval.harness.tasks=[hellaswag]")
    if h["tasks"] and not h["every"]:
        raise ConfigError("`eval.harness.tasks` is set but eval.harness.every=0, so they would never run; set "
                          "eval.harness.every=N (or drop the tasks)")


def diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """`key old -> new` for every leaf that differs between two config dicts (as JSON would hold them)."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += diff(a, b, prefix + k + ".")
        elif a != b:
            out.append(f"{prefix}{k} {a!r} -> {b!r}")
    return out


def from_saved(saved: dict, where: str, log=None) -> ml_collections.FrozenConfigDict:
    """The config a run saved (checkpoint metadata), laid over today's base.yml and validated: the one
    way a saved config is reloaded (resume, from_pretrained, to_hf). A key the saved config lacks was
    added since: it takes today's default, and `log` (if given) says so. A key that no longer exists is
    an error naming it: silently dropping it could change what the run means."""
    schema = _root_schema()
    cfg = yaml.load(yaml.safe_dump(schema), Loader=_Loader)
    if not isinstance(saved, dict):
        raise ConfigError(f"{where}: the saved config is a {type(saved).__name__}, not a mapping; the metadata is damaged")
    for key in _flat_keys(saved):
        if not _known(schema, key):
            raise ConfigError(f"{where}: the saved config has `{key}`, which this version of maxlm does not know (it "
                              f"was removed or renamed); load it with the maxlm version that wrote it")
    _merge(schema, cfg, saved, "", where)
    added = [k for k in _flat_keys(schema, leaves=True) if not _known(saved, k)]
    ruled = {r[0] for r in cfg["sharding_rules"] if isinstance(r, list) and r}
    for rule in schema["sharding_rules"]:  # a logical axis added since: its default rule
        if rule[0] not in ruled:
            cfg["sharding_rules"].append(rule)
            added.append(f"sharding_rules: [{rule[0]}, ...]")
    if added and log is not None:
        log(f"{where}: the saved config predates {', '.join(f'`{k}`' for k in added)}; today's default"
            f"{'s apply' if len(added) > 1 else ' applies'}")
    validate(cfg)
    resolve_paths(cfg)
    return ml_collections.FrozenConfigDict(cfg)


def replace(cfg, changes: dict) -> ml_collections.FrozenConfigDict:
    """`cfg` with `changes` (a nested dict of keys that exist) applied, validated: how code derives one
    config from another (the eval loader's, an HF checkpoint's) instead of editing dicts by hand."""
    schema = _root_schema()
    d = to_dict(cfg)
    _merge(schema, d, changes, "", "a derived config")
    validate(d)
    resolve_paths(d)
    return ml_collections.FrozenConfigDict(d)


def _known(tree: dict, key: str) -> bool:
    """Whether dotted `key` exists in `tree`; anything under a free-form key counts as known."""
    node, prefix = tree, ""
    for part in key.split("."):
        if prefix.rstrip(".") in FREE_KEYS:
            return True
        if not isinstance(node, dict) or part not in node:
            return False
        node, prefix = node[part], prefix + part + "."
    return True


def to_dict(cfg: ml_collections.FrozenConfigDict) -> dict:
    return ml_collections.ConfigDict(cfg).to_dict()


def to_yaml(cfg: ml_collections.FrozenConfigDict) -> str:
    # ConfigDict.to_yaml() emits python tags safe_load cannot read; dump the plain dict instead.
    d = to_dict(cfg)
    rules = d.pop("sharding_rules")
    body = yaml.safe_dump(d, sort_keys=False, default_flow_style=False)
    return body + "sharding_rules:\n" + "".join(f"  - {yaml.safe_dump(r, default_flow_style=True).strip()}\n" for r in rules)
