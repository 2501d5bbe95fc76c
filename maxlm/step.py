"""Loss, optimizer and the jitted train step. Everything here is traced once and runs on device."""

from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax

from maxlm import models, remat
from maxlm.layers import attention, loss, ring
from maxlm.models import decoder
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
    router_bias: Any = None  # MoE with model.router_bias_rate > 0: [n_layers, n_experts] float32, the
                             # selection bias of loss-free balancing. State, not a param: no gradient, no AdamW.

    def model_params(self):
        """The params the model runs with: `params`, plus the router bias when there is one. Works on the
        shardings and abstract trees of a state too."""
        return model_params(self.params, self.router_bias)


def model_params(params, router_bias):
    if router_bias is None:
        return params
    return {**params, "layers": {**params["layers"], "router_bias": router_bias}}


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


def token_losses(params, batch: dict, cfg):
    """Next-token cross-entropy of every position [B, L] (zero where `loss_mask` is 0, padding), the
    model's auxiliary loss (MoE load balancing; 0 for dense models) and its MoE expert load (or None).
    With the sequence split over devices (mesh.context), the model runs on the ring's zig-zag layout
    (layers.ring) and the losses come back in the batch's order."""
    model, m = models.get(cfg.model.family), cfg.model
    _, ring_size = attention.context_axis()
    if ring_size > 1:
        batch = {k: ring.to_zigzag(x_BL, ring_size) for k, x_BL in batch.items()}
    out = model.forward(params, batch["inputs"], batch["positions"], batch["segment_ids"], m, jnp.dtype(cfg.dtype),
                        remat.wrap(cfg.remat), attend=attention.attend_fn(cfg.attention, m, cfg.dtype))
    ce = loss.cross_entropy if cfg.chunked_loss else loss.reference
    tok_BL = ce(out.x_BLD, decoder.head(params, m), batch["targets"], batch["loss_mask"], softcap=m.final_softcap)
    if ring_size > 1:
        tok_BL = ring.from_zigzag(tok_BL, ring_size)
    return tok_BL, out.aux_loss, out.moe


def loss_sum(params, batch: dict, cfg) -> tuple[jax.Array, jax.Array]:
    """Summed next-token cross-entropy over unmasked tokens, and the number of those tokens."""
    return jnp.sum(token_losses(params, batch, cfg)[0]), jnp.sum(batch["loss_mask"].astype(jnp.float32))


class Grads(NamedTuple):
    loss: jax.Array    # mean cross-entropy over the batch's unmasked tokens
    aux: jax.Array     # the model's auxiliary loss (MoE), averaged over microbatches
    grads: Any         # gradient of loss + aux
    tokens: jax.Array  # unmasked tokens
    moe: Any           # MoE expert load and drops, summed over microbatches (decoder.Hidden.moe), or None


def grads(params, batch: dict, cfg, router_bias=None) -> Grads:
    """Loss, auxiliary loss, the gradient of their sum, the token count and the MoE load over the whole
    batch, accumulated over `cfg.microbatches`.

    Each microbatch's summed loss is divided by the token count of the *whole* batch, so the result is
    the same function of the data for any number of microbatches.
    """
    n_tok = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
    M = cfg.microbatches

    def objective(p, mb):
        # The auxiliary loss is a mean per microbatch, so it is averaged over them.
        tok_BL, aux, moe = token_losses(model_params(p, router_bias), mb, cfg)
        ce = jnp.sum(tok_BL) / n_tok
        return ce + aux / M, (ce, aux / M, moe)

    grad_fn = jax.value_and_grad(objective, has_aux=True)
    if M == 1:
        (_, (ce, aux, moe)), g = grad_fn(params, batch)
        return Grads(ce, aux, g, n_tok, moe)

    def split(x_BL):
        # Microbatch m takes rows m, m+M, ...: every device keeps its own rows, nothing moves.
        x_MBL = x_BL.reshape(x_BL.shape[0] // M, M, *x_BL.shape[1:]).swapaxes(0, 1)
        return constrain(x_MBL, (None, "batch", "length"))

    def body(g_acc, mb):
        (_, out), g = grad_fn(params, mb)
        return jax.tree.map(jnp.add, g_acc, g), out  # the small outputs are stacked, then summed

    g, outs = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), jax.tree.map(split, batch))
    ce, aux, moe = jax.tree.map(lambda x: jnp.sum(x, axis=0), outs)
    return Grads(ce, aux, g, n_tok, moe)


def balance_bias(router_bias, load_LE, rate: float):
    """DeepSeek-V3's loss-free balancing step: each expert's bias moves by `rate` toward even load, up
    when it had fewer assignments than its layer's mean, down when more (the step's whole batch)."""
    return router_bias + rate * jnp.sign(jnp.mean(load_LE, axis=-1, keepdims=True) - load_LE)


def train_step(state: TrainState, batch: dict, cfg, tx) -> tuple[TrainState, dict]:
    loss, aux, g, n_tok, moe = grads(state.params, batch, cfg, state.router_bias)
    updates, opt_state = tx.update(g, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.tree.norm(g)
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(cfg)(state.step), "tokens": n_tok}
    bias = state.router_bias
    if cfg.model.n_experts:
        metrics.update(moe_aux_loss=aux, moe_load=moe["load"], moe_dropped=jnp.sum(moe["dropped"]))
        if bias is not None:
            bias = balance_bias(bias, moe["load"], cfg.model.router_bias_rate)
    if cfg.nan_policy == "skip":
        # A non-finite step leaves params, moments and bias exactly as they were; the host counts the skips.
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params, opt_state, bias = jax.tree.map(lambda new, old: jnp.where(ok, new, old),
                                               (params, opt_state, bias), (state.params, state.opt_state, state.router_bias))
        metrics["skipped"] = (~ok).astype(jnp.int32)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state, router_bias=bias), metrics
