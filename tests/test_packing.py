"""Packing: rows hold document fragments that never see each other; every document pair is trained
exactly once per epoch; a packed row's per-token losses equal each fragment's run on its own."""

import json

import grain
import jax
import numpy as np
import pytest

from maxlm import mesh as mesh_lib, recipe as recipe_lib, sharding
from maxlm.config import load
from maxlm.data import make_loader, sources
from maxlm.config import ConfigError
from maxlm.data.order import Plan, Rows
from maxlm.data.pipeline import Component
from maxlm.data.stream import Limits, Packer, covers_epoch
from maxlm.models import llama, params as P_

L = 16


def unique_docs(lengths, start=1000):
    """Documents whose tokens are all distinct, so a fragment names its document and offset."""
    out, at = [], start
    for n in lengths:
        out.append(np.arange(at, at + n, dtype=np.int32))
        at += n
    return out


def fragments(row: dict, starts: bool = False) -> list:
    """The token runs of a row: each segment's inputs plus its last target (with its start column)."""
    out = []
    for s in np.unique(row["segment_ids"][row["segment_ids"] > 0]):
        at = np.flatnonzero(row["segment_ids"] == s)
        assert (np.diff(at) == 1).all() and (row["positions"][at] == np.arange(len(at))).all()
        assert (row["inputs"][at][1:] == row["targets"][at][:-1]).all()
        f = np.r_[row["inputs"][at], row["targets"][at][-1]]
        out.append((int(at[0]), f) if starts else f)
    pad = row["segment_ids"] == 0
    assert (row["loss_mask"][pad] == 0).all() and (row["loss_mask"][~pad] == 1).all()
    return out


def covered_pairs(rows, docs) -> dict:
    """doc index -> list of pair offsets covered, from the rows' fragments."""
    first = {int(d[0]) + k: (i, k) for i, d in enumerate(docs) for k in range(len(d))}
    cov = {i: [] for i in range(len(docs))}
    for row in rows:
        for f in fragments(row):
            i, k = first[int(f[0])]
            assert (docs[i][k:k + len(f)] == f).all()  # a contiguous slice of one document
            cov[i] += range(k, k + len(f) - 1)
    return cov


DOC_LENGTHS = [1, 2, 5, 16, 17, 40, 3, 9, 33, 2, 8]  # around L: shorter, equal, longer, several times longer


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("per", [4096, 3])  # one block; blocks of 3 documents (rows cross blocks)
def test_indexed_epoch_trains_every_pair_once(packing, per):
    docs = unique_docs(DOC_LENGTHS)
    src = sources.InMemorySource(docs)
    src.per = per
    comps = [Component("pydoc", src, 1.0, "mem")]
    rows = Rows(comps, Plan(comps, seed=3), L, packing, seed=3)
    epoch = [rows(g) for g in range(rows.rows_in_epoch(0))]
    cov = covered_pairs(epoch, docs)
    pairs = sum(len(d) - 1 for d in docs)
    got = sum(len(v) for v in cov.values())
    for i, v in cov.items():
        assert len(v) == len(set(v))  # no pair twice
    if packing:
        assert pairs - L < got <= pairs and all(len(fragments(r)) and r["loss_mask"].all() for r in epoch)
    else:
        assert got == pairs and all(len(fragments(r)) == 1 for r in epoch)
        assert all(sorted(v) == list(range(len(docs[i]) - 1)) for i, v in cov.items())
    # The next epoch is another order of the same documents.
    nxt = [rows(g) for g in range(rows.rows_before(1), rows.rows_before(2))]
    assert [r["inputs"].tolist() for r in nxt] != [r["inputs"].tolist() for r in epoch]


