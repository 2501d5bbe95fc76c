"""DeepSeek-V3 <-> DeepseekV3ForCausalLM. The first first_k_dense_replace HF layers fill maxlm's
`dense_layers` stack, the rest its `layers` (MoE) stack.

- RoPE: the published weights lay each head's RoPE dims out in interleaved pairs (rope_interleave,
  transformers' default); maxlm rotates halves, so import reorders those columns of q_b_proj (or q_proj)
  and of kv_a_proj_with_mqa's shared key to evens-then-odds, which gives the same scores exactly, and
  export puts them back.
- kv_a_proj_with_mqa is the latent and the shared RoPE key in one matrix; kv_b_proj is each head's key
  (no RoPE) and value in one.
- FP8: the published weights are float8 e4m3 with one float32 `weight_scale_inv` per 128 x 128 block
  (quantization_config fp8, weight_block_size [128, 128]); import dequantizes them exactly (`fp8_blocks`).
  Export writes float32 or bfloat16.
- Multi-token prediction modules (HF layers num_hidden_layers .. + num_nextn_predict_layers - 1): import
  reads the first model.mtp_depth of them, never their copies of the embedding and output head, drops
  the rest and says so (`import_note`); export writes none (`export_tensors`).
"""

import re

import numpy as np

from maxlm.convert import tables as T
from maxlm.convert.adapters.mistral import check_exportable, fixed_keys

HF_ARCHITECTURES = {"DeepseekV3ForCausalLM": "deepseek_v3"}
QUANT_METHODS = ("fp8",)  # a config.json quantization_config's quant_method import dequantizes (fp8_blocks)
BLOCK = 128  # the FP8 scale block, both axes (quantization_config.weight_block_size)


def fp8_blocks(w: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """float8 [out, in] times its [ceil(out / 128), ceil(in / 128)] block scales -> float32, as DeepSeek's
    weight_dequant defines it (the last blocks of a ragged edge are partial). Other shapes or an integer
    weight are a ValueError (convert.hf names the tensors)."""
    blocks = tuple(-(-n // BLOCK) for n in w.shape)
    if w.ndim != 2 or scale_inv.shape != blocks or w.dtype.kind in "biu":
        raise ValueError(f"a float8 weight [out, in] needs float scales [ceil(out/{BLOCK}), ceil(in/{BLOCK})] "
                         f"= {list(blocks)}")
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), BLOCK, axis=0), BLOCK, axis=1)
    return w.astype(np.float32) * s[:w.shape[0], :w.shape[1]]


def derived_tensors(names) -> dict:
    """Each FP8 weight, dequantized, under its own name (it replaces the weight and its scales)."""
    return {n: (fp8_blocks, (n, n + "_scale_inv")) for n in names if n + "_scale_inv" in names}


def checkpoint_names(names, c: dict, m) -> dict:
    """Every stored name as it is, but those of the multi-token prediction layers past model.mtp_depth, and
    each module's copies of the embedding and output head (the model's own are shared): dropped."""
    layer = re.compile(r"model\.layers\.(\d+)\.(.*)")

    def keep(n: str) -> bool:
        hit = layer.fullmatch(n)
        if hit is None or int(hit[1]) < c["num_hidden_layers"]:
            return True
        return int(hit[1]) < c["num_hidden_layers"] + m.mtp_depth and hit[2] not in SHARED
    return {n: n if keep(n) else None for n in names}


SHARED = ("embed_tokens.weight", "shared_head.head.weight")


def import_note(c: dict) -> str | None:
    k = c.get("num_nextn_predict_layers", 0)
    return (f"deepseek_v3: the checkpoint has {k} multi-token prediction module(s) (model.layers."
            f"{c['num_hidden_layers']}.*): import reads the first model.mtp_depth of them (0 unless set) and "
            f"drops the rest") if k else None


