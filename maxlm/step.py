"""Loss and the jitted train step (the optimizer is maxlm.optim). Everything here is traced once and runs on device."""

from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax

from maxlm import models, pipeline, preference, remat, transforms
from maxlm.layers import attention, loss, ring
from maxlm.models import decoder
from maxlm.optim import schedule
from maxlm.sharding import constrain

BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


@flax.struct.dataclass
class TrainState:
    step: jax.Array       # optimizer steps taken (skipped ones included: they consumed their batch)
    params: Any           # the trained parameters, and nothing else (LoRA: the adapters)
    opt_state: Any
    rng: jax.Array        # raw uint32 key data. A layer that draws random numbers (LoRA dropout) uses
                          # fold_in(rng, step), which resume then reproduces bitwise.
    extras: dict = flax.struct.field(default_factory=dict)  # the transforms' state by name (maxlm.transforms):
                          # checkpointed (FP8 scaling, the router bias) or rebuilt at every start (frozen weights)


def token_losses(params, batch: dict, cfg):
    """Next-token cross-entropy of every position [B, L] (zero where `loss_mask` is 0, padding), the
    model's auxiliary loss (MoE load balancing; 0 for dense models), its MoE expert load (or None), and
    for a model that predicts further ahead (multi-token prediction) each module's cross-entropy [N, B, L]
    against the target k + 1 positions on (or None). With the sequence split over devices (mesh.context),
    the model runs on the ring's zig-zag layout (layers.ring) and the losses come back in the batch's order."""
    model, m = models.get(cfg.model.family), cfg.model
    _, ring_size = attention.context_axis()
    if ring_size > 1:
        batch = {k: ring.to_zigzag(x_BL, ring_size) for k, x_BL in batch.items()}
    out = model.forward(params, batch["inputs"], batch["positions"], batch["segment_ids"], m, jnp.dtype(cfg.dtype),
                        remat.wrap(cfg.remat), attend=attention.attend_fn(cfg.attention, m, cfg.dtype))
    ce = loss.cross_entropy if cfg.chunked_loss else loss.reference
    tok_BL = ce(out.x_BLD, decoder.head(params, m), batch["targets"], batch["loss_mask"], softcap=m.final_softcap)
    ahead_NBL = None
    if out.ahead is not None:
        ahead_NBL = jnp.stack([ce(x_BLD, decoder.head(params, m), *loss.ahead(batch, k + 1), softcap=m.final_softcap)
                               for k, x_BLD in enumerate(out.ahead)])
    if ring_size > 1:
        tok_BL = ring.from_zigzag(tok_BL, ring_size)  # (config refuses multi-token prediction with a ring)
    return tok_BL, out.aux_loss, out.moe, ahead_NBL


def loss_sum(params, batch: dict, cfg) -> tuple[jax.Array, jax.Array]:
    """Summed next-token cross-entropy over unmasked tokens, and the number of those tokens."""
    return jnp.sum(token_losses(params, batch, cfg)[0]), jnp.sum(batch["loss_mask"].astype(jnp.float32))


class Grads(NamedTuple):
    loss: jax.Array    # the objective over the batch: mean cross-entropy over unmasked tokens, or mean DPO loss
    aux: jax.Array     # the model's auxiliary loss (MoE), averaged over microbatches
    grads: Any         # gradient of loss + aux
    tokens: jax.Array  # unmasked tokens
    moe: Any           # MoE expert load and drops, summed over microbatches (decoder.Hidden.moe), or None
    extra: dict        # objective=dpo: the rewards' means (preference.sums over the pairs); else {}
    extra_grads: dict = {}  # the differentiated extras' next values (FP8's scaling state), merged over microbatches


def _objective(run, ref, mb, cfg, denom):
    """One microbatch's share of the objective (summed, divided by the whole batch's `denom`), the MoE
    aux loss and load, and the dpo sums. `run` are the params being trained, `ref` DPO's reference."""
    tok_BL, aux, moe, ahead_NBL = token_losses(run, mb, cfg)
    if cfg.objective == "lm" and ahead_NBL is not None:
        # DeepSeek-V3's L_MTP: each module's summed cross-entropy over the batch's token count, weighted
        loss_N = jnp.sum(ahead_NBL, axis=(1, 2)) / denom
        return jnp.sum(tok_BL) / denom, aux, moe, {"mtp_loss": jnp.mean(loss_N)}, jnp.sum(mtp_weights(cfg) * loss_N)
    if cfg.objective == "lm":
        return jnp.sum(tok_BL) / denom, aux, moe, {}, 0.0
    logp_B2, n_B2 = preference.pair_logps(tok_BL, mb)
    ref_B2 = jnp.zeros_like(logp_B2)
    if cfg.dpo.loss != "simpo":  # the reference pass: forward only, no gradient reaches it
        ref_B2 = jax.lax.stop_gradient(preference.pair_logps(token_losses(ref, mb, cfg)[0], mb)[0])
    sums = {k: v / denom for k, v in preference.sums(*preference.losses(logp_B2, ref_B2, n_B2, cfg.dpo)).items()}
    return sums.pop("loss"), aux, moe, sums, 0.0


