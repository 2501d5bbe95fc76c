"""Gemma 2 and Gemma 3 (text): Gemma (gemma.py) plus a norm after attention and after the MLP, local
(sliding-window) and global layers in the per-layer table (model.layer_pattern: Gemma 2 alternates, LG;
Gemma 3 has five local layers to one global, LLLLLG), queries scaled by query_pre_attn_scalar^-0.5
(`model.attn_scale`). Gemma 2 soft-caps attention scores with tanh (`model.attn_softcap`, after the
scale, before the mask) and the output logits (`model.final_softcap`). Gemma 3 instead RMS-normalises
each query and key head (`model.qk_norm`, gains stored as w - 1) and gives its local layers their own
unscaled RoPE base (`model.local_rope_theta`); its global layers scale RoPE linearly."""


from maxlm.layers.attention import self_attention
from maxlm.models import decoder, gemma
from maxlm.sharding import constrain

NORMS = ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")


def param_specs(m) -> dict:
    return gemma.param_specs(m, NORMS)


def block(p: dict, x_BLD, i, ctx: decoder.Ctx, m):
    """x + norm(attn(norm(x))), then x + norm(geglu(norm(x))); layer `i` (traced) attends as the table says."""
    window, ctx = decoder.layer_attention(i, ctx, m)
    a_BLD, kv = self_attention(p, gemma.norm(x_BLD, p["attn_norm"], m), ctx, eps=m.norm_eps, window=window,
                               softcap=m.attn_softcap, scale=m.attn_scale, attend=ctx.attend, norm_offset=1.0)
    x_BLD = constrain(x_BLD + gemma.norm(a_BLD, p["post_attn_norm"], m), ("batch", "length", None))
    y_BLD = gemma.mlp(p, gemma.norm(x_BLD, p["mlp_norm"], m))
    return constrain(x_BLD + gemma.norm(y_BLD, p["post_mlp_norm"], m), ("batch", "length", None)), kv, {}


def forward(params: dict, tokens_BL, pos_BL, seg_BL, m, dtype, wrap_block=lambda f: f, cache=None,
            attend=None, stack=None) -> decoder.Hidden:
    return gemma.forward(params, tokens_BL, pos_BL, seg_BL, m, dtype, wrap_block, cache, attend, stack, block=block)


unembed, matmul_params = gemma.unembed, gemma.matmul_params  # the head soft-caps by model.final_softcap
windowed_layers = decoder.windowed_layers