def config_from_hf(c: dict) -> dict:
    T.require(c, "hidden_act", ("silu",), "silu")
    T.require(c, "attention_bias", (False,), False)
    T.require(c, "rope_interleave", (True,), True)
    T.require(c, "scoring_func", ("sigmoid",), "sigmoid")
    T.require(c, "topk_method", ("noaux_tc",), "noaux_tc")
    q = c.get("quantization_config")  # convert.hf.model_keys has refused any quant_method but QUANT_METHODS
    if q is not None and (q.get("quant_method"), q.get("fmt", "e4m3"), q.get("weight_block_size")) != \
            ("fp8", "e4m3", [BLOCK, BLOCK]):
        raise T.unsupported("quantization_config", q, "maxlm reads fp8 e4m3 with weight_block_size [128, 128], or none")
    # num_key_value_heads means nothing to MLA (every head gets its key and value from the latent)
    size = lambda name: T.number(c, name, None, "a positive integer", lambda v: v > 0, integer=True,  # noqa: E731
                                 required=True)
    nope, rope, H = size("qk_nope_head_dim"), size("qk_rope_head_dim"), size("num_attention_heads")
    return {**T.common_from_hf(c, tie_default=False), **T.rope_from_hf(c), **fixed_keys(), "sliding_window": 0,
            "n_kv_heads": H, "head_dim": nope + rope, "d_ff": size("moe_intermediate_size"),
            "dense_d_ff": size("intermediate_size"), **moe_from_hf(c),
            "mla": {"q_rank": T.number(c, "q_lora_rank", 0, "a positive integer, or null for a full-rank query",
                                       lambda v: v > 0, integer=True),
                    "kv_rank": size("kv_lora_rank"), "rope_dim": rope, "v_dim": size("v_head_dim")}}


def moe_from_hf(c: dict) -> dict:
    """The routing keys, with DeepseekV3Config's defaults for an absent or null field (the published
    configs give them all; a hand-written one that leaves n_group out still means 8 groups)."""
    count = lambda name, default, least: T.number(c, name, default, f"an integer >= {least}",  # noqa: E731
                                                  lambda v: v >= least, integer=True)
    need = lambda name: T.number(c, name, None, "an integer >= 1", lambda v: v >= 1, integer=True,  # noqa: E731
                                 required=True)
    return {"dense_layers": count("first_k_dense_replace", 3, 0), "n_experts": need("n_routed_experts"),
            "experts_per_token": need("num_experts_per_tok"), "router_score": "sigmoid",
            "router_renorm": T.flag(c, "norm_topk_prob", True), "shared_experts": count("n_shared_experts", 1, 0),
            "router_groups": count("n_group", 8, 1), "router_topk_groups": count("topk_group", 4, 1),
            "router_scale": T.number(c, "routed_scaling_factor", 2.5, "a positive number", lambda v: v > 0),
            "router_aux_loss": 0.0}


def config_to_hf(m) -> dict:
    check_exportable(m)
    T.refuse_options(m, {"router_bias_rate": 0.0}, lambda key, want: ": the train state's router bias is not in "
                     "the parameters the export reads (DeepseekV3's e_score_correction_bias would miss it)")
    a = m.mla
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_act": "silu",
            **T.common_to_hf(m), "head_dim": a.rope_dim, "intermediate_size": m.dense_d_ff,
            "moe_intermediate_size": m.d_ff, "first_k_dense_replace": m.dense_layers, "n_routed_experts": m.n_experts,
            "num_experts_per_tok": m.experts_per_token, "norm_topk_prob": m.router_renorm,
            "n_shared_experts": m.shared_experts, "n_group": m.router_groups or 1,
            "topk_group": m.router_topk_groups or 1, "routed_scaling_factor": m.router_scale,
            "q_lora_rank": a.q_rank or None, "kv_lora_rank": a.kv_rank, "qk_rope_head_dim": a.rope_dim,
            "qk_nope_head_dim": m.head_dim - a.rope_dim, "v_head_dim": a.v_dim or m.head_dim,
            "rope_interleave": True, "attention_bias": False, "num_nextn_predict_layers": 0, **T.rope_to_hf(m)}


def _halves(R: int) -> np.ndarray:
    """The column order that turns interleaved RoPE pairs (x0, x1), (x2, x3), ... into halves."""
    return np.concatenate([np.arange(0, R, 2), np.arange(1, R, 2)])


def _q(path: str, hf: str, R: int) -> T.Tensor:
    """[H * head_dim, in]: each head's last R rows are its RoPE dims, interleaved in HF."""
    def to_maxlm(w, shapes):
        H, Dh = shapes[0][-2:]
        w = w.reshape(H, Dh, -1)
        w = np.concatenate([w[:, :Dh - R], w[:, Dh - R:][:, _halves(R)]], axis=1)
        return (w.reshape(H * Dh, -1).T.reshape(shapes[0]),)

    def to_hf(x):
        *_, H, Dh = x.shape
        w = x.reshape(-1, H, Dh)
        w = np.concatenate([w[..., :Dh - R], w[..., Dh - R:][..., np.argsort(_halves(R))]], axis=-1)
        return w.reshape(w.shape[0], -1).T
    return T.Tensor(hf, (path,), to_maxlm, to_hf)


