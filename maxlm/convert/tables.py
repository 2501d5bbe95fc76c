"""The pieces the per-family adapters (maxlm/convert/adapters/) build their Hugging Face tables from;
`maxlm.convert.hf` does the I/O.

An adapter lists its checkpoint as `Tensor`s: one HF tensor name (with `{i}` for the layer and
`{j}` for the expert) and the maxlm parameters it fills, with the two conversions between one HF
tensor and one layer's (or expert's) slice of those parameters.
"""

import functools
import math
from typing import Callable, NamedTuple

from maxlm.errors import ConfigError


class Tensor(NamedTuple):
    hf: str                  # HF tensor name; {i} is the layer, {j} the expert
    paths: tuple[str, ...]   # maxlm parameters it fills, "/"-separated ("layers/wq")
    to_maxlm: Callable       # (hf_array, shapes of one slice per path) -> one array per path
    to_hf: Callable          # (one array per path) -> hf_array
    layers: tuple[int, int] | None = None  # (first HF layer, count) a stack holds; None: all n_layers


def in_layers(tensors: list[Tensor], first: int, count: int) -> list[Tensor]:
    """`tensors` for a stack that holds HF layers first .. first + count - 1 (its own layer 0 is `first`)."""
    return [t._replace(layers=(first, count)) for t in tensors]


def linear(path: str, hf: str, n_in: int = 1) -> Tensor:
    """torch nn.Linear stores [out, in]; maxlm keeps [in..., out...] (its first `n_in` axes are inputs)."""
    return Tensor(hf, (path,), lambda w, shapes: (w.T.reshape(shapes[0]),),
                  lambda x: x.reshape(math.prod(x.shape[:n_in]), -1).T)


def copy(path: str, hf: str) -> Tensor:
    return Tensor(hf, (path,), lambda w, shapes: (w.reshape(shapes[0]),), lambda x: x)


def flat(path: str, hf: str) -> Tensor:
    """A bias HF keeps flat ([H * Dh]) and maxlm per head ([H, Dh])."""
    return Tensor(hf, (path,), lambda w, shapes: (w.reshape(shapes[0]),), lambda x: x.reshape(-1))


def unsupported(field: str, value, fix: str = "") -> ConfigError:
    return ConfigError(f"config.json: `{field}`={value!r} is not supported by maxlm{'; ' + fix if fix else ''}")


# Model keys any maxlm family may set that most Hugging Face architectures have no field for.
OPTIONS = ("sliding_window", "attn_softcap", "final_softcap", "attn_scale", "qk_norm", "qkv_bias", "layer_pattern",
           "local_rope_theta", "attn_sinks")


def refuse_options(m, fixed: dict, reason) -> None:
    """Refuse to export a model whose config.json cannot say it: transformers would load it as a
    different model. `fixed` maps model keys to the one value the HF architecture has (an `attn_scale`
    equal to the default head_dim^-0.5 is that default); `reason(key, want)` ends the one-line error."""
    for key, want in fixed.items():
        v = getattr(m, key)
        if (v or 0) != (want or 0) and not (key == "attn_scale" and v == m.head_dim ** -0.5):  # "" and 0 are off
            raise ConfigError(f"model.{key}={v!r} cannot be exported{reason(key, want)}")


def refuse_absent(m, arch: str, fields=OPTIONS) -> None:
    """Refuse `fields` set to anything but off: `arch` has no such option."""
    refuse_options(m, dict.fromkeys(fields, 0), lambda key, want: f": {arch} has no such option")


def require(hf: dict, field: str, allowed, default=None) -> None:
    """Refuse a config value maxlm would otherwise silently compute differently."""
    v = hf.get(field, default)
    if v not in allowed:
        raise unsupported(field, v, f"expected {' or '.join(repr(a) for a in allowed)}")


def number(c: dict, name: str, default, want: str, ok=lambda v: True, integer: bool = False, where: str = "",
           required: bool = False):
    """A numeric config.json field: absent or null is `default` (a KeyError if `required`); anything else
    must be a finite number (a whole one if `integer`) for which `ok` holds, or it is refused naming the
    field and `want`. Never `c.get(name) or default`, which turns a present 0 into the default."""
    v = c.get(name)
    if v is None:
        if required and name in c:
            raise unsupported(where + name, v, f"expected {want}")
        if required:
            raise KeyError(where + name)
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v) or \
            integer and not float(v).is_integer():
        raise unsupported(where + name, v, f"expected {want}" + ("" if required else ", or leave it out"))
    return int(v) if integer else v


