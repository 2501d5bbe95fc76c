import jax
import jax.numpy as jnp

from maxlm.sharding import constrain


def swiglu(x_BLD, w_gate_DF, w_up_DF, w_down_FD) -> jax.Array:
    dt = x_BLD.dtype
    g_BLF = jnp.einsum("bld,df->blf", x_BLD, w_gate_DF.astype(dt))
    u_BLF = jnp.einsum("bld,df->blf", x_BLD, w_up_DF.astype(dt))
    h_BLF = constrain(jax.nn.silu(g_BLF) * u_BLF, ("batch", "length", "mlp"))
    return jnp.einsum("blf,fd->bld", h_BLF, w_down_FD.astype(dt))
