"""Loss, optimizer and the jitted train step. Everything here is traced once and runs on device."""

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from maxlm import models, remat
from maxlm.layers import attention
from maxlm.models import params as P_
from maxlm.sharding import constrain

BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


@flax.struct.dataclass
class TrainState:
    step: jax.Array       # optimizer steps taken (skipped ones included: they consumed their batch)
    params: Any
    opt_state: Any
    rng: jax.Array        # raw uint32 key data. No layer draws random numbers yet; one that does (dropout,
                          # router jitter) must use fold_in(rng, step), which resume then reproduces bitwise.


def schedule(cfg) -> optax.Schedule:
    o = cfg.optim
    if o.schedule == "constant":
        return optax.join_schedules(
            [optax.linear_schedule(0.0, o.lr, max(o.warmup_steps, 1)), optax.constant_schedule(o.lr)],
            [o.warmup_steps])
    decay_steps = o.decay_steps or cfg.steps
    return optax.warmup_cosine_decay_schedule(
        0.0, o.lr, o.warmup_steps, max(decay_steps, o.warmup_steps + 1), end_value=o.lr * o.min_lr_ratio)


def decay_mask(specs):
    """Randomly initialised weights (matrices, embeddings, the router) are decayed; constant-initialised
    ones (norm gains, biases) are not: decay would pull them towards zero, not towards a simpler function."""
    return jax.tree.map(lambda s: s.init not in (P_.ones, P_.zeros), specs, is_leaf=P_.is_param)


def optimizer(cfg, specs) -> optax.GradientTransformation:
    """AdamW with its schedule and clipping, over the model's param spec tree."""
    o = cfg.optim
    adamw = optax.adamw(schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask(specs))
    return optax.chain(optax.clip_by_global_norm(o.grad_clip), adamw) if o.grad_clip > 0 else adamw


def token_losses(params, batch: dict, cfg) -> tuple[jax.Array, jax.Array]:
    """Next-token cross-entropy of every position [B, L] (zero where `loss_mask` is 0, padding), and the
    model's auxiliary loss (MoE load balancing; 0 for dense models)."""
    model = models.get(cfg.model.family)
    out = model.forward(params, batch["inputs"], batch["positions"], batch["segment_ids"],
                        cfg.model, jnp.dtype(cfg.dtype), remat.wrap(cfg.remat),
                        attend=attention.attend_fn(cfg.attention, cfg.model, cfg.dtype))
    logits_BLV = model.unembed(params, out.x_BLD, cfg.model)
    logz_BL = jax.nn.logsumexp(logits_BLV, axis=-1)
    tgt_BL = jnp.take_along_axis(logits_BLV, batch["targets"][..., None], axis=-1)[..., 0]
    return (logz_BL - tgt_BL) * batch["loss_mask"].astype(jnp.float32), out.aux_loss


def loss_sum(params, batch: dict, cfg) -> tuple[jax.Array, jax.Array]:
    """Summed next-token cross-entropy over unmasked tokens, and the number of those tokens."""
    return jnp.sum(token_losses(params, batch, cfg)[0]), jnp.sum(batch["loss_mask"].astype(jnp.float32))


def grads(params, batch: dict, cfg) -> tuple[jax.Array, jax.Array, Any, jax.Array]:
    """Mean cross-entropy, auxiliary loss, the gradient of their sum, and the token count, over the
    whole batch, accumulated over `cfg.microbatches`.

    Each microbatch's summed loss is divided by the token count of the *whole* batch, so the result is
    the same function of the data for any number of microbatches.
    """
    n_tok = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
    M = cfg.microbatches

    def objective(p, mb):
        # The auxiliary loss is a mean per microbatch, so it is averaged over them.
        tok_BL, aux = token_losses(p, mb, cfg)
        ce = jnp.sum(tok_BL) / n_tok
        return ce + aux / M, (ce, aux / M)

    grad_fn = jax.value_and_grad(objective, has_aux=True)
    if M == 1:
        (_, (ce, aux)), g = grad_fn(params, batch)
        return ce, aux, g, n_tok

    def split(x_BL):
        # Microbatch m takes rows m, m+M, ...: every device keeps its own rows, nothing moves.
        x_MBL = x_BL.reshape(x_BL.shape[0] // M, M, *x_BL.shape[1:]).swapaxes(0, 1)
        return constrain(x_MBL, (None, "batch", "length"))

    def body(carry, mb):
        ce_acc, aux_acc, g_acc = carry
        (_, (ce, aux)), g = grad_fn(params, mb)
        return (ce_acc + ce, aux_acc + aux, jax.tree.map(jnp.add, g_acc, g)), None

    zero = jnp.zeros((), jnp.float32)
    (ce, aux, g), _ = jax.lax.scan(body, (zero, zero, jax.tree.map(jnp.zeros_like, params)), jax.tree.map(split, batch))
    return ce, aux, g, n_tok


def train_step(state: TrainState, batch: dict, cfg, tx) -> tuple[TrainState, dict]:
    loss, aux, g, n_tok = grads(state.params, batch, cfg)
    updates, opt_state = tx.update(g, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.tree.norm(g)
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(cfg)(state.step), "tokens": n_tok}
    if cfg.model.n_experts:
        metrics["moe_aux_loss"] = aux
    if cfg.nan_policy == "skip":
        # A non-finite step leaves params and moments exactly as they were; the host counts the skips.
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params, opt_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old),
                                         (params, opt_state), (state.params, state.opt_state))
        metrics["skipped"] = (~ok).astype(jnp.int32)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics
