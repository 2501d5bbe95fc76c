"""Pipeline parallelism over the `stage` mesh axis: GPipe and circular schedules around the scanned decoder.

The stacked layer parameters are [L, ...] with the logical axis `layers` on the mesh axis `stage`, so
stage s holds storage block s (L/S consecutive rows) and viewing the stack as [S, R, K, ...] moves no
data. With R = `pipeline_repeats` chunks per stage of K = L/(S*R) layers, stage s runs chunk r as the
true layers r*S*K + s*K .. + K - 1: a microbatch passes through every stage R times (circular). R = 1 is
GPipe, and storage is then the natural layer order. For R > 1 the rows are held in the pipeline's
storage order (`to_storage`): a run's state is laid out once, at init or restore, never per step.
Checkpoints hold that order and record it in their config; restoring under another (S, R), or reading
the params for export, reorders them (maxlm.checkpoint).

Each tick, every stage applies one chunk at once (a vmap over the stage dimension, which GSPMD runs one
stage per device group), and the state buffer [S, B/M, seq, D] shifts one stage on (a roll of the stage
dimension: a collective-permute). Stage s at tick t works on position u = t - s of the order (repeat 0:
microbatches 0..M-1, repeat 1: ..., so chunk u // M of microbatch u % M). What leaves the last stage
rolls into stage 0's slot and is kept in a buffer [M, B/M, seq, D] on stage 0: the next repeat of that
microbatch enters from it (M >= S, so it is there in time), and after the last repeat it holds the
result. M*R + S - 1 ticks; a stage idles S - 1 of them: the bubble (S-1)/(M*R + S-1). Backward is
autodiff of the scan.

Only the decoder layers are pipelined: the embedding and the head run outside, replicated over
`stage` (docs/pipeline.md says why), as does a second stack a family runs with `pipelined=False` and holds
whole (DeepSeek-V3's dense layers and MTP modules).
"""

import contextlib
import contextvars
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from maxlm.layers.dense import Fp8
from maxlm.sharding import active_spec, constrain

AXIS = "stage"
_schedule = contextvars.ContextVar("pipeline_schedule", default=(None, 1))  # (microbatches, repeats)


def stages() -> int:
    """The size of the enclosing mesh's `stage` axis (1 outside a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or AXIS not in mesh.shape else mesh.shape[AXIS]


def repeats() -> int:
    """The enclosing schedule's chunks per stage (1 when pipelined without repeats, or not pipelined)."""
    return _schedule.get()[1] if stages() > 1 else 1


@contextlib.contextmanager
def schedule(microbatches: int | None = None, repeats: int = 1):
    """Trace the model inside this to pipeline the batch as `microbatches` microbatches (the train step's;
    elsewhere, eval, one per stage where the batch splits so) through `repeats` chunks per stage. A run
    with repeats > 1 traces everything inside it (train.main), as its layer stacks are in storage order."""
    token = _schedule.set((microbatches, repeats))
    try:
        yield
    finally:
        _schedule.reset(token)


def bubble(S: int, M: int, repeats: int = 1) -> float:
    """The share of ticks a stage idles: (S - 1) / (M * repeats + S - 1)."""
    return (S - 1) / (M * repeats + S - 1)


def describe(S: int, n_layers: int, M: int, R: int = 1, whole: tuple[str, ...] = ("embedding", "head")) -> str:
    """The start-up line: `n_layers` the pipelined ones, `whole` what runs beside the stages on every one."""
    how = f"circular, {R} chunks of {n_layers // (S * R)} per stage" if R > 1 else "GPipe"
    beside = " and ".join([", ".join(whole[:-1]), whole[-1]] if len(whole) > 1 else whole)
    return (f"pipeline: {S} stages x {n_layers // S} layers, {M} microbatches, bubble (S-1)/(M*R+S-1) = "
            f"{100 * bubble(S, M, R):.1f}% ({how}; {beside} replicated over stage)")


# ---- storage order: stage s's block holds its R chunks, row s*R*K + r*K + k = layer r*S*K + s*K + k ----

