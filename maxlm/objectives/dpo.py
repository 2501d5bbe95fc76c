"""Preference objectives over rows that each hold one pair: segment 1 the prompt and chosen response,
segment 2 the prompt and rejected one, with the loss mask on the responses (data.format=preference).

DPO (Rafailov et al. 2023): -log sigmoid(beta * [(log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))]).
SimPO (Meng et al. 2024), reference-free: -log sigmoid(beta * [log pi(y_w) / |y_w| - log pi(y_l) / |y_l|] - gamma).
The rewards logged are the bracketed terms' halves: beta * (log pi - log ref) for DPO, beta * mean
log-probability for SimPO.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from maxlm.objectives import Terms, masked_tokens
from maxlm.objectives.lm import FIELDS


class DPO(NamedTuple):
    loss: str = "sigmoid"  # dpo.loss: sigmoid (DPO) or simpo
    beta: float = 0.1
    gamma: float = 0.0     # SimPO's target reward margin
    fields = FIELDS
    tokens = staticmethod(masked_tokens)

    @property
    def reference(self) -> bool:
        return self.loss != "simpo"  # SimPO is reference-free

    @staticmethod
    def denominator(batch: dict):
        return jnp.maximum(pairs(batch), 1.0)

    def terms(self, forward, params, ref, mb: dict, denom, stack) -> Terms:
        s = forward.token_losses(params, mb, stack)
        logp_B2, n_B2 = pair_logps(s.tok_BL, mb)
        ref_B2 = jnp.zeros_like(logp_B2)
        if self.reference:  # the reference pass: forward only, no gradient reaches it
            ref_B2 = jax.lax.stop_gradient(pair_logps(forward.token_losses(ref, mb, stack).tok_BL, mb)[0])
        out = {k: v / denom for k, v in sums(*losses(logp_B2, ref_B2, n_B2, self)).items()}
        return Terms(out.pop("loss"), 0.0, s.aux, s.moe, out)


def pair_logps(tok_BL, batch: dict) -> tuple[jax.Array, jax.Array]:
    """Summed log-probabilities [B, 2] of each row's chosen and rejected response tokens (from the per-token
    cross-entropies, zero where masked), and their token counts [B, 2]."""
    seg_BL, on_BL = batch["segment_ids"], batch["loss_mask"] > 0
    sel_BL2 = jnp.stack([on_BL & (seg_BL == 1), on_BL & (seg_BL == 2)], axis=-1).astype(jnp.float32)
    return -jnp.einsum("bl,blc->bc", tok_BL, sel_BL2), jnp.sum(sel_BL2, axis=1)


def losses(logp_B2, ref_B2, n_B2, dcfg) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-row loss [B], rewards [B, 2], and whether the row is a real pair (both responses present) [B]."""
    if dcfg.loss == "simpo":
        r_B2 = dcfg.beta * logp_B2 / jnp.maximum(n_B2, 1.0)
        h_B = r_B2[:, 0] - r_B2[:, 1] - dcfg.gamma
    else:
        r_B2 = dcfg.beta * (logp_B2 - ref_B2)
        h_B = r_B2[:, 0] - r_B2[:, 1]
    return -jax.nn.log_sigmoid(h_B), r_B2, (n_B2[:, 0] > 0) & (n_B2[:, 1] > 0)


def sums(loss_B, r_B2, pair_B) -> dict:
    """The batch sums the train step divides by the whole batch's pair count."""
    w_B = pair_B.astype(jnp.float32)
    return {"loss": jnp.sum(w_B * loss_B), "rewards_chosen": jnp.sum(w_B * r_B2[:, 0]),
            "rewards_rejected": jnp.sum(w_B * r_B2[:, 1]), "reward_margin": jnp.sum(w_B * (r_B2[:, 0] - r_B2[:, 1])),
            "reward_accuracy": jnp.sum(w_B * (r_B2[:, 0] > r_B2[:, 1]))}


def pairs(batch: dict) -> jax.Array:
    """Rows of the batch that hold a pair (float32 scalar)."""
    seg_BL, on_BL = batch["segment_ids"], batch["loss_mask"] > 0
    both_B = jnp.any(on_BL & (seg_BL == 1), axis=1) & jnp.any(on_BL & (seg_BL == 2), axis=1)
    return jnp.sum(both_B.astype(jnp.float32))
