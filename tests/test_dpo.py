"""DPO and SimPO: the train step's loss and gradients against the papers' formulas written out directly
(full logits, float64 formula), the LoRA reference being the base, and learning a preference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_and_resume
from maxlm import aot, mesh as mesh_lib, models, recipe as recipe_lib, sharding, step as step_lib
from maxlm.config import load
from maxlm.models import params as P_
from maxlm.state import StateSpec

SMALL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=16",
         "model.d_ff=128", "seq_len=32", "global_batch_size=8", "dtype=float32", "objective=dpo",
         "data.format=preference", "data.source=jsonl", "data.path=unused.jsonl", "data.chat_template=chatml",
         "optim.schedule=constant", "optim.warmup_steps=0"]


def pair_rows(rng, B, L, prompt=5, chosen=(0, 64), rejected=(192, 256)):
    """B rows, each one pair: segment 1 = prompt + chosen response, segment 2 = prompt + rejected, loss
    mask on the responses' tokens (as data.format=preference lays them out)."""
    rows = {k: np.zeros((B, L), np.int32) for k in ("inputs", "targets", "positions", "segment_ids", "loss_mask")}
    for b in range(B):
        p = rng.integers(64, 192, prompt)
        at = 0
        for seg, (lo, hi) in enumerate((chosen, rejected), 1):
            f = np.r_[p, rng.integers(lo, hi, rng.integers(4, 9))]
            m = len(f) - 1
            sl = slice(at, at + m)
            rows["inputs"][b, sl], rows["targets"][b, sl], rows["positions"][b, sl] = f[:-1], f[1:], np.arange(m)
            rows["segment_ids"][b, sl] = seg
            rows["loss_mask"][b, sl] = np.arange(1, m + 1) >= prompt  # targets that are response tokens
            at += m
    return rows


def direct_logps(params, batch, m):
    """Each row's [chosen, rejected] summed response log-probabilities from the full logits."""
    logits = models.apply(params, batch["inputs"], batch["positions"], batch["segment_ids"], m, jnp.float32).logits
    tok = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), batch["targets"][..., None], -1)[..., 0]
    on = batch["loss_mask"] > 0
    return jnp.stack([jnp.sum(tok * (on & (batch["segment_ids"] == s)), 1) for s in (1, 2)], -1)


def formula64(pi, ref, n, beta, loss, gamma):
    """The papers' losses in float64, and their derivative with respect to pi [B, 2]."""
    pi, ref, n = (np.asarray(x, np.float64) for x in (pi, ref, n))
    if loss == "simpo":
        h = beta * (pi[:, 0] / n[:, 0] - pi[:, 1] / n[:, 1]) - gamma
        dh = np.stack([beta / n[:, 0], -beta / n[:, 1]], -1)
    else:
        h = beta * ((pi[:, 0] - ref[:, 0]) - (pi[:, 1] - ref[:, 1]))
        dh = np.stack([np.full_like(h, beta), np.full_like(h, -beta)], -1)
    B = len(h)
    value = np.mean(np.log1p(np.exp(-h)))
    return value, (-1 / (1 + np.exp(h)))[:, None] * dh / B


@pytest.mark.parametrize("loss", ["sigmoid", "simpo"])
def test_loss_and_gradients_are_the_papers_formula(loss):
    cfg = load("configs/tiny.yml", SMALL + [f"dpo.loss={loss}", "dpo.beta=0.5"])
    m = cfg.model
    specs = models.get(m.family).param_specs(m)
    params = P_.init(specs, jax.random.key(0))
    recipe = recipe_lib.build(cfg)
    ref = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(7), x.shape), params)
    batch = jax.tree.map(jnp.asarray, pair_rows(np.random.default_rng(0), 4, 32))
    ours = jax.jit(lambda p, r, b: step_lib.grads(p, b, recipe, {"frozen": r}))(params, ref, batch)

    # compiled: op by op, each of the model's ops would be compiled on its own
    logps = jax.jit(lambda p: direct_logps(p, batch, m))
    pi, ref_lp = logps(params), logps(ref)
    n = np.asarray(jnp.sum((batch["loss_mask"] > 0)[..., None] & (batch["segment_ids"][..., None] == jnp.array([1, 2])), 1))
    value, dpi = formula64(pi, ref_lp, n, 0.5, loss, cfg.dpo.gamma)
    assert abs(float(ours.loss) - value) <= 1e-5 * abs(value)
    (g,) = jax.jit(lambda p, ct: jax.vjp(logps, p)[1](ct))(params, jnp.asarray(dpi, jnp.float32))
    for x, y in zip(jax.tree.leaves(ours.grads), jax.tree.leaves(g)):
        np.testing.assert_allclose(x, y, rtol=0, atol=2e-4 * np.abs(y).max())
    acc = np.mean((pi[:, 0] - (0 if loss == "simpo" else ref_lp[:, 0])) * (1 / n[:, 0] if loss == "simpo" else 1)
                  > (pi[:, 1] - (0 if loss == "simpo" else ref_lp[:, 1])) * (1 / n[:, 1] if loss == "simpo" else 1))
    assert float(ours.metrics["reward_accuracy"]) == pytest.approx(acc)