def mtp_weights(cfg) -> jax.Array:
    """Each multi-token prediction module's loss weight: model.mtp_weights, one value w standing for w / depth
    each (DeepSeek-V3's lambda / D)."""
    w, n = cfg.model.mtp_weights, cfg.model.mtp_depth
    return jnp.asarray([w[0] / n] * n if len(w) == 1 else list(w), jnp.float32)


def grads(params, batch: dict, cfg, extras: dict | None = None, key=None) -> Grads:
    """Objective, auxiliary loss, the gradient of their sum, the token count, the MoE load, the DPO
    rewards and the differentiated extras' next values over the whole batch, accumulated over
    `cfg.microbatches`. `extras` are the transforms' state (TrainState.extras); `key` the step's random
    key for a transform that wants one.

    Each microbatch's summed loss is divided by the token (DPO: pair) count of the *whole* batch, so the
    result is the same function of the data for any number of microbatches.
    """
    ts, extras = transforms.build(cfg), extras or {}
    n_tok = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
    denom = n_tok if cfg.objective == "lm" else jnp.maximum(preference.pairs(batch), 1.0)
    ref = transforms.reference(ts, extras) if cfg.objective == "dpo" else None
    merges = {k: e.merge for k, e in transforms.extras(ts).items() if e.merge}
    # With mesh.stage > 1 the pipeline runs the microbatches itself, not one after another.
    M = 1 if pipeline.stages() > 1 else cfg.microbatches

    def objective(p_and_diff, mb):
        # The auxiliary loss is a mean per microbatch, so it is averaged over them.
        run = transforms.attach(ts, p_and_diff[0], {**extras, **p_and_diff[1]}, key)
        loss, aux, moe, extra, mtp = _objective(run, ref, mb, cfg, denom)
        return loss + aux / M + mtp, (loss, aux / M, moe, extra)

    # The differentiated extras' "gradients" are their next values.
    grad_fn = jax.value_and_grad(objective, has_aux=True)
    diff = {k: extras[k] for k in merges}
    if M == 1:
        with pipeline.schedule(cfg.microbatches, cfg.pipeline_repeats):
            (_, (loss, aux, moe, extra)), (g, s) = grad_fn((params, diff), batch)
        return Grads(loss, aux, g, n_tok, moe, extra, s)

    def split(x_BL):
        # Microbatch m takes rows m, m+M, ...: every device keeps its own rows, nothing moves.
        x_MBL = x_BL.reshape(x_BL.shape[0] // M, M, *x_BL.shape[1:]).swapaxes(0, 1)
        return constrain(x_MBL, (None, "batch", "length"))

    def body(acc, mb):
        (_, out), (g, s) = grad_fn((params, diff), mb)
        # Gradients add up; a differentiated extra combines by its own merge (FP8: the max).
        return (jax.tree.map(jnp.add, acc[0], g), {k: merges[k](acc[1][k], v) for k, v in s.items()}), out

    zeros = jax.tree.map(jnp.zeros_like, (params, diff))
    (g, s), outs = jax.lax.scan(body, zeros, jax.tree.map(split, batch))
    loss, aux, moe, extra = jax.tree.map(lambda x: jnp.sum(x, axis=0), outs)  # the small outputs were stacked
    return Grads(loss, aux, g, n_tok, moe, extra, s)


def masked_fraction(batch: dict) -> jax.Array:
    """Per row, the share of its tokens (padding aside) that the loss mask leaves out: prompts, system text."""
    real_BL = batch["segment_ids"] > 0
    kept_B = jnp.sum((batch["loss_mask"] > 0) & real_BL, axis=1)
    return 1.0 - kept_B / jnp.maximum(jnp.sum(real_BL, axis=1), 1)


def train_step(state: TrainState, batch: dict, cfg, tx) -> tuple[TrainState, dict]:
    ts = transforms.build(cfg)
    key = None
    if any(t.wants_key for t in ts):  # fold_in(rng, step): a resumed run draws the same
        key = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step))
    out = grads(state.params, batch, cfg, state.extras, key)
    updates, opt_state = tx.update(out.grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.tree.norm(out.grads)
    metrics = {"loss": out.loss, "grad_norm": grad_norm, "lr": schedule(cfg)(state.step), "tokens": out.tokens, **out.extra}
    if cfg.data.format != "text":
        frac_B = masked_fraction(batch)
        metrics.update(masked_frac=jnp.mean(frac_B), masked_frac_max=jnp.max(frac_B))
    if cfg.model.n_experts:
        metrics.update(moe_aux_loss=out.aux, moe_load=out.moe["load"], moe_dropped=jnp.sum(out.moe["dropped"]))
    extras = transforms.update(ts, state.extras, out)
    if cfg.nan_policy == "skip":
        # A non-finite step leaves params, moments and the transforms' state exactly as they were (an inf
        # amax would otherwise pin an FP8 scale for its whole history); the host counts the skips.
        ok = jnp.isfinite(out.loss) & jnp.isfinite(grad_norm)
        params, opt_state, extras = jax.tree.map(lambda new, old: jnp.where(ok, new, old), (params, opt_state, extras),
                                                 (state.params, state.opt_state, {k: state.extras[k] for k in extras}))
        metrics["skipped"] = (~ok).astype(jnp.int32)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                         extras={**state.extras, **extras}), metrics
