"""Group Relative Policy Optimization over sampled completions (Shao et al. 2024, DeepSeekMath), with the
variants users ask for, named as TRL's GRPOTrainer names them (its `loss_type`):

  grpo     each completion's mean token loss, averaged over the completions (the paper's)
  dapo     the token losses summed over the batch's completion tokens, over their count (DAPO, Yu et al. 2025:
           a long completion weighs as much as its tokens)
  dr_grpo  the token losses summed, over completions x the longest completion allowed (Dr. GRPO, Liu et al.
           2025: no per-length normalisation)

Each completion token's loss is the clipped surrogate -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), with
r = pi(token) / pi_old(token) and A the completion's advantage (normalised within its group when the
rollout scored it), plus beta times the k3 estimate of KL(pi || ref), exp(ref - logp) - (ref - logp) - 1,
when beta > 0 (times r by default: DeepSeek-V3.2's unbiased form, as TRL computes it). eps_high above eps_low is DAPO's clip-higher. Log-probabilities are of softmax(logits /
temperature), the distribution the sampler drew from.

A row holds one completion after its prompt (`loss_mask` on the completion's tokens), its advantage and
the old policy's log-probabilities of its targets (`old_logp`, the trainer's forward at rollout time: the
first update's ratio is exactly 1).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from maxlm.batch import Field
from maxlm.objectives import Terms, masked_tokens
from maxlm.objectives.lm import FIELDS

LOSSES = ("grpo", "dapo", "dr_grpo")


def fields(L: int) -> tuple[Field, ...]:
    """What a rollout adds to its packed rows: each completion's advantage, and its old log-probabilities."""
    return (Field("advantages", (), "float32", ("batch",)), Field("old_logp", (L,), "float32", ("batch", "length")))


class GRPO(NamedTuple):
    loss: str = "grpo"            # grpo | dapo | dr_grpo (above)
    eps_low: float = 0.2
    eps_high: float = 0.2
    beta: float = 0.0             # the KL penalty's weight; 0 needs no reference model
    kl_ratio: bool = True         # the KL term times the ratio r (DeepSeek-V3.2's unbiased estimate; TRL's default)
    temperature: float = 1.0      # the sampler's
    max_new_tokens: int = 0       # dr_grpo's constant: the longest completion allowed
    fields = FIELDS + ("advantages", "old_logp")
    tokens = staticmethod(masked_tokens)

    @property
    def reference(self) -> bool:
        return self.beta > 0

    def denominator(self, batch: dict) -> dict:
        """The whole batch's completions and completion tokens; the loss divides by the first, the second or
        completions x max_new_tokens, and the token metrics by the second."""
        rows = jnp.float32(batch["advantages"].shape[0])
        tokens = jnp.maximum(masked_tokens(batch), 1.0)
        loss = {"grpo": rows, "dapo": tokens, "dr_grpo": rows * self.max_new_tokens}[self.loss]
        return {"loss": loss, "tokens": tokens}

    def terms(self, forward, params, ref, mb: dict, denom: dict, stack) -> Terms:
        s = forward.token_losses(params, mb, stack, self.temperature)
        mask_BL = mb["loss_mask"].astype(jnp.float32)
        logp_BL = -s.tok_BL
        ratio_BL = jnp.exp(logp_BL - mb["old_logp"]) * mask_BL
        a_B1 = mb["advantages"][:, None]
        clipped_BL = jnp.clip(ratio_BL, 1.0 - self.eps_low, 1.0 + self.eps_high)
        tok_BL = -jnp.minimum(ratio_BL * a_B1, clipped_BL * a_B1)
        metrics = {}
        if self.reference:  # the reference pass: forward only, no gradient reaches it
            ref_BL = jax.lax.stop_gradient(-forward.token_losses(ref, mb, stack, self.temperature).tok_BL)
            kl_BL = (jnp.exp(ref_BL - logp_BL) - (ref_BL - logp_BL) - 1.0) * mask_BL
            if self.kl_ratio:
                kl_BL = kl_BL * ratio_BL
            tok_BL = tok_BL + self.beta * kl_BL
            metrics["kl"] = jnp.sum(kl_BL) / denom["tokens"]
        tok_BL = tok_BL * mask_BL
        if self.loss == "grpo":
            loss = jnp.sum(jnp.sum(tok_BL, axis=1) / jnp.maximum(jnp.sum(mask_BL, axis=1), 1.0)) / denom["loss"]
        else:
            loss = jnp.sum(tok_BL) / denom["loss"]
        # The shares of completion tokens the clip held, below and above (as TRL counts them).
        low = (ratio_BL < 1.0 - self.eps_low) & (a_B1 < 0)
        high = (ratio_BL > 1.0 + self.eps_high) & (a_B1 > 0)
        metrics.update(clip_low=jnp.sum(low * mask_BL) / denom["tokens"], clip_high=jnp.sum(high * mask_BL) / denom["tokens"],
                       ratio=jnp.sum(ratio_BL) / denom["tokens"])
        return Terms(loss, 0.0, s.aux, s.moe, metrics)
