"""GRPO's update (maxlm.objectives.grpo) against TRL's GRPOTrainer, the oracle: on the same tiny Llama, the same
prompts, completions, advantages and old log-probabilities, and a reference model of its own, maxlm's loss and
gradients equal TRL's `_compute_loss` for GRPO with KL, Dr. GRPO and DAPO's token-level loss with clip-higher."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import oracle
from hf_parity import make_hf

torch = oracle("torch")
transformers = oracle("transformers")
trl = oracle("trl")
datasets = oracle("datasets")

from maxlm import models, recipe as recipe_lib, schedules, step as step_lib  # noqa: E402
from maxlm.batch import Schema  # noqa: E402
from maxlm.convert import hf  # noqa: E402
from maxlm.objectives import grpo  # noqa: E402

ARCH = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
B, G, P, C = 4, 2, 5, 7  # completions, group size, prompt tokens, completion tokens at most
CASES = {  # TRL's names: the paper's GRPO with a KL penalty; Dr. GRPO; DAPO's token-level loss with clip-higher
    "grpo_kl": dict(loss_type="grpo", beta=0.05, epsilon=0.2, epsilon_high=0.2, temperature=0.9),
    "dr_grpo": dict(loss_type="dr_grpo", beta=0.0, epsilon=0.2, epsilon_high=0.2, temperature=1.0),
    "dapo_clip_higher": dict(loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28, temperature=0.7),
}


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """A policy and a reference model (two random tiny Llamas) and one fixed rollout: prompts of one length
    (so HF's positions are maxlm's), completions of several lengths, advantages, and old log-probabilities a
    little off the policy's, so that the ratio is not 1 and the clip acts."""
    d = tmp_path_factory.mktemp("grpo")
    policy = make_hf(transformers.LlamaConfig(**ARCH), d / "policy", seed=0)
    ref = make_hf(transformers.LlamaConfig(**ARCH), d / "ref", seed=1)
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, 64, (B, P))
    completions = rng.integers(1, 64, (B, C))
    lengths = np.array([C, 3, 5, 1])
    mask = (np.arange(C)[None] < lengths[:, None]).astype(np.int64)
    advantages = np.array([1.0, -1.0, 0.7, -0.7], np.float32)  # a group's normalised rewards, two groups
    noise = rng.normal(0, 0.3, (B, C)).astype(np.float32)
    return dict(dir=d, policy=policy, ref=ref, prompts=prompts, completions=completions, mask=mask,
                advantages=advantages, noise=noise)


def torch_logps(model, ids, T: float) -> np.ndarray:
    """Completion tokens' log-probabilities under softmax(logits / T) (the definition; float64 out)."""
    with torch.no_grad():
        logits = model(torch.as_tensor(ids)).logits[:, P - 1:-1].double() / T
    return torch.gather(torch.log_softmax(logits, -1), 2, torch.as_tensor(ids[:, P:])[..., None])[..., 0].numpy()


def tokenizer():
    """A word-level tokenizer over the tiny model's 64 ids: TRL wants one (it decodes completions); nothing here
    reads its text."""
    from tokenizers import Tokenizer, models as tok_models

    vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, 63)}, "<eos>": 63}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tok_models.WordLevel(vocab, unk_token="<pad>")),
                                                pad_token="<pad>", eos_token="<eos>")


def trl_loss_and_grads(r, case, tmp: Path):
    """TRL's GRPOTrainer._compute_loss on the rollout, and the policy's gradients by HF name."""
    kw = CASES[case]
    args = trl.GRPOConfig(output_dir=str(tmp / case), per_device_train_batch_size=B, num_generations=G,
                          max_completion_length=C, report_to=[], use_cpu=True, bf16=False, logging_steps=1,
                          gradient_checkpointing=False, **kw)
    data = datasets.Dataset.from_list([{"prompt": "p"}] * B)
    # TRL loads the policy from its directory (and, with beta > 0, a reference copy it does not use here: the
    # rollout's reference log-probabilities are given, from the other model)
    trainer = trl.GRPOTrainer(model=str(r["dir"] / "policy"), reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
                              args=args, train_dataset=data, processing_class=tokenizer())
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    ids = np.concatenate([r["prompts"], r["completions"]], 1)
    old = torch_logps(trainer.model, ids, kw["temperature"]) + r["noise"]
    inputs = {"prompt_ids": torch.as_tensor(r["prompts"]), "prompt_mask": torch.ones(B, P, dtype=torch.long),
              "completion_ids": torch.as_tensor(r["completions"]), "completion_mask": torch.as_tensor(r["mask"]),
              "advantages": torch.as_tensor(r["advantages"]), "old_per_token_logps": torch.as_tensor(old).float(),
              "num_items_in_batch": torch.as_tensor(float(r["mask"].sum()))}
    if kw["beta"]:
        inputs["ref_per_token_logps"] = torch.as_tensor(torch_logps(r["ref"], ids, kw["temperature"])).float()
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().float().numpy() for n, p in trainer.model.named_parameters()}
    return float(loss), grads, old


def as_maxlm(grads: dict, r, tmp: Path):
    """TRL's gradients laid out as maxlm's params: written as a checkpoint of the policy's config and imported."""
    from safetensors.numpy import save_file
    out = tmp / "grads"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text((r["dir"] / "policy" / "config.json").read_text())
    save_file({n: np.ascontiguousarray(g) for n, g in grads.items()}, str(out / "model.safetensors"))
    return hf.load_params(out, hf.load_config(out))