@pytest.mark.parametrize("packing", [True, False])
def test_streaming_packer_covers_documents_in_order_and_resumes(packing):
    docs = unique_docs(DOC_LENGTHS)
    elems = [{"tokens": d, "skip": "", "where": ""} for d in docs]
    elems.insert(4, {"tokens": np.zeros(0, np.int32), "skip": "bad_json", "where": "x.jsonl:5"})
    chunks = [elems[i:i + 3] for i in range(0, len(elems), 3)]  # the loader's elements are chunks of documents
    ds = Packer(grain.MapDataset.source(chunks).to_iter_dataset(), L, packing)
    rows = list(ds)
    cov = covered_pairs(rows, docs)
    pairs = [len(d) - 1 for d in docs]
    if packing:  # the last, unfilled row is dropped when the data ends
        assert sum(len(v) for v in cov.values()) == len(rows) * L > sum(pairs) - L
    else:
        assert all(sorted(v) == list(range(p)) for v, p in zip(cov.values(), pairs))
    it = iter(ds)
    rows = list(it)
    assert it.get_state()["skips"]["bad_json"] == 1 and it.get_state()["first"] == {"bad_json": "x.jsonl:5"}
    for cut in range(len(rows)):  # a resume from any row, mid-chunk or mid-document, continues exactly
        it = iter(ds)
        for _ in range(cut):
            next(it)
        state = json.loads(json.dumps(it.get_state()))  # it must survive JSON (the checkpoint)
        it2 = iter(ds)
        it2.set_state(state)
        rest = list(it2)
        assert len(rest) == len(rows) - cut
        for a, b in zip(rest, rows[cut:]):
            assert all((a[k] == b[k]).all() for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask"))


def test_packed_row_losses_equal_each_document_alone(tmp_path):
    """The issue's test: per-token losses of packed rows, through the real loader, model and loss."""
    texts = ["Short one.", "A somewhat longer document, with more words in it than the first.",
             "Third!", "def f(x):\n    return x * 2\n", "The last document of this tiny corpus is here."]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = load("configs/tiny.yml", ["data.source=jsonl", f"data.path={tmp_path}/d.jsonl", "seq_len=64",
                                    "global_batch_size=8", "model.n_layers=2", "dtype=float32", "data.add_eos=true",
                                    "model.vocab_size=258"])
    m = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, 8), jax.devices())
    batch = {k: np.asarray(v) for k, v in next(make_loader(cfg, sharding.named(m, ("batch", "length"), sharding.rules(cfg)))).items()}
    params = P_.init(llama.param_specs(cfg.model), jax.random.key(0))
    forward = recipe_lib.build(cfg).forward
    losses_of = jax.jit(lambda p, b: forward.token_losses(p, b)[0])
    losses = np.asarray(losses_of(params, batch))
    docs = [np.r_[np.frombuffer(t.encode(), np.uint8).astype(np.int32), 257] for t in texts]
    # Each fragment alone: a row of its own, from position 0, right-padded with segment 0 (causal: the
    # padding changes nothing before it), 8 rows at a time: the packed batch's shape, so the same program.
    where, alone = [], {k: np.zeros((0, 64), np.int32) for k in batch}
    for r in range(8):
        for at, f in fragments({k: v[r] for k, v in batch.items()}, starts=True):
            assert any(f.tobytes() in d.tobytes() for d in docs)
            n, row = len(f) - 1, {k: np.zeros((1, 64), np.int32) for k in batch}
            row["inputs"][0, :n], row["targets"][0, :n], row["positions"][0, :n] = f[:-1], f[1:], np.arange(n)
            row["segment_ids"][0, :n] = row["loss_mask"][0, :n] = 1
            alone = {k: np.concatenate([alone[k], row[k]]) for k in batch}
            where.append((r, at, n))
    pad = -len(where) % 8
    alone = {k: np.concatenate([v, np.zeros((pad, 64), np.int32)]) for k, v in alone.items()}
    want = np.concatenate([np.asarray(losses_of(params, {k: v[i:i + 8] for k, v in alone.items()}))
                           for i in range(0, len(alone["inputs"]), 8)])
    for i, (r, at, n) in enumerate(where):
        np.testing.assert_allclose(losses[r, at:at + n], want[i, :n], rtol=2e-5, atol=2e-5)
    assert len(where) >= 16  # several documents per row


