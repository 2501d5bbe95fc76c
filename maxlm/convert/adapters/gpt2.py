"""GPT-2 <-> GPT2LMHeadModel: Conv1D weights ([in, out]) and a fused q/k/v projection."""

import math

import numpy as np

from maxlm.errors import ConfigError
from maxlm.convert import tables as T

HF_ARCHITECTURES = {"GPT2LMHeadModel": "gpt2"}
HF_PREFIX = "transformer."  # missing from the hub's GPT-2 files, saved from GPT2Model; convert.hf adds it


def config_from_hf(c: dict) -> dict:
    T.require(c, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new")
    T.require(c, "scale_attn_weights", (True,), True)
    T.require(c, "scale_attn_by_inverse_layer_idx", (False,), False)
    T.require(c, "add_cross_attention", (False,), False)
    # reorder_and_upcast_attn only reorders and upcasts the score math, which maxlm does in float32 anyway.
    get = lambda name, alias: c[name] if name in c else c[alias]  # noqa: E731  (config.json may use either)
    D, H = get("n_embd", "hidden_size"), get("n_head", "num_attention_heads")
    if isinstance(H, bool) or not isinstance(H, int) or H <= 0:
        raise T.unsupported("n_head", H, "expected a positive integer")
    if D % H:
        raise T.unsupported("n_embd", D, f"must be a multiple of n_head={H}")
    return {"vocab_size": T.number(c, "vocab_size", None, "a positive integer", lambda v: v > 0, integer=True,
                                   required=True), "d_model": D, "n_layers": get("n_layer", "num_hidden_layers"),
            "n_heads": H, "n_kv_heads": H, "head_dim": D // H,
            "d_ff": T.number(c, "n_inner", 4 * D, "a positive integer", lambda v: v > 0, integer=True),
            "norm_eps": float(T.number(c, "layer_norm_epsilon", 1e-5, "a number > 0", lambda v: v > 0)),
            "max_positions": get("n_positions", "max_position_embeddings"),
            "tie_embeddings": T.flag(c, "tie_word_embeddings", True)}


def config_to_hf(m) -> dict:
    if m.n_kv_heads != m.n_heads or m.n_heads * m.head_dim != m.d_model:
        raise ConfigError(f"a gpt2 model exports to GPT2LMHeadModel only with n_kv_heads = n_heads and n_heads * "
                          f"head_dim = d_model; got {m.n_kv_heads}, {m.n_heads}, {m.head_dim}, {m.d_model}")
    T.refuse_absent(m, "GPT2LMHeadModel")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m.vocab_size,
            "n_embd": m.d_model, "n_layer": m.n_layers, "n_head": m.n_heads, "n_inner": m.d_ff,
            "n_positions": m.max_positions, "layer_norm_epsilon": m.norm_eps, "activation_function": "gelu_new",
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": m.tie_embeddings}


def conv1d(path: str, name: str, n_in: int) -> T.Tensor:
    """GPT-2's Conv1D stores [in, out], maxlm's own order: only the grouping of axes differs."""
    return T.Tensor(name, (path,), lambda w, shapes: (w.reshape(shapes[0]),),
                     lambda x: x.reshape(math.prod(x.shape[:n_in]), -1))


def fused_qkv(kind: str, name: str, n_in: int) -> T.Tensor:
    """c_attn: q, k and v side by side on the output (last) axis; `kind` "w" for the weight [D, 3D],
    "b" for the bias [3D]."""
    paths = tuple(f"layers/{kind}{x}" for x in "qkv")

    def to_maxlm(w, shapes):
        sizes = np.cumsum([math.prod(s[n_in:]) for s in shapes])[:-1]
        return tuple(part.reshape(s) for part, s in zip(np.split(w, sizes, axis=-1), shapes))
    return T.Tensor(name, paths, to_maxlm,
                     lambda *xs: np.concatenate([x.reshape(*x.shape[:n_in], -1) for x in xs], axis=-1))


def hf_tensors(m) -> list[T.Tensor]:
    h = "transformer.h.{i}"
    out = [T.copy("embed", "transformer.wte.weight"), T.copy("positions", "transformer.wpe.weight"),
           T.copy("final_norm", "transformer.ln_f.weight"), T.copy("final_norm_bias", "transformer.ln_f.bias"),
           T.copy("layers/attn_norm", f"{h}.ln_1.weight"), T.copy("layers/attn_norm_bias", f"{h}.ln_1.bias"),
           fused_qkv("w", f"{h}.attn.c_attn.weight", 1), fused_qkv("b", f"{h}.attn.c_attn.bias", 0),
           conv1d("layers/wo", f"{h}.attn.c_proj.weight", 2), T.copy("layers/bo", f"{h}.attn.c_proj.bias"),
           T.copy("layers/mlp_norm", f"{h}.ln_2.weight"), T.copy("layers/mlp_norm_bias", f"{h}.ln_2.bias"),
           T.copy("layers/w_in", f"{h}.mlp.c_fc.weight"), T.copy("layers/b_in", f"{h}.mlp.c_fc.bias"),
           T.copy("layers/w_out", f"{h}.mlp.c_proj.weight"), T.copy("layers/b_out", f"{h}.mlp.c_proj.bias")]
    if not m.tie_embeddings:
        out.append(T.linear("unembed", "lm_head.weight"))
    return out
