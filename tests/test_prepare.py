"""maxlm.data.prepare: raw text/JSONL/Parquet -> token shards that PreparedSource reads back (and the
ArrayRecord shards that an older prepare wrote, still read)."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from maxlm.data import prepare, tokenizer
from maxlm.data.order import Plan, Rows
from maxlm.data.pipeline import Component
from maxlm.data.sources import PreparedSource
from maxlm.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
KEPT = ["hello world\n", "one", "two", "six", "p1", "p3"]  # the documents of `raw`, in unit order


@pytest.fixture
def raw(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "raw"
    d.mkdir()
    (d / "a.txt").write_text("hello world\n")
    (d / "b.txt").write_text("")
    (d / "c.txt").write_bytes(b"\xff\xfe not utf-8")
    (d / "d.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n{"text": oops\n{"body": "x"}\n\n{"text": "six"}\n')
    pq.write_table(pa.table({"text": ["p1", None, "p3"]}), d / "e.parquet", row_group_size=2)
    return d


def make_hf(path: Path, texts: list[str]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer, hf.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    hf.train_from_iterator(texts * 10, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(path))
    return path


def run(capsys, *args):
    rc = prepare.main([str(a) for a in args])
    return rc, capsys.readouterr()


def cli(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "maxlm.data.prepare", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def snapshot(d: Path) -> dict:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(d.iterdir())}


def one_line_error(r) -> str:
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip()
    assert err.startswith("maxlm: error: ") and "\n" not in err, err
    return err


def test_round_trip_and_stats(raw, tmp_path, capsys):
    out = tmp_path / "out"
    rc, io = run(capsys, raw, "--tokenizer", "byte", "--out", out, "--add-bos", "--add-eos", "--workers", 1,
                 "--chunk-mb", 0.00001)  # ~10 bytes: d.jsonl becomes several units
    assert rc == 0, io.err
    tok = tokenizer.load("byte")
    want = [tokenizer.document_ids(tok, t, True, True) for t in KEPT]
    src = PreparedSource([str(out)])
    lengths = np.concatenate([src.block_lengths(b) for b in range(len(src.blocks))])
    assert len(src) == len(want) and lengths.tolist() == [len(w) for w in want] and not src.scanned
    assert src.blocks[:, 2].tolist() == [len(w) - 1 for w in want if len(w)]  # a block per shard, 1 document each here
    for i, w in enumerate(want):
        assert src.tokens(i).tolist() == w.tolist()
    meta = json.loads((out / "dataset.json").read_text())
    assert meta["block_docs"] == 4096 and [s["blocks"] for s in meta["shards"] if s["docs"]] == src.blocks[:, 2:].tolist()
    # Start-up opens no shard; the first read of a shard checks its size against dataset.json, so a shard
    # cut short or another preparation's fails on it, in one line naming it.
    full = [s for s in meta["shards"] if s["docs"]]
    bad = tmp_path / "bad"
    copy(out, bad)
    for junk in ((out / full[1]["file"]).read_bytes(), (out / full[0]["file"]).read_bytes()[:-1]):
        (bad / full[0]["file"]).write_bytes(junk)
        with pytest.raises(ConfigError, match=rf"^`data.path`: {bad}/{full[0]['file']} holds \d+ bytes where dataset.json "
                                              r"lists \d+: the shards do not match their dataset.json; copy the whole"):
            epoch(PreparedSource([str(bad)]))
    assert meta["format"] == "maxlm-tokens-v2" and meta["dtype"] == "uint16" and src.dtype == np.uint16
    assert meta["tokenizer"] == {"spec": "byte", "name": "byte", "vocab_size": 256, "bos_id": 256, "eos_id": 257,
                                 "sha256": "byte"}
    st = meta["stats"]
    assert st["documents"] == 6 and st["tokens"] == sum(len(w) for w in want)
    assert st["skipped"] == {"empty": 2, "invalid_utf8": 1, "bad_json": 1, "missing_field": 2, "not_text": 0}
    assert st["first_skip"] == {"empty": f"{raw}/b.txt", "invalid_utf8": f"{raw}/c.txt", "bad_json": f"{raw}/d.jsonl:3",
                                "missing_field": f"{raw}/d.jsonl:4"}
    inputs = [s["input"] for s in meta["shards"]]
    assert inputs[:3] == [f"{raw}/{f}.txt" for f in "abc"]
    assert inputs[-2:] == [f"{raw}/e.parquet row groups 0-1", f"{raw}/e.parquet row groups 1-2"]
    jsonl = [s for s in inputs if "d.jsonl" in s]
    size = (raw / "d.jsonl").stat().st_size  # JSONL units: the lines that start in each 10 bytes (none read to plan)
    assert jsonl == [f"{raw}/d.jsonl lines from bytes {a}-{min(a + 10, size)}" for a in range(0, size, 10)]
    assert meta["inputs"] == sorted(str(p) for p in raw.iterdir())
    assert "6 documents" in io.out and "bad_json 1 (first " in io.out


def copy(src: Path, dst: Path) -> None:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())


def epoch(src) -> list[np.ndarray]:
    """Every row of one epoch of `src` packed in rows of 4."""
    comps = [Component("prepared", src, 1.0, "prepared", "data.path")]
    rows = Rows(comps, Plan(comps, seed=0), 4, True, seed=0)
    return [rows(g)["inputs"] for g in range(rows.rows_in_epoch(0))]


def as_v1(out: Path, old: Path, blocks: bool = True) -> None:
    """`out` rewritten as an older prepare wrote it (maxlm-tokens-v1): an ArrayRecord record per document and
    int64 lengths, and (blocks=False) a dataset.json from before block totals were listed."""
    from array_record.python.array_record_module import ArrayRecordWriter

    old.mkdir()
    meta = json.loads((out / "dataset.json").read_text())
    for s in meta["shards"]:
        offs, toks = np.load(out / s["offsets"]), np.fromfile(out / s["file"], meta["dtype"])
        name = s["file"].replace(".tokens", "")
        w = ArrayRecordWriter(str(old / f"{name}.arrayrecord"), "group_size:1")
        for a, b in zip(offs[:-1], offs[1:]):
            w.write(toks[a:b].tobytes())
        w.close()
        np.save(old / f"{name}.lengths.npy", np.diff(offs))
        s.update(file=f"{name}.arrayrecord", lengths=f"{name}.lengths.npy")
        del s["offsets"]
        if not blocks:
            del s["blocks"]
    del meta["args"]["layout"]
    (old / "dataset.json").write_text(json.dumps({**meta, "format": "maxlm-tokens-v1"}))


def loader_messages(overrides: list[str]) -> list[str]:
    import jax
    from maxlm import mesh as mesh_lib, sharding
    from maxlm.config import load
    from maxlm.data import make_loader

    cfg = load("configs/tiny.yml", ["seq_len=4", "global_batch_size=2", "mesh.fsdp=1", *overrides])
    m = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, 1), jax.devices()[:1])
    ld = make_loader(cfg, sharding.named(m, ("batch", "length"), sharding.rules(cfg)), log=lambda _: None)
    ld.close()
    return ld.messages


def test_older_arrayrecord_datasets_still_read(raw, tmp_path, capsys):
    """A directory an older prepare wrote (ArrayRecord shards, lengths.npy; from before block totals too)
    reads as the same documents and packs the same rows; a shard that does not match fails by name."""
    out = tmp_path / "out"
    assert run(capsys, raw, "--tokenizer", "byte", "--out", out, "--add-eos", "--workers", 1, "--chunk-mb", 0.00001)[0] == 0
    new = PreparedSource([str(out)])
    for blocks in (True, False):
        old = tmp_path / f"old{blocks}"
        as_v1(out, old, blocks)
        src = PreparedSource([str(old)])
        assert src.v1 == [str(old)] and src.scanned == ([] if blocks else [str(old)]) and (src.blocks == new.blocks).all()
        assert all(src.tokens(i).tolist() == new.tokens(i).tolist() for i in range(len(new)))
        assert all((a == b).all() for a, b in zip(epoch(src), epoch(new), strict=True))
        said = loader_messages(["data.source=prepared", f"data.path={old}", "data.add_eos=true", "model.vocab_size=258"])
        assert [m for m in said if "maxlm-tokens-v1" in m] == [
            f"data: {old} was prepared by an older maxlm (maxlm-tokens-v1, ArrayRecord shards): each shard a process "
            f"opens keeps 8 bytes per document in memory, and a document is read whole for every row it touches; "
            f"prepare it again (python -m maxlm.data.prepare) for neither"]
        assert any("prepared without its blocks' totals" in m for m in said) == (not blocks)
    meta = json.loads((old / "dataset.json").read_text())
    full = [s for s in meta["shards"] if s["docs"]]
    (old / full[0]["file"]).write_bytes((old / full[1]["file"]).read_bytes())  # 1 document each, other lengths
    with pytest.raises(ConfigError, match=r"^`data.path`: document \d has \d+ tokens where its lengths list \d+: the "
                                          r"shards do not match their dataset.json; copy the whole"):
        epoch(PreparedSource([str(old)]))
    (old / full[0]["file"]).write_bytes(b"not an arrayrecord")
    with pytest.raises(ConfigError, match=rf"^`data.path`: cannot read record 0 of {old}/{full[0]['file']} \(.*\): "
                                          r"the shards do not match their dataset.json"):
        PreparedSource([str(old)]).tokens(0)
    # And a prepare resumed into it is refused: its shards would mix the layouts.
    rc, io = run(capsys, raw, "--tokenizer", "byte", "--out", old, "--add-eos", "--workers", 1, "--chunk-mb", 0.00001)
    assert rc == 2 and io.err.strip() == (f"maxlm: error: --out {old} was prepared with different layout (maxlm-tokens-v1, "
                                         f"ArrayRecord shards; this maxlm writes maxlm-tokens-v2); use a fresh --out"), io.err


def test_idempotent_and_resumable(raw, tmp_path, capsys):
    out = tmp_path / "out"
    args = (raw, "--tokenizer", "byte", "--out", out, "--add-eos", "--workers", 1, "--chunk-mb", 0.00003)
    assert run(capsys, *args)[0] == 0
    before = snapshot(out)
    n = len(json.loads((out / "dataset.json").read_text())["shards"])
    rc, io = run(capsys, *args)
    assert rc == 0 and f"{n} of {n} shards already done" in io.out and "0 shards written" in io.out
    assert snapshot(out) == before  # bytes and mtimes: nothing was rewritten

    # A crash after unit 3's data but before its marker: the unit is redone, nothing else.
    (out / "shard-00003.stats.json").unlink()
    (out / "shard-00003.tokens.tmp").write_bytes(b"partial")
    rc, io = run(capsys, *args)
    assert rc == 0 and f"{n - 1} of {n} shards already done" in io.out and "1 shards written" in io.out
    after = snapshot(out)
    assert after.keys() == before.keys()  # the stale .tmp is gone
    assert {k: v[0] for k, v in after.items()} == {k: v[0] for k, v in before.items()}
    redone = [f"shard-00003.{x}" for x in ("offsets.npy", "stats.json", "tokens")]
    assert [k for k in after if after[k][1] != before[k][1]] == redone

    # A stricter budget over finished shards fails without tokenizing and takes dataset.json away.
    rc, io = run(capsys, *args, "--max-bad-records", 0)  # invalid_utf8 1, bad_json 1, missing_field 2 (empty ones are not bad)
    assert rc == 2 and "4 bad records exceed" in io.err and not (out / "dataset.json").exists()
    assert run(capsys, *args)[0] == 0 and (out / "dataset.json").read_bytes() == before["dataset.json"][0]


def test_hf_tokenizer_uint16(tmp_path, capsys):
    texts = ["the quick brown fox", "jumps over the lazy dog", "hello world"]
    make_hf(tmp_path / "tokenizer.json", texts)
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    out = tmp_path / "out"
    rc, io = run(capsys, data, "--tokenizer", tmp_path / "tokenizer.json", "--out", out, "--field", "body", "--add-bos",
                 "--workers", 1)
    assert rc == 0, io.err
    src, tok = PreparedSource([str(out)]), tokenizer.load(str(tmp_path / "tokenizer.json"))
    assert src.meta[0]["dtype"] == "uint16" and len(src) == 3 and src.meta[0]["tokenizer"]["bos_id"] == 1
    assert src.meta[0]["tokenizer"]["sha256"] == hashlib.sha256((tmp_path / "tokenizer.json").read_bytes()).hexdigest()
    for i, t in enumerate(texts):
        ids = src.tokens(i)
        assert ids.tolist() == tokenizer.document_ids(tok, t, True, False).tolist() and tok.decode(ids[1:]) == t


@pytest.mark.malformed
def test_a_named_pipe_as_input_is_not_said_to_be_missing(tmp_path, capsys):
    """A FIFO was `does not exist`; prepare reads an input by size and byte range, so it names the kind."""
    os.mkfifo(tmp_path / "pipe.jsonl")
    rc, io = run(capsys, tmp_path / "pipe.jsonl", "--tokenizer", "byte", "--out", tmp_path / "o")
    assert rc == 2 and io.err.strip() == (f"maxlm: error: `INPUT`: {tmp_path}/pipe.jsonl is a named pipe (FIFO), not a "
                                          f"regular file: maxlm reads a data file by its size and byte ranges, more "
                                          f"than once; write the data to a file and pass that")


def make_sp(path: Path, texts: list[str], **options) -> Path:
    import io

    import sentencepiece
    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(texts * 10), model_writer=out, vocab_size=60,
                                             unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
                                             character_coverage=1.0, hard_vocab_limit=False, **options)
    path.write_bytes(out.getvalue())
    return path


WORDS = ["the", "quick", "brown", "fox,", "jumps", "über", "naïve", "1234", "don't", "x!", "a\nb", "tab\tbed"]


@pytest.mark.parametrize("kind, drop", [("hf", False), ("sp", True), ("sp-spaces-kept", True)])
def test_long_documents_are_tokenized_in_pieces_with_whole_document_ids(tmp_path, capsys, monkeypatch, kind, drop):
    """A 50 MB one-line document through a BPE tokenizer peaked at 10.6 GB: documents longer than
    PIECE_CHARS are encoded in pieces cut at spaces, CALL_CHARS at a time. With both made small here, ids and
    character offsets equal whole-document tokenization, through prepare too; the seam rule (the piece after
    a seam keeps its space, or drops it for SentencePiece's word prefix) is the one the probes chose."""
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, n)) for n in (0, 1, 3, 60, 400)]
    path = {"hf": lambda: make_hf(tmp_path / "tokenizer.json", texts),
            "sp": lambda: make_sp(tmp_path / "sp.model", texts),
            "sp-spaces-kept": lambda: make_sp(tmp_path / "sp.model", texts, remove_extra_whitespaces=False)}[kind]()
    tok = tokenizer.load(str(path))
    assert (tok.drop_seam_space, tok.seams_exact) == (drop, True)
    whole = tok.encode_offsets_batch(texts)
    assert max(map(len, texts)) < tokenizer.PIECE_CHARS  # whole above, pieces below
    monkeypatch.setattr(tokenizer, "PIECE_CHARS", 40)
    monkeypatch.setattr(tokenizer, "CALL_CHARS", 100)
    cuts = tokenizer.pieces(texts[-1], drop)
    assert len(cuts) > 20 and all(b - a <= 40 for a, b, _ in cuts)
    assert all(texts[-1][b] == " " for _, b, _ in cuts[:-1])  # every seam at a space: none cut between characters
    for got, want in zip(tok.encode_offsets_batch(texts), whole):
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
    calls = []
    encode_many = tok._encode_many
    monkeypatch.setattr(tok, "_encode_many", lambda chunks: calls.append(sum(map(len, chunks))) or encode_many(chunks))
    assert [x.tolist() for x in tok.encode_batch(texts)] == [w[0].tolist() for w in whole]
    assert len(calls) > 20 and max(calls) <= 100  # the tokenizer never holds more than CALL_CHARS at once
    assert tok.encode(texts[-1]).tolist() == whole[-1][0].tolist()

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[1:]))
    rc, io = run(capsys, data, "--tokenizer", path, "--out", tmp_path / "out", "--add-eos", "--workers", 1)
    assert rc == 0, io.err
    src = PreparedSource([str(tmp_path / "out")])
    assert [src.tokens(i).tolist() for i in range(len(src))] == [[*w[0].tolist(), tok.eos_id] for w in whole[1:]]


