"""Sources and bad input: each problem fails, or is counted and reported, in one line; nothing is
dropped silently. Mixtures take their weights' share: of the tokens, per epoch in whole blocks (indexed) or as the rows are packed (streaming)."""

import json
import os
import re

import jax
import numpy as np
import pytest
from conftest import oracle

from maxlm import mesh as mesh_lib, sharding
from maxlm.config import ConfigError, load
from maxlm.data import make_loader, sources
from maxlm.data.order import Plan, Rows, Staged
from maxlm.data.pipeline import Component


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


@pytest.mark.malformed
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


@pytest.mark.malformed
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


@pytest.mark.malformed
def test_jsonl_error_budget_names_the_first_bad_line(tmp_path):
    jsonl(tmp_path / "a.jsonl", 30, [(3, "{not json"), (7, '{"body": "no text field"}'), (9, ""), (12, '{"text": 5}')])
    ld = loader("data.source=jsonl", f"data.path={tmp_path}/a.jsonl", "data.epochs=1")
    drain(ld)
    assert ld.skips == {"empty": 1, "invalid_utf8": 0, "bad_json": 1, "missing_field": 1, "not_text": 1}
    # The first met of each kind, in the shuffled order, named by its line (counted only when shown).
    assert ld.first_skip["bad_json"] == f"{tmp_path}/a.jsonl:4"
    assert ld.first_skip["missing_field"] == f"{tmp_path}/a.jsonl:8"
    assert ld.first_skip["not_text"] == f"{tmp_path}/a.jsonl:13"  # {"text": 5}: there, but a number
    with pytest.raises(ConfigError, match=rf"data: [23] bad records .* more than data.max_bad_records=1; first: {tmp_path}/a.jsonl:\d+"):
        drain(loader("data.source=jsonl", f"data.path={tmp_path}/a.jsonl", "data.max_bad_records=1"))
    ld = loader("data.source=jsonl", f"data.path={tmp_path}/a.jsonl", "data.field=body", "data.max_bad_records=100000")
    drain(ld, 3)
    assert ld.skips["missing_field"] > 0


@pytest.mark.malformed
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


