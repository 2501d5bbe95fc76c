"""Language modelling: the mean next-token cross-entropy over the tokens the loss mask keeps. A model
that predicts further ahead (DeepSeek-V3's multi-token prediction) adds each module's cross-entropy,
weighted (`side_loss`), and reports their mean as `mtp_loss`."""

from typing import NamedTuple

import jax.numpy as jnp

from maxlm.objectives import Terms, masked_tokens

FIELDS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


class LM(NamedTuple):
    mtp_weights: tuple[float, ...] = ()  # each multi-token prediction module's weight (mtp_weights below)
    fields = FIELDS
    reference = False
    tokens = staticmethod(masked_tokens)

    @staticmethod
    def denominator(batch: dict):
        return jnp.maximum(masked_tokens(batch), 1.0)

    def terms(self, forward, params, ref, mb: dict, denom, stack) -> Terms:
        s = forward.token_losses(params, mb, stack)
        loss = jnp.sum(s.tok_BL) / denom
        if s.ahead_NBL is None:
            return Terms(loss, 0.0, s.aux, s.moe, {})
        # DeepSeek-V3's L_MTP: each module's summed cross-entropy over the batch's token count, weighted
        loss_N = jnp.sum(s.ahead_NBL, axis=(1, 2)) / denom
        side = jnp.sum(jnp.asarray(self.mtp_weights, jnp.float32) * loss_N)
        return Terms(loss, side, s.aux, s.moe, {"mtp_loss": jnp.mean(loss_N)})


def mtp_weights(cfg) -> tuple[float, ...]:
    """Each multi-token prediction module's loss weight: model.mtp_weights, one value w standing for w / depth
    each (DeepSeek-V3's lambda / D)."""
    w, n = cfg.model.mtp_weights, cfg.model.mtp_depth
    return tuple([w[0] / n] * n if len(w) == 1 else w)


def loss_sum(forward, params, batch: dict, stack=None):
    """Summed next-token cross-entropy over the kept tokens, and the number of those tokens: what a held-out
    evaluation adds up (maxlm.evaluation)."""
    return jnp.sum(forward.token_losses(params, batch, stack).tok_BL), masked_tokens(batch)
