"""Self-attention, and the choice of the kernel that computes it (config key `attention`).

`xla` is `reference_attention` below: plain einsums that XLA fuses, with an L x L score tensor.
`flash` is maxlm's own Pallas kernels (maxlm/kernels_pallas): Triton on GPU, Mosaic on TPU, and the
GPU kernel in Pallas interpret mode on CPU, where it is slow and meant for tests. `mosaic` is the Hopper
kernels in Pallas Mosaic GPU (wgmma, TMA, warp specialisation; flash_mgpu), which `auto` does not pick
until a GPU measures them faster than Triton's; on CPU they run in the Mosaic GPU interpreter. `cudnn` is
`jax.nn.dot_product_attention(implementation='cudnn')`. The decode path (KV cache) always uses `xla`:
one query row per step gains nothing from a training kernel.
"""

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxlm.errors import ConfigError
from maxlm.layers import ring
from maxlm.layers.sinks import sink_attention
from maxlm.layers.dense import dense
from maxlm.layers.norm import rms_norm
from maxlm.layers.rope import apply_rope
from maxlm.sharding import active_spec, constrain, platform

CPU_FLASH_NOTE = "attention=flash on CPU runs the Pallas kernels in interpret mode: correct but slow, meant for tests"
CPU_MOSAIC_NOTE = ("attention=mosaic on CPU runs the Hopper kernels in the Mosaic GPU interpreter: correct but very "
                   "slow, meant for tests")


def resolve(choice: str, platform: str, m, dtype: str) -> tuple[str, str | None]:
    """What `attention=choice` runs on `platform`, and a warning for the log when that degrades.
    An explicit choice that cannot run here is a ConfigError, never a silent fallback; `auto` picks xla
    where the flash kernels cannot take the shape, and says why."""
    impl, note = _resolve(choice, platform, m, dtype)
    Dv = m.mla.v_dim or m.head_dim
    if impl != "xla" and Dv < m.head_dim:  # attend_and_project pads the values for the kernels
        pad = (f"the kernels take one head width, so MLA's values ({Dv} wide) are zero-padded to the keys' "
               f"{m.head_dim}: {(2 * m.head_dim) / (m.head_dim + Dv) - 1:.0%} more attention work")
        note = f"{note}; {pad}" if note else pad
    return impl, note


def _resolve(choice: str, platform: str, m, dtype: str) -> tuple[str, str | None]:
    why = _flash_unsupported(platform, m.head_dim, dtype) if choice in ("auto", "flash") else None
    if choice == "auto":
        if platform == "cpu":
            return "xla", None
        return ("xla", f"attention=auto picks xla: {why}") if why else ("flash", _padded_note(platform, m.head_dim))
    if choice == "cudnn":
        if platform != "gpu":
            raise ConfigError(f"attention=cudnn needs an NVIDIA GPU, and this run compiles for {platform}; "
                              f"use attention=auto, flash or xla")
        if m.attn_softcap:
            raise ConfigError("attention=cudnn cannot soft-cap scores (model.attn_softcap); use attention=flash or xla")
        if m.attn_sinks:
            raise ConfigError("attention=cudnn has no attention sinks (model.attn_sinks); use attention=flash or xla")
        if dtype != "bfloat16":
            raise ConfigError(f"attention=cudnn runs only in bfloat16, and dtype={dtype}; set dtype=bfloat16 "
                              f"or use attention=flash")
    if choice == "flash" and why:
        raise ConfigError(f"attention=flash: {why}; use attention=xla (or auto, which picks xla for this shape)")
    if choice == "flash" and platform == "cpu":
        return "flash", CPU_FLASH_NOTE
    if choice == "mosaic":
        from maxlm.kernels_pallas import flash_mgpu
        if platform == "tpu":
            raise ConfigError("attention=mosaic is the Hopper GPU kernel, and this run compiles for tpu; use "
                              "attention=auto or flash (the TPU kernel)")
        why = flash_mgpu.unsupported(m.head_dim, dtype)
        if why or (platform == "gpu" and dtype != "bfloat16"):
            raise ConfigError(f"attention=mosaic: {why or f'it runs bfloat16 on a GPU, and dtype={dtype}'}; use "
                              f"attention=flash or xla")
        return "mosaic", CPU_MOSAIC_NOTE if platform == "cpu" else _padded_note(platform, m.head_dim, flash_mgpu)
    return choice, _padded_note(platform, m.head_dim) if choice == "flash" else None


