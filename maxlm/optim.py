"""The optimizers (AdamW, Muon) and the learning-rate schedules, built from the config and the trained
params' spec tree (models.params): which weights Muon takes, and how it sees each one as a stack of
matrices, follow from their logical axis names, so a new family needs nothing here."""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers

from maxlm import sharding
from maxlm.models import params as P_

# ---- Schedules ---------------------------------------------------------------------------------------

# What remains of the peak (above the floor) at progress p in [0, 1] of a WSD decay. sqrt is 1 - sqrt(p)
# (Hägele et al. 2024: it beat linear and matched cosine-to-the-end over the same compute).
DECAY_SHAPES = {"linear": lambda p: 1.0 - p, "sqrt": lambda p: 1.0 - jnp.sqrt(p),
                "cosine": lambda p: 0.5 * (1.0 + jnp.cos(jnp.pi * p))}


def schedule(cfg) -> optax.Schedule:
    """The learning rate at each optimizer step (0-based), after a linear warmup from 0: cosine to
    lr * min_lr_ratio over decay_steps (0: steps) counted from step 0; constant; or wsd, constant until
    the last decay_steps steps of the run, which decay to lr * min_lr_ratio along optim.decay_shape
    (reaching it at step `steps`, the one after the last)."""
    o = cfg.optim
    warmup = optax.linear_schedule(0.0, o.lr, max(o.warmup_steps, 1))
    if o.schedule == "constant":
        return optax.join_schedules([warmup, optax.constant_schedule(o.lr)], [o.warmup_steps])
    if o.schedule == "wsd":
        # Every step before `steps - decay_steps` reads only the warmup and the constant: raising `steps`
        # before the decay has begun changes nothing already trained.
        return optax.join_schedules([warmup, optax.constant_schedule(o.lr), _decay(o, o.decay_steps)],
                                    [o.warmup_steps, cfg.steps - o.decay_steps])
    decay_steps = o.decay_steps or cfg.steps
    return optax.warmup_cosine_decay_schedule(
        0.0, o.lr, o.warmup_steps, max(decay_steps, o.warmup_steps + 1), end_value=o.lr * o.min_lr_ratio)


def _decay(o, n: int) -> optax.Schedule:
    shape = DECAY_SHAPES[o.decay_shape]

    def decay(count):  # steps since the decay began
        left = shape(jnp.clip(count / n, 0.0, 1.0))
        return o.lr * (o.min_lr_ratio + (1.0 - o.min_lr_ratio) * left)
    return decay


# ---- AdamW -------------------------------------------------------------------------------------------

def decay_mask(specs):
    """Randomly initialised weights (matrices, embeddings, the router) are decayed; constant-initialised
    ones (norm gains, biases) are not: decay would pull them towards zero, not towards a simpler function."""
    return jax.tree.map(P_.is_drawn, specs, is_leaf=P_.is_param)


def optimizer(cfg, specs) -> optax.GradientTransformation:
    """optim.name's optimizer with its schedule, decoupled weight decay and clipping, over the trained
    params' spec tree (LoRA: the adapters, all of them decayed: they are matrices, B's zero start
    notwithstanding)."""
    o = cfg.optim
    mask = jax.tree.map(lambda _: True, specs, is_leaf=P_.is_param) if cfg.lora.rank else decay_mask(specs)
    if o.name == "muon":
        tx = optax.chain(scale_by_muon_adamw(muon_dims(specs), o.b1, o.b2, o.eps, P_.axes(specs)),
                         optax.add_decayed_weights(o.weight_decay, mask), optax.scale_by_learning_rate(schedule(cfg)))
    else:
        tx = optax.adamw(schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=mask)
    return optax.chain(optax.clip_by_global_norm(o.grad_clip), tx) if o.grad_clip > 0 else tx


# ---- Muon --------------------------------------------------------------------------------------------

# Keller Jordan's recipe (modded-nanogpt), as Moonlight (Liu et al. 2025, "Muon is Scalable for LLM
# Training") trains with it: Nesterov momentum 0.95, five quintic Newton-Schulz steps.
MUON_BETA = 0.95
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
# Moonlight's scaling: an orthogonalised m x n update has RMS 1/sqrt(max(m, n)); times 0.2 sqrt(max(m, n))
# it has AdamW's typical RMS (0.2-0.4), so AdamW's lr and weight decay carry over unchanged.
RMS = 0.2