def test_parquet_start_up_reads_one_footer_and_an_epoch_reads_every_row_once(tmp_path, monkeypatch):
    """Start-up costs the same for any number of Parquet files: each file's size, and the first file's
    footer (to check data.field). The other footers are read as their units come up. Units of 600 bytes
    cut these files (row groups of about 300 bytes) so that units hold none, one or several row groups; the
    units of an epoch give every row exactly once. A file that is not Parquet, past the first, is named
    when its unit is read."""
    pa, pq = oracle("pyarrow"), oracle("pyarrow.parquet")
    want = []
    for f in range(6):
        texts = [f"file {f} row {r}" for r in range(11 + 7 * f)]
        want += texts
        pq.write_table(pa.table({"text": texts}), tmp_path / f"p{f}.parquet", row_group_size=3 + f)
    footers = []
    meta = sources.parquet_meta
    monkeypatch.setattr(sources, "parquet_meta", lambda path, *a, **k: footers.append(path) or meta(path, *a, **k))
    monkeypatch.setattr(sources, "UNIT_BYTES", 600)
    src = sources.ParquetSource(sources.resolve(str(tmp_path)), "text")
    assert footers == [f"{tmp_path}/p0.parquet"]
    assert len(src) == int(sum(-(-src.sizes // 600)))
    units = [src.read_unit(u) for u in range(len(src))]
    assert sorted(text for unit in units for text, _, _ in unit) == sorted(want)
    assert sorted(footers[1:]) == [f"{tmp_path}/p{f}.parquet" for f in range(6)]  # each once, as needed
    counts = {len(unit) for unit in units}
    assert 0 in counts and max(counts) > 8, counts  # units with no row group, and with several
    (tmp_path / "p3.parquet").write_bytes(np.random.default_rng(0).bytes(4096))
    src = sources.ParquetSource(sources.resolve(str(tmp_path)), "text")  # p0 is fine: start-up passes
    with pytest.raises(ConfigError, match=r"^`data.path`: .*p3.parquet is not a valid Parquet file"):
        for u in range(len(src)):
            src.read_unit(u)


@pytest.mark.malformed
def test_an_indexed_mixture_takes_its_weights_share_of_tokens_and_bad_weights_fail():
    """4000 documents of 5 tokens (token 1) and 4000 of 41 (token 2), weighted 1:3: the short ones are the
    scarce component and pass once per epoch; the long ones give 3x their pairs, 120 of their 400 blocks
    of 10 documents. Counted in the rows themselves, over the epoch's 4000 rows: 75% of the targets."""
    comps = []
    for n, w, tok in ((5, 1.0, 1), (41, 3.0, 2)):
        src = sources.InMemorySource([np.full(n, tok, np.int32)] * 4000)
        src.per = 10
        comps.append(Component("pydoc", src, w, str(n)))
    plan = Plan(comps, seed=0)
    assert plan.take.tolist() == [400, 120]  # blocks per epoch: the scarce component passes once
    assert plan.pairs(0).tolist() == [16000, 48000]
    rows = Rows(comps, plan, 16, True, seed=0)
    epoch = [rows(g) for g in range(rows.rows_in_epoch(0))]
    targets = np.concatenate([r["targets"] for r in epoch])
    assert len(targets) == 64000 and abs((targets == 2).mean() - 0.75) < 0.01
    # Each row counts its pairs per component (the loader's realised shares), exactly what it holds.
    counted = sum(r["comp_pairs"] for r in epoch)
    assert counted.tolist() == [(targets == 1).sum(), (targets == 2).sum()] and counted.sum() == 64000
    blocks_b = np.concatenate([plan.epoch(e)[1][plan.epoch(e)[0] == 1] for e in range(4)])
    # The plentiful one continues where it stopped: 3 epochs never repeat a block, the 4th finishes its pass.
    assert len(set(blocks_b[:360].tolist())) == 360 and len(set(blocks_b.tolist())) == 400
    # Through the loader, the log gives each component's share of an epoch's tokens, near its weight's.
    ld = loader("data.source=mixture", "data.mixture={doc: {source: pydoc, weight: 1}, rand: {source: synthetic, weight: 3}}")
    shares = [float(x) for x in re.findall(r"; ([\d.]+)% of an epoch's tokens", ld.describe())]
    assert len(shares) == 2 and abs(sum(shares) - 100) < 0.2 and abs(shares[1] - 75) < 5, ld.describe()
    ld.close()
    ones = Component("pydoc", sources.InMemorySource([np.zeros(1, np.int32)] * 5), 1.0, "single tokens", "data.mixture.c")
    with pytest.raises(ConfigError, match=r"^data source data.mixture.c \(single tokens\) has no \(input, target\) pairs: "
                                          r"every document is shorter than 2 tokens"):
        Plan([comps[0], ones], seed=0)
    for w in ("0", "-1"):
        with pytest.raises(ConfigError, match=r"`data.mixture.rand`.weight must be a number > 0"):
            load("configs/tiny.yml", ["data.source=mixture", f"data.mixture={{doc: {{source: pydoc, weight: 1}}, rand: {{source: synthetic, weight: {w}}}}}"])
    with pytest.raises(ConfigError, match=r"`data.mixture.web` \(source jsonl\) needs a `path`"):
        load("configs/tiny.yml", ["data.source=mixture", "data.mixture={web: {source: jsonl, weight: 1}}"])


def test_a_streaming_mixture_takes_its_weights_share_of_tokens(tmp_path):
    """Short documents of 'a' and ten times longer ones of 'b', weighted 1:3: a quarter of the trained
    targets are 'a', counted in the batches themselves, within 1% over 3200 rows; metrics get the same."""
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": "a" * 40}) + "\n" for _ in range(300)))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": "b" * 400}) + "\n" for _ in range(300)))
    ld = loader("data.source=mixture", f"data.mixture={{a: {{source: jsonl, path: {tmp_path}/a.jsonl, weight: 1}}, "
                                       f"b: {{source: jsonl, path: {tmp_path}/b.jsonl, weight: 3}}}}")
    assert not ld.indexed and f"a {tmp_path}/a.jsonl (1 file(s), 15.5 KiB in 1 unit(s); 25% of the tokens)" in ld.describe()
    targets = np.concatenate([np.asarray(next(ld)["targets"]).ravel() for _ in range(400)])
    shares = ld.shares()
    ld.close()
    a, b = (targets == ord("a")).sum(), (targets == ord("b")).sum()
    assert a + b == len(targets)
    assert abs(a / (a + b) - 0.25) < 0.01, a / (a + b)
    assert abs(shares["a"] - 0.25) < 0.01 and abs(shares["a"] + shares["b"] - 1) < 1e-9, shares


