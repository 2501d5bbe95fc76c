"""maxlm.remat: every policy computes the gradients of no remat, and `offload` really moves the named
activations (`attn_out`, `mlp_in`) to host memory.

The observable for offload: on CPU the lowered HLO carries no host annotation (jax-notes §11), but the
gradient's jaxpr does. JAX's partial evaluation of `jax.checkpoint` turns each residual that the policy
offloads into a `device_put` to `pinned_host` (an aval typed `f32<host>[...]`) in the forward and one back
in the backward. A name the layers do not emit yields none, so counting them shows the names are found."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import models, recipe as recipe_lib, remat, step as step_lib
from maxlm.config import load
from maxlm.models import params as params_lib

TINY = ["model.n_layers=2", "model.d_model=32", "model.d_ff=64", "model.n_heads=4", "model.n_kv_heads=2",
        "model.head_dim=8", "seq_len=16", "global_batch_size=2", "dtype=float32", "mesh.fsdp=1"]
B, L, D = 2, 16, 32


def cfg_for(policy: str):
    return load("configs/tiny.yml", TINY + [f"remat={policy}"])


@pytest.fixture(scope="module")
def inputs():
    cfg = cfg_for("none")
    params = params_lib.init(models.get(cfg.model.family).param_specs(cfg.model), jax.random.key(0))
    tok = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (B, L + 1))
    seg = np.ones((B, L), np.int32)
    seg[1, 9:] = 2  # two packed documents in one row: the segment mask runs under the checkpoint too
    mask = np.ones((B, L), np.int32)
    mask[0, -3:] = 0
    batch = dict(inputs=tok[:, :-1], targets=tok[:, 1:], positions=np.tile(np.arange(L), (B, 1)), segment_ids=seg,
                 loss_mask=mask)
    return params, {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}


def loss_and_grads(policy, params, batch):
    recipe = recipe_lib.build(cfg_for(policy))
    out = jax.jit(lambda p, b: step_lib.grads(p, b, recipe))(params, batch)
    return float(out.loss), jax.device_get(out.grads)


@pytest.fixture(scope="module")
def no_remat(inputs):
    return loss_and_grads("none", *inputs)


# Each policy costs a cold XLA:CPU compile of the gradient (5-8 s on the shared 2 cores), so the fast suite keeps
# `offload`, which nothing else checks; `full` is also checked against `none` by tests/test_step.py (fast).
SLOW_POLICIES = ("full", "save_dots", "save_dots_no_batch")


@pytest.mark.parametrize("policy", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW_POLICIES else p
                                    for p in sorted(remat.POLICIES)])
def test_every_policy_gives_the_gradients_of_none(policy, inputs, no_remat):
    """Same loss, same gradients (float32). This also compiles `offload` on CPU."""
    loss, grads = loss_and_grads(policy, *inputs)
    ref_loss, ref_grads = no_remat
    assert loss == pytest.approx(ref_loss, rel=1e-6)

    def close(path, g, r):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6 * np.abs(r).max(), err_msg=jax.tree_util.keystr(path))
    jax.tree_util.tree_map_with_path(close, grads, ref_grads)


def host_transfers(jaxpr) -> list:
    """The avals of every `device_put` whose result lives in host memory, in `jaxpr` and its sub-jaxprs
    (the layer scan, the checkpoint)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            found += [v.aval for v in eqn.outvars if "host" in str(getattr(v.aval, "memory_space", "")).lower()]
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else [p]:
                inner = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(inner, "eqns"):
                    found += host_transfers(inner)
    return found


def grad_jaxpr(policy: str, inputs):
    recipe = recipe_lib.build(cfg_for(policy))
    return jax.make_jaxpr(lambda p, b: step_lib.grads(p, b, recipe).grads)(*inputs).jaxpr


@pytest.mark.parametrize("names, offloaded", [
    (remat.OFFLOADED, 2),        # the real policy: both names are found, once each in the scanned layer
    (("attn_out",), 1),
    (("mlp_in",), 1),
    (("no_such_name",), 0),      # a name nobody emits: nothing moves, the policy is a plain `full`
])
def test_offload_moves_exactly_the_named_activations_to_host(names, offloaded, inputs, monkeypatch):
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(names), offload_src="device",
        offload_dst="pinned_host")
    if names != remat.OFFLOADED:
        monkeypatch.setitem(remat.POLICIES, "offload", policy)
    host = host_transfers(grad_jaxpr("offload", inputs))
    assert len(host) == offloaded, host
    # Each is one layer's [batch, length, embed] activation (the scan body holds one layer).
    assert all(a.shape == (B, L, D) and a.dtype == jnp.float32 for a in host), host
    # No other policy moves anything to the host.
    if names == remat.OFFLOADED:
        for other in ("none", *sorted(set(remat.POLICIES) - {"offload"})):
            assert host_transfers(grad_jaxpr(other, inputs)) == [], other


def test_describe_names_offload_only():
    for policy in ("none", *remat.POLICIES):
        for platform in ("cpu", "gpu", "tpu"):
            line = remat.describe(policy, platform)
            if policy != "offload":
                assert line is None, (policy, platform)
            else:
                assert line.startswith("remat=offload: each layer's attn_out and mlp_in go to pinned_host memory")
                assert ("on CPU, host and device memory are one" in line) == (platform == "cpu")