# How a logical axis enters Muon's matrix view of a weight. maxlm stores every weight the way its einsum
# reads it, x[..., in] @ W[in, out]: batch axes first, then the contracted (fan-in) axes, then the output
# (fan-out) axes. The one axis that tells in from out is the residual width: a weight that reads the
# residual stream (q/k/v, the MLP's up and gate, MLA's down-projections) starts with `embed`, one that
# writes to it (o, the MLP's down, MTP's w_eh) ends with it; the other axes go to the other side.
AXIS_ROLE = {"layers": "batch", "stack": "batch", "experts": "batch", "embed": "residual"}
# Matrices inside the layer stack that are not hidden linear maps: the router's few outputs pick experts
# (Moonlight and Kimi K2 keep it on AdamW).
ADAMW_NAMES = ("router",)


def muon_dims(specs):
    """For each parameter, Muon's MuonDimensionNumbers (reduction = fan-in axes, output = fan-out axes, the
    remaining axes a batch of independent matrices), or None where AdamW trains it: what lies outside the
    layer stack (the embedding, the output head, GPT-2's position table, the final norm), the router,
    constant-initialised weights (norm gains, biases: one number per feature, not a linear map) and
    anything with fewer than two matrix axes."""
    return jax.tree_util.tree_map_with_path(_dims, specs, is_leaf=P_.is_param)


def _dims(path, s: P_.Param) -> MuonDimensionNumbers | None:
    name = getattr(path[-1], "key", None)
    mat = [i for i, a in enumerate(s.axes) if AXIS_ROLE.get(a) != "batch"]
    if not {"layers", "stack"} & set(s.axes) or name in ADAMW_NAMES or not P_.is_drawn(s) or len(mat) < 2:
        return None
    if s.axes[mat[0]] == "embed":
        return MuonDimensionNumbers(tuple(mat[:1]), tuple(mat[1:]))
    if s.axes[mat[-1]] == "embed":
        return MuonDimensionNumbers(tuple(mat[:-1]), tuple(mat[-1:]))
    raise ValueError(f"Muon cannot tell fan-in from fan-out axes of {jax.tree_util.keystr(path)} {s.axes}: "
                     f"a hidden weight starts or ends with `embed` (optim.AXIS_ROLE)")


def _is_dims(x) -> bool:
    return x is None or isinstance(x, MuonDimensionNumbers)


def orthogonalise(x: jax.Array, d: MuonDimensionNumbers, axes: tuple | None = None) -> jax.Array:
    """Newton-Schulz's approximation of U V^T for every matrix of `x` (U S V^T its SVD): the batch axes
    stay axes of their own and are never flattened into the matrix (nor into each other, so a sharded
    expert axis stays sharded). `axes`, the weight's logical axes, lets each device work on whole matrices
    of its share of the stack (`whole_matrices`)."""
    red, out = tuple(d.reduction_axis), tuple(d.output_axis)
    batch = tuple(i for i in range(x.ndim) if i not in red + out)
    there = whole_matrices(x, axes, batch, red + out)
    for spec in there:
        x = jax.lax.with_sharding_constraint(x, spec)
    order = batch + red + out
    moved = x.transpose(order)
    X = moved.reshape(*moved.shape[:len(batch)], math.prod(x.shape[i] for i in red), -1)
    tall = X.shape[-2] > X.shape[-1]
    if tall:  # iterate on the smaller Gram matrix
        X = X.mT
    X = X / (jnp.linalg.norm(X, axis=(-2, -1), keepdims=True) + NS_EPS)
    a, b, c = NS_COEFFS
    for _ in range(NS_STEPS):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    if tall:
        X = X.mT
    y = X.reshape(moved.shape).transpose(tuple(order.index(i) for i in range(x.ndim)))
    for spec in [*reversed(there[:-1]), sharding.active_spec(axes)] if there else []:  # the same way back
        y = jax.lax.with_sharding_constraint(y, spec)
    return y


