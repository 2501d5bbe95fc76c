"""DeepSeek-V3's multi-token prediction in the train step: the loss it adds equals a reference written out
position by position from the paper's definition (module k joins the embedding of token i + k + 1 with the
previous module's state, runs one layer, and predicts token i + k + 2 with the shared head), documents and
the sequence's end bound what it sees, its weight reaches the gradient, and generation never runs it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import models, recipe as recipe_lib, step
from maxlm.objectives import lm
from maxlm.config import ConfigError, load
from maxlm.layers.norm import rms_norm
from maxlm.layers.rope import rope_angles
from maxlm.models import decoder, deepseek_v3, params as P_

MODEL = ["model.family=deepseek_v3", "model.n_layers=2", "model.dense_layers=1", "model.dense_d_ff=64", "model.d_model=64",
         "model.n_heads=4", "model.n_kv_heads=4", "model.head_dim=16", "model.d_ff=32", "model.n_experts=4",
         "model.experts_per_token=2", "model.router_score=sigmoid", "model.mla.kv_rank=16", "model.mla.rope_dim=4",
         "model.mla.v_dim=8", "model.mtp_depth=2", "model.vocab_size=64", "model.init_std=0.2", "seq_len=12",
         "global_batch_size=2", "dtype=float32"]


def grads(params, batch, cfg):
    """step.grads compiled: one XLA program instead of a few hundred ops dispatched (and compiled) one by one."""
    recipe = recipe_lib.build(cfg)
    return jax.jit(lambda p, b: step.grads(p, b, recipe))(params, batch)


@pytest.fixture(scope="module")
def setup():
    cfg = load("configs/tiny.yml", MODEL)
    params = P_.init(models.get("deepseek_v3").param_specs(cfg.model), jax.random.key(1))
    rng = np.random.RandomState(0)
    B, L = 2, 12
    toks = rng.randint(0, 64, (B, L + 1)).astype(np.int32)
    seg = np.ones((B, L), np.int32)
    seg[1, 7:] = 2  # two documents in row 1: nothing may be predicted across the boundary
    mask = np.ones((B, L), np.int32)
    mask[0, 3] = 0  # a masked target stays masked for every module that would predict it
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:], "positions": np.tile(np.arange(L, dtype=np.int32), (B, 1)),
             "segment_ids": seg, "loss_mask": mask}
    return cfg, params, batch


def reference_mtp(params, batch, cfg) -> float:
    """The paper's L_MTP, position by position: for module k, position i predicts token i + k + 2 (the
    target at i + k + 1), counted only inside i's document and where that target is kept; each module's
    sum over the batch's token count, averaged over the modules."""
    m, tok = cfg.model, batch["inputs"]
    B, L = tok.shape
    # The model's pieces run compiled (jitted), the bookkeeping in numpy: op by op, each of a few hundred ops
    # would be compiled on its own.
    h = jax.jit(lambda p: deepseek_v3.forward(p, tok, batch["positions"], batch["segment_ids"], m, jnp.float32).x_BLD)(
        {k: v for k, v in params.items() if k != "mtp"})

    @jax.jit
    def module(p, nxt, h, k):
        ctx = decoder.Ctx(rope_angles(jnp.asarray(batch["positions"]), m.mla.rope_dim, m.rope_theta, m.rope_scaling),
                          jnp.asarray(batch["segment_ids"]))
        joined = jnp.concatenate([rms_norm(nxt, p["e_norm"], m.norm_eps), rms_norm(h, p["h_norm"], m.norm_eps)], -1)
        h = deepseek_v3.block(p, joined @ p["w_eh"], m.n_layers + k, ctx, m)[0]
        return h, rms_norm(h, p["head_norm"], m.norm_eps) @ params["unembed"]

    emb, total = np.asarray(params["embed"])[tok], 0.0
    for k in range(m.mtp_depth):
        p = jax.tree.map(lambda x: x[k], params["mtp"])
        nxt = np.zeros_like(emb)
        nxt[:, :L - k - 1] = emb[:, k + 1:]
        h, logits = module(p, nxt, h, k)
        logits = np.asarray(logits, np.float64)
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
        for b in range(B):
            for i in range(L - k - 1):
                j = i + k + 1
                if batch["segment_ids"][b, j] == batch["segment_ids"][b, i] and batch["loss_mask"][b, j]:
                    total -= logp[b, i, batch["targets"][b, j]] / batch["loss_mask"].sum() / m.mtp_depth
    return total


