"""maxlm.data.preflight: the data config's cheap checks, before the trainer compiles. Each bad case fails
in one line, the same line the Loader gives; good configs pass without reading any document or jax."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_prepare import make_hf

from maxlm.config import ConfigError, load
from maxlm.data import prepare, preflight

ROOT = Path(__file__).resolve().parent.parent


def cfg(*overrides):
    return load("configs/tiny.yml", list(overrides))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A JSONL file, a Parquet file, a garbage .parquet, a prepared directory (byte tokenizer, add_eos) and
    a Hugging Face tokenizer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path_factory.mktemp("data")
    (d / "a.jsonl").write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(10)))
    pq.write_table(pa.table({"text": ["p1", "p2"]}), d / "t.parquet")
    (d / "g.parquet").write_bytes(np.random.default_rng(0).bytes(4096))
    assert prepare.main([str(d / "a.jsonl"), "--tokenizer", "byte", "--add-eos", "--out", str(d / "prep"),
                         "--workers", "1"]) == 0
    make_hf(d / "tokenizer.json", ["document one two"])
    (d / "garbage.json").write_bytes(np.random.default_rng(1).bytes(512))
    return d


def test_good_configs_pass(data):
    for overrides in ([], ["data.source=jsonl", f"data.path={data}/a.jsonl"],
                      ["data.source=parquet", f"data.path={data}/t.parquet"],
                      ["data.source=prepared", f"data.path={data}/prep", "data.add_eos=true", "model.vocab_size=258"],
                      ["data.source=jsonl", f"data.path=['{data}/a.jsonl', '{data}/a.jsonl']", "eval.every=5",
                       "eval.source=prepared", f"eval.path={data}/prep", "data.add_eos=true", "model.vocab_size=258"],
                      [f"data.tokenizer={data}/tokenizer.json", "model.vocab_size=300"]):
        assert preflight(cfg(*overrides)) is None, overrides


@pytest.mark.malformed
@pytest.mark.parametrize("overrides, message", [
    (["data.source=jsonl", "data.path={d}/nope.jsonl"], r"^`data.path`: .*/nope.jsonl does not exist \(searched: "),
    (["data.source=jsonl", "data.path=[1,2]"], r"^`data.path`: item 1 of the list is 1 \(int\), not a path; write "
                                               r"every path as a string: data.path=\['1', '2'\]$"),  # from config.load
    (["data.source=mixture", "data.mixture={web: {source: jsonl, path: [1, 2]}}"],
     r"^`data.mixture.web.path`: item 1 of the list is 1 \(int\), not a path; write every path as a string: "
     r"data.mixture.web.path=\['1', '2'\]$"),
    (["data.source=mixture", "data.mixture={a: {source: pydoc}, web: {source: jsonl, path: '{d}/no/*.jsonl'}}"],
     r"^`data.mixture.web.path`: .*/no/\*.jsonl matches no file"),
    (["data.tokenizer={d}/none.json"], r"^`data.tokenizer`: no file .*/none.json \(use `byte`"),
    (["data.tokenizer={d}"], r"^`data.tokenizer`: .* is a directory; name the tokenizer.json or SentencePiece .model file "
                             r"in it: data.tokenizer=.*/tokenizer.json$"),
    (["data.tokenizer="], r"^`data.tokenizer` is empty; set it to byte, a tokenizer.json or a SentencePiece .model$"),
    (["data.tokenizer={d}/garbage.json"], r"^`data.tokenizer`: .*/garbage.json does not load as a Hugging Face tokenizer: "),
    (["data.tokenizer={d}/tokenizer.json"], r"^tokenizer .*tokenizer.json \(Hugging Face\) produces ids up to (\d+) but "
                                            r"`model.vocab_size`=256; set model.vocab_size=\d+ \(or more\)$"),
    (["data.add_eos=true"], r"^tokenizer byte produces ids up to 257 but `model.vocab_size`=256; set model.vocab_size=258"),
    (["data.source=prepared", "data.path={d}/prep/*", "data.add_eos=true", "model.vocab_size=258"],
     r"^`data.path`: .*/prep/\* matches 4 files but no prepared directory \(one holding dataset.json\); pass the "
     r"directory itself: data.path=.*/prep$"),
    (["data.source=prepared", "data.path={d}", "data.add_eos=true", "model.vocab_size=258"],
     r"^`data.path`: .* is not a prepared dataset \(no dataset.json\) but holds prepared directories \(prep\); pass "
     r"them: data.path='.*/\*'$"),
    (["data.source=prepared", "data.path={d}/prep", "model.vocab_size=258"],
     r"^the prepared dataset was made with add_eos=true; set data.add_eos=true"),
    (["data.source=prepared", "data.path={d}/prep", "data.add_eos=true", "data.tokenizer={d}/tokenizer.json",
      "model.vocab_size=300"], r"^the prepared dataset was tokenized with byte \(byte\), not data.tokenizer="),
    (["data.source=parquet", "data.path={d}/g.parquet"], r"^`data.path`: .*/g.parquet is not a valid Parquet file \("),
    (["data.source=parquet", "data.path={d}/t.parquet", "data.field=body"],
     r"^`data.field`: .*/t.parquet has no column `body` \(columns: text\)$"),
    (["data.source=jsonl", "data.path={d}/a.jsonl", "eval.every=5", "eval.path={d}/held.jsonl"],
     r"^eval: `eval.path`: .*/held.jsonl does not exist"),
    (["data.source=jsonl", "data.path={d}/a.jsonl", "eval.every=5", "eval.source=prepared", "eval.path={d}/prep/*"],
     r"^eval: `eval.path`: .*/prep/\* matches 4 files but no prepared directory .*: eval.path=.*/prep$"),
])
def test_each_bad_case_fails_in_one_line(data, overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        preflight(cfg(*(o.replace("{d}", str(data)) for o in overrides)))
    assert "\n" not in str(e.value)


def test_the_loader_says_the_same(data):
    """The Loader keeps its own checks, with the same words."""
    from test_sources import loader

    for overrides in (["data.source=prepared", f"data.path={data}/prep/*", "data.add_eos=true", "model.vocab_size=258"],
                      ["data.source=parquet", f"data.path={data}/g.parquet"], ["data.tokenizer="]):
        with pytest.raises(ConfigError) as want:
            preflight(cfg("seq_len=32", "global_batch_size=8", *overrides))
        with pytest.raises(ConfigError) as got:
            loader(*overrides)
        assert str(got.value) == str(want.value)


def test_it_reads_no_document_and_no_jax(data, tmp_path):
    # Documents are the Loader's to judge: a JSONL file of garbage passes (its path resolves).
    (tmp_path / "junk.jsonl").write_bytes(b"\xff\x00 not json\n" * 100)
    script = (f"import sys; from maxlm.config import load; from maxlm.data import preflight; "
              f"preflight(load('configs/tiny.yml', ['data.source=jsonl', 'data.path={tmp_path}/junk.jsonl'])); "
              f"preflight(load('configs/tiny.yml', ['data.source=parquet', 'data.path={data}/t.parquet'])); "
              f"assert 'jax' not in sys.modules, 'jax imported'")
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
