"""Gemma 2: Gemma (gemma.py) plus a norm after attention and after the MLP, a sliding window on even
layers (0, 2, ...) and global attention on odd ones, queries scaled by query_pre_attn_scalar^-0.5
(`model.attn_scale`), and tanh soft-capping of attention scores (`model.attn_softcap`, after the
scale, before the mask) and of the output logits (`model.final_softcap`)."""

import jax
import jax.numpy as jnp

from maxlm.layers.attention import self_attention
from maxlm.models import decoder, gemma
from maxlm.sharding import constrain

NORMS = ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")


def param_specs(m) -> dict:
    return gemma.param_specs(m, NORMS)


def alternating(attend, local: int):
    """A kernel's window is static, but block() picks each layer's inside the scan: branch on the traced
    window between the two compiled kernels, the local one (`local`) and the global one."""
    if attend is None:
        return None

    def branching(q_BLHD, k_BLKD, v_BLKD, seg_BL, *, window, **static):
        run = lambda w: lambda args: attend(*args, window=w, **static)  # noqa: E731
        return jax.lax.cond(window > 0, run(local), run(0), (q_BLHD, k_BLKD, v_BLKD, seg_BL))
    return branching


def block(p: dict, x_BLD, i, ctx: decoder.Ctx, m):
    """x + norm(attn(norm(x))), then x + norm(geglu(norm(x))); layer `i` (traced) is local when even."""
    window, attend = jnp.where(i % 2 == 0, m.sliding_window, 0), alternating(ctx.attend, m.sliding_window)
    a_BLD, kv = self_attention(p, gemma.norm(x_BLD, p["attn_norm"], m), ctx, eps=m.norm_eps, window=window,
                               softcap=m.attn_softcap, scale=m.attn_scale, attend=attend)
    x_BLD = constrain(x_BLD + gemma.norm(a_BLD, p["post_attn_norm"], m), ("batch", "length", None))
    y_BLD = gemma.mlp(p, gemma.norm(x_BLD, p["mlp_norm"], m))
    return constrain(x_BLD + gemma.norm(y_BLD, p["post_mlp_norm"], m), ("batch", "length", None)), kv, {}


def forward(params: dict, tokens_BL, pos_BL, seg_BL, m, dtype, wrap_block=lambda f: f, cache=None,
            attend=None) -> decoder.Hidden:
    return gemma.forward(params, tokens_BL, pos_BL, seg_BL, m, dtype, wrap_block, cache, attend, block=block)


unembed, matmul_params = gemma.unembed, gemma.matmul_params  # the head soft-caps by model.final_softcap


def windowed_layers(m) -> int:
    return (m.n_layers + 1) // 2  # the even ones, as block() picks them
