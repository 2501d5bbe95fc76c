"""Sparse mixture of experts with a softmax top-k router, computed by dense dispatch: every expert
runs on every token and the router's weights (zero off the top k) combine them. Exact and simple;
E/k times the FLOPs of a real dispatch, which is the next step (expert parallelism)."""

import jax
import jax.numpy as jnp

from maxlm.layers.dense import dense
from maxlm.layers.mlp import ACTIVATIONS
from maxlm.sharding import constrain


def moe(x_BLD, router_DE, w_gate_EDF, w_up_EDF, w_down_EFD, k: int, valid_BL, act: str = "silu"):
    """Returns (y_BLD, stats): stats are the load-balancing sums over valid tokens, so that losses
    can be pooled over layers exactly as Hugging Face pools them (see `balance_loss`)."""
    dt = x_BLD.dtype
    logits_BLE = dense("bld,de->ble", x_BLD, router_DE, out_dtype=jnp.float32)
    probs_BLE = jax.nn.softmax(logits_BLE, axis=-1)
    top_BLK, idx_BLK = jax.lax.top_k(probs_BLE, k)
    top_BLK = top_BLK / jnp.sum(top_BLK, axis=-1, keepdims=True)
    chosen_BLKE = jax.nn.one_hot(idx_BLK, probs_BLE.shape[-1], dtype=jnp.float32)
    comb_BLE = jnp.einsum("blk,blke->ble", top_BLK, chosen_BLKE)
    g_BLEF = dense("bld,edf->blef", x_BLD, w_gate_EDF)
    u_BLEF = dense("bld,edf->blef", x_BLD, w_up_EDF)
    h_BLEF = constrain(ACTIVATIONS[act](g_BLEF) * u_BLEF, ("batch", "length", "experts", "mlp"))
    y_BLD = dense("blef,efd,ble->bld", h_BLEF, w_down_EFD, comb_BLE.astype(dt))
    v_BL = valid_BL.astype(jnp.float32)
    stats = {"routed": jnp.einsum("blke,bl->ke", chosen_BLKE, v_BL), "prob": jnp.einsum("ble,bl->e", probs_BLE, v_BL),
             "tokens": jnp.sum(v_BL)}
    return y_BLD, stats


def balance_loss(stats) -> jax.Array:
    """Switch-Transformer load balancing, E * sum_e f_e * P_e, with f (share of routings, per top-k
    slot) and P (mean router probability) pooled over every layer's valid tokens, as HF computes it."""
    n = jnp.maximum(jnp.sum(stats["tokens"]), 1.0)
    f_KE = jnp.sum(stats["routed"], axis=0) / n
    p_E = jnp.sum(stats["prob"], axis=0) / n
    return p_E.shape[-1] * jnp.sum(f_KE * p_E[None])