def test_a_stretch_without_a_space_is_cut_between_characters(monkeypatch):
    """The bound holds for a document with no seam (CJK text, a blob): pieces of PIECE_CHARS, covering it."""
    monkeypatch.setattr(tokenizer, "PIECE_CHARS", 8)
    text = "x" * 30 + " ab cd"
    cuts = tokenizer.pieces(text)
    assert [(a, b) for a, b, _ in cuts] == [(0, 8), (8, 16), (16, 24), (24, 30), (30, 36)]  # then a seam
    assert "".join(text[a:b] for a, b, _ in cuts) == text
    # SentencePiece's rule: the space at a seam belongs to neither piece (the word prefix stands for it)
    assert tokenizer.pieces("aaaa bbbb cccc dddd", drop_space=True) == [(0, 4, False), (5, 9, True), (10, 14, True),
                                                                         (15, 19, True)]


def test_workers_match_in_process(raw, tmp_path, capsys):
    args = (raw, "--tokenizer", "byte", "--add-eos", "--chunk-mb", 0.00002)  # 3 text + 4 jsonl + 2 parquet units
    assert run(capsys, *args, "--out", tmp_path / "one", "--workers", 1)[0] == 0
    r = cli(*args, "--out", tmp_path / "two", "--workers", 2)
    assert r.returncode == 0, r.stderr
    one, two = snapshot(tmp_path / "one"), snapshot(tmp_path / "two")
    assert len(one) == 9 * 3 + 1 and {k: v[0] for k, v in one.items()} == {k: v[0] for k, v in two.items()}


