"""objective=grpo's rollouts (maxlm.rl.rollout): advantages as TRL computes them, prompts in a fixed order that a
resume continues, one-line refusals of bad prompts, and a run through train.py that samples, scores and
updates, reports its rewards and sampler-to-trainer gap, and resumes bit for bit."""

import collections
import json
import re
import sys
import types

import jax
import numpy as np
import pytest
from conftest import ROOT, oracle, run_and_resume

from maxlm import recipe as recipe_lib, train
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


def test_prompts_from_parquet_are_the_rows_with_every_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = prompts_file(tmp_path / "p.jsonl")
    records = [json.loads(x) for x in jsonl.read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "p.parquet", row_group_size=16)
    cfg = load("configs/tiny.yml", ARGS + [f"data.path={tmp_path / 'p.parquet'}", "data.source=parquet"])
    got = rollout.Prompts(cfg, tokenizer.load("byte"), None).take(40)
    assert sorted(p.record["prompt"] + p.record["answer"] for p in got) == sorted(r["prompt"] + r["answer"] for r in records)
    assert re.fullmatch(r".*p\.parquet:row group \d row \d+", got[0].where)


@pytest.mark.malformed
def test_a_template_that_opens_no_assistant_turn_and_a_prompt_that_ends_with_one_are_refused(tmp_path):
    from maxlm.data import chat

    cfg = load("configs/tiny.yml", ARGS + [f"data.path={prompts_file(tmp_path / 'p.jsonl')}", "rl.max_prompt_tokens=64",
                                           "seq_len=80"])
    tok = tokenizer.load("byte")
    chatml = chat.Template(chat.CHATML, "chatml", {})
    assert rollout.Prompts(cfg, tok, chatml).encode({"prompt": "1+1="}, "p.jsonl:@0").size  # the assistant's header follows
    deaf = chat.Template("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", "deaf.jinja", {})
    with pytest.raises(ConfigError, match=r"data.chat_template deaf.jinja renders no assistant turn after a prompt"):
        rollout.Prompts(cfg, tok, deaf).encode({"prompt": "1+1="}, "p.jsonl:@0")
    answered = {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}
    with pytest.raises(ConfigError, match=r"ends with an assistant turn; a prompt's messages end where"):
        rollout.Prompts(cfg, tok, chatml).encode(answered, "p.jsonl:@0")


@pytest.mark.malformed
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


def test_lora_grpo_trains_the_adapters_against_the_base_as_its_reference(tmp_path):
    """From a model an SFT run saved: only the adapters train (the checkpoint holds them alone), and the KL term
    is measured against LoRA's frozen base, the one copy of the model's weights there is."""
    cfg = load("configs/tiny.yml", ARGS + ["data.path=x.jsonl", "rl.beta=0.04", "lora.rank=4", "init_from=sft"])
    r = recipe_lib.build(cfg)
    assert r.objective.reference and [t.name for t in r.transforms] == ["lora"]  # the reference is LoRA's frozen base
    sft = tmp_path / "sft"
    tiny = ["model.vocab_size=258", "model.n_layers=1", "seq_len=32", "global_batch_size=8", "sample_tokens=0"]
    assert train.run(load("configs/tiny.yml", tiny + ["steps=1", f"run_dir={sft}"])) == 0
    d = tmp_path / "grpo"
    assert train.run(load("configs/tiny.yml", ARGS + [
        f"data.path={prompts_file(tmp_path / 'p.jsonl')}", "rl.beta=0.04", "lora.rank=4", f"init_from={sft}", "steps=2",
        "log_every=1", "rl.updates_per_batch=2", f"run_dir={d}"])) == 0
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert rows[0]["kl"] == 0.0 < rows[1]["kl"]  # the adapters start at zero: the policy is the base, then leaves it
    import orbax.checkpoint as ocp

    params = ocp.PyTreeCheckpointer().metadata(d / "checkpoints/2/state").item_metadata.tree["params"]
    saved = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    assert len(saved) == 8 and all(k.endswith(("['a']", "['b']")) for k in saved), saved  # wq, wk, wv, wo: A and B


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