def _rope_params(params: dict, max_positions: int, where: str) -> dict:
    """maxlm's rope_scaling from one HF rope parameter dict (rope_type and its fields), refusing a value
    that maxlm's own key would refuse; `where` names the dict in config.json."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"kind": "none"}
    if kind not in ("linear", "llama3", "yarn"):
        raise unsupported(where + "rope_type", kind, "maxlm implements default, linear, llama3 and yarn RoPE")
    field = functools.partial(number, params, where=where)
    required = lambda name, want, ok: float(field(name, None, want, ok, required=True))  # noqa: E731
    original = field("original_max_position_embeddings", max_positions, "a positive integer", lambda v: v > 0,
                     integer=True)
    if kind == "linear":
        return {"kind": "linear", "factor": required("factor", "a number >= 1", lambda v: v >= 1)}
    if kind == "llama3":
        low = required("low_freq_factor", "a number > 0", lambda v: v > 0)
        return {"kind": "llama3", "factor": required("factor", "a number >= 1", lambda v: v >= 1),
                "low_freq_factor": low,
                "high_freq_factor": required("high_freq_factor", f"a number > low_freq_factor={low}", lambda v: v > low),
                "original_max_positions": original}
    # yarn: transformers' defaults for what a config leaves out (null included); DeepSeek's factor may be
    # implied by the two context lengths
    factor = field("factor", None, "a number >= 1", lambda v: v >= 1)
    if factor is None:
        factor = max_positions / original
        if factor < 1:
            raise unsupported(where + "factor", None, f"the factor it implies, max_position_embeddings / "
                              f"original_max_position_embeddings = {max_positions}/{original}, is below 1; set it")
    slow = field("beta_slow", 1, "a number > 0", lambda v: v > 0)
    fast = field("beta_fast", 32, f"a number > beta_slow={slow}", lambda v: v > slow)
    if not slow < fast:  # beta_fast left out (32) with a beta_slow above it
        raise unsupported(where + "beta_slow", slow, f"expected a number below beta_fast={fast}")
    return {"kind": "yarn", "factor": float(factor), "original_max_positions": original,
            "beta_fast": float(fast), "beta_slow": float(slow), "truncate": flag(params, "truncate", True, where),
            "mscale": float(field("mscale", 0, "a number >= 0", lambda v: v >= 0)),
            "mscale_all_dim": float(field("mscale_all_dim", 0, "a number >= 0", lambda v: v >= 0)),
            # transformers multiplies sin and cos by a present attention_factor, 0 included; maxlm's 0 derives it
            "attention_factor": float(field("attention_factor", 0, "a number > 0", lambda v: v > 0))}


LAYER_KINDS = {"sliding_attention": "L", "full_attention": "G"}


def layer_pattern(types, n: int, field: str = "layer_types") -> str:
    """HF's per-layer `layer_types` (its first `n`, the model's layers) as model.layer_pattern: the shortest
    cycle that repeats into it (the whole list when none is shorter)."""
    if not isinstance(types, list) or len(types) < n or any(t not in LAYER_KINDS for t in types):
        raise unsupported(field, types, f"expected a list of sliding_attention and full_attention, one per layer "
                                        f"(num_hidden_layers={n})")
    types = types[:n]
    s = "".join(LAYER_KINDS[t] for t in types)
    return next((s[:p] for p in range(1, len(s) + 1) if all(s[i] == s[i % p] for i in range(len(s)))), s)


def layer_types(m) -> list[str]:
    """model.layer_pattern (or the uniform window) as HF's per-layer `layer_types`."""
    kinds = {v: k for k, v in LAYER_KINDS.items()}
    pattern = m.layer_pattern or ("L" if m.sliding_window else "G")
    return [kinds[pattern[i % len(pattern)]] for i in range(m.n_layers)]


def rope_from_hf(hf: dict, params: dict | None = None, where: str = "rope_parameters.") -> dict:
    """RoPE base and scaling from either config.json layout: the current `rope_parameters`, or the older
    top-level `rope_theta` with `rope_scaling`. `params` picks one dict of a per-layer-type layout (`where`
    names it in config.json)."""
    if params is None:
        for name in ("rope_parameters", "rope_scaling"):
            if hf.get(name) is not None and not isinstance(hf[name], dict):
                raise unsupported(name, hf[name], "expected a JSON object, or null")
        # an empty rope_parameters says nothing, as transformers reads it too (`rope_scaling or rope_parameters`)
        both = hf.get("rope_parameters"), hf.get("rope_scaling")
        if all(both) and {k: v for k, v in both[0].items() if k != "rope_theta"} != both[1]:
            raise unsupported("rope_scaling", both[1], f"it differs from rope_parameters={both[0]} and transformers "
                              f"versions read one or the other; keep one")
        if hf.get("rope_parameters"):
            params = hf["rope_parameters"]
        else:
            params, where = dict(hf.get("rope_scaling") or {}), "rope_scaling."
    theta = number(hf, "rope_theta", 10000.0, "a number > 0", lambda v: v > 0)
    theta = number(params, "rope_theta", theta, "a number > 0", lambda v: v > 0, where=where)
    for d, at in ((hf, ""), (params, where)):
        number(d, "partial_rotary_factor", 1.0, "1.0 (maxlm rotates every dimension of a head)", lambda v: v == 1,
               where=at)
    max_positions = number(hf, "max_position_embeddings", 8192, "a positive integer", lambda v: v > 0, integer=True)
    return {"rope_theta": float(theta), "rope_scaling": _rope_params(params, max_positions, where)}


