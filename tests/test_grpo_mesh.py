"""GRPO's update is mesh-invariant: on one fixed rollout (prompts, then completions of several lengths, advantages,
old log-probabilities a little off the policy's so that the ratio is not 1 and the clip acts, and a reference
model of its own for the KL term), the loss and gradients on a data mesh, an fsdp mesh and data x fsdp x tensor
equal one device's in float32, for GRPO with its KL penalty and for DAPO's token-level loss with clip-higher.
The rollout's sampling is not under test: the batch is fixed, so any difference is the sharded update's."""

import jax
import numpy as np
import pytest
from test_step import assert_trees_close

from maxlm import mesh as mesh_lib, recipe as recipe_lib, sharding, step as step_lib
from maxlm.config import load
from maxlm.models import params as P_
from maxlm.state import StateSpec

B, P, L = 8, 5, 16  # completions (2 groups of 4), prompt tokens, row length
# init_std 0.1: the policy and its (independently drawn) reference differ enough for a KL near 1, whose term then
# moves the loss and gradients well above the tolerance, yet does not drown the clipped surrogate
ARGS = ["objective=grpo", "data.format=prompt", "data.source=jsonl", "data.path=x.jsonl", "model.vocab_size=258",
        "model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=16",
        "model.d_ff=128", "model.init_std=0.1", f"seq_len={L}", f"global_batch_size={B}", "rl.group_size=4",
        "rl.max_prompt_tokens=8", "rl.max_new_tokens=8", "rl.rewards={exact: {field: answer}}"]
CASES = {  # the paper's GRPO with a KL penalty (times the ratio), at the sampler's temperature; DAPO with clip-higher
    "grpo_kl": ["rl.loss=grpo", "rl.beta=0.1", "rl.temperature=0.9", "init_from=ref"],  # the test draws its own reference
    "dapo_clip_higher": ["rl.loss=dapo", "rl.eps_high=0.28"],
}
MESHES = {"data8": ["mesh.data=8", "mesh.fsdp=1"], "fsdp8": ["mesh.fsdp=8"],
          "data2_fsdp2_tensor2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]}


def build(overrides, n_devices):
    cfg = load("configs/tiny.yml", ARGS + list(overrides))
    devices = jax.devices()[:n_devices]
    m = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, len(devices)), devices)
    return StateSpec(recipe_lib.build(cfg, m), m, sharding.rules(cfg))


def rows(rng) -> dict:
    """Each row one prompt then its completion (1 to L - P + 1 tokens, loss_mask on them), zero-padded."""
    tokens = rng.integers(1, 258, (B, L + 1))
    ends = P - 1 + rng.integers(1, L - P + 2, B)  # the last completion token's target index + 1
    j = np.arange(L)[None]
    live = j < ends[:, None]
    return {"inputs": tokens[:, :-1] * live, "targets": tokens[:, 1:] * live, "positions": j * live,
            "segment_ids": live.astype(np.int32), "loss_mask": (live & (j >= P - 1)).astype(np.int32),
            "advantages": rng.normal(0, 1, B).astype(np.float32)}


def grads(ss, params, ref, batch):
    """The loss, metrics and gradients of the recipe's objective on this mesh (the train step's own program
    before the optimizer, whose sharded update test_step covers for any objective)."""
    put = jax.device_put
    extras = {"frozen": put(ref, ss.shardings.extras["frozen"])} if ss.recipe.objective.reference else {}
    batch = {k: put(np.asarray(v, ss.abstract_batch[k].dtype), ss.abstract_batch[k].sharding) for k, v in batch.items()}
    with sharding.use(ss.mesh, ss.rule_table):
        out = jax.jit(lambda p, b, e: step_lib.grads(p, b, ss.recipe, e))(put(params, ss.shardings.params), batch, extras)
        return jax.device_get((out.loss, out.metrics, out.grads))


@pytest.fixture(scope="module", params=CASES)
def one_device(request):
    """The rollout and one device's loss, metrics and gradients on it. old_logp is the policy's own (as the
    rollout computes it) plus noise, so the ratio is off 1 on both sides of the clip."""
    ss = build(CASES[request.param] + ["mesh.fsdp=1"], 1)
    params, ref = P_.init(ss.base_specs, jax.random.key(0)), P_.init(ss.base_specs, jax.random.key(1))
    rng = np.random.default_rng(0)
    batch = rows(rng)
    T = ss.recipe.objective.temperature
    logp = -np.asarray(jax.jit(lambda p, b: ss.recipe.forward.token_losses(p, b, temperature=T).tok_BL)(params, batch))
    batch["old_logp"] = (logp + rng.normal(0, 0.3, (B, L))).astype(np.float32)
    return request.param, params, ref, batch, grads(ss, params, ref, batch)


@pytest.mark.parametrize("mesh", MESHES)
def test_grpo_loss_and_gradients_on_a_mesh_equal_one_device(one_device, mesh):
    case, params, ref, batch, (loss1, metrics1, g1) = one_device
    loss, metrics, g = grads(build(CASES[case] + MESHES[mesh], 8), params, ref, batch)
    assert metrics1["clip_low"] > 0 and metrics1["clip_high"] > 0 and metrics1.get("kl", 1.0) > 0  # each path acts
    np.testing.assert_allclose(loss, loss1, rtol=1e-5)
    for k in metrics1:  # the ratio, the clip fractions and the KL: sums over the sharded batch
        np.testing.assert_allclose(metrics[k], metrics1[k], rtol=1e-5, err_msg=k)
    assert_trees_close(g, g1, rtol=1e-5)
