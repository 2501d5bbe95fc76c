"""lm-evaluation-harness on maxlm models: loglikelihoods equal maxlm's own logits, a multiple-choice task scores
what it must by construction, generation stops where lm_eval asks, the CLI on a saved run (and its one-line
refusals), and the benchmarks in training's metrics.

Every model here is a 1-layer byte model on 64-token rows, sharded fsdp=4 x tensor=2: one padded length,
so the scorer compiles once for the whole file."""

import json
import string

import jax
import numpy as np
import pytest
from conftest import oracle, params_checkpoint

lm_eval = oracle("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402

from maxlm import api, eval_harness as eh, mesh as mesh_lib, models, train  # noqa: E402
from maxlm.config import ConfigError, load  # noqa: E402
from maxlm.data import tokenizer  # noqa: E402
from maxlm.models import params as P_  # noqa: E402

TINY = "configs/tiny.yml"
ARGS = ["model.n_layers=1", "model.d_model=64", "model.d_ff=128", "model.n_heads=4", "model.n_kv_heads=2",
        "model.head_dim=16", "seq_len=64", "global_batch_size=8", "mesh.fsdp=4", "mesh.tensor=2", "sample_tokens=0"]
# The bigram model's table: after ':' comes 'A', after 'a' 'b', and so on up the alphabet.
NEXT = {":": "A", **{c: chr(ord(c) + 1) for c in string.ascii_lowercase[:20]}}


@pytest.fixture(scope="module")
def cfg():
    return load(TINY, ARGS)


@pytest.fixture(scope="module")
def mesh(cfg):
    return mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, jax.device_count()))


def bigram(cfg) -> dict:
    """Host parameters of a model whose next byte depends only on the current one: every layer weight is 0,
    so the final hidden state is the normalised embedding. The bytes of NEXT have orthogonal embeddings of
    RMS 1, and each makes its NEXT byte 20 nats likelier than any other; other bytes predict uniformly."""
    D = cfg.model.d_model
    p = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), P_.abstract(models.get("llama").param_specs(cfg.model)))
    p["final_norm"][:] = 1.0
    for i, (a, b) in enumerate(NEXT.items()):
        p["embed"][ord(a), i] = np.sqrt(D)
        p["unembed"][i, ord(b)] = 20.0 / np.sqrt(D)
    return p


@pytest.fixture(scope="module")
def models_(cfg):
    """{name: host params}: a freshly initialised model and the bigram one."""
    return {"random": jax.device_get(api.Model.init(cfg, seed=3).params), "bigram": bigram(cfg)}


def make_lm(cfg, mesh, params):
    m = api.Model(cfg, params, mesh)  # placed by the config's sharding rules
    return eh.MaxLM(cfg, m.recipe, m.params, mesh, m.rules, tokenizer.load("byte"))


def log_softmax(cfg, params, seqs: list[list[int]]) -> np.ndarray:
    """maxlm's own logits (one device, no mesh) -> log_softmax, float64 [n, 72, V]; rows right-padded."""
    rows = np.zeros((len(seqs), 72), np.int32)
    for i, s in enumerate(seqs):
        rows[i, :len(s)] = s
    logits = np.asarray(api.Model(cfg, params).logits(rows), np.float64)
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)


def direct(cfg, params, pairs) -> list[tuple[float, bool]]:
    """(log p(continuation | context), greedy) for byte strings as lm_eval splits them: the context's trailing
    spaces join the continuation, an empty context is the prefix byte '\\n', and the sequence keeps its last
    65 bytes (a 64-token context)."""
    seqs, ks = [], []
    for ctx, cont in pairs:
        n = len(ctx) - len(ctx.rstrip())
        ctx, cont = (ctx[:len(ctx) - n], ctx[len(ctx) - n:] + cont) if n else (ctx, cont)
        c, k = list((ctx or "\n").encode()), list(cont.encode())
        seqs.append((c + k)[-65:])
        ks.append(len(k))
    lp = log_softmax(cfg, params, seqs)
    out = []
    for i, (s, k) in enumerate(zip(seqs, ks)):
        at = range(len(s) - k, len(s))
        out.append((sum(lp[i, j - 1, s[j]] for j in at), all(lp[i, j - 1].argmax() == s[j] for j in at)))
    return out


PAIRS = [("Pick one:", "A"), ("The cat ", "sat"), ("", "hello"), ("x" * 100, "yz"), ("abc", "defg"), ("abc", "dxfg"),
         ("q: ", "abab"), ("\n", "z"), ("zz", "\nq"), ("a" * 70, "b")]


