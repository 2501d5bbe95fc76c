"""The sampler and the trainer route alike: for an MoE model, the experts the KV-cache decoder chose for each
completion token's input (generate.decode(return_routes=True)) are the ones the trainer's forward chooses at
that position of the packed row (Forward.token_losses(routes=True)), in every MoE layer, in float32 on the
CPU. The comparison can fail: a perturbed router, or the rows read one position off, disagree."""

import itertools

import jax
import numpy as np
import pytest

from maxlm import generate, recipe as recipe_lib
from maxlm.config import load
from maxlm.layers import moe
from maxlm.models import params as P_
from maxlm.rl import rollout

SAMPLER = ["model.vocab_size=128", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
           "model.head_dim=8", "model.d_ff=64", "model.init_std=0.3", "dtype=float32", "seq_len=32",
           "global_batch_size=4"]
FAMILIES = {
    "mixtral": ["model.family=mixtral", "model.n_experts=4", "model.experts_per_token=2"],
    # latent attention, a dense first layer, grouped sigmoid routing, shared experts, an MTP module
    "deepseek_v3": ["model.family=deepseek_v3", "model.n_layers=3", "model.n_kv_heads=4", "model.n_experts=8",
                    "model.experts_per_token=2", "model.router_score=sigmoid", "model.router_groups=4",
                    "model.router_topk_groups=2", "model.shared_experts=1", "model.dense_layers=1",
                    "model.dense_d_ff=48", "model.mla.kv_rank=12", "model.mla.rope_dim=4", "model.mtp_depth=1"],
}
PROMPTS = [[5, 17, 3, 88, 41], [11, 2, 70], [9, 9, 9, 1, 2, 3], [40]]
T = 0.8


def differing_share(prompts, g, rows: dict, routes_BLM, shift: int = 0) -> float:
    """The share of (completion token, MoE layer) pairs routed differently by the decoder and the trainer: new
    token t was drawn from the logits of the input at position len(prompt) - 1 + t (`shift` reads elsewhere)."""
    mask_BL = rows["loss_mask"] > 0
    want_BLM = np.zeros(routes_BLM.shape, np.uint32)
    for i, p in enumerate(prompts):
        n = int(g.lengths[i])
        want_BLM[i, len(p) - 1 + shift:len(p) - 1 + shift + n] = g.routes[i, :n]
    return float((want_BLM != np.asarray(routes_BLM))[mask_BL].mean())


def run(overrides):
    cfg = load("configs/tiny.yml", SAMPLER + overrides)
    r = recipe_lib.build(cfg)
    params = P_.init(r.base_specs, jax.random.key(0))
    g = generate.decode(params, cfg.model, PROMPTS, 12, temperature=T, seed=3, return_logps=True, return_routes=True)
    rows = rollout.pack(PROMPTS, g, cfg.seq_len)
    score = jax.jit(lambda p, b: r.forward.token_losses(p, b, temperature=T, routes=True))
    return cfg, params, g, rows, score


@pytest.mark.parametrize("family", FAMILIES)
def test_the_decoder_and_the_trainer_route_alike(family):
    cfg, params, g, rows, score = run(FAMILIES[family])
    s = score(params, rows)
    m = cfg.model
    assert g.routes.dtype == np.uint32 and g.routes.shape == (len(PROMPTS), 12, m.n_layers - m.dense_layers)
    assert s.routes.dtype == np.uint32 and s.routes.shape == (len(PROMPTS), cfg.seq_len, m.n_layers - m.dense_layers)
    assert differing_share(PROMPTS, g, rows, s.routes) == 0.0
    completion_routes = np.concatenate([g.routes[i, :n].ravel() for i, n in enumerate(g.lengths)])
    assert len(np.unique(completion_routes)) > 2  # tokens go to different experts: the check has something to see
    # ...and it sees a difference: rows read one position off, or a router nudged on the trainer's side
    assert differing_share(PROMPTS, g, rows, s.routes, shift=1) > 0.1
    nudged = jax.tree.map(lambda x: x, params)
    nudged["layers"]["router"] = params["layers"]["router"] + 0.3 * jax.random.normal(
        jax.random.key(1), params["layers"]["router"].shape)
    assert differing_share(PROMPTS, g, rows, score(nudged, rows).routes) > 0.0
    # the routes change nothing else: the log-probabilities still agree
    gaps = [np.abs(-np.asarray(s.tok_BL)[i, len(p) - 1:len(p) - 1 + n] - g.logps[i, :n])
            for i, (p, n) in enumerate(zip(PROMPTS, g.lengths))]
    assert max(float(x.max()) for x in gaps) <= 1e-5


def test_a_dense_model_has_no_routes():
    cfg = load("configs/tiny.yml", SAMPLER)
    r = recipe_lib.build(cfg)
    params = P_.init(r.base_specs, jax.random.key(0))
    g = generate.decode(params, cfg.model, PROMPTS, 3, return_routes=True)
    assert g.routes is None
    assert r.forward.token_losses(params, rollout.pack(PROMPTS, g, cfg.seq_len), routes=True).routes is None


def test_the_fingerprint_names_the_set():
    """Every 2-of-8 and 3-of-8 set gets its own value, whatever the order of its indices."""
    sets = {k: list(itertools.combinations(range(8), k)) for k in (2, 3)}
    fps = {k: np.asarray(moe.fingerprint(np.array([c], np.int32)))[0].tolist() for k, c in sets.items()}
    assert len(set(fps[2] + fps[3])) == len(sets[2]) + len(sets[3])
    assert int(moe.fingerprint(np.array([[[5, 1, 3]]], np.int32))[0, 0]) == fps[3][sets[3].index((1, 3, 5))]
