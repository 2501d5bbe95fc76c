"""Next-token cross-entropy that never holds the [B, L, V] float32 logits, forward or backward.

`cross_entropy` scans over chunks of the sequence (outer) and of the vocabulary (inner). The forward
keeps an online logsumexp (running max and sum of exps) and the target's logit per token; the backward
recomputes each chunk's logits from x, w and the saved logsumexp, and accumulates dx and dw chunk by
chunk. Live memory is one chunk's logits plus O(B*L) and O(D*V) arrays.

Chunks are strided so that GSPMD keeps every step local: with L = c * n, token chunk j is tokens
{j, n+j, 2n+j, ...}, so each `context` shard (a contiguous block of L) owns c / shards tokens of every
chunk; vocab chunks are strided the same way over the `tensor` shards of V. A contiguous chunk would
instead sit on one shard while the others idle, or be gathered to all. The backward runs per device
(`_bwd`), so its reductions are one reduce-scatter of each vocab chunk's dw over the token axes (the
table gradient's bytes once a step) and one all-reduce of dx over the vocab's axes.

`reference` is the plain version (the whole logits), for tests and benchmarks.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from maxlm.layers.dense import dense
from maxlm.sharding import active_spec, constrain

_BUDGET_BYTES = 64 << 20  # one chunk's float32 logits per device; the backward holds ~4 such temporaries
_MIN_COLS = 4096          # narrower vocab chunks make dx's per-step reduction outweigh the matmul
_MAX_STEPS = 1024         # scan length bound: past it, chunks exceed the budget rather than crawl
# A vocab chunk's width is padded to a multiple of the TPU's 128 lanes: at 8016 columns (Llama-3's 128,256
# over 16 chunks) libtpu laid each chunk's dW out with D minor, and wrote its reduce-scatter over D as an
# all-reduce and a slice.
_LANES = 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def reference(x_BLD, w_DV, targets_BL, mask_BL, *, softcap: float = 0.0, temperature: float = 1.0) -> jax.Array:
    """Per-token cross-entropy [B, L] from the whole float32 logits (maxlm.step's original loss), of the
    distribution softmax(logits / temperature)."""
    logits_BLV = dense("bld,dv->blv", x_BLD, w_DV, out_dtype=jnp.float32)
    if softcap:
        logits_BLV = softcap * jnp.tanh(logits_BLV / softcap)
    if temperature != 1.0:
        logits_BLV = logits_BLV / temperature
    tgt_BL = jnp.take_along_axis(logits_BLV, targets_BL[..., None], axis=-1)[..., 0]
    return (jax.nn.logsumexp(logits_BLV, axis=-1) - tgt_BL) * mask_BL.astype(jnp.float32)


def ahead(batch: dict, j: int) -> tuple[jax.Array, jax.Array]:
    """(targets, mask) [B, L] for predicting j positions past the next token: position i's target is
    the one of position i + j, kept where that one is kept and lies in the same document (0 past the end)."""
    shift = lambda x_BL: jnp.pad(x_BL[:, j:], ((0, 0), (0, j)))  # noqa: E731
    seg_BL = batch["segment_ids"]
    same_BL = (shift(seg_BL) == seg_BL) & (seg_BL > 0)
    return shift(batch["targets"]), shift(batch["loss_mask"]) * same_BL.astype(batch["loss_mask"].dtype)


def plan(B: int, L: int, V: int, devices: int = 1) -> tuple[int, int]:
    """(token chunks n, vocab chunks nv), powers of two, so one chunk's float32 logits fit the budget
    on each of `devices` (GSPMD spreads the logits over all of them: batch, length and vocab are each
    sharded). Vocab is split first, down to _MIN_COLS wide; then tokens."""
    elems = _BUDGET_BYTES // 4 * devices
    nv = 1
    while B * L * _cdiv(V, nv) > elems and _cdiv(V, 2 * nv) >= _MIN_COLS:
        nv *= 2
    n = 1
    while B * _cdiv(L, n) * _cdiv(V, nv) > elems and 2 * n <= L and 2 * n * nv <= _MAX_STEPS:
        n *= 2
    return n, nv


def cross_entropy(x_BLD, w_DV, targets_BL, mask_BL, *, softcap: float = 0.0, temperature: float = 1.0,
                  chunks: tuple[int, int] | None = None) -> jax.Array:
    """Per-token next-token cross-entropy [B, L] float32 of hidden states x_BLD (activation dtype) under
    the output table w_DV (float32; tied embeddings pass embed.T), zero where mask_BL is 0: logits are
    x @ w in x's dtype accumulated in float32, soft-capped by `softcap * tanh(z / softcap)` if set, then
    divided by `temperature` (a sampler's distribution: reinforcement learning scores its samples by it).
    Equal to `reference`, but memory-bounded. `chunks` = (token chunks, vocab chunks) overrides `plan`;
    sizes that do not divide are padded (masked tokens, -inf vocab columns)."""
    B, L, _ = x_BLD.shape
    V = w_DV.shape[1]
    mesh = jax.sharding.get_abstract_mesh()
    n, nv = chunks or plan(B, L, V, 1 if mesh.empty else mesh.size)
    n, nv = min(n, L), min(nv, V)  # every vocab chunk then holds a real column, so its max is finite
    c = _cdiv(L, n)
    pad_L = ((0, 0), (0, c * n - L))
    x_BLD = jnp.pad(x_BLD, pad_L + ((0, 0),))
    t_BL, m_BL = jnp.pad(targets_BL, pad_L), jnp.pad(mask_BL.astype(jnp.float32), pad_L)
    # [B, c*n] -> [n, B, c]: leading index j is the strided chunk {j, n+j, ...}.
    strided = lambda a: jnp.moveaxis(a.reshape(B, c, n, *a.shape[2:]), 2, 0)  # noqa: E731
    x_NBCD = constrain(strided(x_BLD), (None, "batch", "length", None))
    static = ((float(softcap), float(temperature)), V, nv, jnp.dtype(w_DV.dtype).name)
    loss_NBC = _chunked(x_NBCD, w_DV, strided(t_BL), strided(m_BL), static)
    return jnp.moveaxis(loss_NBC, 0, 2).reshape(B, c * n)[:, :L]


def _table(w_DV, dtype, nv: int):
    """[D, V] -> [nv, D, cv]: vocab chunk k is columns {k, nv+k, ...}, padded to equal widths. Cast first,
    as `dense` does: every copy of the table is bf16 in a bf16 run. Gathered over fsdp once here (as the
    plain matmul would), not once per chunk inside the loops; inside the custom VJP, so that the backward
    hands back the gradient already split as the parameter is, with no gather to undo."""
    D, V = w_DV.shape
    cv = _cdiv(V, nv)
    if cv >= 8 * _LANES:  # a whole number of 128-lane tiles (<= 1/8 more columns): see _LANES
        cv = _cdiv(cv, _LANES) * _LANES
    w_DV = jnp.pad(constrain(w_DV.astype(dtype), (None, "vocab")), ((0, 0), (0, cv * nv - V)))
    return constrain(jnp.moveaxis(w_DV.reshape(D, cv, nv), 2, 0), (None, None, "vocab"))


def _logits(x_BCD, w_DC, k, nv: int, scale: tuple[float, float], V: int, first=0):
    """Vocab chunk k's float32 logits (padding columns at -inf), their derivative dlogits/dz (the soft-cap's
    and the temperature's; 1 without either), and the chunk's column ids (column i of chunk k is vocab entry
    i * nv + k; w_DC may be a device's slice of the chunk, starting at its column `first`). `scale` is
    (softcap, temperature)."""
    softcap, temperature = scale
    z_BCV = dense("bcd,dv->bcv", x_BCD, w_DC, out_dtype=jnp.float32)
    cols_V = (first + jnp.arange(w_DC.shape[1])) * nv + k
    dcap_BCV = 1.0
    if softcap:
        tanh_BCV = jnp.tanh(z_BCV / softcap)
        z_BCV, dcap_BCV = softcap * tanh_BCV, 1.0 - tanh_BCV * tanh_BCV
    if temperature != 1.0:
        z_BCV, dcap_BCV = z_BCV / temperature, dcap_BCV / temperature
    return jnp.where(cols_V < V, z_BCV, -jnp.inf), dcap_BCV, cols_V


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _chunked(x_NBCD, w_DV, t_NBC, m_NBC, static):
    return _fwd(x_NBCD, w_DV, t_NBC, m_NBC, static)[0]


def _fwd(x_NBCD, w_DV, t_NBC, m_NBC, static):
    scale, V, nv, _ = static
    w_NDC = _table(w_DV, x_NBCD.dtype, nv)

    def token_chunk(_, xs):
        x_BCD, t_BC = xs

        def vocab_chunk(carry, xs):
            max_BC, sum_BC, tgt_BC = carry
            logits_BCV, _, cols_V = _logits(x_BCD, *xs, nv, scale, V)
            new_BC = jnp.maximum(max_BC, logits_BCV.max(-1))
            sum_BC = sum_BC * jnp.exp(max_BC - new_BC) + jnp.exp(logits_BCV - new_BC[..., None]).sum(-1)
            # A masked sum, not a gather: it stays local when the chunk's columns are sharded.
            tgt_BC += jnp.where(cols_V == t_BC[..., None], logits_BCV, 0.0).sum(-1)
            return (new_BC, sum_BC, tgt_BC), None

        zeros_BC = jnp.zeros(t_BC.shape, jnp.float32)
        (max_BC, sum_BC, tgt_BC), _ = jax.lax.scan(vocab_chunk, (zeros_BC - jnp.inf, zeros_BC, zeros_BC),
                                                   (w_NDC, jnp.arange(nv)))
        lse_BC = max_BC + jnp.log(sum_BC)
        return None, (lse_BC, tgt_BC)

    _, (lse_NBC, tgt_NBC) = jax.lax.scan(token_chunk, None, (x_NBCD, t_NBC))
    return (lse_NBC - tgt_NBC) * m_NBC, (x_NBCD, w_NDC, t_NBC, m_NBC, lse_NBC)


def _bwd(static, res, g_NBC):
    """dlogits = g * mask * (softmax - onehot) * dcap per chunk, recomputed; dx and dw in float32.

    On a mesh this runs per device (shard_map), so that each reduction happens once: every device sums
    its own tokens' share of a vocab chunk's dw over all its token chunks, then one reduce-scatter over
    the token axes leaves each device its slice of the table gradient as the parameter is laid out; dx
    sums its vocab columns locally and is all-reduced over the vocab's axes once. Under GSPMD each
    (token chunk, vocab chunk) step's dw was all-reduced in full (n x the table's bytes a step)."""
    scale, V, nv, w_dtype = static
    x_NBCD, w_NDC, t_NBC, m_NBC, lse_NBC = res
    args = (x_NBCD, w_NDC, t_NBC, g_NBC * m_NBC, lse_NBC)
    if jax.sharding.get_abstract_mesh().empty:
        dx_NBCD, dw_NDC = _local_bwd(scale, V, (), (), (), *args)
    else:
        tok, x_spec, w_spec = active_spec((None, "batch", "length")), active_spec((None, "batch", "length", None)), \
            active_spec((None, None, "vocab"))
        over = lambda *dims: tuple(a for d in dims for a in ((d,) if isinstance(d, str) else d or ()))  # noqa: E731
        tokens, cols = over(*tok), over(w_spec[2] if len(w_spec) > 2 else None)
        scatter = tuple(a for a in over(*active_spec(("embed",))) if a in tokens)  # D, split as the table is
        fn = functools.partial(_local_bwd, scale, V, scatter, tuple(a for a in tokens if a not in scatter), cols)
        dx_NBCD, dw_NDC = jax.shard_map(fn, in_specs=(x_spec, w_spec, tok, tok, tok),
                                        out_specs=(x_spec, P(None, scatter or None, *w_spec[2:])), check_vma=False)(*args)
    nv, D, cv = dw_NDC.shape
    dw_DV = jnp.moveaxis(dw_NDC, 0, 2).reshape(D, cv * nv)[:, :V]
    return dx_NBCD, constrain(dw_DV, ("embed", "vocab")).astype(w_dtype), None, None


def _local_bwd(scale, V, scatter, summed, cols, x_NBCD, w_NDC, t_NBC, gm_NBC, lse_NBC):
    """The backward on this device's tokens and columns. Vocab chunks outside, token chunks inside: a
    chunk's dw is complete (for these tokens) before it is reduced, over `scatter` (split along D) and
    `summed`; dx's partial sums over this device's columns are reduced over `cols` at the end."""
    nv, dtype = w_NDC.shape[0], x_NBCD.dtype
    first = jax.lax.axis_index(cols) * w_NDC.shape[2] if cols else 0  # this device's columns of each chunk

    def vocab_chunk(dx_NBCD, xs):
        w_DC, k = xs

        def token_chunk(dw_DC, xs):
            x_BCD, t_BC, gm_BC, lse_BC = xs
            logits_BCV, dcap_BCV, cols_V = _logits(x_BCD, w_DC, k, nv, scale, V, first)
            p_BCV = jnp.exp(logits_BCV - lse_BC[..., None])
            dz_BCV = (gm_BC[..., None] * (p_BCV - (cols_V == t_BC[..., None])) * dcap_BCV).astype(dtype)
            dx_BCD = jnp.einsum("bcv,dv->bcd", dz_BCV, w_DC.astype(dtype), preferred_element_type=jnp.float32)
            return dw_DC + jnp.einsum("bcd,bcv->dv", x_BCD, dz_BCV, preferred_element_type=jnp.float32), dx_BCD

        dw_DC, dx_step_NBCD = jax.lax.scan(token_chunk, jnp.zeros(w_DC.shape, jnp.float32),
                                           (x_NBCD, t_NBC, gm_NBC, lse_NBC))
        if summed:
            dw_DC = jax.lax.psum(dw_DC, summed)
        if scatter:
            dw_DC = jax.lax.psum_scatter(dw_DC, scatter, scatter_dimension=0, tiled=True)
        return dx_NBCD + dx_step_NBCD, dw_DC

    dx_NBCD, dw_NDC = jax.lax.scan(vocab_chunk, jnp.zeros(x_NBCD.shape, jnp.float32), (w_NDC, jnp.arange(nv)))
    if cols:
        dx_NBCD = jax.lax.psum(dx_NBCD, cols)
    return dx_NBCD.astype(dtype), dw_NDC


_chunked.defvjp(_fwd, _bwd)
