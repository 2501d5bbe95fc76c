"""Rematerialisation as a transform over a layer function, chosen by name."""

import jax

POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_saveable,
    "save_dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def wrap(policy: str):
    """A `wrap_block` for the model's forward: identity for `none`, else `jax.checkpoint` with a policy."""
    if policy == "none":
        return lambda f: f
    return lambda f: jax.checkpoint(f, policy=POLICIES[policy])
