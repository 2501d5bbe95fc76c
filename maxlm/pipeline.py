"""Pipeline parallelism over the `stage` mesh axis: the GPipe schedule around the scanned decoder.

The stacked layer parameters stay stored as [L, ...] in natural layer order, with the logical axis
`layers` on the mesh axis `stage`. Stage s therefore already holds layers s*K .. s*K + K - 1 (K = L/S),
and viewing the stack as [S, K, ...] moves no data. A checkpoint does not depend on the stage count.

GPipe: the batch is split into M microbatches. A state buffer [S, B/M, L, D], split over `stage`,
holds the microbatch each stage works on. Each of M + S - 1 ticks, microbatch t enters stage 0, every
stage applies its K layers at once (a vmap over the stage dimension, which GSPMD runs one stage per
device group), and the buffer shifts one stage on (a roll of the stage dimension: a collective-permute).
Stage S - 1's output at tick t is microbatch t - S + 1's result. Backward is autodiff of the scan.
A stage idles (S - 1) of every (M + S - 1) ticks: the bubble.

Only the decoder layers are pipelined: the embedding and the head run outside, replicated over
`stage`, because they are one matmul each against S x K layers, and splitting them would add two more
pipeline boundaries for little memory.
"""

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp

from maxlm.sharding import active_spec, constrain

AXIS = "stage"
_microbatches = contextvars.ContextVar("pipeline_microbatches", default=None)


def stages() -> int:
    """The size of the enclosing mesh's `stage` axis (1 outside a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or AXIS not in mesh.shape else mesh.shape[AXIS]


@contextlib.contextmanager
def microbatches(n: int):
    """Trace the forward inside this to pipeline the batch as `n` microbatches (the train step's
    `microbatches`); elsewhere (eval) one microbatch per stage where the batch splits so, else one."""
    token = _microbatches.set(n)
    try:
        yield
    finally:
        _microbatches.reset(token)


def bubble(S: int, M: int, repeats: int = 1) -> float:
    """The share of ticks a stage idles: (S - 1) / (M * repeats + S - 1)."""
    return (S - 1) / (M * repeats + S - 1)


def describe(S: int, n_layers: int, M: int) -> str:
    return (f"pipeline: {S} stages x {n_layers // S} layers, {M} microbatches, bubble (S-1)/(M+S-1) = "
            f"{100 * bubble(S, M):.1f}% (GPipe; embedding and head replicated over stage)")


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


def _stage_fn(layer):
    """One stage: its K layers scanned, as run_layers scans them (`layer` is already wrapped by remat)."""
    def stage(w_K, x_BLD, i_K, ctx):
        def body(x, inp):
            x, _, stats = layer(inp[0], x, inp[1], ctx)
            return x, stats
        return jax.lax.scan(body, x_BLD, (w_K, i_K))
    return jax.vmap(stage, spmd_axis_name=AXIS)


def run(layer, x_BLD, layers: dict, ctx):
    """GPipe over the enclosing mesh's stages. `layer(p, x, i, ctx) -> (x, kv, stats)` is one wrapped
    layer; `ctx` a decoder.Ctx whose arrays all lead with the batch. Returns (x_BLD, stats, None)."""
    S, L, B = stages(), jax.tree.leaves(layers)[0].shape[0], x_BLD.shape[0]
    M = _microbatches.get() or _default_microbatches(B, S)
    if L % S or B % M:  # config.validate says this in one line first; a direct caller gets it here
        raise ValueError(f"pipeline: {L} layers over {S} stages, batch {B} in {M} microbatches do not divide")
    K, T = L // S, M + S - 1
    w_SK = jax.tree.map(lambda a: a.reshape(S, K, *a.shape[1:]), layers)  # contiguous blocks: no data moves
    i_SK = jnp.arange(L).reshape(S, K)  # each stage's true layer indices (local/global patterns)
    x_MBLD, ctx_M = _split(x_BLD, M), jax.tree.map(lambda a: _split(a, M), ctx)
    s_S = jnp.arange(S)
    run_stages = _stage_fn(layer)
    # Every stage holds the inputs (they are replicated over `stage` already, so this moves nothing); only
    # stage 0 reads them. The gradient then sums over the stages once, after the loop, not every tick.
    x_SMBLD = constrain(jnp.broadcast_to(x_MBLD, (S, *x_MBLD.shape)), ("layers", None, "batch", "length", None))
    first_S = (s_S == 0).reshape(S, 1, 1, 1)

    def tick(state_SBLD, t):
        x_SBLD = _pin(jax.lax.dynamic_index_in_dim(x_SMBLD, jnp.minimum(t, M - 1), axis=1, keepdims=False))
        state_SBLD = _pin(jnp.where(first_S, x_SBLD, state_SBLD))
        mb_S = jnp.clip(t - s_S, 0, M - 1)  # the microbatch each stage holds (clipped in the bubble)
        ctx_S = jax.tree.map(lambda a: _pin(a[mb_S]), ctx_M)
        out_SBLD, stats = run_stages(w_SK, state_SBLD, i_SK, ctx_S)
        if jax.tree.leaves(stats):
            raise NotImplementedError("pipeline: per-layer stats (MoE) are not pipelined")
        out_SBLD = _pin(out_SBLD)
        return _pin(jnp.roll(out_SBLD, 1, axis=0)), out_SBLD

    state0 = _pin(jnp.zeros((S, *x_MBLD.shape[1:]), x_BLD.dtype))
    _, out_TSBLD = jax.lax.scan(tick, state0, jnp.arange(T))
    # The last stage's outputs, microbatches 0..M-1, broadcast to every stage once (a masked sum: one
    # all-reduce over `stage`) for the head, which runs replicated.
    last_S = (s_S == S - 1).reshape(1, S, 1, 1, 1)
    y_MBLD = jnp.sum(jnp.where(last_S, out_TSBLD[S - 1:], 0), axis=1)
    return constrain(_merge(y_MBLD), ("batch", "length", None)), {}, None
