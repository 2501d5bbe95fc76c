"""DeepSeek-V3 (and the models built like it): multi-head latent attention on every layer, a dense MLP on
the first model.dense_layers layers and MoE on the rest: sigmoid scores, group-limited choice, the
routed scale and shared experts, as config (layers.moe).

The dense and the MoE layers are two stacks, `dense_layers` and `layers`, each scanned, so compile time
stays flat in depth; `layers` holds the MoE ones, where the train state's router bias and the expert
load metrics point (their layer i is the model's layer dense_layers + i).
"""

import jax
import jax.numpy as jnp

from maxlm.layers import moe
from maxlm.layers.dense import dense
from maxlm.layers.mla import mla_attention
from maxlm.layers.mlp import gated_mlp
from maxlm.layers.norm import rms_norm
from maxlm.layers.rope import rope_angles
from maxlm.models import decoder
from maxlm.models.llama import dense_mlp_specs, moe_specs, outer_specs
from maxlm.models.params import Param, normal, ones, zeros
from maxlm.sharding import constrain


def mla_specs(m, L: int, w) -> dict:
    """The latent attention's weights. The latent dims shard like the model width (`embed`): replicated,
    wq_b, wk_b and wv_b would be held whole on every device of a data-parallel group."""
    D, H, Dh, a = m.d_model, m.n_heads, m.head_dim, m.mla
    R, Dv = a.rope_dim, a.v_dim or m.head_dim
    if a.q_rank:
        q = {"wq_a": Param((L, D, a.q_rank), ("layers", "embed", None), w),
             "q_norm": Param((L, a.q_rank), ("layers", None), ones),
             "wq_b": Param((L, a.q_rank, H, Dh), ("layers", "embed", "heads", "head_dim"), w)}
    else:
        q = {"wq": Param((L, D, H, Dh), ("layers", "embed", "heads", "head_dim"), w)}
    return {**q, "wkv_a": Param((L, D, a.kv_rank), ("layers", "embed", None), w),
            "kv_norm": Param((L, a.kv_rank), ("layers", None), ones),
            "wk_b": Param((L, a.kv_rank, H, Dh - R), ("layers", "embed", "heads", "head_dim"), w),
            "wv_b": Param((L, a.kv_rank, H, Dv), ("layers", "embed", "heads", "head_dim"), w),
            "wk_rope": Param((L, D, R), ("layers", "embed", None), w),
            "wo": Param((L, H, Dv, D), ("layers", "heads", "head_dim", "embed"), w)}


def param_specs(m) -> dict:
    D, K, N = m.d_model, m.dense_layers, m.mtp_depth
    w = normal(m.init_std)

    def stack(L: int, mlp: dict) -> dict:
        return {"attn_norm": Param((L, D), ("layers", "embed"), ones), **mla_specs(m, L, w),
                "mlp_norm": Param((L, D), ("layers", "embed"), ones), **mlp}

    def moe_layers(L: int) -> dict:
        # score_bias: the checkpoint's expert-selection bias (HF's e_score_correction_bias), a constant of
        # the model (the router stops its gradient, and like every zero-initialised parameter it is not
        # decayed); loss-free balancing in training adds the train state's router_bias to it.
        return stack(L, {**moe_specs(m, L, w), "score_bias": Param((L, m.n_experts), ("layers", None), zeros)})
    specs = {**outer_specs(m, w), "layers": moe_layers(m.n_layers - K)}
    if K:
        specs["dense_layers"] = _whole(stack(K, dense_mlp_specs(K, D, m.dense_d_ff, w)))
    if N:  # each module: two norms, the projection of their concatenation, an MoE layer, its head norm
        specs["mtp"] = _whole({**moe_layers(N), "e_norm": Param((N, D), ("layers", "embed"), ones),
                               "h_norm": Param((N, D), ("layers", "embed"), ones),
                               "w_eh": Param((N, 2 * D, D), ("layers", None, "embed"), w),
                               "head_norm": Param((N, D), ("layers", "embed"), ones)})
    return specs


def _whole(stack: dict) -> dict:
    """A stack the pipeline does not split: its layer axis is `stack`, not `layers`, and stays whole on every
    stage (the dense stack and the MTP modules run beside the stages, as the embedding and head do)."""
    return jax.tree.map(lambda p: p._replace(axes=("stack", *p.axes[1:])), stack, is_leaf=lambda x: isinstance(x, Param))


def block(p: dict, x_BLD, i, ctx: decoder.Ctx, m, routes: bool = False):
    h_BLD = rms_norm(x_BLD, p["attn_norm"], m.norm_eps)
    window, ctx = decoder.layer_attention(i, ctx, m)
    a_BLD, kv = mla_attention(p, h_BLD, ctx, m, window=window, attend=ctx.attend)
    x_BLD = constrain(x_BLD + a_BLD, ("batch", "length", None))
    h_BLD = rms_norm(x_BLD, p["mlp_norm"], m.norm_eps)
    if "router" in p:
        y_BLD, stats = moe.moe(h_BLD, p, m, ctx.seg_BL > 0, routes=routes)
    else:
        y_BLD, stats = gated_mlp(h_BLD, p["w_gate"], p["w_up"], p["w_down"]), {}
    return constrain(x_BLD + y_BLD, ("batch", "length", None)), kv, stats


