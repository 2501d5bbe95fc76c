"""What every decoder family shares: the layer scan (with or without a KV cache), the embedding and the
output head (`unembed`), and the matmul count metrics needs.

A family supplies `block(p, x_BLD, i, ctx) -> (x_BLD, kv, stats)` for layer `i`; `kv` is the layer's
updated cache slice when decoding (else None), `stats` any per-layer sums it wants pooled (MoE load
balancing), or {}. It attends as `layer_attention(i, ctx, m)` says: the per-layer table of local and
global layers (model.layer_pattern) is one mechanism for every family.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from maxlm.layers.dense import dense
from maxlm.layers.embed import per_device
from maxlm.layers.rope import rope_angles
from maxlm.sharding import constrain


class Ctx(NamedTuple):
    rope: tuple | None           # (sin_BLF, cos_BLF), or None for a model without RoPE
    seg_BL: jax.Array
    cache_kv: tuple | None = None  # this layer's (k_BSKD, v_BSKD) when decoding
    cache_index: Any = None        # slot where this call's first token is written
    cache_seg: Any = None          # segment ids of every cache slot, this call's included
    attend: Any = None             # the attention kernel (layers.attention.attend_fn); None: XLA's
    rope_local: tuple | None = None  # the local layers' (sin_BLF, cos_BLF) when their RoPE differs (Gemma 3)


class Hidden(NamedTuple):
    """What a family's forward returns. The logits are `unembed(params, x_BLD, m)`, a separate call, so a
    loss can unembed in chunks (never holding [B, L, V]) and DPO or eval reuse the head unchanged."""
    x_BLD: jax.Array   # final hidden states, after the final norm, in the activation dtype
    aux_loss: Any      # scalar added to the training loss (MoE load balancing), 0.0 for dense models
    cache: Any         # the updated KV cache, or None when none was given
    moe: Any = None    # MoE models: {"load": [n_layers, n_experts], "dropped": [n_layers]} (moe.load)
    ahead: Any = None  # multi-token prediction: [depth, B, L, D] hidden states, the k-th (from 0) predicting
                       # the target k + 1 positions on (after its own final norm; unembed makes logits), or None
    routes: Any = None  # forward(routes=True) of an MoE model: [B, L, MoE layers] uint32, each token's chosen
                        # experts in each MoE layer, in layer order, as moe.fingerprint names the set; else None


class Output(NamedTuple):
    """forward then unembed, in one (maxlm.models.apply)."""
    logits: jax.Array  # [B, L, V] float32
    aux_loss: Any
    cache: Any


def init_cache(m, batch: int, length: int, dtype) -> dict:
    """An empty KV cache for `length` slots. Unwritten slots have segment id 0, which no real token
    (segment >= 1) attends to."""
    k = (m.n_layers, batch, length, m.n_kv_heads, m.head_dim)
    v = (*k[:-1], m.mla.v_dim or m.head_dim)  # MLA's values may be narrower than its keys
    return {"k": jnp.zeros(k, dtype), "v": jnp.zeros(v, dtype), "seg": jnp.zeros((batch, length), jnp.int32),
            "index": jnp.zeros((), jnp.int32)}


def local_layers(m) -> np.ndarray:
    """[n_layers] bool: the layers that attend within model.sliding_window. model.layer_pattern repeats
    over the layers (LG: the even ones; LLLLLG: five of every six); with no pattern, all of them when a
    window is set."""
    if not m.layer_pattern:
        return np.full(m.n_layers, bool(m.sliding_window))
    return np.array([m.layer_pattern[i % len(m.layer_pattern)] == "L" for i in range(m.n_layers)])


def windowed_layers(m) -> int:
    """Layers whose queries see at most model.sliding_window keys (metrics counts their FLOPs)."""
    return int(local_layers(m).sum()) if m.sliding_window else 0


def rope(pos_BL, m) -> tuple:
    """(global, local) RoPE angles: the local layers' own, unscaled, when model.local_rope_theta is set
    (Gemma 3), else None (every layer the global ones)."""
    local = rope_angles(pos_BL, m.head_dim, m.local_rope_theta) if m.local_rope_theta else None
    return rope_angles(pos_BL, m.head_dim, m.rope_theta, m.rope_scaling), local


def _branching(attend, local: int):
    """A kernel's window is static, but layer i is traced inside the scan: branch on the traced window
    between the kernel compiled for the local window and the one for none."""
    if attend is None:
        return None

    def branching(q_BLHD, k_BLKD, v_BLKD, seg_BL, *, window, **static):
        run = lambda w: lambda args: attend(*args, window=w, **static)  # noqa: E731
        return jax.lax.cond(window > 0, run(local), run(0), (q_BLHD, k_BLKD, v_BLKD, seg_BL))
    return branching


def layer_attention(i, ctx: Ctx, m) -> tuple[Any, Ctx]:
    """Layer i's (window, ctx with its RoPE angles and kernel) from the per-layer table. A uniform table
    is static; a mixed one selects by the traced i."""
    local = local_layers(m)
    if local.all() or not local.any():
        rope = ctx.rope_local if local.all() and ctx.rope_local is not None else ctx.rope
        return (m.sliding_window if local.all() else 0), ctx._replace(rope=rope)
    is_local = jnp.asarray(local)[i]
    rope = ctx.rope if ctx.rope_local is None else \
        jax.tree.map(lambda a, b: jnp.where(is_local, a, b), ctx.rope_local, ctx.rope)
    attend = _branching(ctx.attend, m.sliding_window)
    return jnp.where(is_local, m.sliding_window, 0), ctx._replace(rope=rope, attend=attend)


def run_layers(block, x_BLD, layers: dict, seg_BL, rope, wrap_block, cache, attend=None, stack=None):
    """Scan `block` over the stacked layers. `rope` is `decoder.rope`'s (global, local) pair, or None
    (no RoPE). Returns (x_BLD, stacked stats, new cache or None). `stack(layer, x_BLD, layers, ctx)`, the
    train step's schedule's (maxlm.schedules: pipeline stages), runs the stack instead of the plain scan
    when given; a family passes it for the stack the stages split, not for one held whole on every stage."""
    # `attend` is a function, not an array: bind it inside the function that remat transforms.
    layer = wrap_block(lambda p, x, i, ctx: block(p, x, i, ctx._replace(attend=attend)))
    idx = jnp.arange(jax.tree.leaves(layers)[0].shape[0])
    rope, rope_local = rope or (None, None)
    if cache is None and stack is not None:
        return stack(layer, x_BLD, layers, Ctx(rope, seg_BL, rope_local=rope_local))
    if cache is None:
        def body(x, inp):
            x, _, stats = layer(inp[0], x, inp[1], Ctx(rope, seg_BL, rope_local=rope_local))
            return x, stats
        x_BLD, stats = jax.lax.scan(body, x_BLD, (layers, idx))
        return x_BLD, stats, None
    at = cache["index"]
    seg_BS = jax.lax.dynamic_update_slice(cache["seg"], seg_BL.astype(jnp.int32), (0, at))

    def body(x, inp):
        p, i, k, v = inp
        x, kv, stats = layer(p, x, i, Ctx(rope, seg_BL, (k, v), at, seg_BS, rope_local=rope_local))
        return x, (kv, stats)
    x_BLD, ((k, v), stats) = jax.lax.scan(body, x_BLD, (layers, idx, cache["k"], cache["v"]))
    return x_BLD, stats, {"k": k, "v": v, "seg": seg_BS, "index": at + seg_BL.shape[1]}


def head(params: dict, m) -> jax.Array:
    """The output table [D, V]: the input embedding's transpose when tied."""
    return params["embed"].T if m.tie_embeddings else params["unembed"]


