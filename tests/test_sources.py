"""Sources and bad input: each problem fails, or is counted and reported, in one line; nothing is
dropped silently. Mixtures take exactly their weights' share of documents per epoch."""

import json

import jax
import numpy as np
import pytest
from conftest import oracle

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
    pa, pq = oracle("pyarrow"), oracle("pyarrow.parquet")
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


@pytest.mark.timeout(120)  # each of these looped forever in the packer, never forming a batch
@pytest.mark.parametrize("line, extra, message", [
    ('{"text": ""}', [], r"no usable document in a whole epoch of 2000 documents \(empty: 2000; first: .*a.jsonl:\d+\); "
                         r"fix the data: its documents are empty or blank"),
    ("", [], r"no usable document in a whole epoch of 2000 documents \(empty: 2000; first: .*a.jsonl:\d+\)"),
    ("not json", ["data.max_bad_records=100000"],
     r"no usable document in a whole epoch of 2000 documents \(bad_json: 2000; first: .*a.jsonl:\d+\); check data.source"),
    ("not json", [], r"data: 1001 bad records \(malformed JSON or missing `data.field`\), more than data.max_bad_records=1000; "
                     r"first: .*a.jsonl:\d+ \(bad_json\)"),
    ('{"text": "x"}', ["data.strict=true"], None),  # a 1-byte document is usable by no one, but it is not a skip
    ('{"text": ""}', ["data.strict=true"], r"data.strict=true: a document was empty at .*a.jsonl:\d+; "),
])
def test_a_stream_of_only_unusable_documents_stops_in_one_line(tmp_path, line, extra, message):
    (tmp_path / "a.jsonl").write_text((line + "\n") * 2000)
    ld = loader("data.source=jsonl", f"data.path={tmp_path}/a.jsonl", "data.epochs=0", *extra)
    if message is None:
        message = r"whole epoch of 2000 documents \(short: 2000; first: .*\); fix the data: a document needs 2 tokens"
    try:
        with pytest.raises(ConfigError, match=message) as e:
            next(ld)
    finally:
        ld.close()
    assert "\n" not in str(e.value)


@pytest.mark.timeout(120)
def test_a_field_missing_from_every_line_fails_even_in_one_epoch(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": f"doc {i} " * 20}) + "\n" for i in range(30)))
    ld = loader("data.source=jsonl", f"data.path={tmp_path}/a.jsonl", "data.epochs=1")  # was: 0 batches, silently
    with pytest.raises(ConfigError, match=r"whole epoch of 30 documents \(missing_field: 30; first: .*a.jsonl:\d+\); "
                                          r"set data.field to the JSON key or Parquet column that holds the text"):
        drain(ld)


def test_paths_that_are_not_strings_or_are_empty_fail_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^`data.path`: item 1 of the list is 1 \(int\), not a path; write every path "
                                          r"as a string: data.path=\['1', '2'\]$"):
        sources.resolve([1, 2])
    with pytest.raises(ConfigError, match=r"`data.path`: item 2 of the list is an empty string; remove it"):
        sources.resolve([str(tmp_path), ""])  # "" would have read the whole current directory
    with pytest.raises(ConfigError, match=r"`data.path` is empty"):
        sources.resolve([""])
    # On the command line the config itself refuses [1,2], with the same words.
    with pytest.raises(ConfigError, match=r"^`data.path`: item 1 of the list is 1 \(int\), not a path"):
        load("configs/tiny.yml", ["data.source=jsonl", "data.path=[1,2]"])
    (tmp_path / "1").write_text("x")
    (tmp_path / "2").write_text("y")
    with pytest.raises(ConfigError, match=r"`data.mixture.web.path`: item 1 of the list is 1 \(int\)"):
        loader("data.source=mixture", "data.mixture={web: {source: text, path: [1, 2]}}")


def test_wrong_kind_of_path_says_what_to_pass(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"notes holds no .jsonl or .json files \(1 other file\)"):
        sources.resolve(str(tmp_path / "notes"), suffixes=sources.SUFFIXES["jsonl"])
    with pytest.raises(ConfigError, match=r"a.txt is a file, not a prepared directory \(one holding dataset.json\); "
                                          r"prepare it .* or set data.source=text"):
        sources.resolve(str(tmp_path / "notes" / "a.txt"), dirs=True)


def test_garbage_parquet_fails_naming_the_file(tmp_path):
    oracle("pyarrow")
    (tmp_path / "g.parquet").write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ConfigError, match=r"^`data.path`: .*g.parquet is not a valid Parquet file \(.*\); remove it or "
                                          r"convert it$") as e:
        loader("data.source=parquet", f"data.path={tmp_path}/g.parquet")
    assert "\n" not in str(e.value)
    # A footer that reads but a row group that does not: found while reading, in a reader thread.
    pa, pq = oracle("pyarrow"), oracle("pyarrow.parquet")
    pq.write_table(pa.table({"text": [f"row {i} " * 20 for i in range(200)]}), tmp_path / "c.parquet")
    raw = bytearray((tmp_path / "c.parquet").read_bytes())
    raw[8:400] = b"\xab" * 392
    (tmp_path / "c.parquet").write_bytes(bytes(raw))
    ld = loader("data.source=parquet", f"data.path={tmp_path}/c.parquet")
    try:
        with pytest.raises(ConfigError, match=r"^`data.path`: .*c.parquet row group 0 does not decode \(.*\); remove or "
                                              r"rewrite the file") as e:
            next(ld)
    finally:
        ld.close()
    assert "\n" not in str(e.value)