def whole_matrices(x: jax.Array, axes: tuple | None, batch: tuple, matrix: tuple) -> list:
    """The shardings that take a weight-shaped `x` from its parameter's sharding to one where the first
    batch axis (the layer stack) also holds each mesh axis of the `matrices` rule that a matrix axis held,
    so that each device holds whole matrices of a share of the stack. One mesh axis moves per step: each
    step is an all-to-all, where GSPMD, asked for the whole move at once under fsdp x tensor, replicates
    the tensor instead. Left to itself, it gathers every sharded momentum matrix onto each device that
    holds a shard (Llama-3-8B on v5p-8: 78-80 GiB of all-gathers per chip per step at fsdp=4 or
    fsdp=2 x tensor=2; benchmarks/muon_hlo.py). [] without a mesh, axes or a stack."""
    if axes is None or not batch or jax.sharding.get_abstract_mesh().empty:
        return []
    tup = lambda a: () if a is None else (a,) if isinstance(a, str) else tuple(a)  # noqa: E731
    spec = sharding.active_spec(axes)
    cur = [tup(spec[i]) if i < len(spec) else () for i in range(x.ndim)]
    steps, stack = [], batch[0]
    for ax in tup(sharding.active_spec(("matrices",))[0]):
        src = next((i for i in matrix if ax in cur[i]), None)
        if src is None:
            continue
        cur[src] = tuple(a for a in cur[src] if a != ax)
        cur[stack] = (*cur[stack], ax)
        steps.append(P(*[c or None for c in cur]))
    return steps


def muon_scale(shape, d: MuonDimensionNumbers) -> float:
    fan_in = math.prod(shape[i] for i in d.reduction_axis)
    fan_out = math.prod(shape[i] for i in d.output_axis)
    return RMS * math.sqrt(max(fan_in, fan_out))


class MuonAdamWState(NamedTuple):
    count: jax.Array  # updates taken (AdamW's bias correction)
    momentum: Any     # every param's first moment: Muon's momentum, or AdamW's mu
    nu: Any           # AdamW's second moment (zeros, never read, for the Muon weights)


def scale_by_muon_adamw(dims, b1: float, b2: float, eps: float, axes=None) -> optax.GradientTransformation:
    """Muon's update (orthogonalised Nesterov momentum, scaled by muon_scale) for the weights `dims` gives
    MuonDimensionNumbers, Adam's (optax.scale_by_adam's arithmetic) for those it marks None; decay and
    the learning rate come after, as in optax.adamw.

    Why not optax.contrib.muon: its MuonDimensionNumbers handle stacked and multi-axis weights (the batch
    axes vmapped), but it joins Muon and AdamW with optax.partition, whose state holds masked trees
    (optax.MaskedNode in place of the other half's weights) that StateSpec's tree_map_params cannot shard
    without an is_leaf for MaskedNode; its AdamW half has no decay mask and shares Muon's eps and Nesterov
    switch. One transformation over whole trees keeps every slot of the state shaped and sharded like its
    parameter, at AdamW's memory (the Muon weights' unused nu slot). `axes`: the weights' logical axes
    (models.params.axes), with which Newton-Schulz runs on whole matrices under a mesh (`whole_matrices`)."""
    muon = lambda d: d is not None  # noqa: E731
    axes = jax.tree.map(lambda _: None, dims, is_leaf=_is_dims) if axes is None else axes

    def init(params):
        return MuonAdamWState(jnp.zeros([], jnp.int32), optax.tree.zeros_like(params), optax.tree.zeros_like(params))

    def update(g, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        mom = jax.tree.map(lambda d, g, m: optax.tree.update_moment(g, m, MUON_BETA if muon(d) else b1, 1),
                           dims, g, state.momentum, is_leaf=_is_dims)
        nu = jax.tree.map(lambda d, g, v: v if muon(d) else optax.tree.update_moment_per_elem_norm(g, v, b2, 2),
                          dims, g, state.nu, is_leaf=_is_dims)

        def direction(d, ax, g, m, v):
            if muon(d):  # Nesterov: the step looks one momentum update ahead
                return muon_scale(g.shape, d) * orthogonalise(MUON_BETA * m + (1 - MUON_BETA) * g, d, ax)
            m_hat, v_hat = optax.tree.bias_correction(m, b1, count), optax.tree.bias_correction(v, b2, count)
            return m_hat / (jnp.sqrt(v_hat) + eps)
        return jax.tree.map(direction, dims, axes, g, mom, nu, is_leaf=_is_dims), MuonAdamWState(count, mom, nu)
    return optax.GradientTransformation(init, update)