def test_synthetic_source_is_deterministic_and_indexed():
    a, b = loader("data.source=synthetic"), loader("data.source=synthetic")
    assert a.indexed
    for _ in range(2):
        assert (np.asarray(next(a)["inputs"]) == np.asarray(next(b)["inputs"])).all()


@pytest.mark.malformed
@pytest.mark.timeout(120)  # each of these looped forever in the packer, never forming a batch
@pytest.mark.parametrize("line, extra, message", [
    ('{"text": ""}', [], r"no usable document in a whole epoch of 2000 documents \(empty: 2000; first: .*a.jsonl:\d+\); "
                         r"fix the data: its documents are empty or blank"),
    ("", [], r"no usable document in a whole epoch of 2000 documents \(empty: 2000; first: .*a.jsonl:\d+\)"),
    ("not json", ["data.max_bad_records=100000"],
     r"no usable document in a whole epoch of 2000 documents \(bad_json: 2000; first: .*a.jsonl:\d+\); check data.source"),
    ("not json", [], r"data: 1001 bad records \(malformed JSON, invalid UTF-8, a missing `data.field` or one that is not text\), more than data.max_bad_records=1000; "
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


@pytest.mark.malformed
@pytest.mark.timeout(120)
def test_a_field_missing_from_every_line_fails_even_in_one_epoch(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": f"doc {i} " * 20}) + "\n" for i in range(30)))
    ld = loader("data.source=jsonl", f"data.path={tmp_path}/a.jsonl", "data.epochs=1")  # was: 0 batches, silently
    with pytest.raises(ConfigError, match=r"whole epoch of 30 documents \(missing_field: 30; first: .*a.jsonl:\d+\); "
                                          r"set data.field to the JSON key or Parquet column that holds the text"):
        drain(ld)


@pytest.mark.malformed
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


@pytest.mark.malformed
def test_wrong_kind_of_path_says_what_to_pass(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"notes holds no .jsonl or .json files \(1 other file\)"):
        sources.resolve(str(tmp_path / "notes"), suffixes=sources.SUFFIXES["jsonl"])
    with pytest.raises(ConfigError, match=r"a.txt is a file, not a prepared directory \(one holding dataset.json\); "
                                          r"prepare it .* or set data.source=text"):
        sources.resolve(str(tmp_path / "notes" / "a.txt"), dirs=True)


def test_a_path_that_exists_but_is_no_regular_file_says_what_it_is(tmp_path):
    """A named pipe was `does not exist`; a dangling symbolic link names its target."""
    os.mkfifo(tmp_path / "pipe.jsonl")
    with pytest.raises(ConfigError, match=r"^`data.path`: .*/pipe.jsonl is a named pipe \(FIFO\), not a regular file: "
                                          r"maxlm reads a data file by its size and byte ranges"):
        sources.resolve(str(tmp_path / "pipe.jsonl"), suffixes=sources.SUFFIXES["jsonl"])
    with pytest.raises(ConfigError, match=r"is a character device, not a regular file"):
        sources.resolve("/dev/null")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "gone.jsonl")
    with pytest.raises(ConfigError, match=r"link.jsonl is a symbolic link to .*/gone.jsonl, which does not exist"):
        sources.resolve(str(tmp_path / "link.jsonl"))


@pytest.mark.malformed
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


@pytest.mark.parametrize("text", [
    b'{"text": "a"}\n{"text": "bb"}\n\n{"text": "c"}',  # a blank line; no newline at the end
    b"x" * 50 + b"\n" + b"y\n" * 9 + b"z" * 33 + b"\n",  # lines longer than a unit, and units inside one line
    b"\n\n\n" + b"q\n" * 20,
])
@pytest.mark.parametrize("unit", [1, 2, 7, 64])
def test_jsonl_units_give_every_line_once_and_name_its_line(tmp_path, monkeypatch, text, unit):
    """A unit is the lines that start in its byte range: over all units, each line exactly once, in file
    order, with `where` locating to its line number."""
    monkeypatch.setattr(sources, "UNIT_BYTES", unit)
    (tmp_path / "a.jsonl").write_bytes(text)
    src = sources.JsonlSource([str(tmp_path / "a.jsonl")], "text", records=True)
    assert len(src) == -(-len(text) // unit)
    got = [d for u in range(len(src)) for d in src.read_unit(u)]
    lines = text.split(b"\n")[:-1] if text.endswith(b"\n") else text.split(b"\n")
    assert [sources.parse_record(x + b"\n")[1] for x in lines] == [skip for _, skip, _ in got]
    assert [sources.locate(w) for _, _, w in got] == [f"{tmp_path}/a.jsonl:{i + 1}" for i in range(len(lines))]


def test_a_line_number_is_counted_only_so_far_into_a_file(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "LOCATE_BYTES", 100)
    (tmp_path / "a.jsonl").write_bytes(b"0123456789\n" * 30)
    assert sources.locate(f"{tmp_path}/a.jsonl:@99") == f"{tmp_path}/a.jsonl:10"
    assert sources.locate(f"{tmp_path}/a.jsonl:@110") == f"{tmp_path}/a.jsonl:byte 110"
    assert sources.locate("b.parquet:row group 0 row 5") == "b.parquet:row group 0 row 5"


def test_streaming_jsonl_reads_no_more_than_its_read_ahead_before_the_first_batch(tmp_path):
    """48 MiB of JSONL: building the loader reads the files' sizes, and the first batch reads a few
    units (the prefetch), not the corpus. /proc/self/io counts every byte this process reads."""
    line = (json.dumps({"text": "lorem ipsum dolor sit amet " * 30}) + "\n").encode()
    for f in range(2):
        (tmp_path / f"c{f}.jsonl").write_bytes(line * ((24 << 20) // len(line)))
    rchar = lambda: int(dict(x.split(": ") for x in open("/proc/self/io").read().splitlines())["rchar"])  # noqa: E731
    before = rchar()
    ld = loader("data.source=jsonl", f"data.path={tmp_path}")
    built = rchar() - before
    next(ld)
    first = rchar() - before
    ld.close()
    assert built < 1 << 20, built
    print(f"bytes read: {built:,} building the loader, {first:,} by the first batch")
    assert first < 16 << 20, first  # 2 threads x (4 buffered + 1) elements x 2 units of 1 MiB at most


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_a_streaming_epoch_trains_every_line_once(tmp_path, monkeypatch, request, where):
    """Three files cut into 256-byte units (lines straddle them), on disk or in a bucket of the GCS
    emulator (ranged reads through gcsfs): with data.epochs=1 and a row per document, the rows hold every
    line's document exactly once, and then the data ends."""
    from maxlm import storage

    monkeypatch.setattr(sources, "UNIT_BYTES", 256)
    docs = [f"doc {i} " + "x" * (i % 17) for i in range(152)]  # 19 batches of 8 rows: none left over
    d = str(tmp_path) if where == "local" else request.getfixturevalue("gcs") + "/corpus"
    for f in range(3):
        storage.write(f"{d}/{f}.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in docs[f::3]))
    ld = loader("data.source=jsonl", f"data.path={d}", "data.epochs=1", "data.packing=false")
    rows = []
    for batch in ld:
        x, seg = np.asarray(batch["inputs"]), np.asarray(batch["segment_ids"])
        rows += [bytes(r[s > 0].astype(np.uint8)) + b"?" for r, s in zip(x, seg) if s.any()]
    ld.close()
    # each row holds one document, inputs being all its bytes but the last (x is a target only)
    assert sorted(rows) == sorted(t[:-1].encode() + b"?" for t in docs)


def test_staged_weights_change_at_their_step_and_resume_exactly_across_it(tmp_path):
    """Weights {0: 1, 50: 3} against {0: 3, 50: 1}: steps 0-49 take 25% of their targets from `a`, steps
    50-99 75% (each stage's shares count from its start; the first rows of a stage finish the document
    the last stage left, up to 2 steps here). A loader restored at step 40 makes the same batches through
    the change as the one that ran on."""
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": "a" * 40}) + "\n" for _ in range(300)))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": "b" * 400}) + "\n" for _ in range(300)))
    mix = [f"data.mixture={{a: {{source: jsonl, path: {tmp_path}/a.jsonl, weight: {{0: 1, 50: 3}}}}, "
           f"b: {{source: jsonl, path: {tmp_path}/b.jsonl, weight: {{0: 3, 50: 1}}}}}}"]
    ld = loader("data.source=mixture", *mix)
    assert "25% of the tokens, 75% of the tokens from step 50" in ld.describe()
    batches, state = [], None
    for step in range(100):
        if step == 40:
            state = ld.get_state()
        batches.append(np.asarray(next(ld)["targets"]))
    assert abs(ld.shares()["a"] - 0.75) < 0.01, ld.shares()
    ld.close()
    for lo, hi, want in ((0, 50, 0.25), (52, 100, 0.75)):
        t = np.concatenate([b.ravel() for b in batches[lo:hi]])
        share = (t == ord("a")).sum() / len(t)
        assert abs(share - want) < 0.02, (lo, hi, share)
    again = loader("data.source=mixture", *mix)
    again.set_state(state)
    for step in range(40, 60):
        assert (np.asarray(next(again)["targets"]) == batches[step]).all(), step
    again.close()
    with pytest.raises(ConfigError, match=r"weight in stages must map steps .* step 0 among them"):
        load("configs/tiny.yml", ["data.source=mixture", "data.mixture={a: {source: jsonl, path: x, weight: {10: 1}}}"])
    with pytest.raises(ConfigError, match=r"^`data.mixture.r.weight` has stages, which start fresh epochs of a mixture "
                                          r"of token sources, so data.epochs=2 counts nothing; set data.epochs=0"):
        load("configs/tiny.yml", ["data.source=mixture", "data.mixture={r: {source: synthetic, weight: {0: 1, 5: 2}}, "
                                  "d: {source: pydoc, weight: 1}}", "data.epochs=2"])


def test_an_indexed_mixture_changes_its_token_shares_at_each_stage_and_resumes_exactly_across_them():
    """Token sources with staged weights {0: 1:3, 50: 3:1, 100: 1:0}: each stage is its own stream of
    epochs, planned exactly in its weights (75%, 25%, then 0% of the pairs from the long documents), and
    its rows show it; row g stays a pure function of g, so a loader restored before a change gives the
    same batches through it."""
    comps = []
    for n, tok in ((5, 1), (41, 2)):
        src = sources.InMemorySource([np.full(n, tok, np.int32)] * 4000)
        src.per = 10
        comps.append(Component("pydoc", src, {0: 1.0}, str(n)))
    B, L, weights = 8, 16, [[1, 3], [3, 1], [1, 0]]
    plans = [Plan(comps, t << 32, w) for t, w in enumerate(weights)]
    assert [p.pairs(0)[1] / p.pairs(0).sum() for p in plans] == [0.75, pytest.approx(0.25, abs=0.01), 0.0]
    staged = Staged([0, 50 * B, 100 * B], [Rows(comps, p, L, True, t << 32) for t, p in enumerate(plans)])
    for (lo, hi), want in zip(((0, 50), (50, 100), (100, 150)), (0.75, 0.25, 0.0)):
        t = np.concatenate([staged(g)["targets"] for g in range(lo * B, hi * B)])
        assert abs((t == 2).mean() - want) < 0.05, (lo, (t == 2).mean())
    mix = ["data.source=mixture", "data.mixture={doc: {source: pydoc, weight: {0: 1, 6: 3}}, rand: {source: synthetic, "
           "weight: {0: 3, 6: 1}}}"]
    ld = loader(*mix)
    shares = re.findall(r"([\d.]+)% of an epoch's tokens(?: from step (\d+))?", ld.describe())
    assert [s[1] for s in shares] == ["", "6", "", "6"], ld.describe()
    batches, state, shares, taken = [], None, [], []
    for step in range(10):
        if step == 4:
            state = ld.get_state()
        batches.append(np.asarray(next(ld)["inputs"]))
        shares.append(ld.shares())
        taken.append(int(ld.pairs.sum()))
    ld.close()
    again = loader(*mix)
    again.set_state(state)
    for step in range(4, 10):
        assert (np.asarray(next(again)["inputs"]) == batches[step]).all(), step
        assert again.shares() == shares[step], step  # the realised shares are in the data position too
    again.close()
    assert all(abs(sum(x.values()) - 1) < 1e-9 for x in shares) and shares[6] != shares[5]
    # Counted from each stage's start: step 6 begins the second stage, so its count is one batch's again.
    assert taken[5] == 6 * taken[0] and taken[6] == taken[0] == 8 * 32


@pytest.mark.malformed
def test_fewer_units_than_reading_processes_for_the_epochs_is_one_line(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "tiny"}) + "\n")
    cfg = load("configs/tiny.yml", ["seq_len=32", "global_batch_size=8", "data.source=jsonl",
                                    f"data.path={tmp_path}/a.jsonl", "data.epochs=2"])
    ld = loader("data.source=jsonl", f"data.path={tmp_path}/a.jsonl", "data.epochs=2")
    ld.close()
    with pytest.raises(ConfigError, match=r"^data: jsonl .*a.jsonl has 1 units \(the lines that start in one MiB of a file\) for 2 epoch\(s\) "
                                          r"over 4 reading processes, so some would read nothing; give it more data"):
        ld._streams(cfg.data, ld.comps, 0, 4)  # as process 0 of 4 would build it


def test_prepared_data_reads_the_same_from_a_bucket(tmp_path, gcs):
    """A prepared directory copied to a bucket of the GCS emulator gives the same batches as on disk:
    dataset.json, a block's lengths (a ranged read) and the ArrayRecord shards all through gs://."""
    from maxlm import storage
    from maxlm.data import prepare

    (tmp_path / "raw.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * (1 + i % 9)}) + "\n"
                                                for i in range(300)))
    assert prepare.main([str(tmp_path / "raw.jsonl"), "--tokenizer", "byte", "--out", str(tmp_path / "prep"),
                         "--workers", "1", "--chunk-mb", "0.004"]) == 0
    for f in (tmp_path / "prep").iterdir():
        storage.write(f"{gcs}/prep/{f.name}", f.read_bytes())
    local, remote = (loader("data.source=prepared", f"data.path={d}") for d in (tmp_path / "prep", f"{gcs}/prep"))
    for _ in range(3):
        assert (np.asarray(next(local)["inputs"]) == np.asarray(next(remote)["inputs"])).all()
    local.close()
    remote.close()


