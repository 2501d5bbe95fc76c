"""Tokenize raw text/JSONL/Parquet once into token shards that `PreparedSource` reads (data.source=prepared).

    python -m maxlm.data.prepare INPUT... --tokenizer SPEC --out DIR [--format text|jsonl|parquet|chat|preference]
        [--field text] [--chat-template SPEC] [--add-bos] [--add-eos] [--workers N] [--chunk-mb 64] [--strict]
        [--max-bad-records 1000] [--shard I/N]

Why: training on raw text re-tokenizes every epoch and cannot know document lengths up front; tokens
on disk make every document addressable at random with its length known, so packed rows can be
shuffled without a scan.

DIR (local, or gs://BUCKET/PATH: each file is written locally, then uploaded whole) holds, per work
unit K (a text file; the JSONL lines that start in one chunk-mb byte range; a group of Parquet row
groups): `shard-K.tokens` (every kept document's ids back to back, as `dtype`, BOS/EOS already
added), `shard-K.offsets.npy` (int64: where each document starts, then the end), for chat and
preference records (JSONL, rendered by --chat-template as data.format=chat|preference renders them)
`shard-K.mask` (a byte per token, 1 where it is trained; a preference record is two documents,
prompt+chosen then prompt+rejected) and
`shard-K.stats.json` (counts, skips, the unit's input range and this call's args). The stats file is
written last and is the unit's completion marker, so a killed run resumes where it stopped and a finished one re-runs as a no-op.
`dataset.json` (format maxlm-tokens-v2: tokenizer, dtype, shards in unit order with the (input, target)
pairs of each block of `block_docs` documents, which lets the loader plan epochs without reading a
length, and totals) is written last of all, from the stats files; its absence means "not finished".
Units depend only on the sorted inputs, format and chunk size, never on worker count, host count
(--shard) or timing, so the output is reproducible byte for byte.
"""

import json
import math
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from types import SimpleNamespace

import numpy as np
from etils import epath

from maxlm import cli, storage
from maxlm.errors import ConfigError
from maxlm.data import chat, tokenizer
from maxlm.data.sources import (BAD_RECORDS, BLOCK_DOCS, FORMAT, block_pairs, SKIPS, SUFFIXES, decode, lines_from, locate, parquet_meta,
                                parquet_rows, parse_jsonl, parse_record, parse_value, relocate, resolve)

_W = {}  # per-process state: the tokenizer is loaded once per worker, not once per unit
ENCODE_BATCH = 256  # documents per tokenizer call


RECORDS = ("chat", "preference")  # --format values whose JSONL lines are records, rendered by a chat template
MAX_SHARDS = 100_000  # shard-00000 .. shard-99999: more would outgrow the names' width (and a directory's listing)


def _kind(path: str, fmt: str | None) -> str:
    if fmt in RECORDS:
        return "jsonl"
    return fmt or next((k for k, s in SUFFIXES.items() if s and path.endswith(s)), "text")


def _facts(path: str, fmt: str | None, field: str) -> tuple[str, object]:
    """What planning needs of one file: its kind, and its size (Parquet: its row groups' sizes, from the footer)."""
    kind = _kind(path, fmt)
    if kind != "parquet":
        return kind, epath.Path(path).stat().length
    meta = parquet_meta(path, field, key="INPUT", field_key="--field")
    return kind, [meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)]


