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


def linear(path: str, hf: str, n_in: int = 1) -> Tensor:
    """torch nn.Linear stores [out, in]; maxlm keeps [in..., out...] (its first `n_in` axes are inputs)."""
    return Tensor(hf, (path,), lambda w, shapes: (w.T.reshape(shapes[0]),),
                  lambda x: x.reshape(math.prod(x.shape[:n_in]), -1).T)


def copy(path: str, hf: str) -> Tensor:
    return Tensor(hf, (path,), lambda w, shapes: (w.reshape(shapes[0]),), lambda x: x)


def unsupported(field: str, value, fix: str = "") -> ConfigError:
    return ConfigError(f"config.json: `{field}`={value!r} is not supported by maxlm{'; ' + fix if fix else ''}")


# Model keys any maxlm family may set that most Hugging Face architectures have no field for.
OPTIONS = ("sliding_window", "attn_softcap", "final_softcap", "attn_scale", "qk_norm")


def refuse_options(m, fixed: dict, reason) -> None:
    """Refuse to export a model whose config.json cannot say it: transformers would load it as a
    different model. `fixed` maps model keys to the one value the HF architecture has (an `attn_scale`
    equal to the default head_dim^-0.5 is that default); `reason(key, want)` ends the one-line error."""
    for key, want in fixed.items():
        v = getattr(m, key)
        if v != want and not (key == "attn_scale" and v == m.head_dim ** -0.5):
            raise ConfigError(f"model.{key}={v!r} cannot be exported{reason(key, want)}")


def refuse_absent(m, arch: str, fields=OPTIONS) -> None:
    """Refuse `fields` set to anything but off: `arch` has no such option."""
    refuse_options(m, dict.fromkeys(fields, 0), lambda key, want: f": {arch} has no such option")


def require(hf: dict, field: str, allowed, default=None) -> None:
    """Refuse a config value maxlm would otherwise silently compute differently."""
    v = hf.get(field, default)
    if v not in allowed:
        raise unsupported(field, v, f"expected {' or '.join(repr(a) for a in allowed)}")


def rope_from_hf(hf: dict) -> dict:
    """RoPE base and scaling from either config.json layout: the current `rope_parameters`, or the older
    top-level `rope_theta` with `rope_scaling`."""
    params = hf.get("rope_parameters") or dict(hf.get("rope_scaling") or {}, rope_theta=hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    out = {"rope_theta": float(params.get("rope_theta", 10000.0)), "rope_scaling": {"kind": "none"}}
    if kind == "llama3":
        out["rope_scaling"] = {"kind": "llama3", "factor": float(params["factor"]),
                               "low_freq_factor": float(params["low_freq_factor"]),
                               "high_freq_factor": float(params["high_freq_factor"]),
                               "original_max_positions": int(params["original_max_position_embeddings"])}
    elif kind != "default":
        raise unsupported("rope_scaling.rope_type", kind, "maxlm implements default and llama3 RoPE")
    return out


def rope_to_hf(m) -> dict:
    """The older layout (top-level rope_theta, rope_scaling): every transformers version reads it."""
    out = {"rope_theta": m.rope_theta, "rope_scaling": None}
    r = m.rope_scaling
    if r.kind == "llama3":
        out["rope_scaling"] = {"rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                               "high_freq_factor": r.high_freq_factor,
                               "original_max_position_embeddings": r.original_max_positions}
    return out


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
    """q/k/v/o projections (and Qwen3's q/k norms) under `prefix` = "model.layers.{i}.self_attn"."""
    out = [linear("layers/wq", f"{prefix}.q_proj.weight"), linear("layers/wk", f"{prefix}.k_proj.weight"),
           linear("layers/wv", f"{prefix}.v_proj.weight"), linear("layers/wo", f"{prefix}.o_proj.weight", n_in=2)]
    if m.qk_norm:
        out += [copy("layers/q_norm", f"{prefix}.q_norm.weight"), copy("layers/k_norm", f"{prefix}.k_norm.weight")]
    return out


def embedding_tensors(m, final_norm: str = "model.norm.weight") -> list[Tensor]:
    out = [copy("embed", "model.embed_tokens.weight"), copy("final_norm", final_norm)]
    if not m.tie_embeddings:
        out.append(linear("unembed", "lm_head.weight"))
    return out