def test_prepared_data_in_worker_processes_gives_the_same_batches(tmp_path):
    """data.workers=1 reads the shards in a worker process, which opens its own readers (the source's
    state leaves its open ones behind): the same batches as in-process."""
    from maxlm.data import prepare

    (tmp_path / "raw.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * (1 + i % 7)}) + "\n" for i in range(200)))
    assert prepare.main([str(tmp_path / "raw.jsonl"), "--tokenizer", "byte", "--out", str(tmp_path / "prep"),
                         "--workers", "1", "--chunk-mb", "0.002"]) == 0
    here, there = (loader("data.source=prepared", f"data.path={tmp_path}/prep", f"data.workers={w}") for w in (0, 1))
    for _ in range(3):
        assert (np.asarray(next(here)["inputs"]) == np.asarray(next(there)["inputs"])).all()
    here.close()
    there.close()


@pytest.mark.malformed
def test_a_missing_bucket_or_object_on_gs_is_one_line_before_anything_compiles(gcs, gcs_server):
    """Through the CLI, as a user meets it: a bucket that does not exist is named as such; a path with
    nothing under it in a bucket that does, as that."""
    from conftest import gcs_env, run_cli

    for path, source, want in (
            ("gs://no-such-bucket-zz/web", "jsonl",
             "`data.path`: bucket `no-such-bucket-zz` of gs://no-such-bucket-zz/web does not exist (or is in another "
             "project); fix the path"),
            (f"{gcs}/web", "jsonl", f"`data.path`: {gcs}/web matches no file in its bucket"),
            (f"{gcs}/prep", "prepared", f"`data.path`: {gcs}/prep matches no prepared directory in its bucket")):
        r = run_cli("configs/tiny.yml", f"data.source={source}", f"data.path={path}", env=gcs_env(gcs_server))
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == f"maxlm: error: {want}", r.stderr[-1500:]
        assert "Traceback" not in r.stderr


# Damaged prepared data: (name, damage to a copy of a 6-shard prepared directory, the message's fragment, checked at
# start-up (preflight, before the compile) or only at the first read of the block (an index edited inside)).
def _meta(edit):
    def harm(d):
        m = json.loads((d / "dataset.json").read_text())
        edit(m)
        (d / "dataset.json").write_text(json.dumps(m))
    return harm


def _offsets(edit):
    def harm(d):
        np.save(d / "shard-00001.offsets.npy", edit(np.load(d / "shard-00001.offsets.npy")))
    return harm


def _docs_plus(n, total=False):
    def edit(m):
        m["shards"][1]["docs"] += n
        if total:
            m["stats"]["documents"] += n
    return edit


DAMAGED = [
    ("garbage-offsets", lambda d: (d / "shard-00001.offsets.npy").write_bytes(np.random.default_rng(0).bytes(900)),
     "{d}/shard-00001.offsets.npy is not a .npy file (the magic string is not correct", True),
    ("empty-offsets", lambda d: (d / "shard-00001.offsets.npy").write_bytes(b""), "{d}/shard-00001.offsets.npy is not a .npy file", True),
    ("float-offsets", _offsets(lambda a: a.astype(np.float64)),
     "{d}/shard-00001.offsets.npy holds a 57 array of float64, not a 1-d array of int64", True),
    ("cut-offsets", lambda d: (d / "shard-00001.offsets.npy").write_bytes((d / "shard-00001.offsets.npy").read_bytes()[:-8]),
     "{d}/shard-00001.offsets.npy holds 576 bytes where its header says 584: it was cut short or appended to", True),
    ("reversed-offsets", _offsets(lambda a: a[::-1].copy()),
     "{d}/shard-00001.offsets.npy starts its first document at 3556, not 0", True),
    ("offsets-end", _offsets(lambda a: np.r_[a[:-1], a[-1] - 1]),
     "{d}/shard-00001.offsets.npy ends its last document at 3555 where dataset.json lists 3556 tokens for shard-00001.tokens", True),
    ("doc-count", _meta(_docs_plus(3)), "{d}/dataset.json lists stats.documents=300 where its shards add up to 303", True),
    ("doc-count-and-total", _meta(_docs_plus(3, total=True)),
     "{d}/shard-00001.offsets.npy holds 57 entries where dataset.json lists 59 documents for shard-00001.tokens (60 entries)", True),
    ("negative-docs", _meta(_docs_plus(-100, total=True)), "{d}/dataset.json lists docs=-44 for shard-00001.tokens", True),
    ("token-total", _meta(lambda m: m["stats"].update(tokens=1)), "{d}/dataset.json lists stats.tokens=1 where its shards add up to", True),
    ("bogus-dtype", _meta(lambda m: m.update(dtype="bogus")), "{d}/dataset.json lists token dtype 'bogus', not uint16 or int32", True),
    ("float-dtype", _meta(lambda m: m.update(dtype="float32")), "{d}/dataset.json lists token dtype 'float32', not uint16", True),
    ("int32-dtype", _meta(lambda m: m.update(dtype="int32")),
     "{d}/shard-00000.tokens holds 7012 bytes where dataset.json lists 14024: the shards do not match", True),
    ("dtype-too-small", _meta(lambda m: m["tokenizer"].update(vocab_size=70000)),
     "{d}/dataset.json lists token dtype uint16, which cannot hold the 70000 ids of its tokenizer byte", True),
    ("cut-tokens", lambda d: (d / "shard-00001.tokens").write_bytes((d / "shard-00001.tokens").read_bytes()[:-2]),
     "{d}/shard-00001.tokens holds 7110 bytes where dataset.json lists 7112", True),
    ("shards-not-a-list", _meta(lambda m: m.update(shards={"a": 1})), "{d}/dataset.json lists `shards` that are not a list of objects", True),
    ("tokens-a-string", _meta(lambda m: m["shards"][0].update(tokens="12")),
     "{d}/dataset.json lists tokens='12' for shard-00000.tokens, not a whole number >= 0", True),
    ("file-a-path", _meta(lambda m: m["shards"][0].update(file="../../etc/passwd")),
     "{d}/dataset.json lists file='../../etc/passwd' for shard 0, not a file name", True),
    ("blocks-count", _meta(lambda m: m["shards"][1].update(blocks=[1, 2])),
     "{d}/dataset.json lists 2 blocks for shard-00001.tokens of 56 documents (one per 4096)", True),
    ("blocks-impossible", _meta(lambda m: m["shards"][1].update(blocks=[m["shards"][1]["blocks"][0] - 2])),
     "{d}/dataset.json lists blocks for shard-00001.tokens holding 3498 (input, target) pairs, which 56 documents of "
     "3556 tokens cannot have (between 3500 and 3556)", True),
    # Inside an index or between the ends of the possible: found when the block is first read, still one line naming it.
    ("blocks-edited", _meta(lambda m: m["shards"][1].update(blocks=[m["shards"][1]["blocks"][0] + 5])),
     "{d}/shard-00001.offsets.npy (documents 0-56 of the shard) gives 3500 (input, target) pairs where dataset.json's "
     "block totals list 3505", False),
    ("offsets-swapped", _offsets(lambda a: np.r_[a[:5], a[6], a[5], a[7:]]),
     "{d}/shard-00001.offsets.npy (documents 0-56 of the shard) holds offsets that go backwards or past the shard's 3556 tokens", False),
    ("ids-past-the-vocabulary", lambda d: (d / "shard-00001.tokens").write_bytes(np.full(3556, 5000, np.uint16).tobytes()),
     "{d}/shard-00001.tokens holds token id 5000, but its tokenizer (byte) has 258 ids", False),
]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from maxlm.data import prepare

    d = tmp_path_factory.mktemp("prepared")
    (d / "raw.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * (1 + i % 9)}) + "\n" for i in range(300)))
    assert prepare.main([str(d / "raw.jsonl"), "--tokenizer", "byte", "--out", str(d / "prep"), "--workers", "1",
                         "--chunk-mb", "0.004", "--add-eos"]) == 0
    return d / "prep"


def _read_all(src) -> None:
    for b in range(len(src.blocks)):
        src.block_lengths(b)
    for i in range(len(src)):
        src.tokens(i)


@pytest.mark.malformed
@pytest.mark.parametrize("harm, want, at_start", [c[1:] for c in DAMAGED], ids=[c[0] for c in DAMAGED])
def test_damaged_prepared_data_is_one_line_naming_the_file(prepared, tmp_path, harm, want, at_start):
    import shutil

    from maxlm.data import checks

    d = tmp_path / "prep"
    shutil.copytree(prepared, d)
    harm(d)
    cfg = load("configs/tiny.yml", ["data.source=prepared", f"data.path={d}", "data.add_eos=true", "model.vocab_size=512"])
    if at_start:  # the trainer's preflight, before anything compiles
        with pytest.raises(ConfigError) as e:
            checks.preflight(cfg)
    else:
        checks.preflight(cfg)
        with pytest.raises(ConfigError) as e:
            _read_all(sources.PreparedSource([str(d)]))
    msg = str(e.value)
    assert msg.startswith("`data.path`: ") and want.format(d=d) in msg and "\n" not in msg, msg
    assert msg.endswith("prepare it again into a fresh --out") or msg.endswith(f"prepare {d} again into a fresh --out"), msg


def test_the_checks_of_an_intact_prepared_directory_read_only_its_index_ends(prepared, monkeypatch):
    """Start-up reads each shard's index header and its first and last entries, not a document's offsets."""
    from maxlm import storage

    reads = []
    real = storage.read_ranges
    monkeypatch.setattr(storage, "read_ranges", lambda ranges: reads.append(ranges) or real(ranges))
    src = sources.PreparedSource([str(prepared)])
    meta = json.loads((prepared / "dataset.json").read_text())
    assert len(reads) == 2 and [len(r) for r in reads] == [len(meta["shards"]), 2 * len(meta["shards"])]
    assert all(hi - lo == 8 for _, lo, hi in reads[1])
    _read_all(src)  # and an intact directory reads whole


@pytest.mark.malformed
def test_a_dataset_whose_tokenizer_outgrows_the_model_is_refused_naming_both(prepared, tmp_path):
    import shutil

    from maxlm.data import checks

    d = tmp_path / "prep"
    shutil.copytree(prepared, d)
    _meta(lambda m: m["tokenizer"].update(vocab_size=1000))(d)  # recorded: 1000 ids (uint16 holds them)
    cfg = load("configs/tiny.yml", ["data.source=prepared", f"data.path={d}", "data.add_eos=true", "model.vocab_size=512"])
    with pytest.raises(ConfigError, match=r"^the prepared dataset was tokenized with byte \(byte\), whose ids go up to 999 "
                                          r"\(its dataset.json's vocab_size, bos_id and eos_id\), but `model.vocab_size`=512; "
                                          r"set model.vocab_size=1000 \(or more\)"):
        checks.preflight(cfg)


@pytest.mark.malformed
def test_damaged_prepared_data_through_the_cli_is_exit_2_before_the_compile(prepared, tmp_path):
    import shutil

    from conftest import run_cli

    d = tmp_path / "prep"
    shutil.copytree(prepared, d)
    (d / "shard-00002.offsets.npy").write_bytes(b"\x93NUMPY garbage")
    r = run_cli("configs/tiny.yml", "data.source=prepared", f"data.path={d}", "data.add_eos=true", "model.vocab_size=512",
                f"run_dir={tmp_path}/run", "steps=2", devices=1)
    errors = [line for line in r.stderr.splitlines() if line.startswith("maxlm: error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr + r.stdout, r.stderr[-2000:]
    assert errors[0].startswith(f"maxlm: error: `data.path`: {d}/shard-00002.offsets.npy is not a .npy file"), errors
    assert "MFU" not in r.stdout and "steps per epoch" not in r.stdout, r.stdout[-2000:]  # said as the data starts