def plan(files: list[str], fmt: str | None, field: str, chunk: int) -> list[dict]:
    """The work units, in the order that numbers the shards. Only sizes and Parquet footers are read, 16 files
    at a time (on gs:// each is a request): a JSONL unit is the lines that start in one `chunk` of bytes (as the
    loader reads JSONL)."""
    with ThreadPoolExecutor(16) as pool:  # map raises the first bad file's error, in the files' order
        facts = list(pool.map(lambda path: _facts(path, fmt, field), files))
    _check_unit_count(facts, chunk)
    units = []
    for path, (kind, size) in zip(files, facts):
        if kind == "text":
            units.append(dict(kind=kind, file=path, a=0, b=0, size=size, input=path))
        elif kind == "jsonl":
            for a in range(0, size, chunk):
                b = min(a + chunk, size)
                units.append(dict(kind=kind, file=path, a=a, b=b, size=b - a, input=f"{path} lines from bytes {a}-{b}"))
        else:
            g0, total = 0, 0
            for g, group in enumerate(size):
                total += group
                if total >= chunk or g == len(size) - 1:
                    units.append(dict(kind=kind, file=path, a=g0, b=g + 1, size=total,
                                      input=f"{path} row groups {g0}-{g + 1}"))
                    g0, total = g + 1, 0
    return units


