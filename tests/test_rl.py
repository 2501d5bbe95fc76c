"""objective=grpo's rollouts (maxlm.rl.rollout): advantages as TRL computes them, prompts in a fixed order that a
resume continues, one-line refusals of bad prompts, and a run through train.py that samples, scores and
updates, reports its rewards and sampler-to-trainer gap, and resumes bit for bit."""

import json
import re

import numpy as np
import pytest
from conftest import ROOT, oracle, run_and_resume

from maxlm import recipe as recipe_lib
from maxlm.config import ConfigError, load
from maxlm.data import tokenizer
from maxlm.rl import arithmetic, rollout

ARGS = ["objective=grpo", "data.format=prompt", "data.source=jsonl", "model.vocab_size=258", "model.n_layers=1",
        "seq_len=32", "global_batch_size=8", "rl.group_size=4", "rl.max_new_tokens=8", "rl.max_prompt_tokens=8",
        "rl.rewards={printable: {reward: format, pattern: '^[ -~]'}}", "sample_tokens=0", "optim.lr=1e-2",
        "optim.warmup_steps=0", "optim.schedule=constant"]


def prompts_file(path, n=40):
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.integers(0, 10, 2)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return path


def test_advantages_are_trls():
    torch = oracle("torch")
    from trl.trainer.utils import nanstd

    rewards = np.array([[1.0, 0.0, 0.5, 0.25], [2.0, 2.0, 2.0, 2.0], [0.0, 3.0, 0.0, 1.0]])
    t = torch.as_tensor(rewards)
    want = (t - t.mean(1, keepdim=True)) / (nanstd(t, dim=1).unsqueeze(1) + 1e-4)
    np.testing.assert_allclose(rollout.advantages(rewards, True), want.numpy(), rtol=1e-7)
    np.testing.assert_allclose(rollout.advantages(rewards, False), rewards - rewards.mean(1, keepdims=True))
    assert not rollout.advantages(rewards, True)[1].any()  # a group whose rewards are all equal teaches nothing


def test_prompts_come_in_one_order_and_a_position_resumes_it(tmp_path):
    path = prompts_file(tmp_path / "p.jsonl")
    cfg = load("configs/tiny.yml", ARGS + [f"data.path={path}"])
    tok = tokenizer.load("byte")
    a = rollout.Prompts(cfg, tok, None)
    first = [p.record["prompt"] for p in a.take(30)] + [p.record["prompt"] for p in a.take(30)]  # past one pass
    b = rollout.Prompts(cfg, tok, None)
    b.take(30)
    again = rollout.Prompts(cfg, tok, None)
    again.taken = b.taken
    assert [p.record["prompt"] for p in again.take(30)] == first[30:]
    assert sorted(first[:40]) == sorted(json.loads(x)["prompt"] for x in path.read_text().splitlines())  # one pass: each once
    p = a.take(1)[0]
    assert list(p.ids) == list(tok.encode(p.record["prompt"]))


@pytest.mark.parametrize("record, message", [
    ({"question": "1+1="}, r"the record at .*p.jsonl:1 has no `prompt` \(text or a messages list\) nor `messages`"),
    ({"prompt": "1+1= and a much longer prompt than eight tokens"}, r"the prompt at .*p.jsonl:1 is 47 tokens, more than "
                                                                    r"rl.max_prompt_tokens=8"),
    ({"messages": [{"role": "user", "content": "1+1="}]}, r"holds messages, and no chat template renders them"),
])
def test_a_bad_prompt_is_one_line_naming_it(tmp_path, record, message):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(record) + "\n")
    cfg = load("configs/tiny.yml", ARGS + [f"data.path={path}"])
    with pytest.raises(ConfigError, match=message):
        rollout.Prompts(cfg, tokenizer.load("byte"), None).take(1)


def test_lora_grpo_keeps_no_second_copy_for_its_reference():
    cfg = load("configs/tiny.yml", ARGS + ["data.path=x.jsonl", "rl.beta=0.04", "lora.rank=4"])
    r = recipe_lib.build(cfg)
    assert r.objective.reference and [t.name for t in r.transforms] == ["lora"]  # the reference is LoRA's frozen base
    assert {f.name: (f.shape, f.dtype) for f in r.batch.fields}["advantages"] == ((), "float32")


def test_a_grpo_run_samples_scores_updates_and_resumes_bitwise(tmp_path):
    """Two updates per rollout, a checkpoint every 2 steps (at a rollout's end): the run reports its rewards,
    completions and the sampler-to-trainer gap, its parameters move, and a resume from step 2 samples the same
    completions and takes the same steps, bit for bit."""
    path = prompts_file(tmp_path / "p.jsonl")
    rows_a, rows_b, a, b = run_and_resume("configs/tiny.yml", ARGS + [f"data.path={path}", "rl.updates_per_batch=2"],
                                          tmp_path)
    assert [(r["loss"], r.get("reward")) for r in rows_a[2:]] == [(r["loss"], r.get("reward")) for r in rows_b[-2:]]
    first = rows_a[0]
    for key in ("reward", "reward/printable", "reward_std", "solved", "completion_len", "truncated", "logp_gap_max",
                "clip_low", "clip_high", "rollout_s"):
        assert key in first, key
    assert first["logp_gap_max"] <= 1e-5  # float32 on the CPU: the sampler's and the trainer's log-probabilities agree
    # one rollout, two updates: each update's row reports the rollout it trained on
    assert rows_a[1]["reward"] == first["reward"] and rows_a[1]["rollout_s"] == first["rollout_s"]
    assert rows_a[2]["rollout_s"] != first["rollout_s"]
    assert 0 < first["reward"] < 1 and first["grad_norm"] > 0 and rows_a[1]["ratio"] != 1.0


def test_the_demonstrations_task_is_right_and_its_shipped_files_are_the_generators(tmp_path):
    """data/arithmetic (the GRPO demonstration's configs read it) is what `python -m maxlm.rl.arithmetic` writes;
    every answer is right, about half the demonstrations are off by one or two, and the held-out problems are
    in neither training file."""
    counts = arithmetic.write(tmp_path)
    for name in counts:
        assert (tmp_path / name).read_bytes() == (ROOT / "data/arithmetic" / name).read_bytes(), name
    read = lambda name: [json.loads(x) for x in (tmp_path / name).read_text().splitlines()]  # noqa: E731
    prompts, held = read("prompts.jsonl"), read("eval.jsonl")
    for r in prompts + held:
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", r["prompt"]).groups()
        assert int(r["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
    answers = {r["prompt"]: int(r["answer"]) for r in prompts}
    assert not set(answers) & {r["prompt"] for r in held} and len(held) > 0.05 * len(answers)
    off = [int(d["text"].split("=")[1]) - answers[d["text"].split("=")[0] + "="] for d in read("sft.jsonl")]
    assert set(off) <= {-2, -1, 0, 1, 2} and 0.45 < np.mean(np.array(off) != 0) < 0.55
