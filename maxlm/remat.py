"""Rematerialisation as a transform over a layer function, chosen by name.

`offload` keeps two named activations of each layer (checkpoint_name in the layers: the attention
output `attn_out` and the MLP input `mlp_in`) in host memory between the forward and the backward,
and recomputes the rest, so a layer's backward needs neither a recompute of its attention (the
costly part) nor device memory for those activations. The scan carry (each layer's input) stays on the
device: XLA cannot offload a loop carry (openxla/xla#17541).
"""

import jax

OFFLOADED = ("attn_out", "mlp_in")

POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_saveable,
    "save_dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(OFFLOADED),
        offload_src="device", offload_dst="pinned_host"),
}


def wrap(policy: str):
    """A `wrap_block` for the model's forward: identity for `none`, else `jax.checkpoint` with a policy."""
    if policy == "none":
        return lambda f: f
    return lambda f: jax.checkpoint(f, policy=POLICIES[policy])


def describe(policy: str, platform: str) -> str | None:
    """The log line for a policy that moves data off the device, else None."""
    if policy != "offload":
        return None
    where = " (on CPU, host and device memory are one: it changes nothing there)" if platform == "cpu" else ""
    return f"remat=offload: each layer's {' and '.join(OFFLOADED)} go to pinned_host memory, the rest is recomputed{where}"
