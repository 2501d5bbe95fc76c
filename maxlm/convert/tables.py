"""The pieces the per-family adapters (maxlm/convert/adapters/) build their Hugging Face tables from;
`maxlm.convert.hf` does the I/O.

An adapter lists its checkpoint as `Tensor`s: one HF tensor name (with `{i}` for the layer and
`{j}` for the expert) and the maxlm parameters it fills, with the two conversions between one HF
tensor and one layer's (or expert's) slice of those parameters.
"""

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


def _rope_params(params: dict, max_positions: int) -> dict:
    """maxlm's rope_scaling from one HF rope parameter dict (rope_type and its fields)."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"kind": "none"}
    original = int(params.get("original_max_position_embeddings") or max_positions)
    if kind == "linear":
        return {"kind": "linear", "factor": float(params["factor"])}
    if kind == "llama3":
        return {"kind": "llama3", "factor": float(params["factor"]), "low_freq_factor": float(params["low_freq_factor"]),
                "high_freq_factor": float(params["high_freq_factor"]), "original_max_positions": original}
    if kind == "yarn":  # transformers' defaults for what a config leaves out; DeepSeek's factor may be implied
        factor = params.get("factor") or max_positions / original
        return {"kind": "yarn", "factor": float(factor), "original_max_positions": original,
                "beta_fast": float(params.get("beta_fast") or 32), "beta_slow": float(params.get("beta_slow") or 1),
                "truncate": bool(params.get("truncate", True)), "mscale": float(params.get("mscale") or 0),
                "mscale_all_dim": float(params.get("mscale_all_dim") or 0),
                "attention_factor": float(params.get("attention_factor") or 0)}
    raise unsupported("rope_scaling.rope_type", kind, "maxlm implements default, linear, llama3 and yarn RoPE")


LAYER_KINDS = {"sliding_attention": "L", "full_attention": "G"}


def layer_pattern(types, field: str = "layer_types") -> str:
    """HF's per-layer `layer_types` as model.layer_pattern: the shortest cycle that repeats into it (the
    whole list when none is shorter)."""
    if not isinstance(types, list) or any(t not in LAYER_KINDS for t in types):
        raise unsupported(field, types, "expected a list of sliding_attention and full_attention")
    s = "".join(LAYER_KINDS[t] for t in types)
    return next(s[:p] for p in range(1, len(s) + 1) if all(s[i] == s[i % p] for i in range(len(s))))


def layer_types(m) -> list[str]:
    """model.layer_pattern (or the uniform window) as HF's per-layer `layer_types`."""
    kinds = {v: k for k, v in LAYER_KINDS.items()}
    pattern = m.layer_pattern or ("L" if m.sliding_window else "G")
    return [kinds[pattern[i % len(pattern)]] for i in range(m.n_layers)]


def rope_from_hf(hf: dict, params: dict | None = None) -> dict:
    """RoPE base and scaling from either config.json layout: the current `rope_parameters`, or the older
    top-level `rope_theta` with `rope_scaling`. `params` picks one dict of a per-layer-type layout."""
    params = params or hf.get("rope_parameters") or dict(hf.get("rope_scaling") or {},
                                                         rope_theta=hf.get("rope_theta", 10000.0))
    return {"rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 10000.0))),
            "rope_scaling": _rope_params(params, hf.get("max_position_embeddings", 8192))}


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


def common_from_hf(hf: dict, tie_default: bool, norm_eps_field: str = "rms_norm_eps") -> dict:
    """The fields every family shares, under their usual HF names."""
    D, H = hf["hidden_size"], hf["num_attention_heads"]
    return {"vocab_size": hf["vocab_size"], "d_model": D, "n_layers": hf["num_hidden_layers"], "n_heads": H,
            "n_kv_heads": hf.get("num_key_value_heads") or H, "head_dim": hf.get("head_dim") or D // H,
            "d_ff": hf["intermediate_size"], "norm_eps": float(hf[norm_eps_field]),
            "max_positions": hf.get("max_position_embeddings", 8192),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", tie_default))}


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