def rope_scaling_to_hf(r) -> dict | None:
    """HF's rope_scaling dict for maxlm's `model.rope_scaling` (None: plain RoPE)."""
    if r.kind == "linear":
        return {"rope_type": "linear", "factor": r.factor}
    if r.kind == "llama3":
        return {"rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                "high_freq_factor": r.high_freq_factor, "original_max_position_embeddings": r.original_max_positions}
    if r.kind == "yarn":
        out = {"rope_type": "yarn", "factor": r.factor, "original_max_position_embeddings": r.original_max_positions,
               "beta_fast": r.beta_fast, "beta_slow": r.beta_slow, "truncate": r.truncate}
        return out | {k: getattr(r, k) for k in ("mscale", "mscale_all_dim", "attention_factor") if getattr(r, k)}
    return None


def rope_to_hf(m) -> dict:
    """The older layout (top-level rope_theta, rope_scaling): every transformers version reads it."""
    return {"rope_theta": m.rope_theta, "rope_scaling": rope_scaling_to_hf(m.rope_scaling)}


def common_from_hf(hf: dict, tie_default: bool, norm_eps_field: str = "rms_norm_eps",
                   head_dim: int | None = None) -> dict:
    """The fields every family shares, under their usual HF names, each checked where it is read (a null or
    a string is named as the config.json field it is, never as the model key it would become). `head_dim`
    is the config class's default (None: hidden_size / num_attention_heads)."""
    positive = functools.partial(number, hf, want="a positive integer", ok=lambda v: v > 0, integer=True)
    D, H = positive("hidden_size", None, required=True), positive("num_attention_heads", None, required=True)
    return {"vocab_size": positive("vocab_size", None, required=True), "d_model": D,
            "n_layers": positive("num_hidden_layers", None, required=True), "n_heads": H,
            "n_kv_heads": positive("num_key_value_heads", H), "head_dim": positive("head_dim", head_dim or D // H),
            "d_ff": positive("intermediate_size", None, required=True),
            "norm_eps": float(number(hf, norm_eps_field, None, "a number > 0", lambda v: v > 0, required=True)),
            "max_positions": positive("max_position_embeddings", 8192),
            "tie_embeddings": flag(hf, "tie_word_embeddings", tie_default)}


def flag(c: dict, name: str, default: bool, where: str = "") -> bool:
    """A boolean config.json field: absent or null is `default`; anything but true or false (the string
    "false" is truthy to Python) is refused naming the field."""
    v = c.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise unsupported(where + name, v, "expected true or false")
    return v


def common_to_hf(m, norm_eps_field: str = "rms_norm_eps") -> dict:
    return {"vocab_size": m.vocab_size, "hidden_size": m.d_model, "num_hidden_layers": m.n_layers,
            "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads, "head_dim": m.head_dim,
            "intermediate_size": m.d_ff, norm_eps_field: m.norm_eps, "max_position_embeddings": m.max_positions,
            "tie_word_embeddings": m.tie_embeddings}


def attention_tensors(prefix: str, m) -> list[Tensor]:
    """q/k/v/o projections (and Qwen2's q/k/v biases, Qwen3's q/k norms) under `prefix` =
    "model.layers.{i}.self_attn"."""
    out = [linear("layers/wq", f"{prefix}.q_proj.weight"), linear("layers/wk", f"{prefix}.k_proj.weight"),
           linear("layers/wv", f"{prefix}.v_proj.weight"), linear("layers/wo", f"{prefix}.o_proj.weight", n_in=2)]
    if m.qkv_bias:
        out += [flat(f"layers/b{x}", f"{prefix}.{x}_proj.bias") for x in "qkv"]
    if m.qk_norm:
        out += [copy("layers/q_norm", f"{prefix}.q_norm.weight"), copy("layers/k_norm", f"{prefix}.k_norm.weight")]
    return out


def embedding_tensors(m, final_norm: str = "model.norm.weight") -> list[Tensor]:
    out = [copy("embed", "model.embed_tokens.weight"), copy("final_norm", final_norm)]
    if not m.tie_embeddings:
        out.append(linear("unembed", "lm_head.weight"))
    return out