def _flash_unsupported(platform: str, head_dim: int, dtype: str) -> str | None:
    """Why the flash kernels for `platform` cannot take this head_dim and dtype (CPU runs the GPU kernels)."""
    if platform != "tpu":
        from maxlm.kernels_pallas import flash_gpu
        return flash_gpu.unsupported(head_dim, dtype)
    # Compiled with libtpu for v5p (and v6e where marked): 48, 64, 80, 96, 128, 192 (v6e too), 256 (v6e too)
    if not (16 <= head_dim <= 256 and head_dim % 16 == 0):
        return f"the TPU flash kernel takes head_dim 16..256, a multiple of 16, and model.head_dim={head_dim}"
    return None


def _padded_note(platform: str, head_dim: int, kernels=None) -> str | None:
    if platform != "gpu":
        return None
    from maxlm.kernels_pallas import flash_gpu
    padded = (kernels or flash_gpu).padded_head_dim(head_dim)
    if padded != head_dim:
        return (f"the GPU flash kernels run head_dim {head_dim} zero-padded to {padded}: attention does "
                f"{padded / head_dim - 1:.0%} more work than it needs")
    return None


KERNEL_LIMITS = ("Shared memory size limit exceeded", "out of resource")  # XLA's and Triton's words for it


def kernel_resource_error(reason: str, m, dtype: str, device) -> str:
    """The line for a GPU compile refused because a kernel's tile asks for more shared memory (or
    registers) per block than the device has: which kernel, its tile, the limit, and the fix that helps."""
    refused = []
    if device.platform != "tpu":
        from maxlm.kernels_pallas import flash_gpu
        if not flash_gpu.unsupported(m.head_dim, dtype):
            refused = flash_gpu.refused_kernels(device, m.head_dim, dtype, softcap=m.attn_softcap)
    which = "; ".join(refused) if refused else f"a kernel XLA generated, not maxlm's flash kernels ({reason})"
    fix = ("use attention=xla (or cudnn) on this GPU, and report this line: the flash tiles "
           "(maxlm/kernels_pallas/flash_gpu.py, TILES) are set to fit H100, H200 and B200" if refused else
           "report this line with the config")
    return (f"a GPU kernel does not fit the {device.device_kind}'s per-block limits: {which}. This is a kernel "
            f"resource limit, not device memory: sharding or remat will not change it; {fix}")


def attend_fn(choice: str, m, dtype: str):
    """`attend(q_BLHD, k_BLKD, v_BLKD, seg_BL, *, window, softcap, scale) -> o_BLHD` for self-attention
    with a static window, or None for `xla` on an unsplit sequence (self_attention then calls
    `reference_attention`). When the rules split `length` over devices (mesh.context), every choice
    runs as a ring over them (layers.ring), with its kernel's block forward and backward."""
    where = platform()
    impl, _ = resolve(choice, where, m, dtype)
    axis, size = context_axis()
    if size > 1:
        return functools.partial(_ring_per_shard, _blocks(impl, where), axis, size)
    if impl == "xla":
        return None
    if m.attn_sinks and not (where == "tpu" and impl == "flash"):  # splash takes sinks itself, below
        # the GPU kernels take sinks through their block pair, merged once (layers.sinks)
        return functools.partial(_per_shard, functools.partial(sink_attention, _blocks(impl, where)))
    if impl == "cudnn":
        kernel = _cudnn
    elif impl == "mosaic":
        from maxlm.kernels_pallas import flash_mgpu
        kernel = functools.partial(flash_mgpu.flash_attention, interpret=where == "cpu")
    elif where == "tpu":
        from maxlm.kernels_pallas import flash_tpu
        kernel = flash_tpu.flash_attention
    else:
        from maxlm.kernels_pallas import flash_gpu
        kernel = functools.partial(flash_gpu.flash_attention, interpret=where == "cpu")
    return functools.partial(_per_shard, kernel)