def unembed(params: dict, x_BLD, m) -> jax.Array:
    """Float32 logits [B, L, V] of hidden states (any L): the matmul in x's dtype with the output table,
    then tanh soft-capping by model.final_softcap if set (Gemma 2). The train loss never calls this:
    layers.loss computes the same cross-entropy in chunks from x and `head`."""
    logits_BLV = dense("bld,dv->blv", x_BLD, head(params, m), out_dtype=jnp.float32)
    if m.final_softcap:
        logits_BLV = m.final_softcap * jnp.tanh(logits_BLV / m.final_softcap)
    return constrain(logits_BLV, ("batch", "length", "vocab"))


def matmul_params(m, mlp_matrices: int = 3) -> int:
    """Weights one token meets in matmuls (metrics.flops_per_token's N_matmul): q, k, v and o, the MLP's
    `mlp_matrices` (3 gated, 2 plain), the unembedding. MoE: the router plus the experts_per_token experts
    and the shared experts each token uses (what dropless dispatch computes, less its block padding)."""
    D, F, L, H, K, Dh, V = m.d_model, m.d_ff, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim, m.vocab_size
    mlp = mlp_matrices * D * F * (m.experts_per_token + m.shared_experts) + D * m.n_experts if m.n_experts \
        else mlp_matrices * D * F
    return L * (D * H * Dh * 2 + D * K * Dh * 2 + mlp) + D * V


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def lookup(table_VD, tokens_BL, dtype) -> jax.Array:
    """The rows of `table_VD` for `tokens_BL`, gathered in `dtype`, while the gradient is scatter-added in the
    table's own dtype, as take-then-cast does. Gathering float32 rows and casting after moved twice the
    bytes wherever the rows move between devices (docs/pipeline.md)."""
    return jnp.take(table_VD.astype(dtype), tokens_BL, axis=0)


def _lookup_fwd(table_VD, tokens_BL, dtype):
    return lookup(table_VD, tokens_BL, dtype), (table_VD, tokens_BL)


def _lookup_bwd(dtype, res, ct_BLD):
    table_VD, tokens_BL = res
    return jnp.zeros_like(table_VD).at[tokens_BL].add(ct_BLD.astype(table_VD.dtype)), None


lookup.defvjp(_lookup_fwd, _lookup_bwd)


def embed(params: dict, tokens_BL, dtype, scale: float = 1.0) -> jax.Array:
    # Per device on any mesh: GSPMD partitions the lookup badly under stages and a vocabulary split (layers/embed.py)
    x_BLD = per_device(lookup, params["embed"], tokens_BL, dtype)
    if x_BLD is None:
        x_BLD = lookup(params["embed"], tokens_BL, dtype)
    if scale != 1.0:  # Gemma: scaled in the activation dtype, as HF does
        x_BLD = x_BLD * jnp.asarray(scale, dtype)
    return constrain(x_BLD, ("batch", "length", None))
