"""Sources and bad input: each problem fails, or is counted and reported, in one line; nothing is
dropped silently. Mixtures take exactly their weights' share of documents per epoch."""

import json

import jax
import numpy as np
import pytest

from maxlm import mesh as mesh_lib, sharding
from maxlm.config import ConfigError, load
from maxlm.data import make_loader, sources
from maxlm.data.pipeline import _Plan, Component


def loader(*overrides):
    cfg = load("configs/tiny.yml", ["seq_len=32", "global_batch_size=8", *overrides])
    m = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, 8), jax.devices())
    return make_loader(cfg, sharding.named(m, ("batch", "length"), sharding.rules(cfg)))


def drain(ld, steps=200):
    try:
        for _ in range(steps):
            next(ld)
    except StopIteration:
        pass
    finally:
        ld.close()


def test_missing_paths_and_empty_globs_fail_naming_what_was_searched(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ConfigError, match=r"`data.path`: .*nope.jsonl does not exist \(searched: .*a.jsonl, .*nope.jsonl"):
        sources.resolve([str(tmp_path / "a.jsonl"), str(tmp_path / "nope.jsonl")])
    with pytest.raises(ConfigError, match=r"\*.parquet matches no file"):
        sources.resolve(str(tmp_path / "*.parquet"))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.jsonl").write_text("")
    (tmp_path / "sub" / "notes.txt").write_text("")
    assert sources.resolve(str(tmp_path), suffixes=(".jsonl",)) == [str(tmp_path / "a.jsonl"), str(tmp_path / "sub" / "b.jsonl")]
    with pytest.raises(ConfigError, match="needs `data.path`"):
        load("configs/tiny.yml", ["data.source=jsonl"])


def test_text_files_empty_and_invalid_utf8_are_counted_and_reported(tmp_path):
    (tmp_path / "good.txt").write_text("A perfectly fine document. " * 20)
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1") * 10)
    ld = loader("data.source=text", f"data.path={tmp_path}", "data.epochs=1")
    drain(ld)
    assert ld.skips["empty"] == 1 and ld.skips["invalid_utf8"] == 1
    assert ld.first_skip == {"empty": str(tmp_path / "empty.txt"), "invalid_utf8": str(tmp_path / "latin1.txt")}
    msgs = " | ".join(ld.messages)
    assert f"skipping documents: invalid_utf8 (first: {tmp_path / 'latin1.txt'})" in msgs
    with pytest.raises(ConfigError, match=r"data.strict=true: a document was (empty|invalid_utf8) at .*(empty|latin1).txt"):
        drain(loader("data.source=text", f"data.path={tmp_path}", "data.strict=true"))


def jsonl(path, good: int, bad_at=()):
    lines = [json.dumps({"text": f"document number {i} " * 5}) for i in range(good)]
    for at, line in bad_at:
        lines.insert(at, line)
    path.write_text("\n".join(lines) + "\n")


def test_jsonl_error_budget_names_the_first_bad_line(tmp_path):
    jsonl(tmp_path / "a.jsonl", 30, [(3, "{not json"), (7, '{"body": "no text field"}'), (9, ""), (12, '{"text": 5}')])
    ld = loader("data.source=jsonl", f"data.path={tmp_path}/a.jsonl", "data.epochs=1")
    drain(ld)
    assert ld.skips == {"empty": 1, "invalid_utf8": 0, "bad_json": 1, "missing_field": 2}
    assert ld.first_skip["bad_json"] == f"{tmp_path}/a.jsonl:4" and ld.first_skip["missing_field"] == f"{tmp_path}/a.jsonl:8"
    with pytest.raises(ConfigError, match=rf"data: [23] bad records .* more than data.max_bad_records=1; first: {tmp_path}/a.jsonl:\d+"):
        drain(loader("data.source=jsonl", f"data.path={tmp_path}/a.jsonl", "data.max_bad_records=1"))
    ld = loader("data.source=jsonl", f"data.path={tmp_path}/a.jsonl", "data.field=body", "data.max_bad_records=100000")
    drain(ld, 3)
    assert ld.skips["missing_field"] > 0


def test_parquet_rows_and_missing_column(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    texts = [f"parquet row {i} " * 4 for i in range(40)]
    texts[5] = None
    pq.write_table(pa.table({"content": texts}), tmp_path / "t.parquet", row_group_size=16)
    with pytest.raises(ConfigError, match=r"t.parquet has no column `text` \(columns: content\)"):
        loader("data.source=parquet", f"data.path={tmp_path}/t.parquet")
    ld = loader("data.source=parquet", f"data.path={tmp_path}/t.parquet", "data.field=content", "data.epochs=1")
    rows = []
    try:
        while True:
            rows.append(np.asarray(next(ld)["inputs"]))
    except StopIteration:
        pass
    assert ld.skips["missing_field"] == 1 and ld.first_skip["missing_field"].endswith("t.parquet:row group 0 row 5")
    seen = bytes(np.concatenate(rows).ravel().astype(np.uint8)).decode()
    assert "parquet row 39" in seen or "parquet row 38" in seen


def test_mixture_takes_its_weights_share_and_bad_weights_fail(tmp_path):
    comps = [Component("pydoc", sources.InMemorySource([np.zeros(3, np.int32)] * n), w, str(n))
             for n, w in ((100, 3.0), (1000, 1.0))]
    plan = _Plan(comps, seed=0)
    assert plan.take.tolist() == [100, 33]  # the scarce component passes once per epoch
    docs_b = np.concatenate([plan.epoch(e)[1][plan.epoch(e)[0] == 1] for e in range(30)])
    assert len(set(docs_b[:990].tolist())) == 990  # the plentiful one continues, never repeating within its pass
    for w in ("0", "-1"):
        with pytest.raises(ConfigError, match=r"`data.mixture.rand`.weight must be a number > 0"):
            load("configs/tiny.yml", ["data.source=mixture", f"data.mixture={{doc: {{source: pydoc, weight: 1}}, rand: {{source: synthetic, weight: {w}}}}}"])
    with pytest.raises(ConfigError, match=r"`data.mixture.web` \(source jsonl\) needs a `path`"):
        load("configs/tiny.yml", ["data.source=mixture", "data.mixture={web: {source: jsonl, weight: 1}}"])
    jsonl(tmp_path / "a.jsonl", 20)
    ld = loader("data.source=mixture", f"data.mixture={{docs: {{source: pydoc, weight: 1}}, web: {{source: jsonl, path: {tmp_path}/a.jsonl, weight: 2}}}}")
    assert not ld.indexed and ld.plan.take.tolist() == [10, 20]
    text = bytes(np.concatenate([np.asarray(next(ld)["inputs"]).ravel() for _ in range(20)]).astype(np.uint8))
    ld.close()
    assert b"document number" in text and b"the" in text  # both components reach the batches


def test_synthetic_source_is_deterministic_and_indexed():
    a, b = loader("data.source=synthetic"), loader("data.source=synthetic")
    assert a.indexed
    for _ in range(2):
        assert (np.asarray(next(a)["inputs"]) == np.asarray(next(b)["inputs"])).all()
