"""Pipeline parallelism over the `stage` mesh axis: the GPipe and circular schedules, and the layer
stacks' storage order that goes with it (maxlm.schedules.layout).

The stacked layer parameters are [L, ...] with the logical axis `layers` on the mesh axis `stage`, so
stage s holds storage block s (L/S consecutive rows) and viewing the stack as [S, R, K, ...] moves no
data. With R = `pipeline_repeats` chunks per stage of K = L/(S*R) layers, stage s runs chunk r as the
true layers r*S*K + s*K .. + K - 1: a microbatch passes through every stage R times (circular). R = 1 is
GPipe, and storage is then the natural layer order. For R > 1 the rows are held in the pipeline's
storage order (`layout.Layout`): a run's state is laid out once, at init or restore, never per step.

Each tick, every stage applies one chunk at once (a vmap over the stage dimension, which GSPMD runs one
stage per device group), and the state buffer [S, B/M, seq, D] shifts one stage on (a roll of the stage
dimension: a collective-permute). Stage s at tick t works on position u = t - s of the order (repeat 0:
microbatches 0..M-1, repeat 1: ..., so chunk u // M of microbatch u % M). What leaves the last stage
rolls into stage 0's slot and is kept in a buffer [M, B/M, seq, D] on stage 0: the next repeat of that
microbatch enters from it (M >= S, so it is there in time), and after the last repeat it holds the
result. M*R + S - 1 ticks; a stage idles S - 1 of them: the bubble (S-1)/(M*R + S-1). Backward is
autodiff of the scan.

Only the decoder layers are pipelined: the embedding and the head run outside, replicated over
`stage` (docs/pipeline.md says why), as does a second stack a family runs without the schedule's
`stack` and holds whole (DeepSeek-V3's dense layers and MTP modules).
"""

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from maxlm.schedules.accumulate import split
from maxlm.schedules.layout import Layout, storage_order, to_natural
from maxlm.sharding import active_spec, constrain

AXIS = "stage"


