import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxlm.layers.dense import dense
from maxlm.sharding import constrain

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # Gemma's and GPT-2's "gelu": the tanh form
}


SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # gpt-oss's (GptOssConfig swiglu_alpha, swiglu_limit)


def clamped_swiglu(g, u, limit: float = SWIGLU_LIMIT):
    """gpt-oss's gated unit: the gate clamped from above and the up projection on both sides at `limit`
    (model.swiglu_limit), then gate * sigmoid(1.702 gate) * (up + 1)."""
    g = jnp.minimum(g, limit)
    u = jnp.clip(u, -limit, limit)
    return g * jax.nn.sigmoid(SWIGLU_ALPHA * g) * (u + 1)


def glu(act: str, limit: float = SWIGLU_LIMIT):
    """h(gate, up) of a gated MLP: act(gate) * up for the ACTIVATIONS (looked up when called), or
    `clamped_swiglu` at `limit` for "gpt_oss"."""
    if act == "gpt_oss":
        return lambda g, u: clamped_swiglu(g, u, limit)
    return lambda g, u: ACTIVATIONS[act](g) * u


def gated_mlp(x_BLD, w_gate_DF, w_up_DF, w_down_FD, act: str = "silu") -> jax.Array:
    """SwiGLU (silu) or GeGLU (gelu_tanh): down(act(x @ gate) * (x @ up))."""
    x_BLD = checkpoint_name(x_BLD, "mlp_in")  # the name remat=offload keeps on the host
    g_BLF = dense("bld,df->blf", x_BLD, w_gate_DF)
    u_BLF = dense("bld,df->blf", x_BLD, w_up_DF)
    h_BLF = constrain(glu(act)(g_BLF, u_BLF), ("batch", "length", "mlp"))
    return dense("blf,fd->bld", h_BLF, w_down_FD)


def mlp(x_BLD, w_in_DF, b_in_F, w_out_FD, b_out_D, act: str = "gelu_tanh") -> jax.Array:
    """The ungated two-layer MLP with biases (GPT-2)."""
    x_BLD = checkpoint_name(x_BLD, "mlp_in")
    dt = x_BLD.dtype
    h_BLF = dense("bld,df->blf", x_BLD, w_in_DF) + b_in_F.astype(dt)
    h_BLF = constrain(ACTIVATIONS[act](h_BLF), ("batch", "length", "mlp"))
    return dense("blf,fd->bld", h_BLF, w_out_FD) + b_out_D.astype(dt)
