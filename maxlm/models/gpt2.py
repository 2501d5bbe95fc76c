"""GPT-2: learned absolute positions (no RoPE), pre-LayerNorm with bias, biases on every projection,
an ungated tanh-GELU MLP, and tied embeddings by default. The position table has `model.max_positions`
rows; config validation keeps `seq_len` within it."""

import math

import jax.numpy as jnp
import numpy as np

from maxlm.config import ConfigError
from maxlm.layers.attention import self_attention
from maxlm.layers.mlp import mlp
from maxlm.layers.norm import layer_norm
from maxlm.models import decoder, hf, llama
from maxlm.models.params import Param, normal, ones, zeros
from maxlm.sharding import constrain


def param_specs(m) -> dict:
    V, D, L, F, H, K, Dh = m.vocab_size, m.d_model, m.n_layers, m.d_ff, m.n_heads, m.n_kv_heads, m.head_dim
    w, LD = normal(m.init_std), ("layers", "embed")
    layers = {
        "attn_norm": Param((L, D), LD, ones), "attn_norm_bias": Param((L, D), LD, zeros),
        **llama.attention_specs(m, w),
        "bq": Param((L, H, Dh), ("layers", "heads", "head_dim"), zeros),
        "bk": Param((L, K, Dh), ("layers", "kv_heads", "head_dim"), zeros),
        "bv": Param((L, K, Dh), ("layers", "kv_heads", "head_dim"), zeros),
        "bo": Param((L, D), LD, zeros),
        "mlp_norm": Param((L, D), LD, ones), "mlp_norm_bias": Param((L, D), LD, zeros),
        "w_in": Param((L, D, F), ("layers", "embed", "mlp"), w),
        "b_in": Param((L, F), ("layers", "mlp"), zeros),
        "w_out": Param((L, F, D), ("layers", "mlp", "embed"), w),
        "b_out": Param((L, D), LD, zeros),
    }
    specs = {"embed": Param((V, D), ("vocab", "embed"), w),
             "positions": Param((m.max_positions, D), (None, "embed"), w),
             "layers": layers, "final_norm": Param((D,), ("embed",), ones),
             "final_norm_bias": Param((D,), ("embed",), zeros)}
    if not m.tie_embeddings:
        specs["unembed"] = Param((D, V), ("embed", "vocab"), w)
    return specs


def block(p: dict, x_BLD, i, ctx: decoder.Ctx, m):
    """x + attn(ln(x)), then x + mlp(ln(x))."""
    h_BLD = layer_norm(x_BLD, p["attn_norm"], p["attn_norm_bias"], m.norm_eps)
    a_BLD, kv = self_attention(p, h_BLD, ctx, m, window=m.sliding_window)
    x_BLD = constrain(x_BLD + a_BLD, ("batch", "length", None))
    h_BLD = layer_norm(x_BLD, p["mlp_norm"], p["mlp_norm_bias"], m.norm_eps)
    y_BLD = mlp(h_BLD, p["w_in"], p["b_in"], p["w_out"], p["b_out"], act="gelu_tanh")
    return constrain(x_BLD + y_BLD, ("batch", "length", None)), kv, {}


def forward(params: dict, tokens_BL, pos_BL, seg_BL, m, dtype, wrap_block=lambda f: f, cache=None,
            attend=None) -> decoder.Output:
    # Token and position rows are summed in float32, then cast once.
    x_BLD = jnp.take(params["embed"], tokens_BL, axis=0) + jnp.take(params["positions"], pos_BL, axis=0)
    x_BLD = constrain(x_BLD.astype(dtype), ("batch", "length", None))
    x_BLD, _, cache = decoder.run_layers(lambda p, x, i, ctx: block(p, x, i, ctx, m), x_BLD, params["layers"],
                                         seg_BL, None, wrap_block, cache, attend)
    x_BLD = layer_norm(x_BLD, params["final_norm"], params["final_norm_bias"], m.norm_eps)
    w_DV = params["embed"].T if m.tie_embeddings else params["unembed"]
    return decoder.Output(decoder.unembed(x_BLD, w_DV, dtype, m.final_softcap), jnp.zeros((), jnp.float32), cache)


# ---- Hugging Face ---------------------------------------------------------------------------------
HF_ARCHITECTURES = {"GPT2LMHeadModel": "gpt2"}
HF_PREFIX = "transformer."  # missing from the hub's GPT-2 files, saved from GPT2Model; convert.hf adds it