def stages() -> int:
    """The size of the enclosing mesh's `stage` axis (1 outside a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or AXIS not in mesh.shape else mesh.shape[AXIS]


def bubble(S: int, M: int, repeats: int = 1) -> float:
    """The share of ticks a stage idles: (S - 1) / (M * repeats + S - 1)."""
    return (S - 1) / (M * repeats + S - 1)


def describe(S: int, n_layers: int, M: int, R: int = 1, whole: tuple[str, ...] = ("embedding", "head")) -> str:
    """The start-up line: `n_layers` the pipelined ones, `whole` what runs beside the stages on every one."""
    how = f"circular, {R} chunks of {n_layers // (S * R)} per stage" if R > 1 else "GPipe"
    beside = " and ".join([", ".join(whole[:-1]), whole[-1]] if len(whole) > 1 else whole)
    return (f"pipeline: {S} stages x {n_layers // S} layers, {M} microbatches, bubble (S-1)/(M*R+S-1) = "
            f"{100 * bubble(S, M, R):.1f}% ({how}; {beside} replicated over stage)")


# ---- the schedule ----

def default_microbatches(B: int, S: int) -> int:
    """Outside training (a forward over a batch the caller chose): the most microbatches, up to S, whose
    rows still split evenly over the batch's mesh axes (XLA cannot partition uneven ones)."""
    mesh, axes = jax.sharding.get_abstract_mesh(), active_spec(("batch",))[0]
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    shards = math.prod(mesh.shape[a] for a in names)
    return max(m for m in range(1, S + 1) if B % m == 0 and (B // m) % shards == 0 or m == 1)


def _merge(a_MB):
    return a_MB.swapaxes(0, 1).reshape(-1, *a_MB.shape[2:])


def _pin(a_S):
    """Stage dimension on `stage`, the microbatch's rows on the batch axes."""
    return constrain(a_S, ("layers", "batch", "length") + (None,) * (a_S.ndim - 3))


def _pin_buffer(a_SM):
    return constrain(a_SM, ("layers", None, "batch", "length") + (None,) * (a_SM.ndim - 4))


# ---- state whose gradient is its next value (a transform's Extra with a merge: FP8's scaling state) ----
# The train step combines its microbatches' next values by the extra's merge. Inside the schedule a
# layer's state is used once per microbatch, at ticks whose cotangents the scan would sum, and the
# bubble's idle ticks would add theirs. So such a stack gains a microbatch axis (`Slots`): each microbatch
# reads, and returns its next value into, its own slot (idle ticks return nothing), and the slots merged
# are the gradient. The transform that attaches the state never sees the slots: a stage takes its own.

@functools.partial(jax.tree_util.register_dataclass, data_fields=["a"], meta_fields=[])
@dataclasses.dataclass
class Slots:
    """A layer stack [L, M, ...] with one slot per microbatch."""
    a: jax.Array


def _is_slots(x) -> bool:
    return isinstance(x, Slots)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _fan_out(a_L, M: int, merge: Callable):
    """[L, ...] -> [L, M, ...], one copy per microbatch; the gradient is the copies merged."""
    return jnp.broadcast_to(a_L[:, None], (a_L.shape[0], M, *a_L.shape[1:]))


def _fan_out_fwd(a_L, M, merge):
    return _fan_out(a_L, M, merge), None


def _fan_out_bwd(M, merge, _, ct_LM):
    return (functools.reduce(merge, [ct_LM[:, m] for m in range(M)]),)


_fan_out.defvjp(_fan_out_fwd, _fan_out_bwd)


def fan_out(tree, M: int, merge: Callable):
    """Each layer stack of a merged extra's tree (a leaf under `layers`) as `Slots` of M microbatches."""
    def one(path, a):
        on_layers = any(getattr(k, "key", None) == "layers" for k in path)
        return Slots(_fan_out(a, M, merge)) if on_layers else a
    return jax.tree_util.tree_map_with_path(one, tree)


def _own_slot(w_K, m, live):
    def take(slots):
        a_K = jax.lax.dynamic_index_in_dim(slots.a, m, 1, keepdims=False)
        return jnp.where(live, a_K, jax.lax.stop_gradient(a_K))  # an idle tick's next state is not a use
    return jax.tree.map(lambda x: take(x) if _is_slots(x) else x, w_K, is_leaf=_is_slots)


def _stage_fn(layer, R: int):
    """One stage: chunk r of its R, its K layers scanned as run_layers scans them (`layer` is already
    wrapped by remat), with microbatch m's slot of any `Slots` (`live`: whether this tick's work counts).
    Picking the chunk is local: every chunk of a stage lives on its devices. (Under the vmap a per-stage
    index is a gather, whose gradient scatters into a zero stack of the stage's weights every tick:
    GPipe's single chunk is taken statically instead.)"""
    def stage(w_RK, r, m, live, x_BLD, i_RK, ctx):
        chunk = (lambda a: a[0]) if R == 1 else (lambda a: jax.lax.dynamic_index_in_dim(a, r, keepdims=False))
        w_K, i_K = jax.tree.map(chunk, (w_RK, i_RK))
        w_K = _own_slot(w_K, m, live)

        def body(x, inp):
            x, _, stats = layer(inp[0], x, inp[1], ctx)
            return x, stats
        return jax.lax.scan(body, x_BLD, (w_K, i_K))
    return jax.vmap(stage, spmd_axis_name=AXIS)


def run(layer, x_BLD, layers: dict, ctx, S: int, M: int | None, R: int):
    """The schedule over S stages (the enclosing mesh's). `layer(p, x, i, ctx) -> (x, kv, stats)` is one
    wrapped layer; `layers` the stacks in storage order; `ctx` a decoder.Ctx whose arrays all lead with
    the batch; M the microbatches (None: `default_microbatches`). Returns (x_BLD, stats [L, ...] in layer
    order, summed over the batch, None)."""
    L, B = jax.tree.leaves(layers)[0].shape[0], x_BLD.shape[0]
    M = M or default_microbatches(B, S)
    if L % (S * R) or B % M:  # config.validate says this in one line first; a direct caller gets it here
        raise ValueError(f"pipeline: {L} layers over {S} stages x {R} repeats, batch {B} in {M} microbatches "
                         f"do not divide")
    # A repeat needs its microbatch back from the last stage before stage 0 takes it again: with fewer
    # than S microbatches (a caller's own circular forward; training refuses it), idle slots pad each
    # repeat to S.
    K, W = L // (S * R), M if R == 1 else max(M, S)
    T = W * R + S - 1
    w_SRK = jax.tree.map(lambda a: a.reshape(S, R, K, *a.shape[1:]), layers)  # each stage's block: no data moves
    i_SRK = jnp.asarray(storage_order(L, S, R).reshape(S, R, K))  # the true layer indices (local/global patterns)
    x_MBLD, ctx_M = split(x_BLD, M), jax.tree.map(lambda a: split(a, M), ctx)
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


class Pipeline(NamedTuple):
    """The schedule of a run with mesh.stage > 1: the layer stack runs through the stages as M microbatches
    (GPipe; circular with repeats > 1), in one call of the step's function over the whole batch, whose
    backward is autodiff of the schedule's scan. `microbatches` None: a forward outside training picks them
    (`default_microbatches`)."""
    stages: int
    microbatches: int | None = None
    repeats: int = 1

    @property
    def layout(self) -> Layout:
        return Layout(self.stages, self.repeats)

    def stack(self, layer, x_BLD, layers: dict, ctx):
        """What the model runs its pipelined layer stack with (decoder.run_layers' `stack`)."""
        return run(layer, x_BLD, layers, ctx, self.stages, self.microbatches, self.repeats)

    def value_and_grad(self, terms, params, diff: dict, merges: dict, batch: dict):
        def value(p_and_diff, b):
            d = {k: fan_out(v, self.microbatches, merges[k]) for k, v in p_and_diff[1].items()}
            t = terms(p_and_diff[0], d, b, self.stack)
            return t.loss + t.side_loss + t.aux, t
        (_, t), (g, nxt) = jax.value_and_grad(value, has_aux=True)((params, diff), batch)
        return t, g, nxt

    def forward(self, fn, batch: dict):
        return fn(batch, self.stack)

    def describe(self, n_layers: int, whole: tuple[str, ...]) -> str:
        return describe(self.stages, n_layers, self.microbatches, self.repeats, whole)