def test_under_lora_the_reference_is_the_base_so_step_0_is_log_2():
    cfg = load("configs/tiny.yml", SMALL + ["lora.rank=4"])
    the_mesh = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, 1), jax.devices()[:1])
    ss = StateSpec(recipe_lib.build(cfg, the_mesh), the_mesh, sharding.rules(cfg))
    state = ss.init_fn(0)()
    batch = jax.tree.map(jnp.asarray, pair_rows(np.random.default_rng(1), 8, 32))
    with sharding.use(the_mesh, sharding.rules(cfg)):
        out = jax.jit(lambda s, b: step_lib.grads(s.params, b, ss.recipe, s.extras))(state, batch)
    assert float(out.loss) == pytest.approx(np.log(2), abs=1e-7)  # policy == base: every margin is exactly 0
    assert float(out.metrics["reward_margin"]) == 0.0
    assert all(np.any(ab["b"]) for ab in out.grads["layers"].values())  # yet the adapters get a gradient


def test_dpo_learns_a_constructed_preference():
    """Chosen responses use low token ids, rejected ones high ids: the reward accuracy on fresh pairs
    must pass 0.9, and the chosen reward must rise above the rejected one."""
    cfg = load("configs/tiny.yml", SMALL + ["optim.lr=3e-3", "dpo.beta=0.1"])
    the_mesh = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, 1), jax.devices()[:1])
    rules = sharding.rules(cfg)
    ss = StateSpec(recipe_lib.build(cfg, the_mesh), the_mesh, rules)
    step = aot.compile_step(cfg, ss)
    state, rng, seen = ss.init_fn(0)(), np.random.default_rng(2), []
    for _ in range(40):
        state, metrics = step(state, jax.device_put(pair_rows(rng, 8, 32), ss.abstract_batch["inputs"].sharding))
        seen.append({k: float(metrics[k]) for k in ("loss", "reward_accuracy", "reward_margin")})
    assert seen[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)
    last = seen[-5:]
    assert min(s["reward_accuracy"] for s in last) > 0.9, seen
    assert min(s["reward_margin"] for s in last) > 0 and np.mean([s["loss"] for s in last]) < 0.5 * np.log(2), seen


@pytest.mark.parametrize("source", ["jsonl", "prepared"])
def test_configs_dpo_end_to_end_logs_rewards_and_resumes_bitwise(tmp_path, source):
    """configs/dpo.yml through train.run on a preference JSONL, and on the same records prepared
    (`prepare --format preference`), full-parameter (the reference is the frozen copy of the seed's weights,
    rebuilt on resume): rewards in metrics.jsonl; a copy resumed from step 2 gives the same losses bit for bit."""
    import json

    from maxlm.data import prepare

    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}?", "chosen": "yes " * (i % 3 + 1), "rejected": f"no {i}"}) + "\n"
                            for i in range(48)))
    if source == "prepared":
        assert prepare.main([str(data), "--tokenizer", "byte", "--chat-template", "chatml", "--format", "preference",
                             "--out", str(tmp_path / "prep"), "--workers", "1"]) == 0
        data = tmp_path / "prep"
    args = SMALL[:9] + ["init_from=", "data.tokenizer=byte", "data.chat_template=chatml", f"data.path={data}",
                        f"data.source={source}", "lora.rank=0", "sample_tokens=8", "seq_len=192", "model.vocab_size=384",
                        "optim.lr=1e-3"]
    rows_a, rows_b, _, _ = run_and_resume("configs/dpo.yml", args, tmp_path)
    first = rows_a[0]
    assert first["loss"] == pytest.approx(np.log(2), abs=1e-6) and first["reward_margin"] == 0.0
    assert {"rewards_chosen", "rewards_rejected", "reward_accuracy", "masked_frac"} <= set(first)
    assert [r["loss"] for r in rows_a][2:] == [r["loss"] for r in rows_b][-2:]