def config_from_hf(c: dict) -> dict:
    hf.require(c, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new")
    hf.require(c, "scale_attn_weights", (True,), True)
    hf.require(c, "scale_attn_by_inverse_layer_idx", (False,), False)
    hf.require(c, "add_cross_attention", (False,), False)
    # reorder_and_upcast_attn only reorders and upcasts the score math, which maxlm does in float32 anyway.
    get = lambda name, alias: c[name] if name in c else c[alias]  # noqa: E731  (config.json may use either)
    D, H = get("n_embd", "hidden_size"), get("n_head", "num_attention_heads")
    if D % H:
        raise hf.unsupported("n_embd", D, f"must be a multiple of n_head={H}")
    return {"vocab_size": c["vocab_size"], "d_model": D, "n_layers": get("n_layer", "num_hidden_layers"),
            "n_heads": H, "n_kv_heads": H, "head_dim": D // H, "d_ff": c.get("n_inner") or 4 * D,
            "norm_eps": float(c.get("layer_norm_epsilon", 1e-5)),
            "max_positions": get("n_positions", "max_position_embeddings"),
            "tie_embeddings": bool(c.get("tie_word_embeddings", True))}


def config_to_hf(m) -> dict:
    if m.n_kv_heads != m.n_heads or m.n_heads * m.head_dim != m.d_model:
        raise ConfigError(f"a gpt2 model exports to GPT2LMHeadModel only with n_kv_heads = n_heads and n_heads * "
                          f"head_dim = d_model; got {m.n_kv_heads}, {m.n_heads}, {m.head_dim}, {m.d_model}")
    hf.refuse_options(m, "GPT2LMHeadModel", ("sliding_window", "attn_softcap", "final_softcap", "attn_scale", "qk_norm"))
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m.vocab_size,
            "n_embd": m.d_model, "n_layer": m.n_layers, "n_head": m.n_heads, "n_inner": m.d_ff,
            "n_positions": m.max_positions, "layer_norm_epsilon": m.norm_eps, "activation_function": "gelu_new",
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": m.tie_embeddings}


def conv1d(path: str, name: str, n_in: int) -> hf.Tensor:
    """GPT-2's Conv1D stores [in, out], maxlm's own order: only the grouping of axes differs."""
    return hf.Tensor(name, (path,), lambda w, shapes: (w.reshape(shapes[0]),),
                     lambda x: x.reshape(math.prod(x.shape[:n_in]), -1))


def fused_qkv(kind: str, name: str, n_in: int) -> hf.Tensor:
    """c_attn: q, k and v side by side on the output (last) axis; `kind` "w" for the weight [D, 3D],
    "b" for the bias [3D]."""
    paths = tuple(f"layers/{kind}{x}" for x in "qkv")

    def to_maxlm(w, shapes):
        sizes = np.cumsum([math.prod(s[n_in:]) for s in shapes])[:-1]
        return tuple(part.reshape(s) for part, s in zip(np.split(w, sizes, axis=-1), shapes))
    return hf.Tensor(name, paths, to_maxlm,
                     lambda *xs: np.concatenate([x.reshape(*x.shape[:n_in], -1) for x in xs], axis=-1))


def hf_tensors(m) -> list[hf.Tensor]:
    h = "transformer.h.{i}"
    out = [hf.copy("embed", "transformer.wte.weight"), hf.copy("positions", "transformer.wpe.weight"),
           hf.copy("final_norm", "transformer.ln_f.weight"), hf.copy("final_norm_bias", "transformer.ln_f.bias"),
           hf.copy("layers/attn_norm", f"{h}.ln_1.weight"), hf.copy("layers/attn_norm_bias", f"{h}.ln_1.bias"),
           fused_qkv("w", f"{h}.attn.c_attn.weight", 1), fused_qkv("b", f"{h}.attn.c_attn.bias", 0),
           conv1d("layers/wo", f"{h}.attn.c_proj.weight", 2), hf.copy("layers/bo", f"{h}.attn.c_proj.bias"),
           hf.copy("layers/mlp_norm", f"{h}.ln_2.weight"), hf.copy("layers/mlp_norm_bias", f"{h}.ln_2.bias"),
           hf.copy("layers/w_in", f"{h}.mlp.c_fc.weight"), hf.copy("layers/b_in", f"{h}.mlp.c_fc.bias"),
           hf.copy("layers/w_out", f"{h}.mlp.c_proj.weight"), hf.copy("layers/b_out", f"{h}.mlp.c_proj.bias")]
    if not m.tie_embeddings:
        out.append(hf.linear("unembed", "lm_head.weight"))
    return out