def _kv_a(hf: str, C: int, R: int) -> T.Tensor:
    """[C + R, D]: the latent, then the shared RoPE key (interleaved in HF)."""
    def to_maxlm(w, shapes):
        return w[:C].T.reshape(shapes[0]), w[C:][_halves(R)].T.reshape(shapes[1])

    def to_hf(c, r):
        return np.concatenate([c.T, r.T[np.argsort(_halves(R))]], axis=0)
    return T.Tensor(hf, ("layers/wkv_a", "layers/wk_rope"), to_maxlm, to_hf)


def _kv_b(hf: str, N: int) -> T.Tensor:
    """[H * (N + v_dim), C]: per head, its key (no RoPE) rows, then its value rows."""
    def to_maxlm(w, shapes):
        H = shapes[0][-2]
        w = w.reshape(H, -1, w.shape[-1])
        return w[:, :N].transpose(2, 0, 1).reshape(shapes[0]), w[:, N:].transpose(2, 0, 1).reshape(shapes[1])

    def to_hf(k, v):
        return np.concatenate([k, v], axis=-1).transpose(1, 2, 0).reshape(-1, k.shape[0])
    return T.Tensor(hf, ("layers/wk_b", "layers/wv_b"), to_maxlm, to_hf)


def _layer(m, moe: bool) -> list[T.Tensor]:
    a, at, mlp = m.mla, "model.layers.{i}.self_attn", "model.layers.{i}.mlp"
    R = a.rope_dim
    q = [T.linear("layers/wq_a", f"{at}.q_a_proj.weight"), T.copy("layers/q_norm", f"{at}.q_a_layernorm.weight"),
         _q("layers/wq_b", f"{at}.q_b_proj.weight", R)] if a.q_rank else [_q("layers/wq", f"{at}.q_proj.weight", R)]
    out = [T.copy("layers/attn_norm", "model.layers.{i}.input_layernorm.weight"),
           T.copy("layers/mlp_norm", "model.layers.{i}.post_attention_layernorm.weight"), *q,
           _kv_a(f"{at}.kv_a_proj_with_mqa.weight", a.kv_rank, R),
           T.copy("layers/kv_norm", f"{at}.kv_a_layernorm.weight"),
           _kv_b(f"{at}.kv_b_proj.weight", m.head_dim - R), T.linear("layers/wo", f"{at}.o_proj.weight", n_in=2)]
    if not moe:
        return out + [T.linear(f"layers/{w}", f"{mlp}.{h}_proj.weight") for w, h in MLP]
    out += [T.linear("layers/router", f"{mlp}.gate.weight"),
            T.copy("layers/score_bias", f"{mlp}.gate.e_score_correction_bias"),
            *[T.linear(f"layers/{w}", f"{mlp}.experts.{{j}}.{h}_proj.weight") for w, h in MLP]]
    if m.shared_experts:
        out += [T.linear(f"layers/shared_{w[2:]}", f"{mlp}.shared_experts.{h}_proj.weight") for w, h in MLP]
    return out


MLP = (("w_gate", "gate"), ("w_up", "up"), ("w_down", "down"))


def _in_stack(tensors: list[T.Tensor], stack: str) -> list[T.Tensor]:
    return [t._replace(paths=tuple(p.replace("layers/", f"{stack}/", 1) for p in t.paths)) for t in tensors]


def _mtp(m) -> list[T.Tensor]:
    """Module k is HF layer num_hidden_layers + k: an MoE layer plus its norms and projection."""
    at = "model.layers.{i}"
    module = [T.copy("layers/e_norm", f"{at}.enorm.weight"), T.copy("layers/h_norm", f"{at}.hnorm.weight"),
             T.linear("layers/w_eh", f"{at}.eh_proj.weight"), T.copy("layers/head_norm", f"{at}.shared_head.norm.weight")]
    return _in_stack(T.in_layers(_layer(m, moe=True) + module, m.n_layers, m.mtp_depth), "mtp")


def hf_tensors(m) -> list[T.Tensor]:
    """The published names, with the first model.mtp_depth multi-token prediction modules."""
    K = m.dense_layers
    dense = _in_stack(T.in_layers(_layer(m, moe=False), 0, K), "dense_layers") if K else []
    return [*T.embedding_tensors(m), *dense, *T.in_layers(_layer(m, moe=True), K, m.n_layers - K),
            *(_mtp(m) if m.mtp_depth else [])]


def export_tensors(m) -> list[T.Tensor]:
    """What export writes: no multi-token prediction modules (num_nextn_predict_layers: 0); they serve
    training only, and transformers' DeepseekV3ForCausalLM has none."""
    return [t for t in hf_tensors(m) if not t.paths[0].startswith("mtp/")]