@pytest.mark.parametrize("name", ["random", "bigram"])
def test_loglikelihood_equals_maxlm_logits(cfg, mesh, models_, name):
    lm = make_lm(cfg, mesh, models_[name])
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(PAIRS)])
    want = direct(cfg, models_[name], PAIRS)
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=1e-5, atol=1e-4)
    assert [g[1] for g in got] == [w[1] for w in want]
    if name == "bigram":  # greedy by construction: "abc" -> "defg", and ':' -> 'A'; not with a wrong byte
        assert [g[1] for g in got[:1] + got[4:6]] == [True, True, False]


def test_loglikelihood_rolling_equals_maxlm_logits(cfg, mesh, models_):
    p = models_["random"]
    texts = ["hello world", "abcdefghij" * 10, ""]
    got = make_lm(cfg, mesh, p).loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i)
                                                      for i, t in enumerate(texts)])
    t, long = list(texts[0].encode()), list(texts[1].encode())
    # lm_eval's windows of 64: [\n]+text predicts all of a short text; 100 bytes are 64 predicted after [\n]
    # and then the last 36, each window's input the 64 bytes before its last byte.
    seqs = [[10] + t, [10] + long[:64], long[35:100]]
    lp = log_softmax(cfg, p, seqs)
    score = lambda i, k: sum(lp[i, j - 1, seqs[i][j]] for j in range(len(seqs[i]) - k, len(seqs[i])))  # noqa: E731
    np.testing.assert_allclose(got, [score(0, len(t)), score(1, 64) + score(2, 36), 0.0], rtol=1e-5, atol=1e-4)


def test_generate_until_stops_at_until_and_max_gen_toks(cfg, mesh, models_):
    lm = make_lm(cfg, mesh, models_["bigram"])  # greedy from 'a' runs up the alphabet
    reqs = [("xa", {"until": ["e"], "max_gen_toks": 8}), ("xa", {"until": ["zz"], "max_gen_toks": 3}),
            ("xa", {"until": ["f", "d"], "max_gen_toks": 8}), ("c", {"until": "n", "max_gen_toks": 8}),
            ("xa", {"until": [], "max_gen_toks": 8}), ("k", {"until": ["zz"], "max_gen_toks": 3})]
    got = lm.generate_until([Instance("generate_until", {}, r, i) for i, r in enumerate(reqs)])
    assert got == ["bcd", "bcd", "bc", "defghijk", "bcdefghi", "lmn"]