def context_axis() -> tuple[str | None, int]:
    """The mesh axis the rules split `length` over and its size (None, 1 outside a mesh or unsplit)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None, 1
    axes = active_spec(("length",))[0]
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    split = [a for a in axes if mesh.shape[a] > 1]
    if len(split) > 1:
        raise ConfigError(f"sharding_rules split `length` over {' and '.join(split)}; a ring runs over one mesh axis: "
                          f"map length to [context] only")
    return (split[0], mesh.shape[split[0]]) if split else (None, 1)


def _blocks(impl: str, where: str) -> tuple:
    """The (forward, backward) block kernels of `impl` for the ring (layers.ring's contract)."""
    if impl == "cudnn":
        raise ConfigError("attention=cudnn cannot run a context-parallel ring (its API returns no log-sum-exp); "
                          "use attention=flash or xla with mesh.context > 1")
    if impl == "xla":
        return block_forward, block_backward
    if where == "tpu":
        from maxlm.kernels_pallas import flash_tpu
        return flash_tpu.block_forward, flash_tpu.block_backward
    from maxlm.kernels_pallas import flash_gpu, flash_mgpu
    kernels = flash_mgpu if impl == "mosaic" else flash_gpu
    interpret = where == "cpu"
    return (functools.partial(kernels.block_forward, interpret=interpret),
            functools.partial(kernels.block_backward, interpret=interpret))


def _cudnn(q_BLHD, k_BLKD, v_BLKD, seg_BL, *, window, softcap, scale):
    del softcap  # refused by resolve()
    # cuDNN's API has no segment ids, so packed documents cost an L x L mask here; flash needs none.
    mask_B1LL = (seg_BL[:, :, None] == seg_BL[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q_BLHD, k_BLKD, v_BLKD, mask=mask_B1LL, scale=scale or None, is_causal=True,
                                        local_window_size=(window - 1, 0) if window else None,
                                        implementation="cudnn")


def _shard_specs():
    """q, k/v and segment-id specs for a per-device kernel: batch and heads split as the rules say (the
    query heads of a shard must be the ones its K/V heads serve), head_dim whole."""
    q_spec = active_spec(("batch", "length", "heads", "head_dim"))
    kv_spec = active_spec(("batch", "length", "kv_heads", "head_dim"))
    if q_spec[3] is not None:
        raise ConfigError("attention kernels need `head_dim` unsharded (sharding_rules); use attention=xla to shard it")
    if q_spec[2] != kv_spec[2]:
        raise ConfigError(f"attention kernels need `heads` and `kv_heads` on the same mesh axes (sharding_rules has "
                          f"{q_spec[2]} and {kv_spec[2]}); align them or use attention=xla")
    return q_spec, kv_spec, jax.sharding.PartitionSpec(q_spec[0], q_spec[1])


def _per_shard(kernel, q_BLHD, k_BLKD, v_BLKD, seg_BL, sinks=None, **static):
    """Kernels are per-device programs that XLA cannot partition, so under a mesh each device runs one
    on its own shard: batch and heads split as the sharding rules say, the sequence whole (attend_fn
    sends a split sequence to the ring). `sinks` [H], if given, split with the heads."""
    args = (q_BLHD, k_BLKD, v_BLKD, seg_BL) + (() if sinks is None else (sinks,))
    if jax.sharding.get_abstract_mesh().empty:
        return kernel(*args, **static)
    q_spec, kv_spec, seg_spec = _shard_specs()
    specs = (q_spec, kv_spec, kv_spec, seg_spec) + (() if sinks is None else (jax.sharding.PartitionSpec(q_spec[2]),))
    return jax.shard_map(functools.partial(kernel, **static), in_specs=specs, out_specs=q_spec,
                         check_vma=False)(*args)


def _ring_per_shard(blocks, axis: str, size: int, *args, **static):
    """The ring (layers.ring) on each device's zig-zag shard of the sequence."""
    return _per_shard(functools.partial(ring.ring_attention, blocks, axis=axis, size=size), *args, **static)


def _scores(q_BLHD, k_BSKD, seg_BL, seg_BS, q_offset, window, softcap, scale):
    """Scaled, soft-capped float32 scores [B, K, G, L, S] (query heads grouped over their K/V head, so
    repeated K/V is never built), the mask [B, L, S] and tanh of the capped scores (for the backward)."""
    B, L, H, Dh = q_BLHD.shape
    S, K = k_BSKD.shape[1], k_BSKD.shape[2]
    q_BLKGD = q_BLHD.reshape(B, L, K, H // K, Dh)
    acc = jnp.promote_types(q_BLHD.dtype, jnp.float32)
    s_BKGLS = jnp.einsum("blkgd,bskd->bkgls", q_BLKGD, k_BSKD, preferred_element_type=acc) * (scale or Dh ** -0.5)
    t_BKGLS = None
    if softcap:
        t_BKGLS = jnp.tanh(s_BKGLS / softcap)
        s_BKGLS = softcap * t_BKGLS
    d_LS = q_offset + jnp.arange(L)[:, None] - jnp.arange(S)[None, :]
    mask_BLS = (seg_BL[:, :, None] == seg_BS[:, None, :]) & (d_LS >= 0)[None]
    mask_BLS &= ((d_LS < window) | (window <= 0))[None]
    return s_BKGLS, mask_BLS[:, None, None], t_BKGLS


def reference_attention(q_BLHD, k_BSKD, v_BSKD, seg_BL, seg_BS, *, q_offset=0, window=0, softcap=0.0,
                        scale=0.0, sinks=None) -> jax.Array:
    """Plain XLA causal softmax attention with GQA, packed-sequence masking, a sliding window and
    score soft-capping.

    Query i sits at key slot `q_offset + i` (the KV cache's write index when decoding). It sees key s
    when their segment ids match (0 is padding), s is not after it, and, with `window` > 0, s is one
    of its last `window` slots. `window` may be traced (per-layer in a scan). Scores and softmax run in
    float32, or float64 for float64 inputs: the kernel tests use this function as their exact reference.
    `sinks` [H] adds one logit per head to every row's softmax, with no value (gpt-oss), as transformers
    does: concatenated to the scores, then dropped from the probabilities.
    """
    B, L, H, Dh = q_BLHD.shape
    K = k_BSKD.shape[2]
    s_BKGLS, mask, _ = _scores(q_BLHD, k_BSKD, seg_BL, seg_BS, q_offset, window, softcap, scale)
    s_BKGLS = jnp.where(mask, s_BKGLS, -1e30)
    if sinks is None:
        p_BKGLS = jax.nn.softmax(s_BKGLS, axis=-1)
    else:
        sink_BKGL1 = jnp.broadcast_to(sinks.astype(s_BKGLS.dtype).reshape(K, H // K)[None, :, :, None, None],
                                      (*s_BKGLS.shape[:-1], 1))
        p_BKGLS = jax.nn.softmax(jnp.concatenate([s_BKGLS, sink_BKGL1], axis=-1), axis=-1)[..., :-1]
    o_BLKGD = jnp.einsum("bkgls,bskd->blkgd", p_BKGLS.astype(v_BSKD.dtype), v_BSKD)
    return o_BLKGD.reshape(B, L, H, v_BSKD.shape[-1])  # values may be narrower than queries (MLA)


def block_forward(q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, *, offset: int = 0, window: int = 0,
                  softcap: float = 0.0, scale: float = 0.0):
    """The ring's block contract (layers.ring) in plain XLA: query i at position offset + i, key j at j;
    returns o and the natural log-sum-exp [B, H, L] of each row's visible scores (-inf: none)."""
    B, L, H, _ = q_BLHD.shape
    s_BKGLS, mask, _ = _scores(q_BLHD, k_BLKD, qseg_BL, kseg_BL, offset, window, softcap, scale)
    lse_BKGL = jax.nn.logsumexp(jnp.where(mask, s_BKGLS, -jnp.inf), axis=-1)
    p_BKGLS = jnp.where(mask, jnp.exp(s_BKGLS - lse_BKGL[..., None]), 0.0)
    o_BLKGD = jnp.einsum("bkgls,bskd->blkgd", p_BKGLS.astype(v_BLKD.dtype), v_BLKD)
    return o_BLKGD.reshape(B, L, H, v_BLKD.shape[-1]).astype(q_BLHD.dtype), lse_BKGL.reshape(B, H, L)


def block_backward(q_BLHD, k_BLKD, v_BLKD, qseg_BL, kseg_BL, o_BLHD, lse_BHL, do_BLHD, *, offset: int = 0,
                   window: int = 0, softcap: float = 0.0, scale: float = 0.0):
    """dq, dk, dv of one block given the attention's global output and log-sum-exp (FlashAttention-2's
    backward: exp(s - lse) is the final probability, so blocks add up)."""
    B, L, H, Dh = q_BLHD.shape
    K = k_BLKD.shape[2]
    s_BKGLS, mask, t_BKGLS = _scores(q_BLHD, k_BLKD, qseg_BL, kseg_BL, offset, window, softcap, scale)
    p_BKGLS = jnp.where(mask, jnp.exp(s_BKGLS - lse_BHL.reshape(B, K, H // K, L)[..., None]), 0.0)
    grouped = lambda x: x.reshape(B, L, K, H // K, x.shape[-1])  # noqa: E731
    do_BLKGD, q_BLKGD = grouped(do_BLHD), grouped(q_BLHD)
    acc = jnp.promote_types(q_BLHD.dtype, jnp.float32)
    delta_BKGL = jnp.einsum("blkgd,blkgd->bkgl", grouped(o_BLHD).astype(acc), do_BLKGD.astype(acc))
    f32 = dict(preferred_element_type=acc)
    dv_BLKD = jnp.einsum("bkgls,blkgd->bskd", p_BKGLS.astype(do_BLHD.dtype), do_BLKGD, **f32)
    dp_BKGLS = jnp.einsum("blkgd,bskd->bkgls", do_BLKGD, v_BLKD, **f32)
    ds_BKGLS = p_BKGLS * (dp_BKGLS - delta_BKGL[..., None]) * (scale or Dh ** -0.5)
    if softcap:
        ds_BKGLS = ds_BKGLS * (1.0 - t_BKGLS * t_BKGLS)
    ds_BKGLS = ds_BKGLS.astype(q_BLHD.dtype)
    dq_BLHD = jnp.einsum("bkgls,bskd->blkgd", ds_BKGLS, k_BLKD, **f32).reshape(B, L, H, Dh)
    dk_BLKD = jnp.einsum("bkgls,blkgd->bskd", ds_BKGLS, q_BLKGD, **f32)
    return dq_BLHD.astype(q_BLHD.dtype), dk_BLKD.astype(k_BLKD.dtype), dv_BLKD.astype(v_BLKD.dtype)


def _proj(x_BLD, w, b):
    y = dense("bld,d...->bl...", x_BLD, w)
    return y if b is None else y + b.astype(x_BLD.dtype)


def self_attention(p: dict, x_BLD, ctx, *, eps: float, window=0, softcap: float = 0.0, scale: float = 0.0,
                   attend=None, norm_offset: float = 0.0):
    """Project, position and attend; returns (out_BLD, (k, v) as written to the cache or None).

    The parameter tree decides the variant: `bq`/`bk`/`bv`/`bo` add biases (GPT-2), `q_norm`/`k_norm`
    normalise each head before RoPE (Qwen3; `eps`, `norm_offset` as rms_norm's), `sinks` [H] joins each
    softmax with a learned logit per head (gpt-oss). `ctx` carries RoPE angles
    (None: no RoPE), segment ids, and the layer's KV cache slice (None when not decoding). `window` (0:
    none), `softcap` and `scale` (0: head_dim^-0.5) are reference_attention's. `attend` is the kernel
    (attend_fn; None: XLA's reference); a kernel's window must be static, so a caller that picks the
    window per layer inside the scan (Gemma 2) hands a traced `window` and an `attend` that branches.
    """
    q_BLHD = _proj(x_BLD, p["wq"], p.get("bq"))
    k_BLKD = _proj(x_BLD, p["wk"], p.get("bk"))
    v_BLKD = _proj(x_BLD, p["wv"], p.get("bv"))
    if "q_norm" in p:
        q_BLHD = rms_norm(q_BLHD, p["q_norm"], eps, norm_offset)
        k_BLKD = rms_norm(k_BLKD, p["k_norm"], eps, norm_offset)
    if ctx.rope is not None:
        q_BLHD, k_BLKD = apply_rope(q_BLHD, *ctx.rope), apply_rope(k_BLKD, *ctx.rope)
    return attend_and_project(p, q_BLHD, k_BLKD, v_BLKD, ctx, window=window, softcap=softcap, scale=scale,
                              attend=attend)


def attend_and_project(p: dict, q_BLHD, k_BLKD, v_BLKD, ctx, *, window=0, softcap: float = 0.0, scale: float = 0.0,
                       attend=None):
    """Attention over positioned q, k, v (self_attention's second half, which MLA shares), then the
    output projection p["wo"] (+ p["bo"]). Values narrower than the queries (MLA's v_dim) are zero-padded
    to the kernels' one head width, and the padding sliced off their output: `xla` needs no padding."""
    dt = q_BLHD.dtype
    q_BLHD = constrain(q_BLHD, ("batch", "length", "heads", "head_dim"))
    k_BLKD = constrain(k_BLKD, ("batch", "length", "kv_heads", "head_dim"))
    v_BLKD = constrain(v_BLKD, ("batch", "length", "kv_heads", "head_dim"))
    kv = None
    if ctx.cache_kv is None:
        k_BSKD, v_BSKD, seg_BS, offset = k_BLKD, v_BLKD, ctx.seg_BL, 0
    else:  # decoding: write this step's keys at the cache index and attend over the whole cache
        at = (0, ctx.cache_index, 0, 0)
        k_BSKD = jax.lax.dynamic_update_slice(ctx.cache_kv[0], k_BLKD.astype(ctx.cache_kv[0].dtype), at)
        v_BSKD = jax.lax.dynamic_update_slice(ctx.cache_kv[1], v_BLKD.astype(ctx.cache_kv[1].dtype), at)
        seg_BS, offset, kv = ctx.cache_seg, ctx.cache_index, (k_BSKD, v_BSKD)
    sinks = {} if "sinks" not in p else {"sinks": p["sinks"]}
    if attend is None or ctx.cache_kv is not None:
        o_BLHD = reference_attention(q_BLHD, k_BSKD.astype(dt), v_BSKD.astype(dt), ctx.seg_BL, seg_BS, q_offset=offset,
                                     window=window, softcap=softcap, scale=scale, **sinks)
    else:
        Dv, pad = v_BLKD.shape[-1], q_BLHD.shape[-1] - v_BLKD.shape[-1]
        v_BLKD = jnp.pad(v_BLKD, ((0, 0),) * 3 + ((0, pad),)) if pad else v_BLKD
        o_BLHD = attend(q_BLHD, k_BLKD, v_BLKD, ctx.seg_BL, window=window, softcap=softcap, scale=scale, **sinks)
        o_BLHD = o_BLHD[..., :Dv]
    out_BLD = dense("blhk,hkd->bld", o_BLHD, p["wo"])
    if "bo" in p:
        out_BLD = out_BLD + p["bo"].astype(dt)
    return checkpoint_name(out_BLD, "attn_out"), kv  # the name remat=offload keeps on the host