def storage_order(L: int, S: int, R: int) -> np.ndarray:
    """The true layer index of each storage row."""
    return np.arange(L).reshape(R, S, L // (S * R)).swapaxes(0, 1).reshape(L)


def to_storage(a, S: int, R: int):
    """A natural-order stack [L, ...] in (S, R)'s storage order (a transpose of [R, S, K] blocks)."""
    if R == 1:
        return a
    K = a.shape[0] // (S * R)
    return a.reshape(R, S, K, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)


def to_natural(a, S: int, R: int):
    if R == 1:
        return a
    K = a.shape[0] // (S * R)
    return a.reshape(S, R, K, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)


SMALL_ROW = 1 << 14  # elements per layer below which `reorder` gathers a stack whole (FP8's scaling state, gains)


def moves(was: tuple[int, int], now: tuple[int, int]) -> bool:
    """Whether the storage orders (S, R) `was` and `now` differ (every R = 1 order is the natural one)."""
    return was != now and (was[1] > 1 or now[1] > 1)


def reorder(tree, was: tuple[int, int], now: tuple[int, int]):
    """Every layer stack of `tree` (a leaf under a `layers` key: params, their moments, extras) from the
    storage order `was` = (S, R) to `now`."""
    if not moves(was, now):
        return tree

    def one(path, a):
        if not (any(getattr(k, "key", None) == "layers" for k in path) and getattr(a, "ndim", 0)):
            return a
        if a.size // a.shape[0] <= SMALL_ROW:  # gathered whole: GSPMD cannot all-to-all a stack sharded on `stage` alone
            return a[np.argsort(storage_order(a.shape[0], *was))[storage_order(a.shape[0], *now)]]
        return to_storage(to_natural(a, *was), *now)  # an all-to-all of each stage's rows
    return jax.tree_util.tree_map_with_path(one, tree)


# ---- the schedule ----

def _default_microbatches(B: int, S: int) -> int:
    """Outside the train step (eval, which may have split the batch already): the most microbatches, up
    to S, whose rows still split evenly over the batch's mesh axes (XLA cannot partition uneven ones)."""
    mesh, axes = jax.sharding.get_abstract_mesh(), active_spec(("batch",))[0]
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    shards = math.prod(mesh.shape[a] for a in names)
    return max(m for m in range(1, S + 1) if B % m == 0 and (B // m) % shards == 0 or m == 1)


def _split(a, M: int):
    """[B, ...] -> [M, B/M, ...]; microbatch m takes rows m, m+M, ... (as step.grads splits), so every
    device keeps its own rows."""
    return a.reshape(a.shape[0] // M, M, *a.shape[1:]).swapaxes(0, 1)


def _merge(a_MB):
    return a_MB.swapaxes(0, 1).reshape(-1, *a_MB.shape[2:])


def _pin(a_S):
    """Stage dimension on `stage`, the microbatch's rows on the batch axes."""
    return constrain(a_S, ("layers", "batch", "length") + (None,) * (a_S.ndim - 3))


def _pin_buffer(a_SM):
    return constrain(a_SM, ("layers", None, "batch", "length") + (None,) * (a_SM.ndim - 4))


def _stage_fn(layer, R: int):
    """One stage: chunk r of its R, its K layers scanned as run_layers scans them (`layer` is already
    wrapped by remat), with microbatch m's slot of any FP8 state (`live`: whether this tick's work counts).
    Picking the chunk is local: every chunk of a stage lives on its devices. (Under the vmap a per-stage
    index is a gather, whose gradient scatters into a zero stack of the stage's weights every tick:
    GPipe's single chunk is taken statically instead.)"""
    def stage(w_RK, r, m, live, x_BLD, i_RK, ctx):
        chunk = (lambda a: a[0]) if R == 1 else (lambda a: jax.lax.dynamic_index_in_dim(a, r, keepdims=False))
        w_K, i_K = jax.tree.map(chunk, (w_RK, i_RK))
        w_K = _fp8_slot(w_K, m, live)

        def body(x, inp):
            x, _, stats = layer(inp[0], x, inp[1], ctx)
            return x, stats
        return jax.lax.scan(body, x_BLD, (w_K, i_K))
    return jax.vmap(stage, spmd_axis_name=AXIS)


# ---- FP8's scaling state: its gradient is its next value, one per use, which microbatches combine by max ----
# The train step takes the maximum of its microbatches' next states (maxlm.fp8). Inside the schedule a
# layer's state is used once per microbatch, at ticks whose cotangents the scan would sum, and the bubble's
# idle ticks would add theirs. So the state gains a microbatch axis: each microbatch reads, and returns its
# next value into, its own slot (idle ticks return nothing), and the slots' maximum is the gradient.

def _each_fp8(tree: dict, f) -> dict:
    """`tree` with f applied to every Fp8 node's scale and amax (an Fp8 may sit inside a Lora node)."""
    one = lambda n: dataclasses.replace(n, scale=f(n.scale), amax=f(n.amax)) if isinstance(n, Fp8) else n
    return jax.tree.map(one, tree, is_leaf=lambda n: isinstance(n, Fp8))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _fan_out(a_L, M: int):
    """[L, ...] -> [L, M, ...], one copy per microbatch; the gradient is the copies' maximum."""
    return jnp.broadcast_to(a_L[:, None], (a_L.shape[0], M, *a_L.shape[1:]))


def _fan_out_fwd(a_L, M):
    return _fan_out(a_L, M), None


def _fan_out_bwd(M, _, ct_LM):
    return (jnp.max(ct_LM, axis=1),)


_fan_out.defvjp(_fan_out_fwd, _fan_out_bwd)


def _fp8_slot(w_K: dict, m, live) -> dict:
    def take(a_KM):
        a_K = jax.lax.dynamic_index_in_dim(a_KM, m, 1, keepdims=False)
        return jnp.where(live, a_K, jax.lax.stop_gradient(a_K))  # an idle tick's next state is not a use
    return _each_fp8(w_K, take)


def run(layer, x_BLD, layers: dict, ctx):
    """The schedule over the enclosing mesh's stages. `layer(p, x, i, ctx) -> (x, kv, stats)` is one
    wrapped layer; `layers` the stacks in storage order; `ctx` a decoder.Ctx whose arrays all lead with
    the batch. Returns (x_BLD, stats [L, ...] in layer order, summed over the batch, None)."""
    S, L, B = stages(), jax.tree.leaves(layers)[0].shape[0], x_BLD.shape[0]
    M, R = _schedule.get()
    M = M or _default_microbatches(B, S)
    if L % (S * R) or B % M:  # config.validate says this in one line first; a direct caller gets it here
        raise ValueError(f"pipeline: {L} layers over {S} stages x {R} repeats, batch {B} in {M} microbatches "
                         f"do not divide")
    # A repeat needs its microbatch back from the last stage before stage 0 takes it again: with fewer
    # than S microbatches (eval's pieces; training refuses it), idle slots pad each repeat to S.
    K, W = L // (S * R), M if R == 1 else max(M, S)
    T = W * R + S - 1
    layers = _each_fp8(layers, lambda a: _fan_out(a, M))
    w_SRK = jax.tree.map(lambda a: a.reshape(S, R, K, *a.shape[1:]), layers)  # each stage's block: no data moves
    i_SRK = jnp.asarray(storage_order(L, S, R).reshape(S, R, K))  # the true layer indices (local/global patterns)
    x_MBLD, ctx_M = _split(x_BLD, M), jax.tree.map(lambda a: _split(a, M), ctx)
    s_S = jnp.arange(S)
    run_stages = _stage_fn(layer, R)
    # Every stage holds the inputs (they are replicated over `stage` already, so this moves nothing); only
    # stage 0 reads them. The gradient then sums over the stages once, after the loop, not every tick.
    x_SMBLD = _pin_buffer(jnp.broadcast_to(x_MBLD, (S, *x_MBLD.shape)))
    first_S = (s_S == 0).reshape(S, 1, 1, 1)

    # Per-layer statistics (MoE loads: sums over tokens) add up over the work that counts, into [S, R, K, ...]:
    # the whole batch's, as one pass over it would give.
    shapes = jax.eval_shape(run_stages, w_SRK, s_S, s_S, s_S >= 0, x_SMBLD[:, 0], i_SRK,
                            jax.tree.map(lambda a: a[s_S], ctx_M))[1]
    stats0 = jax.tree.map(lambda a: jnp.zeros((S, R, *a.shape[1:]), a.dtype), shapes)

    def tick(carry, t):
        state_SBLD, kept_SWBLD, stats_SRK = carry
        # Stage 0 takes slot t % W: a fresh microbatch in the first repeat, else as the last stage left it.
        fresh = jax.lax.dynamic_index_in_dim(x_SMBLD, jnp.minimum(t % W, M - 1), 1, keepdims=False)
        again = jax.lax.dynamic_index_in_dim(kept_SWBLD, t % W, 1, keepdims=False)
        state_SBLD = _pin(jnp.where(first_S, jnp.where(t < W, fresh, again), state_SBLD))
        u_S = t - s_S  # each stage's place in the order; its work is unused outside [0, W*R) and in idle slots
        r_S, m_S = jnp.clip(u_S // W, 0, R - 1), jnp.minimum(u_S % W, M - 1)
        live_S = (u_S >= 0) & (u_S < W * R) & (u_S % W < M)
        ctx_S = jax.tree.map(lambda a: _pin(a[m_S]), ctx_M)
        out_SBLD, stats_SK = run_stages(w_SRK, r_S, m_S, live_S, state_SBLD, i_SRK, ctx_S)
        counts_SR = live_S[:, None] & (r_S[:, None] == jnp.arange(R))
        stats_SRK = jax.tree.map(
            lambda acc, s: acc + jnp.where(counts_SR.reshape(S, R, *[1] * (s.ndim - 1)), s[:, None], 0),
            stats_SRK, stats_SK)
        state_SBLD = _pin(jnp.roll(_pin(out_SBLD), 1, axis=0))  # stage 0's slot: what left the last stage
        kept_SWBLD = _pin_buffer(jax.lax.dynamic_update_index_in_dim(kept_SWBLD, state_SBLD, (t - S + 1) % W, 1))
        return (state_SBLD, kept_SWBLD, stats_SRK), None

    zeros_SWBLD = jnp.zeros((S, W, *x_MBLD.shape[1:]), x_BLD.dtype)
    carry = (_pin(zeros_SWBLD[:, 0]), _pin_buffer(zeros_SWBLD), stats0)
    (_, kept_SWBLD, stats_SRK), _ = jax.lax.scan(tick, carry, jnp.arange(T))
    stats = jax.tree.map(lambda a: to_natural(a.reshape(L, *a.shape[3:]), S, R), stats_SRK)  # [L, ...], layer order
    # Stage 0's buffer ends with every microbatch's result: broadcast to every stage once (a masked sum:
    # one all-reduce over `stage`) for the head, which runs replicated.
    y_MBLD = jnp.sum(jnp.where(first_S[..., None], kept_SWBLD[:, :M], 0), axis=0)
    return constrain(_merge(y_MBLD), ("batch", "length", None)), stats, None
