"""The jitted train step, composed from a built `Recipe` (maxlm.recipe): its objective's terms, run over
the batch by its schedule, with its transforms' state attached, then its optimizer's update. Everything
here is traced once and runs on device; nothing here reads the config."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from maxlm import transforms
from maxlm.state import TrainState


class Grads(NamedTuple):
    loss: jax.Array     # the objective over the batch (lm: mean cross-entropy over kept tokens; dpo: mean loss)
    aux: jax.Array      # the model's auxiliary loss (MoE), averaged over microbatches
    grads: Any          # gradient of loss + aux (+ the objective's side loss)
    tokens: jax.Array   # tokens the batch trains (its loss mask's)
    moe: Any            # MoE expert load and drops, summed over the batch (decoder.Hidden.moe), or None
    metrics: dict       # the objective's own (dpo: the rewards; multi-token prediction: mtp_loss)
    next_extras: dict = {}  # the next values of the extras whose gradient is their next value (FP8's scaling state)


def grads(params, batch: dict, recipe, extras: dict | None = None, key=None) -> Grads:
    """The recipe's objective over the whole batch, its gradient and what comes with it. `extras` are the
    transforms' state (TrainState.extras); `key` the step's random key for a transform that wants one.

    Each microbatch's summed loss is divided by the *whole* batch's denominator (tokens, pairs), so the
    result is the same function of the data for any number of microbatches."""
    ts, objective, extras = recipe.transforms, recipe.objective, extras or {}
    denom = objective.denominator(batch)
    ref = transforms.reference(ts, extras) if objective.reference else None
    merges = transforms.merges(ts)

    def terms(p, diff, mb, stack):
        run = transforms.attach(ts, p, {**extras, **diff}, key)
        return objective.terms(recipe.forward, run, ref, mb, denom, stack)

    diff = {k: extras[k] for k in merges}
    t, g, nxt = recipe.schedule.value_and_grad(terms, params, diff, merges, batch)
    return Grads(t.loss, t.aux, g, objective.tokens(batch), t.moe, t.metrics, nxt)


def train_step(state: TrainState, batch: dict, recipe) -> tuple[TrainState, dict]:
    ts = recipe.transforms
    key = None
    if any(t.wants_key for t in ts):  # fold_in(rng, step): a resumed run draws the same
        key = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step))
    out = grads(state.params, batch, recipe, state.extras, key)
    updates, opt_state = recipe.tx.update(out.grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.tree.norm(out.grads)
    metrics = {"loss": out.loss, "grad_norm": grad_norm, "lr": recipe.lr(state.step), "tokens": out.tokens,
               **out.metrics, **(recipe.batch.metrics(batch) if recipe.batch.metrics else {}),
               **recipe.forward.metrics(out.aux, out.moe)}
    extras = transforms.update(ts, state.extras, out)
    if recipe.skip_nonfinite:
        # A non-finite step leaves params, moments and the transforms' state exactly as they were (an inf
        # amax would otherwise pin an FP8 scale for its whole history); the host counts the skips.
        ok = jnp.isfinite(out.loss) & jnp.isfinite(grad_norm)
        params, opt_state, extras = jax.tree.map(lambda new, old: jnp.where(ok, new, old), (params, opt_state, extras),
                                                 (state.params, state.opt_state, {k: state.extras[k] for k in extras}))
        metrics["skipped"] = (~ok).astype(jnp.int32)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                         extras={**state.extras, **extras}), metrics