def test_the_mtp_loss_is_the_papers_definition(setup):
    cfg, params, batch = setup
    g = grads(params, batch, cfg)
    ref = reference_mtp(params, batch, cfg)
    assert abs(float(g.metrics["mtp_loss"]) - ref) <= 1e-5 * ref
    # the main loss is the next-token loss alone, as without the modules
    plain = grads({k: v for k, v in params.items() if k != "mtp"}, batch,
                       load("configs/tiny.yml", MODEL + ["model.mtp_depth=0"]))
    np.testing.assert_allclose(float(g.loss), float(plain.loss), rtol=1e-6)


def test_its_weight_reaches_the_gradient_and_zero_weight_trains_the_modules_not_at_all(setup):
    cfg, params, batch = setup
    # (the modules' MoE layers join the load-balancing loss like the others: switched off here)
    def grads_with(*weights):  # on the host: numpy's checks below compile nothing
        return jax.device_get(grads(params, batch, load("configs/tiny.yml", MODEL + ["model.router_aux_loss=0.0", *weights])))
    # a weight per module: the second module's loss off, its weights untrained, the first's still trained
    on, off = grads_with("model.mtp_weights=[0.3, 0.0]"), grads_with("model.mtp_weights=[0.0]")
    assert np.abs(on.grads["mtp"]["w_eh"][1]).max() == 0 < np.abs(on.grads["mtp"]["w_eh"][0]).max()
    assert all(np.abs(x).max() == 0 for x in jax.tree.leaves(off.grads["mtp"]))
    # the modules read the main model's last state, so their loss trains the main layers too
    assert np.abs(on.grads["layers"]["wo"] - off.grads["layers"]["wo"]).max() > 0
    # one weight w is w / depth for each module: [0.3] is [0.15, 0.15] (the weights are all that grads reads
    # of them, so equal weights are equal gradients; compiling a third program would show nothing more)
    assert tuple(cfg.model.mtp_weights) == (0.3,)
    split = load("configs/tiny.yml", MODEL + ["model.mtp_weights=[0.15, 0.15]"])
    np.testing.assert_array_equal(lm.mtp_weights(split), lm.mtp_weights(cfg))


def test_generation_and_logits_never_run_the_modules(setup):
    cfg, params, batch = setup
    m = cfg.model
    cache = decoder.init_cache(m, 2, 16, jnp.float32)
    out = deepseek_v3.forward(params, batch["inputs"][:, :4], batch["positions"][:, :4], batch["segment_ids"][:, :4], m,
                              jnp.float32, cache=cache)
    assert out.ahead is None and out.cache["k"].shape[0] == m.n_layers


@pytest.mark.malformed
@pytest.mark.parametrize("overrides, message", [
    (["model.mtp_depth=1"], "`model.mtp_depth` applies to deepseek_v3 (multi-head latent attention), not "
                            "model.family=llama"),
    (MODEL + ["mesh.context=2"], "model.mtp_depth with mesh.context > 1"),
    (MODEL + ["model.mtp_weights=[-1]"], "`model.mtp_weights` must be one weight >= 0"),
    (MODEL + ["model.mtp_weights=[0.1, 0.2, 0.3]"], "or one per module (2), e.g. [0.3]; got [0.1, 0.2, 0.3]"),
])
def test_what_it_cannot_do_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=None) as e:
        load("configs/tiny.yml", overrides)
    assert message in str(e.value)