def _check_unit_count(facts: list[tuple[str, object]], chunk: int) -> None:
    """Refuse, before listing them, more work units than one --out holds shards (--chunk-mb 1e-9 would make a
    shard of every byte: hundreds of thousands of files)."""
    def groups(sizes):  # a Parquet file's units: row groups gathered until they reach `chunk` bytes
        n, total = 0, 0
        for g, size in enumerate(sizes):
            total += size
            if total >= chunk or g == len(sizes) - 1:
                n, total = n + 1, 0
        return n

    n = sum(1 if kind == "text" else -(-size // chunk) if kind == "jsonl" else groups(size) for kind, size in facts)
    if n <= MAX_SHARDS:
        return
    fixed = sum(1 if kind == "text" else len(size) if kind == "parquet" else 0 for kind, size in facts)
    jsonl = [size for kind, size in facts if kind == "jsonl"]
    room = MAX_SHARDS - fixed - len(jsonl)  # each JSONL file's last unit may be a short one
    if room > 0:
        least = -(-sum(jsonl) // room)  # bytes per unit
        step = 10.0 ** (math.floor(math.log10(least / 2**20)) - 2)  # 3 significant digits, rounded up
        mb = math.ceil(least / 2**20 / step) * step
        while int(mb * 2**20) < least:  # still enough after float rounding
            mb += step
        hint = f"raise --chunk-mb to at least {mb:.3g}"
    else:
        hint = (f"the {fixed:,} text files and Parquet row groups are a unit each at least: merge some inputs, or split "
                f"them over several --out directories")
    raise ConfigError(f"--chunk-mb cuts the inputs into {n:,} work units (of {chunk:,} bytes), more than the "
                      f"{MAX_SHARDS:,} shards one --out holds; {hint}")


def _documents(u: dict):
    """(text, skip, where) for every document of a unit; a JSONL line's where is `file:@OFFSET`."""
    if u["kind"] == "text":
        with epath.Path(u["file"]).open("rb") as f:
            yield *decode(f.read()), u["file"]
    elif u["kind"] == "jsonl":
        with epath.Path(u["file"]).open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            for line, where in lines_from(f, u["file"], u["a"], u["b"], size):
                yield *(parse_record(line) if _W["encoder"] else parse_jsonl(line, _W["field"])), where
    else:
        for g in range(u["a"], u["b"]):
            for r, value in enumerate(parquet_rows(u["file"], g, _W["field"])):
                yield *parse_value(value), f"{u['file']}:row group {g} row {r}"


def _init(spec: str, field: str, add_bos: bool, add_eos: bool, dtype: str, out: str, stage: str, args: dict,
          encoder: chat.Encoder | None):
    # A shard is written to local disk (`stage`), then put in place whole: renamed beside its final name,
    # or, for a gs:// --out, uploaded from a temporary directory of this run's.
    _W.update(tok=tokenizer.load(spec, "--tokenizer"), field=field, add_bos=add_bos, add_eos=add_eos, dtype=np.dtype(dtype),
              out=out, stage=stage, args=args, encoder=encoder)


def _init_worker(*init):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: one message, not N tracebacks
    _init(*init)


def _write_json(path: str, obj) -> None:
    storage.write(path, json.dumps(obj, indent=1) + "\n")


def _read_json(path: str):
    text = storage.read_text(path)
    return None if text is None else json.loads(text)


def _run_unit(job: tuple[int, dict]) -> tuple[int, dict]:
    k, u = job
    name = f"shard-{k:05d}"
    stage = f"{_W['stage']}/{name}"
    toks, offs, masks = f"{stage}.tokens.tmp", f"{stage}.offsets.npy.tmp", f"{stage}.mask.tmp"
    skipped, first, lengths, texts = dict.fromkeys(SKIPS, 0), {}, [], []
    encoder = _W["encoder"]

    def flush(w, m):  # a batch tokenizer call (a Hugging Face tokenizer encodes on every core at once)
        if encoder is None:
            ids = tokenizer.document_ids_batch(_W["tok"], texts, _W["add_bos"], _W["add_eos"])
        else:  # records: a chat record is one document, a preference record two (prompt+chosen, prompt+rejected)
            try:
                enc = encoder(_W["tok"], texts)
            except ConfigError as e:
                raise ConfigError(relocate(str(e), [where for _, where in texts])) from None
            seqs = [(d["tokens"], d["mask"]) for d in enc] if encoder.fmt == "chat" else \
                [s for d in enc for s in ((d["tokens"], d["mask"]), (d["rejected"], d["rejected_mask"]))]
            ids = [x for x, _ in seqs]
            if seqs:
                m.write(np.concatenate([y for _, y in seqs]).astype(np.uint8).tobytes())
        if ids:
            w.write(np.concatenate(ids).astype(_W["dtype"]).tobytes())
        lengths.extend(len(d) for d in ids)
        texts.clear()

    with open(toks, "wb") as w, open(masks if encoder else os.devnull, "wb") as m:
        for text, skip, where in _documents(u):
            if skip:
                skipped[skip] += 1
                first.setdefault(skip, where)  # insertion order = order of occurrence: the first key is the first skip
            else:
                texts.append((text, where) if encoder else text)
                if len(texts) == ENCODE_BATCH:
                    flush(w, m)
        flush(w, m)
    first = {r: locate(where) for r, where in first.items()}  # a JSONL line's number, counted now
    with open(offs, "wb") as f:  # a file object: np.save would append .npy to a .tmp name
        np.save(f, np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64))
    storage.put(toks, storage.join(_W["out"], f"{name}.tokens"))
    storage.put(offs, storage.join(_W["out"], f"{name}.offsets.npy"))
    if encoder:
        storage.put(masks, storage.join(_W["out"], f"{name}.mask"))
    st = dict(docs=len(lengths), tokens=int(sum(lengths)), blocks=block_pairs(lengths, BLOCK_DOCS).tolist(), skipped=skipped,
              first_skip=first, input=u["input"], args=_W["args"])
    _write_json(storage.join(_W["out"], f"{name}.stats.json"), st)  # written last: the shard is done
    return k, st


def _finished(out: str, names: list[str], n_units: int) -> dict[int, dict]:
    """The stats of the units that are done (their stats file, written last, is there)."""
    return {k: _read_json(storage.join(out, f"shard-{k:05d}.stats.json")) for k in range(n_units)
            if f"shard-{k:05d}.stats.json" in names}


def _fatal(stats: dict, strict: bool, max_bad: int, n: int) -> ConfigError:
    """Too many bad records (or, with --strict, any skip): name the first in unit order among finished units."""
    reasons = SKIPS if strict else BAD_RECORDS
    loc, why = next((v, r) for k in sorted(stats) for r, v in stats[k]["first_skip"].items() if r in reasons)
    if strict:
        return ConfigError(f"--strict: {n} document(s) skipped, first at {loc} ({why}); fix the input or drop --strict")
    return ConfigError(f"{n} bad records exceed --max-bad-records {max_bad}, first at {loc} ({why}); fix the "
                       f"input or raise --max-bad-records (finished shards are kept; re-run resumes)")


def _no_documents(stats: dict, n_files: int, a) -> ConfigError:
    """Every document was skipped: the counts per reason and the first of each."""
    skipped = {r: sum(st["skipped"][r] for st in stats.values()) for r in SKIPS}
    first = {r: next(st["first_skip"][r] for _, st in sorted(stats.items()) if r in st["first_skip"])
             for r in SKIPS if skipped[r]}
    if not first:
        return ConfigError(f"the {n_files} input file(s) hold no documents at all; check INPUT")
    why = ", ".join(f"{r} {skipped[r]} (first {first[r]})" for r in first)
    how = f"--format {a.format or 'by suffix'}, --field {a.field}"
    return ConfigError(f"no documents written: every document of the {n_files} input file(s) was skipped ({why}); fix "
                       f"the input, or the flags that read it ({how})")


def _refuse_mismatch(out: str, names: list[str], args: dict, files: list[str], units: list[dict]) -> None:
    def differ(old_args: dict) -> list[str]:
        if old_args.get("layout") != args["layout"]:  # an older maxlm's shards (v1: ArrayRecord) cannot be mixed in
            return [f"layout ({old_args.get('layout') or 'maxlm-tokens-v1, ArrayRecord shards'}; this maxlm writes "
                    f"{args['layout']})"]
        return [f"{k} ({old_args.get(k)!r} vs {args[k]!r})" for k in args if old_args.get(k) != args[k]]

    what = []
    if "dataset.json" in names:
        old = _read_json(storage.join(out, "dataset.json"))
        what = differ(old.get("args", {})) + (["inputs"] if old.get("inputs") != files else [])
    for name in (n for n in names if n.startswith("shard-") and n.endswith(".stats.json")):
        if what:
            break
        k, st = int(name.split(".")[0][6:]), _read_json(storage.join(out, name))
        what = differ(st.get("args", {})) or ([] if k < len(units) and st.get("input") == units[k]["input"]
                                              else [f"inputs ({name} is {st.get('input')})"])
    if what:
        raise ConfigError(f"--out {out} was prepared with different {', '.join(what)}; use a fresh --out")


def main(argv=None) -> int:
    ap = cli.Parser(prog="python -m maxlm.data.prepare", description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="+", metavar="INPUT", help="files, directories or globs (local or gs://)")
    ap.add_argument("--tokenizer", required=True, help="`byte`, a tokenizer.json or a SentencePiece .model")
    ap.add_argument("--out", required=True, type=cli.path, help="output directory, local or gs://")
    ap.add_argument("--format", choices=("text", "jsonl", "parquet", *RECORDS),
                    help="default: by suffix, per file; chat and preference read JSONL records (as data.format does)")
    ap.add_argument("--field", default="text", help="the JSONL key / Parquet column holding the text")
    ap.add_argument("--chat-template", default="", metavar="SPEC",
                    help="chat/preference: chatml, llama3, a .jinja file, or '' (default) for the tokenizer's own")
    ap.add_argument("--add-bos", action="store_true")
    ap.add_argument("--add-eos", action="store_true")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--chunk-mb", type=float, default=64.0, help="target size of one work unit / shard")
    ap.add_argument("--strict", action="store_true", help="any skipped document is fatal")
    ap.add_argument("--max-bad-records", type=int, default=1000,
                    help="invalid_utf8 + bad_json + missing_field + not_text documents allowed in total")
    ap.add_argument("--shard", default="0/1", metavar="I/N",
                    help="this host's share of the work units (every N-th from the I-th), hosts writing to one --out")
    term = signal.signal(signal.SIGTERM, _on_sigterm) if threading.current_thread() is threading.main_thread() else None
    try:
        return _prepare(ap.parse_args(argv))
    except ConfigError as e:
        print(f"maxlm: error: {e}", file=sys.stderr)
        return 2
    except storage.StorageError as e:  # a write that failed (disk full, permissions, GCS): worth a retry
        print(f"maxlm: error: {e}", file=sys.stderr)
        return 4
    except WorkerLost as e:
        print(f"maxlm: error: {e}", file=sys.stderr)
        return 5
    except KeyboardInterrupt:
        print("maxlm: interrupted (finished shards are kept; re-run resumes)", file=sys.stderr)
        return 130
    except Terminated:
        print("maxlm: stopped by SIGTERM (the workers are stopped; finished shards are kept: re-run the same command to "
              "resume)", file=sys.stderr)
        return 143
    finally:
        if term is not None:
            signal.signal(signal.SIGTERM, term)


def _template(a, files: list[str]):
    """--format chat|preference: the chat template, loaded and checked as the trainer's preflight does; None else."""
    if a.format not in RECORDS:
        if a.chat_template:
            raise ConfigError("--chat-template renders chat and preference records; add --format chat or preference")
        return None
    if a.add_bos or a.add_eos:
        raise ConfigError(f"--add-bos/--add-eos with --format {a.format}: the chat template writes the special tokens "
                          f"itself; drop them")
    other = next((f for f in files if not f.endswith(".jsonl")), None)
    if other:
        raise ConfigError(f"--format {a.format} reads JSONL records (one JSON object per line), but {other} is not a "
                          f".jsonl file; convert it, or pass only .jsonl inputs")
    try:
        template = chat.load_template(SimpleNamespace(chat_template=a.chat_template, tokenizer=a.tokenizer))
        chat.check_template(template)
    except ConfigError as e:  # said in the trainer's keys: name this command's flags
        raise ConfigError(str(e).replace("data.chat_template", "--chat-template").replace("data.tokenizer", "--tokenizer")) \
            from None
    return template


def _check_flags(a) -> None:
    """The numbers argparse takes as given: finite, in range."""
    if not math.isfinite(a.chunk_mb) or a.chunk_mb <= 0:
        raise ConfigError(f"--chunk-mb must be a finite number of MiB > 0 (the size of one work unit), got {a.chunk_mb}")
    if a.workers < 1:
        raise ConfigError(f"--workers must be >= 1 (processes that tokenize), got {a.workers}")
    if a.max_bad_records < 0:
        raise ConfigError(f"--max-bad-records must be >= 0 (0: no bad record allowed), got {a.max_bad_records}")


def _prepare(a) -> int:
    from tqdm import tqdm

    _check_flags(a)
    host, hosts = _host_share(a.shard)
    files = sorted(resolve(a.inputs, key="INPUT"))  # argument order must not change the dataset
    template = _template(a, files)
    tok = tokenizer.load(a.tokenizer, "--tokenizer")
    tokenizer.document_ids(tok, "", a.add_bos, a.add_eos)  # a missing BOS/EOS fails now, not in every worker
    sha = tokenizer.fingerprint(a.tokenizer)  # what the loader checks data.tokenizer against
    dtype = "uint16" if tokenizer.ids_needed(tok, a.add_bos, a.add_eos) <= 65536 else "int32"
    args = dict(layout=FORMAT, format=a.format, field=a.field, add_bos=a.add_bos, add_eos=a.add_eos, chunk_mb=a.chunk_mb,
                tokenizer_sha256=sha)
    if template is not None:
        args["chat_template_sha256"] = template.sha256
    units = plan(files, a.format, a.field, max(1, int(a.chunk_mb * 2**20)))
    out = a.out.rstrip("/")
    if storage.is_gcs(out):
        storage.check_writable("--out", out)  # a missing credential, bucket or permission: one line, now
    else:
        storage.make_dir("--out", out)  # a file, an unwritable or uncreatable directory: one line, now
    names = storage.listdir(out)  # one listing: which shards are done, and what a killed run left
    _refuse_mismatch(out, names, args, files, units)
    mine = [k for k in range(len(units)) if k % hosts == host]
    own = tuple(f"shard-{k:05d}." for k in mine)
    for name in names:  # a killed run's leftovers (their units have no stats marker and are redone); not other hosts'
        if ".tmp" in name and name.startswith(own):
            storage.remove(storage.join(out, name))
    stats = _finished(out, names, len(units))
    n_done = len(stats)
    if n_done:
        print(f"{n_done} of {len(units)} shards already done")
    limit = 0 if a.strict else a.max_bad_records
    n_bad = lambda st: sum(st["skipped"][r] for r in (SKIPS if a.strict else BAD_RECORDS))  # noqa: E731
    bad = sum(n_bad(st) for st in stats.values())

    def fail():  # an earlier, laxer run's dataset.json must not outlive a failed check of the same data
        storage.remove(storage.join(out, "dataset.json"))
        return _fatal(stats, a.strict, a.max_bad_records, bad)

    if bad > limit:
        raise fail()
    todo = [(k, units[k]) for k in mine if k not in stats]
    stage = tempfile.mkdtemp(prefix="maxlm-prepare-") if storage.is_gcs(out) else out
    encoder = chat.Encoder(a.format, template) if template is not None else None
    init = (a.tokenizer, a.field, a.add_bos, a.add_eos, dtype, out, stage, args, encoder)
    t0, docs, toks = time.perf_counter(), 0, 0
    bar = tqdm(total=sum(u["size"] for _, u in todo), unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
               disable=True if not todo else None, desc="prepare")
    results = _units(todo, init, a.workers)
    try:
        for k, st in results:
            stats[k] = st
            docs, toks = docs + st["docs"], toks + st["tokens"]
            bar.set_postfix(docs=f"{docs:,}", tok_s=f"{toks / (time.perf_counter() - t0):.3g}", refresh=False)
            bar.update(units[k]["size"])
            bad += n_bad(st)
            if bad > limit:  # stop early: a broken input should not cost a full pass to find out
                raise fail()
    finally:
        results.close()
        bar.close()
        if stage != out:
            shutil.rmtree(stage, ignore_errors=True)
    dt = time.perf_counter() - t0

    # Every host's shards, as the other hosts have finished them: the last host to finish writes
    # dataset.json (two finishing at once write the same bytes).
    stats = _finished(out, storage.listdir(out), len(units))
    if len(stats) < len(units):
        print(f"{out}: shard {a.shard} done: {len(todo)} shards written, {toks:,} tokens in {dt:.1f} s; "
              f"{len(units) - len(stats)} of {len(units)} shards are other hosts' still, and the last to finish "
              f"writes dataset.json")
        return 0
    bad = sum(n_bad(st) for st in stats.values())
    if bad > limit:  # the budget is the job's, over every host's shards
        raise fail()
    if not sum(st["docs"] for st in stats.values()):  # nothing to train on is a mistake, not a dataset
        storage.remove(storage.join(out, "dataset.json"))
        raise _no_documents(stats, len(files), a)
    meta = _manifest(a, tok, sha, dtype, template, [stats[k] for k in range(len(units))], files, args)
    path = storage.join(out, "dataset.json")
    if _read_json(path) != meta:  # a no-op re-run leaves even the mtime alone
        _write_json(path, meta)
    st = meta["stats"]
    print(f"{out}: {st['documents']:,} documents, {st['tokens']:,} tokens ({dt:.1f} s for {toks:,} new tokens: "
          f"{toks / max(dt, 1e-9):,.0f} tokens/s); {len(todo)} shards written, {n_done} already done")
    print("skipped: " + ", ".join(f"{r} {n}" + (f" (first {st['first_skip'][r]})" if n else "")
                                  for r, n in st["skipped"].items()))
    return 0


class WorkerLost(Exception):
    """A worker process died (killed, out of memory, crashed) with its unit unfinished."""


class Terminated(BaseException):
    """SIGTERM: raised in the main thread, so the workers are stopped and the finished shards kept."""


def _on_sigterm(signum, frame):
    raise Terminated()


def _units(todo, init, workers: int):
    """(k, stats) of each unit in `todo`, as it finishes: from a pool of spawned workers, or from this process.
    concurrent.futures, not multiprocessing.Pool: a Pool whose worker is killed replaces it and waits forever for
    the unit it had; the executor says the pool is broken, and this says which worker died and how."""
    if workers > 1 and len(todo) > 1:
        pool = ProcessPoolExecutor(min(workers, len(todo)), mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker, initargs=init)
        procs = {}
        try:
            futures = [pool.submit(_run_unit, job) for job in todo]
            procs = dict(getattr(pool, "_processes", None) or {})
            for f in as_completed(futures):
                procs.update(getattr(pool, "_processes", None) or {})
                yield f.result()
        except BrokenProcessPool:
            procs.update(getattr(pool, "_processes", None) or {})
            pool.shutdown(wait=True, cancel_futures=True)  # its manager reaps the dead, and ends the rest with SIGTERM
            dead = [(pid, p.exitcode) for pid, p in procs.items() if p.exitcode not in (None, 0)]
            dead = [(pid, c) for pid, c in dead if c != -signal.SIGTERM] or dead
            how = ", ".join(f"pid {pid} " + (f"killed by {signal.Signals(-c).name}" if c < 0 else f"exit code {c}")
                            for pid, c in dead) or "a worker"
            raise WorkerLost(f"a worker process died with its unit unfinished ({how}; SIGKILL is often the "
                             f"out-of-memory killer: fewer --workers or a smaller --chunk-mb use less memory); the "
                             f"finished shards are kept: re-run the same command to resume") from None
        finally:  # after an error or a signal, stop the other units now; finished ones keep their markers
            procs.update(getattr(pool, "_processes", None) or {})
            for p in procs.values():
                if p.is_alive():
                    p.kill()
            pool.shutdown(wait=True, cancel_futures=True)
    else:
        _init(*init)
        yield from map(_run_unit, todo)


def _host_share(shard: str) -> tuple[int, int]:
    """--shard I/N: this host's index and the number of hosts sharing the work."""
    i, _, n = shard.partition("/")
    if not (i.isdigit() and n.isdigit() and int(i) < int(n)):
        raise ConfigError(f"--shard must be I/N with 0 <= I < N (this host's share of the work), e.g. 0/4; got {shard}")
    return int(i), int(n)


def _manifest(a, tok, sha, dtype, template, done, files, args) -> dict:
    """dataset.json: the tokenizer and options the loader checks, every shard's counts, and the skips."""
    skipped = {r: sum(s["skipped"][r] for s in done) for r in SKIPS}
    first = {r: next(s["first_skip"][r] for s in done if r in s["first_skip"]) for r in SKIPS if skipped[r]}
    meta = {"format": FORMAT,
            "tokenizer": {"spec": a.tokenizer, "name": tok.name, "vocab_size": tok.vocab_size, "bos_id": tok.bos_id,
                          "eos_id": tok.eos_id, "sha256": sha},
            "add_bos": a.add_bos, "add_eos": a.add_eos, "dtype": dtype,
            "block_docs": BLOCK_DOCS,
            "shards": [{"file": f"shard-{k:05d}.tokens", "offsets": f"shard-{k:05d}.offsets.npy",
                        **({"mask": f"shard-{k:05d}.mask"} if template is not None else {}),
                        "docs": s["docs"], "tokens": s["tokens"], "input": s["input"], "blocks": s["blocks"]}
                       for k, s in enumerate(done)],
            "stats": {"documents": sum(s["docs"] for s in done), "tokens": sum(s["tokens"] for s in done),
                      "skipped": skipped, "first_skip": first},
            "inputs": files, "args": args}
    if template is not None:  # what the loader checks data.format and data.chat_template against
        meta.update(records=a.format, chat_template={"name": template.name, "sha256": template.sha256})
    return meta


if __name__ == "__main__":
    code = main()
    # Everything is written (each file replaced into place) and said. Leave without the interpreter's
    # teardown: there, about 1 run in 15 that had read Parquet aborted (exit 134, "terminate called
    # without an active exception", a C++ thread still joinable), seen with 3 runs at once on 2 cores.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