def test_covers_epoch_is_exactly_a_whole_epoch_of_this_process():
    """A run of unusable documents a..b stops the packer iff it holds all of this process's documents of
    some epoch: checked against brute force for every small shape, including epochs smaller than the
    process count."""
    for D in range(1, 8):
        for P in range(1, 5):
            for p in range(P):
                N = 20 * (D + P)  # the runs tried below end well before N: every epoch they touch is whole
                mine = list(range(p, N, P))
                epochs = [{m for m in mine if e * D <= m < (e + 1) * D} for e in range(N // D)]
                for i, a in enumerate(mine[:len(mine) // 3]):
                    for b in mine[i:i + 3 * D // P + 3]:
                        want = any(s and all(a <= m <= b for m in s) for s in epochs)
                        assert covers_epoch(a, b, Limits(D, p, P)) == want, (D, P, p, a, b)


def stream(n_docs: int, reason: str = "empty", good=lambda m: False, p: int = 0, P: int = 1):
    """An endless stream (data.epochs=0) of process p's chunks of 3 documents (plan indices p, p+P, ...):
    document m is 5L tokens if good(m), else skipped for `reason` at f.jsonl:(m % n_docs + 1)."""
    def chunk(c):
        return [{"tokens": np.arange(1000, 1000 + 5 * L, dtype=np.int32) if good(m) else None,
                 "skip": "" if good(m) else reason, "where": f"f.jsonl:{m % n_docs + 1}", "m": m}
                for m in range(p + 3 * P * c, p + 3 * P * (c + 1), P)]
    return grain.MapDataset.range(10**6).map(chunk).to_iter_dataset()


@pytest.mark.timeout(60)  # without the check, each of these loops forever
def test_streaming_packer_stops_after_a_whole_epoch_of_unusable_documents():
    with pytest.raises(ConfigError, match=r"^data: no usable document in a whole epoch of 50 documents \(empty: 50; "
                                          r"first: f.jsonl:1\); fix the data: its documents are empty or blank"):
        next(iter(Packer(stream(50), L, True, Limits(50))))
    # Process 1 of 2 reads every 2nd document from 1: 25 per epoch.
    with pytest.raises(ConfigError, match=r"whole epoch of process 1's 25 documents \(bad_json: 25; first: f.jsonl:2\); "
                                          r"check data.source"):
        next(iter(Packer(stream(50, "bad_json", p=1, P=2), L, True, Limits(50, 1, 2, max_bad=10**6))))
    # One usable document per epoch is enough to go on, wherever it falls: a shorter run is not an epoch.
    for at in (0, 17, 49):
        it = iter(Packer(stream(50, good=lambda m: m % 50 == at), L, True, Limits(50)))
        assert all(next(it)["loss_mask"].all() for _ in range(12))


@pytest.mark.malformed
@pytest.mark.timeout(60)
def test_strict_and_the_bad_record_budget_stop_before_any_row_forms():
    with pytest.raises(ConfigError, match=r"^data.strict=true: a document was bad_json at f.jsonl:1; "):
        next(iter(Packer(stream(5000, "bad_json"), L, True, Limits(5000, strict=True))))
    with pytest.raises(ConfigError, match=r"^data: 8 bad records \(malformed JSON, invalid UTF-8, a missing `data.field` or one that is not text\), more than "
                                          r"data.max_bad_records=7; first: f.jsonl:1 \(missing_field\)"):
        next(iter(Packer(stream(5000, "missing_field"), L, True, Limits(5000, max_bad=7))))


@pytest.mark.timeout(60)
def test_a_resumed_packer_stops_at_the_same_document():
    """Good documents in epoch 0 only: a run resumed from any row stops with the same message as the
    straight run (the skip counts and the unusable run continue exactly)."""
    ds = Packer(stream(30, good=lambda m: m < 30 and m % 10 == 0), L, True, Limits(30))
    it, rows = iter(ds), 0
    with pytest.raises(ConfigError) as straight:
        while True:
            next(it)
            rows += 1
    assert rows == 14 and "whole epoch of 39 documents (empty: 39; first: f.jsonl:22)" in str(straight.value)
    for cut in range(rows):
        it = iter(ds)
        for _ in range(cut):
            next(it)
        it2 = iter(ds)
        it2.set_state(json.loads(json.dumps(it.get_state())))
        with pytest.raises(ConfigError) as resumed:
            for _ in range(rows - cut + 1):
                next(it2)
        assert str(resumed.value) == str(straight.value)