def test_a_run_compiles_each_program_once_and_the_decoder_for_a_few_logged_prompt_lengths(tmp_path, capsys):
    """rl.max_prompt_tokens=40: rollouts pad their prompts to 8, 16, 32 or 40 tokens, so the decoder compiles at
    most four times (prompts of 20 and 23 tokens share one), each logged when a rollout first needs it; the
    step and the old log-probabilities' forward compile once, and no step compiles anything again."""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": "x" * n}) + "\n" for n in (5, 12, 20, 23, 30, 40)))
    compiles = collections.Counter()

    def count(event, _, fun_name=None, **__):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[fun_name] += 1

    args = [a for a in ARGS if not a.startswith(("rl.max_prompt_tokens", "seq_len", "rl.group_size"))]
    jax.clear_caches()  # what earlier tests in this process compiled would not compile again
    jax.monitoring.register_event_duration_secs_listener(count)
    try:  # one prompt a rollout: six rollouts see each length once
        assert train.run(load("configs/tiny.yml", args + ["rl.max_prompt_tokens=40", "seq_len=48", "rl.group_size=8",
                                                          f"data.path={path}", "steps=6", f"run_dir={tmp_path / 'run'}"])) == 0
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    logged = re.findall(r"compiling the decoder for prompts padded to (\d+) tokens", capsys.readouterr().out)
    assert sorted(map(int, logged)) == [8, 16, 32, 40]
    assert compiles.pop("jit(_generate)") == 4
    assert compiles["jit(train_step)"] == compiles["jit(old_logp)"] == 1
    assert set(compiles.values()) == {1}, compiles


def test_the_decoder_reads_the_trainers_own_weights(tmp_path, monkeypatch):
    """No copy of the weights, to the host or on the devices: each rollout's decoder is handed the very buffers
    the trainer's state holds at that step (8 devices, the parameters sharded over them)."""
    from maxlm import generate
    from maxlm.state import StateSpec

    buffers = lambda tree: [s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree) for s in x.addressable_shards]  # noqa: E731
    held, decoded = [], []
    natural, decode = StateSpec.natural_params, generate._generate

    def natural_params(self, state):
        held.append(buffers(state.params))
        return natural(self, state)

    def _generate(params, *args, **kw):
        decoded.append(buffers(params))
        return decode(params, *args, **kw)

    monkeypatch.setattr(StateSpec, "natural_params", natural_params)
    monkeypatch.setattr(generate, "_generate", _generate)
    path = prompts_file(tmp_path / "p.jsonl")
    assert train.run(load("configs/tiny.yml", ARGS + [f"data.path={path}", "steps=3", f"run_dir={tmp_path / 'run'}"])) == 0
    assert len(decoded) == 3 and decoded == held and len(set(decoded[0])) > 8


def test_dynamic_sampling_replaces_the_groups_that_teach_nothing(tmp_path, monkeypatch):
    """A reward that is 1 for every completion of a prompt with an even sum, and random-ish otherwise: without
    dynamic sampling about half the groups are all equal; with it, more rounds replace them, the trained batch
    has none, and the prompts consumed are counted, so a resume stays exact. When no round can help (a reward
    that is always 0), every round is used and the batch says its groups are all equal."""
    mod = types.ModuleType("half_decided")
    mod.reward = lambda record, completion: 1.0 if int(record["answer"]) % 2 == 0 else float(completion[:1] < "P")
    mod.never = lambda record, completion: 0.0
    monkeypatch.setitem(sys.modules, "half_decided", mod)
    path = prompts_file(tmp_path / "p.jsonl")

    def run(name, *extra):
        d = tmp_path / name
        assert train.run(load("configs/tiny.yml", ARGS + [f"data.path={path}", "steps=3", "log_every=1", f"run_dir={d}",
                                                          *extra])) == 0
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
        return rows, json.loads((d / "checkpoints/3/data/process_0-of-1.json").read_text())

    reward = "rl.rewards={r: {reward: 'half_decided:reward'}}"
    plain, _ = run("plain", reward)
    dynamic, state = run("dynamic", reward, "rl.dynamic_sampling=8")
    assert sum(r["groups_all_equal"] for r in plain) > 0 and all(r["groups_all_equal"] == 0 for r in dynamic)
    assert all(r["sampling_rounds"] >= 1 for r in dynamic) and sum(r["sampling_rounds"] for r in dynamic) > 3
    assert state["prompts"] == 2 * sum(r["sampling_rounds"] for r in dynamic)  # 2 prompts a round
    hopeless, _ = run("hopeless", "rl.rewards={r: {reward: 'half_decided:never'}}", "rl.dynamic_sampling=2")
    assert [(r["sampling_rounds"], r["groups_all_equal"]) for r in hopeless] == [(3, 1.0)] * 3