def maxlm_loss_and_grads(r, case, old):
    kw = CASES[case]
    path = r["dir"] / "policy"
    cfg = hf.load_config(path, [f"seq_len={P + C - 1}", f"global_batch_size={B}", "dtype=float32"])
    base = recipe_lib.build(cfg)
    objective = grpo.GRPO(kw["loss_type"], kw["epsilon"], kw["epsilon_high"], kw["beta"], True, kw["temperature"], C)
    batch_schema = Schema((*base.batch.fields, *grpo.fields(cfg.seq_len)), B)
    import maxlm.transforms as transforms
    ts = transforms.build(cfg, base.base_specs, schedules.Layout(), objective.reference)
    recipe = base._replace(objective=objective, batch=batch_schema, transforms=ts,
                           schedule=schedules.build(1, axes=batch_schema.axes))
    L = P + C - 1
    ids = np.concatenate([r["prompts"], r["completions"]], 1)
    mask_BL = np.zeros((B, L), np.int32)
    mask_BL[:, P - 1:] = r["mask"]
    old_BL = np.zeros((B, L), np.float32)
    old_BL[:, P - 1:] = old * r["mask"]
    seg = np.ones((B, L), np.int32)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "positions": np.tile(np.arange(L), (B, 1)), "segment_ids": seg,
             "loss_mask": mask_BL, "advantages": r["advantages"], "old_logp": old_BL}
    batch = {k: jnp.asarray(v, jnp.float32 if k in ("advantages", "old_logp") else jnp.int32) for k, v in batch.items()}
    params = hf.load_params(path, cfg)
    extras = {"frozen": hf.load_params(r["dir"] / "ref", cfg)} if objective.reference else {}
    out = jax.jit(lambda p, b, e: step_lib.grads(p, b, recipe, e))(params, batch, extras)
    return float(out.loss), jax.device_get(out.grads), out.metrics


@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradients_equal_trl(rollout, case, tmp_path):
    loss_trl, grads_trl, old = trl_loss_and_grads(rollout, case, tmp_path)
    loss, grads, metrics = maxlm_loss_and_grads(rollout, case, old)
    assert loss == pytest.approx(loss_trl, rel=1e-5)
    want = as_maxlm(grads_trl, rollout, tmp_path)
    for path, a, b in zip(*zip(*jax.tree_util.tree_leaves_with_path(grads)), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max(), err_msg=jax.tree_util.keystr(path))
    assert float(metrics["clip_low"]) + float(metrics["clip_high"]) > 0  # the clip acted


# ---- the sampler and the trainer agree: the decoder's log-probabilities are the trainer forward's ----

SAMPLER = ["model.vocab_size=128", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
           "model.head_dim=8", "model.d_ff=64", "model.init_std=0.3", "dtype=float32", "seq_len=32",
           "global_batch_size=4"]


@pytest.mark.parametrize("overrides", [[], ["model.family=mixtral", "model.n_experts=4", "model.experts_per_token=2"]],
                         ids=["dense", "moe"])
def test_sampled_log_probabilities_equal_the_trainer_forward(overrides):
    """Completions sampled at temperature 0.8 with the KV-cache decoder: each token's log-probability as the
    sampler drew it equals the trainer's forward over the whole row (the chunked loss at the same
    temperature), to 1e-5 in float32, for a dense model and an MoE one."""
    from maxlm import generate
    from maxlm.config import load
    from maxlm.models import params as P_
    from maxlm.rl import rollout

    cfg = load("configs/tiny.yml", SAMPLER + overrides)
    r = recipe_lib.build(cfg)
    params = P_.init(r.base_specs, jax.random.key(0))
    prompts = [[5, 17, 3, 88, 41], [11, 2, 70], [9, 9, 9, 1, 2, 3], [40]]
    g = generate.decode(params, cfg.model, prompts, 12, temperature=0.8, seed=3, return_logps=True)
    rows = rollout.pack(prompts, g, cfg.seq_len)
    tok = np.asarray(jax.jit(lambda p, b: r.forward.token_losses(p, b, temperature=0.8).tok_BL)(params, rows))
    gaps = [np.abs(-tok[i, len(p) - 1:len(p) - 1 + n] - g.logps[i, :n]) for i, (p, n) in enumerate(zip(prompts, g.lengths))]
    assert max(float(x.max()) for x in gaps) <= 1e-5
    assert np.all(g.logps[:, 0] < 0) and len(set(map(tuple, g.tokens))) > 1  # sampled, not greedy
    # the entropy of what each token was drawn from: the model's logits over the row at the same temperature
    logits = np.asarray(models.apply(params, rows["inputs"], rows["positions"], rows["segment_ids"], cfg.model,
                                     jnp.float32).logits)
    lp = jax.nn.log_softmax(logits / 0.8, axis=-1)
    want = -np.sum(np.exp(lp) * lp, axis=-1)
    for i, (p, n) in enumerate(zip(prompts, g.lengths)):
        np.testing.assert_allclose(g.entropy[i, :n], want[i, len(p) - 1:len(p) - 1 + n], rtol=1e-5, atol=1e-5)
