"""What a train step minimises. An objective implements:

  fields                 the batch fields it reads, by name (the batch's schema, maxlm.batch, declares them)
  reference              True when it needs a reference model, the frozen weights as the run started (DPO):
                         the transforms then keep one (transforms.build)
  denominator(batch)     what its summed loss is divided by, over the whole batch (tokens, pairs), so that a
                         step is the same function of the data for any microbatch split
  tokens(batch)          the tokens the batch trains, reported as `tokens`
  terms(forward, params, ref, mb, denom, stack) -> Terms
                         one microbatch's share: `forward` the model as the step runs it (maxlm.forward),
                         `params` what trains with the transforms attached, `ref` the reference model's
                         params (or None), `stack` the schedule's (maxlm.schedules)

`LM` (next-token cross-entropy, with multi-token prediction's weighted terms), `DPO` (DPO and SimPO on
preference pairs) and `GRPO` (GRPO and its DAPO and Dr. GRPO variants on sampled completions) are the three;
another is one module here and a line in `build`.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Terms(NamedTuple):
    """One microbatch's share of a step. The schedule differentiates loss + side_loss + aux and sums the rest
    over the microbatches (maxlm.schedules)."""
    loss: jax.Array       # the objective's share: summed over the microbatch, divided by the whole batch's
                          # denominator; logged as `loss`
    side_loss: Any        # further trained terms not logged as `loss` (multi-token prediction's), or 0.0
    aux: jax.Array        # the model's auxiliary loss over this microbatch (MoE; 0 for dense models)
    moe: Any              # the model's MoE load and drops over this microbatch (decoder.Hidden.moe), or None
    metrics: dict         # the objective's own metrics, each a share like `loss`


def masked_tokens(batch: dict) -> jax.Array:
    """Tokens the loss mask keeps (float32 scalar)."""
    return jnp.sum(batch["loss_mask"].astype(jnp.float32))


def build(cfg):
    """The run's objective (the config's `objective`)."""
    from maxlm.objectives import dpo, grpo, lm

    if cfg.objective == "dpo":
        return dpo.DPO(cfg.dpo.loss, cfg.dpo.beta, cfg.dpo.gamma)
    if cfg.objective == "grpo":
        r = cfg.rl
        return grpo.GRPO(r.loss, r.eps_low, r.eps_high, r.beta, r.kl_ratio, r.temperature, r.max_new_tokens)
    return lm.LM(lm.mtp_weights(cfg) if cfg.model.mtp_depth else ())
