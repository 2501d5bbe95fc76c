"""Sparse mixture of experts: the router, and the layer around `dispatch.experts`.

The router scores every expert (softmax, as Mixtral and Qwen3-MoE, or sigmoid, as DeepSeek-V3), picks
the top k by score plus an optional per-expert bias that only steers the choice (DeepSeek-V3's
auxiliary-loss-free balancing; the bias lives in the train state), optionally among the experts of each
token's best groups only (DeepSeek-V3's group-limited routing), and weighs the chosen experts by their
scores, renormalised over the k or not, times model.router_scale. Shared experts, when the model has them, see every token.
"""

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxlm.layers import dispatch
from maxlm.layers.dense import dense
from maxlm.layers.mlp import gated_mlp, glu


def route(x_BLD, router_DE, m, bias_E=None, router_b_E=None):
    """(logits_BLE float32, scores_BLE, chosen experts idx_BLK, their weights w_BLK). `router_b_E` is a
    learned bias of the router's logits (gpt-oss); `bias_E` the train state's selection bias."""
    logits_BLE = dense("bld,de->ble", x_BLD, router_DE, out_dtype=jnp.float32)
    if router_b_E is not None:
        logits_BLE = logits_BLE + router_b_E.astype(jnp.float32)
    scores_BLE = jax.nn.softmax(logits_BLE, axis=-1) if m.router_score == "softmax" else jax.nn.sigmoid(logits_BLE)
    pick_BLE = scores_BLE if bias_E is None else scores_BLE + jax.lax.stop_gradient(bias_E)
    if m.router_groups:
        pick_BLE = _within_best_groups(pick_BLE, m.router_groups, m.router_topk_groups)
    _, idx_BLK = jax.lax.top_k(pick_BLE, m.experts_per_token)
    w_BLK = jnp.take_along_axis(scores_BLE, idx_BLK, axis=-1)
    if m.router_renorm:
        w_BLK = w_BLK / jnp.sum(w_BLK, axis=-1, keepdims=True)
    return logits_BLE, scores_BLE, idx_BLK, w_BLK * m.router_scale