def test_a_dry_run_compiles_what_the_rollouts_run(tmp_path, capsys):
    """Under a circular pipeline (layers stored out of natural order): the reshard the decoder needs, the decoder
    at each prompt length a rollout can pad to, and the old log-probabilities' forward, each with its memory."""
    args = [a for a in ARGS if not a.startswith(("model.n_layers", "rl.max_prompt_tokens"))]
    assert train.run(load("configs/tiny.yml", args + [
        "model.n_layers=4", "rl.max_prompt_tokens=20", "mesh.stage=2", "mesh.fsdp=4", "microbatches=2", "pipeline_repeats=2",
        "dry_run=true", f"data.path={tmp_path / 'absent.jsonl'}", f"run_dir={tmp_path / 'run'}"])) == 0
    out = capsys.readouterr().out
    names = re.findall(r"^  (\S.*?)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)$", out.split("rollout programs compiled")[1], re.M)
    assert [n[0] for n in names] == ["reshard to natural layer order", "decoder, prompts padded to 8 tokens",
                                     "decoder, prompts padded to 16 tokens", "decoder, prompts padded to 24 tokens",
                                     "old log-probabilities"]
    assert all(float(total) > 0 for *_, total in names) and "dry run: the step compiles and fits" in out


def test_an_moe_run_reports_the_tokens_the_decoder_and_the_trainer_routed_differently(tmp_path):
    """Mixtral-style, 4 experts, 2 a token, sharded over 8 devices, float32: every completion token the
    decoder sampled was routed to the same experts, in every layer, by the trainer's forward."""
    path = prompts_file(tmp_path / "p.jsonl")
    moe = ["model.family=mixtral", "model.n_experts=4", "model.experts_per_token=2", "model.n_layers=2"]
    d = tmp_path / "run"
    assert train.run(load("configs/tiny.yml", ARGS + moe + [f"data.path={path}", "steps=2", "log_every=1",
                                                            f"run_dir={d}"])) == 0
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert [r["routes_differ"] for r in rows] == [0.0, 0.0] and max(r["logp_gap_max"] for r in rows) <= 1e-5


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


@pytest.mark.malformed
@pytest.mark.parametrize("args, message", [
    (["--out", ""], "argument --out: is empty; give a path"),  # wrote the three files into the current directory
    (["--out", "/etc/passwd"], "--out /etc/passwd is a file, not a directory"),  # a FileExistsError traceback
    (["--high", "-1"], "argument --high: must be a whole number >= 1, got -1"),  # wrote empty files, exit 0
    (["--copies", "0"], "argument --copies: must be a whole number >= 1, got 0"),
    (["--noise", "nan"], "argument --noise: must be a number in [0, 1], got 'nan'"),
    (["--noise", "2"], "argument --noise: must be a number in [0, 1], got '2'"),
])
def test_the_generators_mistakes_are_one_line(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    assert arithmetic.main(["--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("maxlm: error: ") and message in err and "\n" not in err, err
    assert not list(tmp_path.iterdir())