def write_tasks(d) -> str:
    """A directory of local tasks: tiny_right and tiny_wrong (multiple choice; the answer key is 'A' or one of
    the others) and tiny_gen (generate until 'e', exact match), on JSONL files beside them."""
    d.mkdir(exist_ok=True)
    docs = [{"q": f"Question {i}:", "choices": c, "right": c.index("A"), "wrong": c.index("B")}
            for i, c in enumerate([["A", "B", "C"], ["B", "A", "C"], ["C", "B", "A"], ["B", "C", "D", "A"]])]
    (d / "mc.jsonl").write_text("".join(json.dumps(x) + "\n" for x in docs))
    (d / "gen.jsonl").write_text(json.dumps({"prompt": "xa", "answer": "bcd"}) + "\n")
    mc = ("dataset_path: json\ndataset_kwargs:\n  data_files: {d}/mc.jsonl\ntest_split: train\noutput_type: "
          "multiple_choice\ndoc_to_text: '{{{{q}}}}'\ntarget_delimiter: ''\ndoc_to_choice: choices\n"
          "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    for key in ("right", "wrong"):
        (d / f"{key}.yaml").write_text(f"task: tiny_{key}\n" + mc.format(d=d) + f"doc_to_target: {key}\n")
    (d / "gen.yaml").write_text(
        f"task: tiny_gen\ndataset_path: json\ndataset_kwargs:\n  data_files: {d}/gen.jsonl\ntest_split: train\n"
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: [e]\n  max_gen_toks: 8\nmetric_list:\n  - metric: exact_match\n"
        "    aggregation: mean\n    higher_is_better: true\n")
    return str(d)


def test_multiple_choice_accuracy_by_construction(cfg, mesh, models_, tmp_path):
    tasks = write_tasks(tmp_path / "tasks")
    manager = eh.task_manager(["tiny_right", "tiny_wrong"], tasks)
    results = eh.evaluate(make_lm(cfg, mesh, models_["bigram"]), ["tiny_right", "tiny_wrong"], manager)
    assert eh.flat(results) == {"harness/tiny_right/acc": 1.0, "harness/tiny_wrong/acc": 0.0}


def one_error(capfd, argv) -> str:
    """main(argv) in-process: exit 2, one stderr line `maxlm.eval_harness: error: ...`, no traceback."""
    rc = eh.main(argv)
    out, err = capfd.readouterr()
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("maxlm.eval_harness: error: "), (rc, err)
    assert "Traceback" not in out + err
    return lines[0]


@pytest.mark.malformed
def test_cli_on_a_saved_run_and_its_refusals(cfg, models_, tmp_path, capfd, monkeypatch):
    tasks = write_tasks(tmp_path / "tasks")
    run = params_checkpoint(tmp_path / "run", cfg, jax.device_put(models_["bigram"], jax.devices()[0]), step=4)
    assert eh.main([str(run), "--tasks", f"tiny_right,{tasks}/wrong.yaml,tiny_gen", "--include", tasks]) == 0
    out, _ = capfd.readouterr()
    assert "tiny_right" in out and f"results in {run}/harness/step_4.json" in out
    r = json.loads((run / "harness" / "step_4.json").read_text())
    assert r["results"]["tiny_right"]["acc,none"] == 1.0 and r["results"]["tiny_wrong"]["acc,none"] == 0.0
    assert r["results"]["tiny_gen"]["exact_match,none"] == 1.0 and r["maxlm"]["step"] == 4

    assert "does not exist" in one_error(capfd, [str(tmp_path / "nope"), "--tasks", "tiny_right", "--include", tasks])
    assert "--step 3: " in one_error(capfd, [str(run), "--tasks", "tiny_right", "--include", tasks, "--step", "3"])
    assert "no task file" in one_error(capfd, [str(run), "--tasks", f"{tasks}/nope.yaml"])
    assert "--limit" in one_error(capfd, [str(run), "--tasks", "tiny_right", "--limit", "-1"])
    # Indexing lm_eval's own ~15,000 tasks takes 15 s here: an unknown name is checked against the include
    # directory alone, which is the same code path with an empty built-in index.
    small = lambda include_path=None, include_defaults=True, **kw: Manager(include_path=include_path, include_defaults=False)  # noqa: E731
    Manager = lm_eval.tasks.TaskManager
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", small)
    msg = one_error(capfd, [str(run), "--tasks", "tiny_rigth", "--include", tasks])
    assert "unknown task `tiny_rigth` (did you mean tiny_right?)" in msg
    monkeypatch.setattr(eh, "_MISSING", ImportError("No module named 'lm_eval'"))
    assert "pip install -r requirements-eval.txt" in one_error(capfd, [str(run), "--tasks", "tiny_right"])


def test_special_tokens_follow_the_run(cfg):
    byte = tokenizer.load("byte")
    assert eh.special_ids(byte, cfg.data, 256) == (None, None, 10)  # 256 byte ids, no specials: a newline leads
    bos = load(TINY, [*ARGS, "model.vocab_size=258", "data.add_bos=true", "data.add_eos=true"])
    assert eh.special_ids(byte, bos.data, 258) == (256, 257, 256)  # trained with BOS: every request starts with it


def test_harness_config(mesh, monkeypatch):
    c = load(TINY, ["eval.harness.every=5", "eval.harness.tasks=[hellaswag, t/x.yaml]", "eval.harness.include=t"])
    assert c.eval.harness.tasks[0] == "hellaswag" and c.eval.harness.tasks[1].startswith("/")  # files: absolute
    assert c.eval.harness.include.startswith("/")
    monkeypatch.setattr(eh, "_MISSING", ImportError("No module named 'lm_eval'"))
    with pytest.raises(ConfigError, match=r"eval.harness.tasks needs lm_eval, which is not installed .*requirements-eval"):
        eh.Harness(c, None, mesh, (), print)  # at start-up, before the compile (it fails before the recipe is read)


def test_benchmarks_in_training_metrics(tmp_path):
    tasks = write_tasks(tmp_path / "tasks")
    run = tmp_path / "run"
    assert train.run(load(TINY, [*ARGS, "steps=4", "log_every=1", "checkpoint.every=0", f"run_dir={run}",
                                 "eval.harness.every=2", "eval.harness.tasks=[tiny_right]",
                                 f"eval.harness.include={tasks}"])) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    got = {r["step"]: r["harness/tiny_right/acc"] for r in rows if "harness/tiny_right/acc" in r}
    assert sorted(got) == [2, 4] and all(v in (0.0, 0.25, 0.5, 0.75, 1.0) for v in got.values())
    assert all("harness_time_s" in r for r in rows if r["step"] in got)


@pytest.mark.slow  # ~15 s on 2 cores: two processes start, import lm_eval and join over gloo
def test_cli_on_two_processes(cfg, models_, tmp_path):
    """Both processes of a job run the sharded model on the same requests; only process 0 writes."""
    import subprocess
    import sys

    from conftest import ROOT, cli_env
    from test_distributed import job_envs

    tasks = write_tasks(tmp_path / "tasks")
    run = params_checkpoint(tmp_path / "run", cfg, jax.device_put(models_["bigram"], jax.devices()[0]), step=4)
    argv = [sys.executable, "-m", "maxlm.eval_harness", str(run), "--tasks", "tiny_right,tiny_wrong,tiny_gen",
            "--include", tasks]
    procs = [subprocess.Popen(argv, cwd=ROOT, env={**cli_env(devices=4), **env}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for env in job_envs()]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "tiny_right" in outs[0] and "results in" in outs[0] and "results in" not in outs[1]
    r = json.loads((run / "harness" / "step_4.json").read_text())["results"]
    assert (r["tiny_right"]["acc,none"], r["tiny_wrong"]["acc,none"], r["tiny_gen"]["exact_match,none"]) == (1, 0, 1)


@pytest.mark.malformed
def test_a_task_file_that_is_not_yaml_is_one_line(tmp_path, capfd):
    """lm_eval's own parse error is a 53-line traceback; checked before the run is read (it does not exist)."""
    (tmp_path / "bad.yaml").write_text("task: [unclosed\n  : x\n")
    (tmp_path / "list.yaml").write_text("- task: x\n")
    (tmp_path / "fn.yaml").write_text("task: fn\nprocess_docs: !function utils.process\n")
    msg = one_error(capfd, [str(tmp_path / "nope"), "--tasks", str(tmp_path / "bad.yaml")])
    assert msg.startswith(f"maxlm.eval_harness: error: --tasks: task file {tmp_path}/bad.yaml is not valid YAML "
                          f"({tmp_path}/bad.yaml, line 2: "), msg
    assert "holds a YAML list, not a task" in one_error(capfd, [str(tmp_path / "nope"), "--tasks", str(tmp_path / "list.yaml")])
    eh._check_yaml(str(tmp_path / "fn.yaml"), "--tasks")  # lm_eval's !function tag is YAML


@pytest.mark.malformed
def test_a_task_whose_data_is_missing_is_a_mistake_naming_the_file(cfg, models_, mesh, tmp_path, capfd):
    """Before: datasets' FileNotFoundError, exit 4 in training (an I/O failure, retried) and the run
    directory named by the CLI. Now exit 2 naming the file; in training, at start-up."""
    tasks = write_tasks(tmp_path / "tasks")
    (tmp_path / "tasks" / "mc.jsonl").unlink()
    run = params_checkpoint(tmp_path / "run", cfg, jax.device_put(models_["bigram"], jax.devices()[0]), step=4)
    msg = one_error(capfd, [str(run), "--tasks", "tiny_right", "--include", tasks])
    assert msg.startswith("maxlm.eval_harness: error: --tasks: a task's data cannot be found: ") and \
        f"{tasks}/mc.jsonl" in msg, msg
    c = load(TINY, ["eval.harness.every=5", "eval.harness.tasks=[tiny_right]", f"eval.harness.include={tasks}"])
    with pytest.raises(ConfigError, match=rf"eval.harness.tasks: a task's data cannot be found: .*{tasks}/mc.jsonl"):
        eh.Harness(c, None, mesh, (), print)


@pytest.mark.malformed
def test_output_is_checked_before_the_evaluation(tmp_path, capfd):
    """--output is checked before the run is read (it does not exist here), not after the whole evaluation."""
    tasks = write_tasks(tmp_path / "tasks")
    args = [str(tmp_path / "nope"), "--tasks", f"{tasks}/right.yaml"]
    assert "--output /dev/null/r.json: its directory cannot be created (" in one_error(
        capfd, [*args, "--output", "/dev/null/r.json"])
    assert f"--output {tmp_path} is a directory; name the results file" in one_error(capfd, [*args, "--output", str(tmp_path)])
    assert "does not exist" in one_error(capfd, [*args, "--output", str(tmp_path / "out" / "r.json")])