def _part(cache, lo: int, hi: int):
    return None if cache is None else {**cache, "k": cache["k"][lo:hi], "v": cache["v"][lo:hi]}


def forward(params: dict, tokens_BL, pos_BL, seg_BL, m, dtype, wrap_block=lambda f: f, cache=None,
            attend=None, stack=None, routes: bool = False) -> decoder.Hidden:
    """As llama.forward: the dense stack, then the MoE stack (the KV cache's layers split between them). Only
    the MoE stack runs through the schedule's `stack` (pipeline stages): the dense one is held whole.
    `routes`: those of the MoE stack's layers, not of the multi-token prediction modules."""
    K = m.dense_layers
    x_BLD = decoder.embed(params, tokens_BL, dtype)
    rope = (rope_angles(pos_BL, m.mla.rope_dim, m.rope_theta, m.rope_scaling), None)
    caches = []
    if K:
        x_BLD, _, c = decoder.run_layers(lambda p, x, i, ctx: block(p, x, i, ctx, m), x_BLD, params["dense_layers"],
                                         seg_BL, rope, wrap_block, _part(cache, 0, K), attend)
        caches.append(c)
    x_BLD, stats, c = decoder.run_layers(lambda p, x, i, ctx: block(p, x, i + K, ctx, m, routes), x_BLD,
                                         params["layers"], seg_BL, rope, wrap_block, _part(cache, K, m.n_layers), attend,
                                         stack)
    stats, routes_BLM = moe.split_routes(stats)
    caches.append(c)
    if cache is not None:
        cache = {**c, "k": jnp.concatenate([c["k"] for c in caches]), "v": jnp.concatenate([c["v"] for c in caches])}
    x_BLD = rms_norm(x_BLD, params["final_norm"], m.norm_eps)
    ahead = None
    if "mtp" in params and cache is None:  # training and scoring; generation never runs the modules
        ahead, mtp_stats = _predict_ahead(params, x_BLD, tokens_BL, seg_BL, rope, m, dtype, wrap_block, attend)
        stats = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), stats, mtp_stats)  # their MoE layers last
    return decoder.Hidden(x_BLD, moe.aux_loss(stats, m), cache, moe.load(stats), ahead, routes_BLM)


def _predict_ahead(params, h_BLD, tokens_BL, seg_BL, rope, m, dtype, wrap_block, attend):
    """DeepSeek-V3's multi-token prediction: module k (from 0) joins the embedding of token i + k + 1 with
    the previous module's hidden state at position i (for k = 0 the main model's, after its final norm, as
    the published modules are served), projects their normalised concatenation, in that order, back to
    d_model and runs one MoE layer over it, causally, as the main layers do. Returns its hidden states after its head norm [depth, B, L, D] (the shared output table
    makes their logits, for the token k + 2 after i) and the MoE statistics of its layers."""
    e_BLD = decoder.embed(params, tokens_BL, dtype)
    L, N = tokens_BL.shape[1], m.mtp_depth
    e_BXD = jnp.pad(e_BLD, ((0, 0), (0, N), (0, 0)))  # past the end: zeros, and the targets there are masked
    layer = wrap_block(lambda p, x, i, ctx: block(p, x, i, ctx._replace(attend=attend), m))

    def module(h_BLD, inp):
        p, k = inp
        next_BLD = jax.lax.dynamic_slice_in_dim(e_BXD, k + 1, L, axis=1)
        joined = jnp.concatenate([rms_norm(next_BLD, p["e_norm"], m.norm_eps), rms_norm(h_BLD, p["h_norm"], m.norm_eps)],
                                 axis=-1)
        h_BLD = constrain(dense("bld,de->ble", joined, p["w_eh"]), ("batch", "length", None))
        h_BLD, _, stats = layer(p, h_BLD, m.n_layers + k, decoder.Ctx(rope[0], seg_BL))
        return h_BLD, (rms_norm(h_BLD, p["head_norm"], m.norm_eps), stats)
    _, (ahead_NBLD, stats) = jax.lax.scan(module, h_BLD, (params["mtp"], jnp.arange(N)))
    return ahead_NBLD, stats


unembed = decoder.unembed
windowed_layers = decoder.windowed_layers


def matmul_params(m) -> int:
    """Weights a token meets in matmuls: the latent attention's, the dense layers' MLP, and on the MoE
    layers the router, the experts_per_token experts and the shared experts; the unembedding; and in
    training each multi-token prediction module's projection, layer and output head."""
    D, H, Dh, a, K = m.d_model, m.n_heads, m.head_dim, m.mla, m.dense_layers
    Dv = a.v_dim or Dh
    q = D * a.q_rank + a.q_rank * H * Dh if a.q_rank else D * H * Dh
    attn = q + D * (a.kv_rank + a.rope_dim) + a.kv_rank * H * (Dh - a.rope_dim + Dv) + H * Dv * D
    moe_mlp = 3 * D * m.d_ff * (m.experts_per_token + m.shared_experts) + D * m.n_experts
    mtp = m.mtp_depth * (2 * D * D + attn + moe_mlp + D * m.vocab_size)  # training: each module, its output head
    return m.n_layers * attn + K * 3 * D * m.dense_d_ff + (m.n_layers - K) * moe_mlp + D * m.vocab_size + mtp
