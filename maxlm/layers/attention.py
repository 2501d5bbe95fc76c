import jax
import jax.numpy as jnp


def reference_attention(q_BLHD, k_BSKD, v_BSKD, seg_BL, seg_BS, causal: bool = True) -> jax.Array:
    """Plain XLA softmax attention with GQA and packed-sequence masking.

    Query heads are grouped over their shared K/V head (H = K*G), so repeated K/V is never built.
    A query sees key s only within the same segment id (and s <= its index when causal); segment id 0
    is padding. Scores and softmax run in float32.
    """
    B, L, H, Dh = q_BLHD.shape
    K = k_BSKD.shape[2]
    q_BLKGD = q_BLHD.reshape(B, L, K, H // K, Dh)
    s_BKGLS = jnp.einsum("blkgd,bskd->bkgls", q_BLKGD, k_BSKD, preferred_element_type=jnp.float32)
    s_BKGLS = s_BKGLS * (Dh ** -0.5)
    mask_BLS = seg_BL[:, :, None] == seg_BS[:, None, :]
    if causal:
        L_, S = s_BKGLS.shape[-2:]
        mask_BLS &= (jnp.arange(L_)[:, None] >= jnp.arange(S)[None, :])[None]
    s_BKGLS = jnp.where(mask_BLS[:, None, None], s_BKGLS, -1e30)
    p_BKGLS = jax.nn.softmax(s_BKGLS, axis=-1)
    o_BLKGD = jnp.einsum("bkgls,bskd->blkgd", p_BKGLS.astype(v_BSKD.dtype), v_BSKD)
    return o_BLKGD.reshape(B, L, H, Dh)
