"""Held-out evaluation: config errors, held-out splits that training never reads, the same eval batches at
every evaluation, and eval_loss / eval_ppl in metrics.jsonl equal to an independent computation."""

import json
import math

import jax
import numpy as np
import pytest
from conftest import run_cli

from maxlm import config, recipe as recipe_lib
from maxlm.config import ConfigError, load
from maxlm.data import make_eval_loader, make_loader
from maxlm.data.corpus import pydoc_documents
from maxlm.evaluation import Evaluator

TINY = "configs/tiny.yml"
SMALL = ["seq_len=32", "global_batch_size=8"]
MODEL = ["model.n_layers=1", "model.d_model=64", "model.d_ff=128", "model.n_heads=4", "model.n_kv_heads=2",
         "model.head_dim=16", *SMALL]
ONE = jax.sharding.SingleDeviceSharding(jax.devices()[0])


@pytest.mark.parametrize("overrides, message", [
    (["eval.every=5", "data.source=jsonl", "data.path=x.jsonl"], "eval.every=5 with source jsonl needs `eval.path`"),
    (["eval.every=5", "data.source=text", "data.path=a", "eval.path=a"], "`eval.path` is `data.path`"),
    (["eval.every=5", "eval.path=held.txt"], "`eval.path` is not used with eval source pydoc"),
    (["eval.every=5", "data.source=mixture", "data.mixture={a: {source: pydoc}}"],
     "eval with data.source=mixture needs one held-out source: set eval.source and eval.path"),
    (["eval.source=mixture"], "`eval.source` must be one of"),
    (["eval.every=-1"], "`eval.every` must be >= 0"),
    (["eval.steps=-2"], "`eval.steps` must be >= 0"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        load(TINY, overrides)
    assert "\n" not in str(e.value)


def test_config_accepts_held_out_sources():
    load(TINY, ["eval.every=5"])  # pydoc: its own held-out topics
    load(TINY, ["eval.every=5", "data.source=synthetic"])
    load(TINY, ["eval.every=5", "data.source=jsonl", "data.path=a.jsonl", "eval.path=[b.jsonl, c.jsonl]"])
    load(TINY, ["eval.every=5", "data.source=mixture", "data.mixture={a: {source: pydoc}}", "eval.source=pydoc"])
    load(TINY, ["data.source=jsonl", "data.path=a.jsonl"])  # eval off: no eval.path needed


@pytest.mark.malformed
def test_cli_error_is_one_line():
    r = run_cli(TINY, "eval.every=10", "data.source=jsonl", "data.path=x.jsonl")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("maxlm: error: eval.every=10 with source jsonl needs `eval.path`")


def _docs(loader) -> set[bytes]:
    return {d.tobytes() for d in loader.comps[0].source.docs}


def test_pydoc_held_out_topics_never_train():
    train_, held = pydoc_documents("train"), pydoc_documents("eval")
    assert len(held) >= 5 and not set(train_) & set(held) and sorted(train_ + held) == sorted(pydoc_documents())
    cfg = load(TINY, ["eval.every=5", *SMALL])
    trained, evaluated = _docs(make_loader(cfg, ONE)), _docs(make_eval_loader(cfg, ONE))
    assert len(evaluated) == len(held) and not trained & evaluated
    assert len(trained) + len(evaluated) == len(_docs(make_loader(load(TINY, SMALL), ONE)))  # eval off: all 79
    # Every fragment of an eval batch comes from a held-out topic.
    batch = jax.device_get(next(make_eval_loader(cfg, ONE)))
    for row in range(8):
        for seg in set(batch["segment_ids"][row]) - {0}:
            frag = bytes(batch["inputs"][row][batch["segment_ids"][row] == seg].astype(np.uint8))
            assert any(frag in h.encode() for h in held)


def test_synthetic_held_out_is_another_seed():
    cfg = load(TINY, ["eval.every=5", "data.source=synthetic", *SMALL])
    a, b = make_loader(cfg, ONE).comps[0].source, make_eval_loader(cfg, ONE).comps[0].source
    assert a.seed != b.seed and not np.array_equal(a.tokens(0)[:16], b.tokens(0)[:16])


def test_evaluator_reads_the_same_batches_every_time(tmp_path):
    """Streaming (JSONL) held-out data: each evaluation restarts at the same batches; eval.steps larger than
    the data reads it once and says so; the loss is the float64 sum over batches / tokens."""
    for name, n in (("train", 40), ("held", 10)):
        lines = [json.dumps({"text": f"{name} document {i}: " + "the quick brown fox jumps over the dog " * 2}) for i in range(n)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    seen = []

    def fake_step(params, batch):  # a "loss" of 2 per token, and the batches it was given
        seen.append(np.asarray(batch["inputs"]))
        n_tok = np.float32(np.asarray(batch["loss_mask"]).sum())
        return np.float32(2.0) * n_tok, n_tok

    base = [*SMALL, "data.source=jsonl", f"data.path={tmp_path}/train.jsonl", "eval.every=1",
            f"eval.path={tmp_path}/held.jsonl"]
    ev = Evaluator(load(TINY, [*base, "eval.steps=2"]), fake_step, ONE)
    first = ev(None)
    assert first["eval_loss"] == 2.0 and first["eval_ppl"] == pytest.approx(math.exp(2.0))
    assert first["eval_tokens"] == 2 * 8 * 32 and len(seen) == 2
    ev(None)
    assert len(seen) == 4 and all(np.array_equal(x, y) for x, y in zip(seen[:2], seen[2:]))
    assert b"held document" in bytes(seen[0][0].astype(np.uint8))
    seen.clear()
    everything = Evaluator(load(TINY, [*base, "eval.steps=0"]), fake_step, ONE)
    everything(None)
    n = len(seen)
    assert 2 < n < 10  # ~1k bytes held out: a few batches of 8 x 32, one pass
    too_many = Evaluator(load(TINY, [*base, "eval.steps=50"]), fake_step, ONE)
    assert too_many(None)["eval_tokens"] == n * 8 * 32
    assert any(f"only {n} batch(es)" in m for m in too_many.messages)


def _rows(run_dir) -> dict:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_eval_in_metrics_equals_an_independent_computation(tmp_path):
    """eval.every=2 over 5 steps: eval rows at 2, 4 and the last step (5), written whatever log_every says;
    each eval_loss is the loss of that step's saved parameters over the first eval.steps held-out batches."""
    r = run_cli(TINY, *MODEL, "steps=5", "log_every=100", "sample_tokens=0", "eval.every=2", "eval.steps=3",
                "checkpoint.every=2", "checkpoint.keep=5", f"run_dir={tmp_path}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = _rows(tmp_path)
    assert sorted(s for s, row in rows.items() if "eval_loss" in row) == [2, 4, 5]
    assert "eval_loss" not in rows[1]
    for s in (2, 4, 5):
        assert rows[s]["eval_ppl"] == pytest.approx(math.exp(rows[s]["eval_loss"]), rel=1e-12)
        assert rows[s]["eval_tokens"] == 3 * 8 * 32
        assert f"eval at step {s}: loss {rows[s]['eval_loss']:.4f}" in r.stdout
    assert f"eval_loss {rows[4]['eval_loss']:.4f} | eval_ppl" in r.stdout  # the console line shows it

    import orbax.checkpoint as ocp
    from maxlm import checkpoint as ckpt
    from maxlm.objectives.lm import loss_sum

    cfg = config.load(tmp_path / "config.yml")
    loader = make_eval_loader(cfg, ONE)
    batches = [next(loader) for _ in range(3)]
    forward = recipe_lib.build(cfg).forward
    fn = jax.jit(lambda p, b: loss_sum(forward, p, b))
    ck = ckpt.Checkpointer(str(tmp_path / "checkpoints"), read_only=True)
    for s in (2, 4, 5):
        params = ck.mgr.restore(s, args=ocp.args.Composite(state=ocp.args.StandardRestore())).state["params"]
        params = jax.tree.map(np.asarray, params)
        total = tokens = 0.0
        for b in batches:
            ls, n = jax.device_get(fn(params, b))
            total, tokens = total + float(ls), tokens + float(n)
        assert rows[s]["eval_loss"] == pytest.approx(total / tokens, rel=1e-5), s
    ck.close()
    assert rows[2]["eval_loss"] != rows[4]["eval_loss"] != rows[5]["eval_loss"]


def test_eval_step_with_microbatches_equals_one_pass():
    """eval_step splits the batch like the train step does; the summed loss and token count must equal
    one pass over the whole batch, on a data x fsdp mesh."""
    from maxlm import mesh as mesh_lib, sharding
    from maxlm.evaluation import compile_eval
    from maxlm.state import StateSpec

    outs = []
    for m in (1, 4):
        cfg = load(TINY, [*MODEL, "mesh.data=2", "mesh.fsdp=4", f"microbatches={m}", "eval.every=1"])
        the_mesh = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, 8), jax.devices())
        ss = StateSpec(recipe_lib.build(cfg, the_mesh), the_mesh, sharding.rules(cfg))
        fn = compile_eval(ss)
        batch = next(make_eval_loader(cfg, ss.abstract_batch))
        batch["loss_mask"] = jax.device_put(np.asarray(batch["loss_mask"]) * (np.arange(32) % 3 > 0),
                                            ss.abstract_batch["loss_mask"].sharding)  # masked tokens must stay out of the sum
        outs.append([float(x) for x in fn(ss.init_fn(0)().params, batch)])
    (s1, n1), (s4, n4) = outs
    assert n1 == n4 and n1 < 8 * 32
    assert s4 == pytest.approx(s1, rel=1e-6)