def _within_best_groups(pick_BLE, groups: int, keep: int):
    """DeepSeek-V3's group-limited choice: the experts form `groups` equal groups, each scored by the sum
    of its two best selection scores, and only the `keep` best groups' experts stay eligible (-inf)."""
    *BL, E = pick_BLE.shape
    g_BLGX = pick_BLE.reshape(*BL, groups, E // groups)
    _, best_BLK = jax.lax.top_k(jnp.sum(jax.lax.top_k(g_BLGX, 2)[0], axis=-1), keep)
    chosen_BLG = jnp.any(jax.nn.one_hot(best_BLK, groups, dtype=jnp.bool_), axis=-2)
    return jnp.where(chosen_BLG[..., None], g_BLGX, -jnp.inf).reshape(*BL, E)


def selection_bias(p: dict):
    """What steers the choice of experts, or None: a checkpoint's fixed `score_bias` (DeepSeek-V3's
    e_score_correction_bias) plus the train state's `router_bias` (loss-free balancing), either or both."""
    present = [p[k] for k in ("score_bias", "router_bias") if k in p]
    return sum(present[1:], present[0]) if present else None


def capacity(m, length: int) -> int:
    """Assignments one expert takes from one sequence (model.capacity_factor x its fair share), 0: all."""
    if not m.capacity_factor:
        return 0
    return max(1, int(-(-m.capacity_factor * length * m.experts_per_token // m.n_experts)))


def moe(x_BLD, p: dict, m, valid_BL, act: str = "silu", routes: bool = False):
    """Returns (y_BLD, stats): per-layer sums over valid tokens that losses and metrics pool over layers
    (see `balance_loss`, `z_loss`). p holds router, w_gate, w_up, w_down (experts stacked first), the
    shared experts' shared_gate/up/down if any, router_bias if the run balances by bias, and gpt-oss's
    biases (b_router, b_gate, b_up, b_down) if the family has them. `act` names the gated unit (mlp.glu).
    `routes`: stats also holds "route", each token's `fingerprint` [B, L] (see `split_routes`)."""
    x_BLD = checkpoint_name(x_BLD, "mlp_in")  # the name remat=offload keeps on the host
    E, dt = m.n_experts, x_BLD.dtype
    logits_BLE, scores_BLE, idx_BLK, w_BLK = route(x_BLD, p["router"], m, selection_bias(p), p.get("b_router"))
    cap = capacity(m, x_BLD.shape[1])
    keep_BLK = (dispatch.capacity_keep(idx_BLK, valid_BL, E, cap) if cap
                else jnp.broadcast_to(valid_BL[..., None], idx_BLK.shape))
    ew = {k: p[k] for k in dispatch.WEIGHTS if k in p}
    y_BLD, over_BL = dispatch.experts(x_BLD, jnp.where(keep_BLK, idx_BLK, E), w_BLK, ew, glu(act, m.swiglu_limit), cap,
                                      m.ep_slack, m.expert_grad_dtype, m.grouped_gemm)
    if m.shared_experts:
        y_BLD = y_BLD + gated_mlp(x_BLD, p["shared_gate"], p["shared_up"], p["shared_down"], act)
    v_BL = valid_BL.astype(jnp.float32)
    share_BLE = scores_BLE if m.router_score == "softmax" else scores_BLE / jnp.sum(scores_BLE, -1, keepdims=True)
    stats = {"routed": jnp.einsum("blke,bl->ke", jax.nn.one_hot(idx_BLK, E, dtype=jnp.float32), v_BL),
             "prob": jnp.einsum("ble,bl->e", share_BLE, v_BL), "tokens": jnp.sum(v_BL),
             "z": jnp.sum(jnp.square(jax.nn.logsumexp(logits_BLE, axis=-1)) * v_BL),
             "dropped": jnp.sum(v_BL[..., None] * (~keep_BLK)) + jnp.sum(over_BL, dtype=jnp.float32)}
    if routes:  # per token, not a sum: never in a train step, whose schedules sum stats over microbatches
        stats["route"] = fingerprint(idx_BLK)
    return y_BLD.astype(dt), stats


def fingerprint(idx_BLK) -> jax.Array:
    """[B, L] uint32 naming each token's set of chosen experts, whatever their order: the wrapping sum of
    murmur3's finaliser over the indices (+ a constant, since it maps 0 to 0). Equal sets give equal values;
    two different sets collide with probability about 2^-32. Capacity drops are not in it (stats' "dropped")."""
    h = idx_BLK.astype(jnp.uint32) + jnp.uint32(0x9E3779B9)
    for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        h = (h ^ (h >> shift)) * jnp.uint32(mul)
    return jnp.sum(h ^ (h >> 16), axis=-1, dtype=jnp.uint32)


def split_routes(stats: dict):
    """(stats without "route", [B, L, layers] uint32 fingerprints of the stacked layers' routes, or None).
    `run_layers` stacks the per-layer stats on a leading axis; the routes come back with it last."""
    if "route" not in stats:
        return stats, None
    stats = dict(stats)
    return stats, jnp.moveaxis(stats.pop("route"), 0, -1)


def balance_loss(stats) -> jax.Array:
    """Switch-Transformer load balancing, E * sum_e f_e * P_e, with f (share of routings, per top-k
    slot) and P (mean router probability) pooled over every layer's valid tokens, as HF computes it."""
    n = jnp.maximum(jnp.sum(stats["tokens"]), 1.0)
    f_KE = jnp.sum(stats["routed"], axis=0) / n
    p_E = jnp.sum(stats["prob"], axis=0) / n
    return p_E.shape[-1] * jnp.sum(f_KE * p_E[None])


def z_loss(stats) -> jax.Array:
    """ST-MoE's router z-loss, the mean squared log-partition of the router logits over every layer's
    valid tokens: it keeps the logits small, where the softmax is well conditioned."""
    return jnp.sum(stats["z"]) / jnp.maximum(jnp.sum(stats["tokens"]), 1.0)


def aux_loss(stats, m) -> jax.Array:
    return m.router_aux_loss * balance_loss(stats) + m.router_z_loss * z_loss(stats)


def load(stats) -> dict:
    """Per-layer [L, E] assignments each expert was given (valid tokens, before any capacity drop) and
    [L] assignments dropped, for capacity or by a full receive buffer of the ragged expert exchange
    (model.ep_slack): what the metrics report and the bias balances."""
    return {"load": jnp.sum(stats["routed"], axis=1), "dropped": stats["dropped"]}


def dense_reference(x_BLD, p: dict, m, act: str = "silu") -> jax.Array:
    """The same layer by dense dispatch (every expert on every token, weighted by zero off the chosen k):
    E / k times the FLOPs, exact, and independent of `dispatch`. Tests and benchmarks compare against it.
    No capacity; padding tokens are computed (`moe` gives them zero)."""
    _, _, idx_BLK, w_BLK = route(x_BLD, p["router"], m, selection_bias(p), p.get("b_router"))
    comb_BLE = jnp.einsum("blk,blke->ble", w_BLK, jax.nn.one_hot(idx_BLK, m.n_experts, dtype=jnp.float32))
    dt = x_BLD.dtype
    g_BLEF = dense("bld,edf->blef", x_BLD, p["w_gate"])
    u_BLEF = dense("bld,edf->blef", x_BLD, p["w_up"])
    if "b_gate" in p:
        g_BLEF, u_BLEF = g_BLEF + p["b_gate"].astype(dt), u_BLEF + p["b_up"].astype(dt)
    y_BLD = dense("blef,efd,ble->bld", glu(act, m.swiglu_limit)(g_BLEF, u_BLEF), p["w_down"], comb_BLE.astype(dt))
    if "b_down" in p:
        y_BLD = y_BLD + jnp.einsum("ble,ed->bld", comb_BLE.astype(dt), p["b_down"].astype(dt))
    if m.shared_experts:
        y_BLD = y_BLD + gated_mlp(x_BLD, p["shared_gate"], p["shared_up"], p["shared_down"], act)
    return y_BLD