def test_hosts_sharing_the_units_write_what_one_host_writes(raw, tmp_path, capsys):
    """--shard 0/3, 1/3 and 2/3 into one --out, run at once as three processes: the same bytes as one host;
    the hosts that finish before the others say so and leave dataset.json to the last."""
    args = (raw, "--tokenizer", "byte", "--add-eos", "--chunk-mb", 0.00002, "--workers", 1)
    assert run(capsys, *args, "--out", tmp_path / "one")[0] == 0
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, "-m", "maxlm.data.prepare", *map(str, args), "--out", tmp_path / "many",
                               "--shard", f"{i}/3"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    one, many = snapshot(tmp_path / "one"), snapshot(tmp_path / "many")
    assert {k: v[0] for k, v in one.items()} == {k: v[0] for k, v in many.items()}
    assert sum("documents," in o for o in outs) >= 1  # the last to finish wrote dataset.json and its totals
    err = one_line_error(cli(*args, "--out", tmp_path / "x", "--shard", "3/3"))
    assert err == "maxlm: error: --shard must be I/N with 0 <= I < N (this host's share of the work), e.g. 0/4; got 3/3"


def test_hosts_write_to_a_bucket_what_one_host_writes_to_disk(raw, tmp_path, capsys, gcs):
    """--out gs://... on the GCS emulator, split over two hosts (processes) with 2 workers each: the bucket
    holds byte for byte what one host writes to a local --out, nothing else, the local staging is gone,
    and a re-run is a no-op. A bucket that does not exist is one line."""
    from etils import epath

    from maxlm import storage

    args = (raw, "--tokenizer", "byte", "--add-eos", "--chunk-mb", 0.00002)
    assert run(capsys, *args, "--workers", 1, "--out", tmp_path / "one")[0] == 0
    (tmp_path / "tmp").mkdir()  # where the shards are staged before their upload
    env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path / "tmp"))  # and the fixture's emulator variables
    procs = [subprocess.Popen([sys.executable, "-m", "maxlm.data.prepare", *map(str, args), "--workers", "2",
                               "--out", f"{gcs}/prep", "--shard", f"{i}/2"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert not list((tmp_path / "tmp").iterdir())
    one = {k: v[0] for k, v in snapshot(tmp_path / "one").items()}
    assert storage.listdir(f"{gcs}/prep") == sorted(one)
    assert all(epath.Path(f"{gcs}/prep/{name}").read_bytes() == data for name, data in one.items())
    rc, io = run(capsys, *args, "--workers", 1, "--out", f"{gcs}/prep")
    assert rc == 0 and f"0 shards written, {len(one) // 3} already done" in io.out, io.out
    err = one_line_error(cli(*args, "--out", "gs://no-such-bucket-here/prep"))
    assert err == ("maxlm: error: gs://no-such-bucket-here/prep: bucket `no-such-bucket-here` does not exist (or is in "
                   "another project); create it, or fix the path")


@pytest.mark.malformed
def test_refusals(raw, tmp_path, capsys):
    out = tmp_path / "out"
    jsonl = raw / "d.jsonl"
    assert run(capsys, jsonl, "--tokenizer", "byte", "--out", out, "--workers", 1)[0] == 0
    meta = (out / "dataset.json").read_bytes()
    err = one_line_error(cli(jsonl, "--tokenizer", "byte", "--out", out, "--field", "body"))
    assert "different field ('text' vs 'body'); use a fresh --out" in err
    hf = make_hf(tmp_path / "tokenizer.json", ["one two six"])
    assert "different tokenizer_sha256 ('byte' vs '" in one_line_error(cli(jsonl, "--tokenizer", hf, "--out", out))
    (tmp_path / "tok.model").write_bytes(b"not a model")
    rc, io = run(capsys, jsonl, "--tokenizer", tmp_path / "tok.model", "--out", out)
    assert rc == 2 and "tok.model does not load as a SentencePiece tokenizer" in io.err
    rc, io = run(capsys, jsonl, "--tokenizer", "byte", "--out", out, "--workers", 1, "--add-bos")
    assert rc == 2 and "different add_bos (False vs True)" in io.err and (out / "dataset.json").read_bytes() == meta
    rc, io = run(capsys, raw / "e.parquet", "--tokenizer", "byte", "--out", tmp_path / "pq", "--field", "body")
    assert rc == 2 and "has no column `body` (columns: text)" in io.err

    bad = tmp_path / "bad"
    err = one_line_error(cli(raw, "--tokenizer", "byte", "--out", bad, "--max-bad-records", 2, "--workers", 1))
    assert "3 bad records exceed --max-bad-records 2" in err and f"first at {raw}/c.txt (invalid_utf8)" in err
    assert not (bad / "dataset.json").exists()
    err = one_line_error(cli(raw, "--tokenizer", "byte", "--out", tmp_path / "strict", "--strict", "--workers", 1))
    assert "--strict" in err and f"{raw}/b.txt (empty)" in err and not (tmp_path / "strict" / "dataset.json").exists()
    err = one_line_error(cli(tmp_path / "nowhere.jsonl", "--tokenizer", "byte", "--out", tmp_path / "x"))
    assert f"{tmp_path}/nowhere.jsonl does not exist" in err


@pytest.mark.malformed
def test_garbage_inputs_and_tokenizers_fail_in_one_line(raw, tmp_path):
    (tmp_path / "g.parquet").write_bytes(np.random.default_rng(0).bytes(4096))
    err = one_line_error(cli(raw / "a.txt", tmp_path / "g.parquet", "--tokenizer", "byte", "--out", tmp_path / "o"))
    assert f"maxlm: error: `INPUT`: {tmp_path}/g.parquet is not a valid Parquet file (" in err
    (tmp_path / "tok.json").write_bytes(np.random.default_rng(1).bytes(512))
    err = one_line_error(cli(raw / "a.txt", "--tokenizer", tmp_path / "tok.json", "--out", tmp_path / "o"))
    assert f"`--tokenizer`: {tmp_path}/tok.json does not load as a Hugging Face tokenizer: " in err
    err = one_line_error(cli(raw / "a.txt", "--tokenizer", "", "--out", tmp_path / "o"))
    assert err == "maxlm: error: `--tokenizer` is empty; set it to byte, a tokenizer.json or a SentencePiece .model"


@pytest.mark.malformed
@pytest.mark.parametrize("flags, message", [
    (["--chunk-mb", "nan"], "--chunk-mb must be a finite number of MiB > 0 (the size of one work unit), got nan"),
    (["--chunk-mb", "inf"], "--chunk-mb must be a finite number of MiB > 0 (the size of one work unit), got inf"),
    (["--chunk-mb", "0"], "--chunk-mb must be a finite number of MiB > 0 (the size of one work unit), got 0.0"),
    (["--max-bad-records", "-1"], "--max-bad-records must be >= 0 (0: no bad record allowed), got -1"),
    (["--workers", "-4"], "--workers must be >= 1 (processes that tokenize), got -4"),
    (["--workers", "0"], "--workers must be >= 1 (processes that tokenize), got 0"),
    (["--workers", "two"], "argument --workers: invalid int value: 'two' (see python -m maxlm.data.prepare --help)"),
    (["--chunk-mb", "big"], "argument --chunk-mb: invalid float value: 'big' (see python -m maxlm.data.prepare --help)"),
    (["--format", "csv"], "argument --format: invalid choice: 'csv' (choose from "),
    (["--bogus"], "unrecognized arguments: --bogus (see python -m maxlm.data.prepare --help)"),
    # an empty --out wrote its shards to the filesystem's root, then exited 0
    (["--out", ""], "argument --out: is empty; give a path (see python -m maxlm.data.prepare --help)"),
])
def test_bad_flags_are_one_line_and_exit_2(raw, tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    rc, io = run(capsys, raw / "d.jsonl", "--tokenizer", "byte", "--out", out, *flags)
    err = io.err.strip()
    assert rc == 2 and err.startswith("maxlm: error: ") and "\n" not in err and message in err, err
    assert not out.exists()


@pytest.mark.malformed
def test_missing_required_flags_and_no_inputs_are_one_line(tmp_path, capsys):
    for args, message in (([tmp_path / "a.txt", "--out", tmp_path / "o"], "the following arguments are required: --tokenizer"),
                          (["--tokenizer", "byte", "--out", tmp_path / "o"], "the following arguments are required: INPUT")):
        rc, io = run(capsys, *args)
        err = io.err.strip()
        assert rc == 2 and err == f"maxlm: error: {message} (see python -m maxlm.data.prepare --help)", err


@pytest.mark.malformed
def test_an_out_that_cannot_be_a_directory_is_one_line(raw, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    ro = tmp_path / "ro"
    ro.mkdir()
    for out, message in ((tmp_path / "file", f"`--out` {tmp_path}/file is a file, not a directory; choose a directory"),
                         ("/dev/null/x", "`--out` /dev/null/x cannot be created (Not a directory); choose a writable directory"),
                         (tmp_path / "file" / "sub", f"`--out` {tmp_path}/file/sub cannot be created (Not a directory)")):
        rc, io = run(capsys, raw / "d.jsonl", "--tokenizer", "byte", "--out", out, "--workers", 1)
        assert rc == 2 and io.err.strip().count("\n") == 0 and f"maxlm: error: {message}" in io.err, io.err
    os.chmod(ro, 0o500)
    try:
        if os.geteuid() == 0:  # root writes anyway: a read-only file system is what refuses root
            pytest.skip("root can write into a mode 0500 directory")
        rc, io = run(capsys, raw / "d.jsonl", "--tokenizer", "byte", "--out", ro / "sub", "--workers", 1)
        assert rc == 2 and f"maxlm: error: `--out` {ro}/sub cannot be created (Permission denied)" in io.err, io.err
    finally:
        os.chmod(ro, 0o700)


@pytest.mark.malformed
def test_an_unwritable_out_is_one_line_before_any_work(raw, tmp_path, capsys, monkeypatch):
    """A directory that exists but takes no file (read-only, or a file system that refuses even root)."""
    out = tmp_path / "out"
    out.mkdir()
    real = Path.write_bytes

    def refuse(self, data):
        if self.name.startswith(".maxlm-write-check-"):
            raise OSError(30, "Read-only file system")
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", refuse)
    rc, io = run(capsys, raw / "d.jsonl", "--tokenizer", "byte", "--out", out, "--workers", 1)
    assert rc == 2 and io.err.strip() == (f"maxlm: error: `--out` {out} is not writable (Read-only file system); choose a "
                                         f"writable directory"), io.err
    assert list(out.iterdir()) == []


@pytest.mark.malformed
def test_a_chunk_that_would_make_too_many_shards_is_refused_before_any_file(tmp_path, capsys):
    data = tmp_path / "big.jsonl"
    data.write_text('{"text": "a line of about fifty bytes, give or take"}\n' * 2500)  # ~125 KB
    out = tmp_path / "out"
    rc, io = run(capsys, data, "--tokenizer", "byte", "--out", out, "--chunk-mb", "1e-9")
    err = io.err.strip()
    assert rc == 2 and err.count("\n") == 0 and not out.exists(), err
    assert err.startswith(f"maxlm: error: --chunk-mb cuts the inputs into {data.stat().st_size:,} work units (of 1 bytes), "
                          f"more than the 100,000 shards one --out holds; raise --chunk-mb to at least "), err
    # The hint is enough: a chunk that size makes at most 100,000 units.
    at_least = float(err.rsplit(" ", 1)[1])
    assert -(-data.stat().st_size // int(at_least * 2**20)) <= 100_000


@pytest.mark.malformed
@pytest.mark.parametrize("name, content, message", [
    ("empty.jsonl", b"", "the 1 input file(s) hold no documents at all; check INPUT"),
    ("blank.jsonl", b"\n\n   \n", "every document of the 1 input file(s) was skipped (empty 3 (first {d}/blank.jsonl:1)); "),
    ("blank.txt", b"\n \n", "was skipped (empty 1 (first {d}/blank.txt)); "),
    ("binary.txt", bytes(np.random.default_rng(0).integers(128, 256, 200_000, dtype=np.uint8)),
     "was skipped (invalid_utf8 1 (first {d}/binary.txt)); "),
    ("numbers.jsonl", b'{"text": 5}\n{"text": ["x"]}\n{"text": null}\n',
     "was skipped (missing_field 1 (first {d}/numbers.jsonl:3), not_text 2 (first {d}/numbers.jsonl:1)); fix the "
     "input, or the flags that read it (--format by "
     "suffix, --field text)"),
])
def test_no_documents_is_exit_2_naming_what_was_skipped(tmp_path, capsys, name, content, message):
    d = tmp_path / "in"
    d.mkdir()
    (d / name).write_bytes(content)
    out = tmp_path / "out"
    rc, io = run(capsys, d / name, "--tokenizer", "byte", "--out", out, "--workers", 1)
    err = io.err.strip()
    assert rc == 2 and err.startswith("maxlm: error: ") and "\n" not in err and message.format(d=d) in err, err
    assert not (out / "dataset.json").exists()


@pytest.mark.malformed
def test_invalid_utf8_counts_toward_max_bad_records(tmp_path, capsys):
    data = tmp_path / "mixed.jsonl"
    data.write_bytes(b'{"text": "good"}\n' + b'{"text": "\xff\xfe"}\n' * 3)
    rc, io = run(capsys, data, "--tokenizer", "byte", "--out", tmp_path / "out", "--workers", 1, "--max-bad-records", 2)
    err = io.err.strip()
    assert rc == 2 and "\n" not in err and err.startswith(
        f"maxlm: error: 3 bad records exceed --max-bad-records 2, first at {data}:2 (invalid_utf8)"), err
    rc, io = run(capsys, data, "--tokenizer", "byte", "--out", tmp_path / "out", "--workers", 1, "--max-bad-records", 3)
    assert rc == 0 and "invalid_utf8 3 (first " in io.out, io.err


def _workers(pid: int) -> list[int]:
    """The pids of `pid`'s spawned pool workers (not multiprocessing's resource tracker)."""
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return [k for k in kids if "spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes().decode(errors="replace")]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def slow_input(tmp_path):
    """~5.6 MB of JSONL in 11 units for a trained BPE tokenizer: seconds of work for 2 workers."""
    words = [f"w{i}x{i * 7 % 13}" for i in range(2000)]
    tok = make_hf(tmp_path / "tokenizer.json", [" ".join(words[i:i + 50]) for i in range(0, 2000, 50)])
    rng = np.random.default_rng(0)
    line = lambda: json.dumps({"text": " ".join(rng.choice(words, 120))}) + "\n"  # noqa: E731
    (tmp_path / "big.jsonl").write_text("".join(line() for _ in range(6000)))
    return [tmp_path / "big.jsonl", "--tokenizer", tok, "--chunk-mb", "0.5", "--workers", 2]


def _start(args, out):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-m", "maxlm.data.prepare", *map(str, args), "--out", str(out)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _when_working(p, timeout=60.0) -> list[int]:
    import time

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        kids = _workers(p.pid)
        if len(kids) == 2:
            time.sleep(1.0)  # into their first units
            return kids
        assert p.poll() is None, p.communicate()
        time.sleep(0.05)
    raise AssertionError("no workers started")


@pytest.mark.malformed
def test_a_killed_worker_ends_prepare_in_one_line_and_a_rerun_resumes(slow_input, tmp_path):
    import signal

    out = tmp_path / "out"
    p = _start(slow_input, out)
    kids = _when_working(p)
    os.kill(kids[0], signal.SIGKILL)
    _, err = p.communicate(timeout=60)
    lines = err.strip().splitlines()
    assert p.returncode == 5 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"maxlm: error: a worker process died with its unit unfinished (pid {kids[0]} killed by "
                               f"SIGKILL; SIGKILL is often the out-of-memory killer"), err
    assert lines[0].endswith("the finished shards are kept: re-run the same command to resume")
    assert not any(_alive(k) for k in kids) and not (out / "dataset.json").exists()
    done = len(list(out.glob("*.stats.json")))
    units = -(-slow_input[0].stat().st_size // 2**19)
    r = _start(slow_input, out)
    o, err = r.communicate(timeout=120)
    assert r.returncode == 0 and f"{units - done} shards written, {done} already done" in o, o + err


@pytest.mark.malformed
def test_sigterm_stops_prepare_and_its_workers_in_one_line(slow_input, tmp_path):
    import signal

    p = _start(slow_input, tmp_path / "out")
    kids = _when_working(p)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143 and err.strip() == ("maxlm: stopped by SIGTERM (the workers are stopped; finished shards "
                                                   "are kept: re-run the same command to resume)"), err
    assert not any(_alive(k) for k in kids)
