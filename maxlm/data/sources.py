"""Document sources: where documents come from, addressed by index, and what was wrong with the bad ones.

Two kinds:
- *text* sources (`text`, `jsonl`, `parquet`) hold raw documents, read a unit at a time (a file, the
  lines that start in one MiB of a JSONL file, the row groups that start in one MiB of a Parquet file).
  `read_unit(u)` returns its documents as `(text, skip, where)`: the text, or None and the reason it was
  skipped (one of SKIPS), and where it is.
- *token* sources (`prepared` by `maxlm.data.prepare`, `synthetic`, `pydoc`) hold tokenized
  documents and know every document's length up front, which lets the loader address packed rows at
  random (see order.py). `tokens(i)` returns int32 ids, and `spans` ids a..z of documents i (which
  have n) for many (i, n, a, z) at once: a prepared source reads only those, in parallel on gs://.
  They come in blocks of up to BLOCK_DOCS documents in storage order (never across a shard's end): `blocks` holds each block's first document,
  its document count and its (input, target) pairs, known up front; `block_lengths(b)` reads one
  block's document lengths. Nothing per document is held.

A `text` document is one whole file; a `jsonl` document is one line's `data.field` (with `records`, for
data.format chat and preference, the line's whole JSON value: maxlm.data.chat reads it); a `parquet`
document is one row's `data.field` column. Paths are local or `gs://` (via etils.epath), a file, a directory (all
files in it), a glob, or a list of those.
"""

import bisect
import functools
import glob as globlib
import io
import json
import os
import stat
import threading
from pathlib import Path

import numpy as np
import yaml
from etils import epath

from maxlm import storage
from maxlm.errors import ConfigError

SKIPS = ("empty", "invalid_utf8", "bad_json", "missing_field", "not_text")
BAD_RECORDS = ("invalid_utf8", "bad_json", "missing_field", "not_text")  # broken, not just empty: what max_bad_records budgets
TOKEN_KINDS = ("prepared", "synthetic", "pydoc")
SUFFIXES = {"text": None, "jsonl": (".jsonl", ".json"), "parquet": (".parquet",)}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zip", ".lz4")
BLOCK_DOCS = 4096  # documents per block of a token source: 32 KiB of lengths, read in one request


def block_pairs(lengths: np.ndarray, per: int = BLOCK_DOCS) -> np.ndarray:
    """The (input, target) pairs of each block of `per` documents of one shard whose documents have `lengths`."""
    pairs = np.maximum(np.asarray(lengths, np.int64) - 1, 0)
    return np.add.reduceat(pairs, np.arange(0, len(pairs), per)) if len(pairs) else pairs


def blocks_of(pairs: np.ndarray, docs: int, first: int = 0, per: int = BLOCK_DOCS) -> np.ndarray:
    """(first document, documents, pairs) of each block of one shard of `docs` documents, from its
    blocks' `pairs`."""
    starts = np.arange(len(pairs), dtype=np.int64) * per
    return np.stack([first + starts, np.minimum(starts + per, docs) - starts, pairs], 1).astype(np.int64).reshape(-1, 3)


@functools.lru_cache(maxsize=4096)
def _npy_layout(path: str) -> tuple[int, np.dtype]:
    """Where a .npy file's data starts, and its dtype: read once per file."""
    f = io.BytesIO(storage.read_range(path, 0, 4096))  # numpy pads its headers to 64 bytes; ours are one line
    header = np.lib.format.read_array_header_1_0 if np.lib.format.read_magic(f) == (1, 0) else \
        np.lib.format.read_array_header_2_0
    _, _, dtype = header(f)
    return f.tell(), dtype


def read_npy_range(path: str, lo: int, hi: int) -> np.ndarray:
    """Entries lo..hi of a 1-d .npy file, in one ranged read (local or gs://)."""
    start, dtype = _npy_layout(path)
    raw = storage.read_range(path, start + lo * dtype.itemsize, start + hi * dtype.itemsize)
    return np.frombuffer(raw, dtype).astype(np.int64)


def _has_glob(s: str) -> bool:
    return any(c in s for c in "*?[")


def resolve(spec, key: str = "data.path", suffixes: tuple | None = None, dirs: bool = False) -> list[str]:
    """Expand a path, directory, glob or list of them into a sorted, de-duplicated list of files (with
    `dirs`, of directories: a directory is kept whole). A missing path or an empty glob fails, naming
    everything that was searched; so does a list item that is not a non-empty string."""
    items = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    if not items or items == [""]:
        raise ConfigError(f"`{key}` is empty; set it to a file, directory, glob or list of them")
    for n, item in enumerate(items, 1):
        what = f"item {n} of the list" if len(items) > 1 or isinstance(spec, (list, tuple)) else "it"
        if not isinstance(item, str):
            quoted = ", ".join(repr(str(v)) for v in items)
            raise ConfigError(f"`{key}`: {what} is {item!r} ({type(item).__name__}), not a path; write every path as "
                              f"a string: {key}=[{quoted}]")
        if not item.strip():  # Path("") is the current directory: it would read everything there
            raise ConfigError(f"`{key}`: {what} is an empty string; remove it or name a file, directory or glob")
    files, searched = [], []
    for item in items:
        if item.startswith("gs://"):
            storage.check_bucket(key, item)  # a bad name is no bucket at all: say so, not "matches no file"
            storage.check_credentials_file()  # gcsfs would fail on it in its own words
            found = _gcs_files(item, key, suffixes, dirs)
        elif _has_glob(item):
            found = sorted(p for p in globlib.glob(item, recursive=True) if (Path(p).is_dir() if dirs else Path(p).is_file()))
        elif dirs:
            found = [item] if Path(item).is_dir() else []
        elif Path(item).is_dir():
            found = sorted(str(p) for p in Path(item).rglob("*") if p.is_file() and not p.name.startswith("."))
            if suffixes:
                found = [f for f in found if f.endswith(suffixes)]
        elif Path(item).is_file():
            found = [item]
        else:
            found = []
        searched.append(item)
        if not found:
            raise ConfigError(f"`{key}`: {_none_found(item, key, suffixes, dirs, searched)}")
        files += found
    packed = next((f for f in files if f.endswith(COMPRESSED)), None)
    if packed:  # else every line of it is "invalid UTF-8", and the fix named is the wrong one
        raise ConfigError(f"`{key}`: {packed} is compressed ({packed[packed.rindex('.'):]}); maxlm reads uncompressed "
                          f"text, JSONL and Parquet: decompress it first")
    return list(dict.fromkeys(files))


def _none_found(item: str, key: str, suffixes: tuple | None, dirs: bool, searched: list[str]) -> str:
    """Why `item` gave nothing, and what to pass instead."""
    if item.startswith("gs://"):
        bucket = storage.split(item)[0]
        try:  # asked only now: reading a bucket's metadata needs more than reading its objects
            missing = storage.client().lookup_bucket(bucket, timeout=60) is None
        except Exception:  # noqa: BLE001 - no permission for the metadata: say what the listing showed
            missing = False
        if missing:
            return f"bucket `{bucket}` of {item} does not exist (or is in another project); fix the path"
        return f"{item} matches no {'prepared directory' if dirs else 'file'} in its bucket"
    where = f" (searched: {', '.join(searched)}; cwd {Path.cwd()})"
    p = Path(item)
    if _has_glob(item):
        files = sorted(f for f in globlib.glob(item, recursive=True) if Path(f).is_file())
        if dirs and files:  # `prep/*` names a prepared directory's files, not the directory
            made = sorted({str(Path(f).parent) for f in files if Path(f).name == "dataset.json"})
            parents = made or sorted({str(Path(f).parent) for f in files})
            shown = parents[0] if len(parents) == 1 else f"[{', '.join(parents)}]"
            return (f"{item} matches {len(files)} files but no prepared directory (one holding dataset.json); pass "
                    f"the directory itself: {key}={shown}")
        msg = f"{item} matches no {'directory' if dirs else 'file'}{where}"
        if item.startswith("[") and item.endswith("]"):  # `data.path=[1,2]`: YAML read numbers, so the config kept the text
            try:
                parsed = yaml.safe_load(item)
            except yaml.YAMLError:
                parsed = None
            if isinstance(parsed, list) and parsed:
                msg += f"; for a list of paths write every item as a string: {key}=[{', '.join(repr(str(v)) for v in parsed)}]"
        return msg
    if dirs and p.is_file():
        if (p.parent / "dataset.json").is_file():
            fix = f"pass the directory: {key}={p.parent}"
        else:
            kind = next((k for k, s in SUFFIXES.items() if s and item.endswith(s)), "text")
            fix = (f"prepare it (python -m maxlm.data.prepare {item} --tokenizer ... --out DIR) or set "
                   f"{key.removesuffix('path')}source={kind}")
        return f"{item} is a file, not a prepared directory (one holding dataset.json); {fix}"
    if p.is_dir():
        if suffixes:
            others = sum(1 for q in p.rglob("*") if q.is_file() and not q.name.startswith("."))
            return f"{item} holds no {' or '.join(suffixes)} files ({others} other file{'s' * (others != 1)}){where}"
        return f"{item} holds no files{where}"
    kind = special_file(p)
    if kind:
        return (f"{item} is {kind}, not a regular file: maxlm reads a data file by its size and byte ranges, more "
                f"than once; write the data to a file and pass that")
    if p.is_symlink():
        return f"{item} is a symbolic link to {os.readlink(p)}, which does not exist{where}"
    return f"{item} does not exist{where}"


def special_file(p) -> str | None:
    """What `p` is when it exists but is neither a regular file nor a directory (a FIFO, a socket, a device),
    in words for an error line; None otherwise."""
    try:
        mode = os.stat(p).st_mode
    except OSError:
        return None
    for test, what in ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return None


def _gcs_files(item: str, key: str, suffixes: tuple | None, dirs: bool = False) -> list[str]:
    try:
        if _has_glob(item):
            head = item[:min(item.index(c) for c in "*?[" if c in item)].rsplit("/", 1)[0]
            return sorted(str(p) for p in epath.Path(head).glob(item[len(head) + 1:]) if not dirs or p.is_dir())
        p = epath.Path(item)
        if dirs:
            return [item] if p.is_dir() else []
        if p.is_dir():
            return [f for f in storage.find(item) if not f.rsplit("/", 1)[-1].startswith(".")
                    and (not suffixes or f.endswith(suffixes))]
        return [item] if p.exists() else []
    except Exception as e:  # noqa: BLE001 - missing gcsfs, no credentials, ...: name it
        raise ConfigError(f"`{key}`: cannot list {item}: {str(e).splitlines()[0][:200]}") from None


def decode(raw: bytes) -> tuple[str | None, str]:
    """UTF-8 text, or None and the skip reason."""
    if not raw.strip():
        return None, "empty"
    try:
        return raw.decode("utf-8"), ""
    except UnicodeDecodeError:
        return None, "invalid_utf8"


def parse_jsonl(line: bytes, field: str) -> tuple[str | None, str]:
    """The `field` of one JSONL line, or None and the skip reason."""
    if not line.strip():
        return None, "empty"
    try:
        obj = json.loads(line)
    except UnicodeDecodeError:
        return None, "invalid_utf8"
    except ValueError:
        return None, "bad_json"
    return parse_value(obj.get(field) if isinstance(obj, dict) else None)


def parse_record(line: bytes) -> tuple[object, str]:
    """One JSONL line's whole JSON value (a chat or preference record), or None and the skip reason."""
    if not line.strip():
        return None, "empty"
    try:
        return json.loads(line), ""
    except UnicodeDecodeError:
        return None, "invalid_utf8"
    except ValueError:
        return None, "bad_json"


def parse_value(text) -> tuple[str | None, str]:
    """A JSON field's or Parquet cell's value as a document, or None and the skip reason: absent (or null)
    is `missing_field`, a number, list or object is `not_text`."""
    if text is None:
        return None, "missing_field"
    if not isinstance(text, str):
        return None, "not_text"
    return (text, "") if text.strip() else (None, "empty")


def _read_bytes(path: str) -> bytes:
    with epath.Path(path).open("rb") as f:
        return f.read()


def line_offsets(data: bytes) -> np.ndarray:
    """Start offsets of every line, plus the end: line i is data[o[i]:o[i+1]] (newline included)."""
    if not data:
        return np.zeros(1, np.int64)
    nl = np.flatnonzero(np.frombuffer(data, np.uint8) == ord("\n")) + 1
    ends = nl if (len(data) and data[-1:] == b"\n") else np.r_[nl, len(data)]
    return np.r_[0, ends].astype(np.int64)


def _sizes(files: list[str]) -> np.ndarray:
    """Each file's size in bytes: a listing's worth of requests (in parallel: on gs:// each is a GET)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(16) as pool:
        return np.array(list(pool.map(lambda f: epath.Path(f).stat().length, files)), np.int64)


# Text sources are read a unit at a time: a unit's documents come back in file order, and the loader
# shuffles them within the unit. Nothing is read before a unit's turn, so start-up costs a listing.
UNIT_BYTES = 1 << 20  # a JSONL unit: the lines that start in one MiB of a file
LOCATE_BYTES = 64 << 20  # a line number is counted only this far into a file; further on, its byte offset


class TextSource:
    """Each file is one document, and one unit."""

    def __init__(self, files: list[str]):
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def read_unit(self, u: int) -> list[tuple[str | None, str, str]]:
        return [(*decode(_read_bytes(self.files[u])), self.files[u])]


class JsonlSource:
    """Each line is one document. A unit is the lines that start in one UNIT_BYTES range of a file, read
    with one ranged read (and the rest of its last line). Start-up reads each file's size and nothing
    else, so it costs the same for 1 GB as for 1 TB. With `records`, a document is the line's parsed JSON
    value instead of its `field`'s text.

    A document's `where` is `file:@OFFSET` (its byte offset): a line number would need the newlines
    before it. `locate` turns it into `file:LINE` when a message shows it."""

    def __init__(self, files: list[str], field: str, records: bool = False):
        self.files, self.field, self.records = files, field, records
        self.sizes = _sizes(files)
        self._first = np.r_[0, np.cumsum(-(-self.sizes // UNIT_BYTES))]  # units before file f

    def __len__(self) -> int:
        return int(self._first[-1])

    def __getstate__(self) -> dict:  # open files stay behind when sent to a worker process
        return {k: v for k, v in self.__dict__.items() if k != "_open"}

    def _handle(self, f: int):
        if "_open" not in self.__dict__:
            self._open = threading.local()  # one handle per file and thread: seek+read must not interleave
        handles = self._open.__dict__.setdefault("files", {})
        if f not in handles:
            handles[f] = epath.Path(self.files[f]).open("rb")
        return handles[f]

    def read_unit(self, u: int) -> list[tuple[object, str, str]]:
        f = int(np.searchsorted(self._first, u, side="right")) - 1
        lo = (u - int(self._first[f])) * UNIT_BYTES
        parse = parse_record if self.records else functools.partial(parse_jsonl, field=self.field)
        return [(*parse(line), where) for line, where in
                lines_from(self._handle(f), self.files[f], lo, min(lo + UNIT_BYTES, int(self.sizes[f])), int(self.sizes[f]))]


def lines_from(fh, path: str, lo: int, hi: int, size: int) -> list[tuple[bytes, str]]:
    """The lines of an open file that start in bytes [lo, hi), each with its `path:@OFFSET`: one ranged
    read, plus the rest of the last line where it runs past hi."""
    begin = max(lo - 1, 0)  # a line starts at lo if lo is 0 or byte lo-1 is a newline
    fh.seek(begin)
    data = fh.read(hi - begin)
    if lo:
        nl = data.find(b"\n")
        if nl < 0 or begin + nl + 1 >= hi:  # no line starts in [lo, hi): a long line runs through it
            return []
        data, begin = data[nl + 1:], begin + nl + 1
    if not data.endswith(b"\n") and hi < size:
        data += fh.readline()
    o = line_offsets(data)
    return [(data[o[n]:o[n + 1]], f"{path}:@{begin + int(o[n])}") for n in range(len(o) - 1)]


_LINES: dict[str, list[tuple[int, int]]] = {}  # file -> (offset, newlines before it) pairs counted so far


def locate(where: str) -> str:
    """`file:@OFFSET` (a JSONL document) as `file:LINE`: the newlines before OFFSET, counted from the
    nearest offset counted before, up to LOCATE_BYTES into the file; past that, `file:byte OFFSET`.
    Anything else unchanged."""
    path, at, offset = where.rpartition(":@")
    if not at or not offset.isdigit():
        return where
    offset = int(offset)
    if offset > LOCATE_BYTES:
        return f"{path}:byte {offset}"
    known = _LINES.setdefault(path, [(0, 0)])
    start, lines = known[bisect.bisect_right(known, (offset, 1 << 62)) - 1]
    if start < offset:
        with epath.Path(path).open("rb") as f:
            f.seek(start)
            lines += f.read(offset - start).count(b"\n")
        bisect.insort(known, (offset, lines))
    return f"{path}:{lines + 1}"


def relocate(message: str, wheres) -> str:
    """`message` with each of `wheres` that it names located (see `locate`)."""
    for w in wheres:
        if w in message:
            message = message.replace(w, locate(w))
    return message


def _first_line(e: Exception) -> str:
    return (str(e).strip() or type(e).__name__).splitlines()[0][:200]


def parquet_meta(path: str, field: str | None, key: str = "data.path", field_key: str = "data.field"):
    """A Parquet file's metadata (its footer only); one line naming the file if it is not Parquet or lacks
    the `field` column (None: any columns)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("parquet data needs pyarrow: pip install pyarrow") from None
    try:
        with epath.Path(path).open("rb") as f:
            meta = pq.ParquetFile(f).metadata
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...: any is the file's fault
        raise ConfigError(f"`{key}`: {path} is not a valid Parquet file ({_first_line(e)}); remove it or "
                          f"convert it") from None
    names = meta.schema.names
    if field is not None and field not in names:
        raise ConfigError(f"`{field_key}`: {path} has no column `{field}` (columns: {', '.join(names)})")
    return meta


def parquet_rows(path: str, g: int, field: str | None) -> list:
    """The `field` values of row group g (None: each row as a dict of every column); one line naming the row
    group if it does not decode."""
    import pyarrow.parquet as pq

    try:
        with epath.Path(path).open("rb") as f:
            if field is None:
                return pq.ParquetFile(f).read_row_group(g).to_pylist()
            return pq.ParquetFile(f).read_row_group(g, columns=[field]).column(0).to_pylist()
    except Exception as e:  # noqa: BLE001 - a footer that reads but a corrupt row group
        raise ConfigError(f"`data.path`: {path} row group {g} does not decode ({_first_line(e)}); remove or "
                          f"rewrite the file") from None


class ParquetSource:
    """Each row is one document. A unit is the row groups that start in one UNIT_BYTES range of a file, as
    JSONL's units are its lines: start-up reads each file's size (and the first file's footer, to check
    `field`), so it costs the same for ten files as for ten thousand. A file's footer is read when one of
    its units is first read (a row group is usually many MiB, so most units hold none). With `records`, a
    document is the whole row, a dict of every column (GRPO's prompt records), instead of its `field`."""

    def __init__(self, files: list[str], field: str, key: str = "data.path", records: bool = False):
        self.files, self.field, self.key, self.records = files, field, key, records
        if records:  # any columns will do: the prompt's and the rewards' fields are checked per record
            self.field = None
        parquet_meta(files[0], self.field, key)  # a wrong data.field, or a path that is not Parquet: before any step
        self.sizes = _sizes(files)
        self._first = np.r_[0, np.cumsum(-(-self.sizes // UNIT_BYTES))]  # units before file f
        self.__setstate__(self.__dict__)

    def __len__(self) -> int:
        return int(self._first[-1])

    def __getstate__(self) -> dict:  # a worker process reads footers itself
        return {k: v for k, v in self.__dict__.items() if k != "_starts"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._starts = functools.lru_cache(maxsize=256)(self._read_starts)

    def _read_starts(self, f: int) -> np.ndarray:
        """Where each row group of file f starts (its first column chunk's first page), from its footer."""
        meta = parquet_meta(self.files[f], self.field, self.key)
        firsts = (meta.row_group(g).column(0) for g in range(meta.num_row_groups))
        return np.array([c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset for c in firsts],
                        np.int64)

    def read_unit(self, u: int) -> list[tuple[str | None, str, str]]:
        f = int(np.searchsorted(self._first, u, side="right")) - 1
        lo = (u - int(self._first[f])) * UNIT_BYTES
        starts = self._starts(f)
        groups = range(int(np.searchsorted(starts, lo)), int(np.searchsorted(starts, lo + UNIT_BYTES)))
        parse = (lambda v: (v, None)) if self.records else parse_value
        return [(*parse(v), f"{self.files[f]}:row group {g} row {r}")
                for g in groups for r, v in enumerate(parquet_rows(self.files[f], g, self.field))]


FORMAT = "maxlm-tokens-v2"
V1 = "maxlm-tokens-v1"  # ArrayRecord shards with lengths.npy: still read (see PreparedSource)


def read_prepared(d: str, key: str = "data.path") -> dict:
    """A prepared directory's dataset.json, checked: it parses, has our format, and every shard it lists
    is there (one listing of the directory, no shard read)."""
    root = epath.Path(d)
    path = root / "dataset.json"
    if not path.exists():
        subs = sorted(q.name for q in root.iterdir() if q.is_dir() and (q / "dataset.json").exists())
        if subs:  # the parent of prepared directories
            shown = ", ".join(subs[:3]) + (", ..." if len(subs) > 3 else "")
            raise ConfigError(f"`{key}`: {d} is not a prepared dataset (no dataset.json) but holds prepared "
                              f"directories ({shown}); pass them: {key}='{d}/*'")
        raise ConfigError(f"`{key}`: {d} is not a prepared dataset (no dataset.json); make one with "
                          f"`python -m maxlm.data.prepare INPUT... --tokenizer ... --out {d}`")
    try:
        meta = json.loads(path.read_text())
        ok = meta.get("format") in (FORMAT, V1) and all(k in meta for k in ("tokenizer", "dtype", "shards", "add_bos",
                                                                             "add_eos"))
    except (ValueError, AttributeError):  # not JSON (or not UTF-8), or not an object
        ok = False
    if not ok:
        raise ConfigError(f"`{key}`: {path} is not a {FORMAT} dataset.json; prepare {d} again into a fresh --out")
    _check_manifest(d, str(path), meta, key)
    have = storage.listsizes(d)  # one listing: every shard is there, at the size dataset.json implies
    missing = [s[k] for s in meta["shards"] for k in ("file", "lengths", "offsets", "mask") if k in s and s[k] not in have]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ConfigError(f"`{key}`: {d} lacks {missing[0]}{more}, listed in its dataset.json; copy the whole "
                          f"directory, or prepare it again")
    _check_shards(d, meta, have, key)
    return meta


TOKEN_DTYPES = ("uint16", "int32")  # what prepare writes: uint16 for vocabularies up to 65536 ids


def ids_needed(meta: dict) -> int | None:
    """How many ids a prepared dataset's tokens may use, as dataset.json records them: its tokenizer's
    vocabulary, and BOS and EOS where it added them; None where it does not say."""
    t = meta.get("tokenizer")
    if not isinstance(t, dict) or not _count(t.get("vocab_size")):
        return None
    added = [t.get(k + "_id") for k in ("bos", "eos") if meta.get("add_" + k) is True]
    return max([t["vocab_size"], *((x + 1) for x in added if _count(x))])


def _count(x) -> bool:
    """A whole number >= 0 (JSON's bool is not one)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_manifest(d: str, path: str, meta: dict, key: str) -> None:
    """dataset.json agrees with itself: a dtype prepare writes and that holds its tokenizer's ids, shards with
    whole-number counts, block totals that fit their shard, and totals that add up. Reads nothing else."""
    def bad(what: str) -> ConfigError:
        return ConfigError(f"`{key}`: {path} {what}; the file was edited or damaged: prepare {d} again into a "
                           f"fresh --out")

    dtype, shards, per = meta["dtype"], meta["shards"], meta.get("block_docs", BLOCK_DOCS)
    if dtype not in TOKEN_DTYPES:
        raise bad(f"lists token dtype {dtype!r}, not {' or '.join(TOKEN_DTYPES)}")
    needed = ids_needed(meta)
    if needed is not None and needed > np.iinfo(dtype).max + 1:
        raise bad(f"lists token dtype {dtype}, which cannot hold the {needed} ids of its tokenizer "
                  f"{meta['tokenizer'].get('name')}")
    if not _count(per) or not per:
        raise bad(f"lists block_docs={per!r}, not a whole number >= 1")
    if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
        raise bad("lists `shards` that are not a list of objects")
    v1 = meta["format"] == V1
    for k, s in enumerate(shards):
        name = s.get("file") if isinstance(s.get("file"), str) else f"shard {k}"
        for field in ("file", "lengths" if v1 else "offsets", *(("mask",) if "mask" in s else ())):
            if not isinstance(s.get(field), str) or not s[field] or "/" in s[field]:
                raise bad(f"lists {field}={s.get(field)!r} for shard {k}, not a file name")
        for field in ("docs", "tokens"):
            if not _count(s.get(field)):
                raise bad(f"lists {field}={s.get(field)!r} for {name}, not a whole number >= 0")
        if "blocks" in s:
            pairs = s["blocks"]
            if not isinstance(pairs, list) or not all(_count(x) for x in pairs):
                raise bad(f"lists blocks for {name} that are not whole numbers >= 0")
            if len(pairs) != -(-s["docs"] // per):
                raise bad(f"lists {len(pairs)} blocks for {name} of {s['docs']} documents (one per {per})")
            if not s["tokens"] - s["docs"] <= sum(pairs) <= s["tokens"]:  # a document of n tokens has max(n-1, 0) pairs
                raise bad(f"lists blocks for {name} holding {sum(pairs)} (input, target) pairs, which {s['docs']} "
                          f"documents of {s['tokens']} tokens cannot have (between {max(s['tokens'] - s['docs'], 0)} "
                          f"and {s['tokens']})")
    stats = meta.get("stats")
    if not isinstance(stats, dict):
        raise bad("has no `stats` object")
    for field, total in (("documents", "docs"), ("tokens", "tokens")):
        want = sum(s[total] for s in shards)
        if stats.get(field) != want:
            raise bad(f"lists stats.{field}={stats.get(field)!r} where its shards add up to {want}")


def _check_shards(d: str, meta: dict, sizes: dict, key: str) -> None:
    """Every shard's files against dataset.json, without a scan: the tokens and mask sizes (from the
    directory's listing), and each index's .npy header, size and first and last entries (a ranged read or
    two per shard, all in flight at once on gs://). O(shards), not O(documents)."""
    def bad(file: str, what: str) -> ConfigError:
        return ConfigError(f"`{key}`: {storage.join(d, file)} {what}: the shards do not match their dataset.json; "
                           f"copy the whole directory again, or prepare it again into a fresh --out")

    v1, itemsize = meta["format"] == V1, np.dtype(meta["dtype"]).itemsize
    shards, index = meta["shards"], "lengths" if v1 else "offsets"
    for s in shards:
        for file, want in ((s.get("mask"), s["tokens"]), (None if v1 else s["file"], s["tokens"] * itemsize)):
            if file is not None and sizes[file] != want:
                raise ConfigError(f"`{key}`: {storage.join(d, file)} holds {sizes[file]} bytes where dataset.json "
                                  f"lists {want}: the shards do not match their dataset.json; copy the whole "
                                  f"directory again, or prepare it again into a fresh --out")
    heads = storage.read_ranges([(storage.join(d, s[index]), 0, 4096) for s in shards])
    starts = []
    for s, head in zip(shards, heads):
        n = s["docs"] + (0 if v1 else 1)
        f = io.BytesIO(head)
        try:
            version = np.lib.format.read_magic(f)
            shape, fortran, dtype = (np.lib.format.read_array_header_1_0 if version == (1, 0) else
                                     np.lib.format.read_array_header_2_0)(f)
        except Exception as e:  # noqa: BLE001 - numpy's own words for what is wrong with the header
            raise bad(s[index], f"is not a .npy file ({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})") \
                from None
        if dtype != np.dtype("<i8") or fortran or len(shape) != 1:
            raise bad(s[index], f"holds a {'x'.join(map(str, shape))} array of {dtype}, not a 1-d array of int64")
        if shape[0] != n:
            raise bad(s[index], f"holds {shape[0]} entries where dataset.json lists {s['docs']} documents for "
                                f"{s['file']} ({n} entries)")
        if sizes[s[index]] != f.tell() + 8 * n:
            raise bad(s[index], f"holds {sizes[s[index]]} bytes where its header says {f.tell() + 8 * n}: it was "
                                f"cut short or appended to")
        starts.append(f.tell())
    if v1:  # lengths: nothing more to check without reading them all
        return
    ends = storage.read_ranges([(storage.join(d, s[index]), a, a + 8) for s, a in zip(shards, starts)] +
                               [(storage.join(d, s[index]), a + 8 * s["docs"], a + 8 * s["docs"] + 8)
                                for s, a in zip(shards, starts)])
    for s, first, last in zip(shards, ends[:len(shards)], ends[len(shards):]):
        first, last = (int(np.frombuffer(x, "<i8")[0]) if len(x) == 8 else None for x in (first, last))
        if first != 0:
            raise bad(s[index], f"starts its first document at {first}, not 0")
        if last != s["tokens"]:
            raise bad(s[index], f"ends its last document at {last} where dataset.json lists {s['tokens']} tokens for "
                                f"{s['file']}")


def check_dtypes(metas: list[dict], key: str = "data.path") -> np.dtype:
    dtypes = {m["dtype"] for m in metas}
    if len(dtypes) > 1:
        raise ConfigError(f"`{key}`: the prepared datasets mix token dtypes {sorted(dtypes)}; prepare them "
                          f"with the same tokenizer")
    return np.dtype(dtypes.pop())


class PreparedSource:
    """Tokenized documents written by `python -m maxlm.data.prepare`. Each directory holds dataset.json
    (tokenizer, dtype, shards with their blocks' pair totals) and, per shard, `shard-K.tokens` (every
    document's ids back to back, as `dtype`) and `shard-K.offsets.npy` (int64: where each document
    starts, then the end). Start-up reads dataset.json alone; a block's offsets are one ranged read when
    the block is first used, and a row reads just the tokens it packs (one pread, or one ranged GET on
    gs://), so nothing held grows with the corpus.

    Chat and preference records (`records`: prepare --format chat|preference) also have `shard-K.mask`, a
    byte per token, 1 where the token is trained (`masked_spans`). A preference record is two documents,
    prompt+chosen then prompt+rejected.

    Directories prepared as maxlm-tokens-v1 (ArrayRecord shards and lengths.npy) are read too, listed in
    `v1`: array_record holds 8 bytes per document of every shard it has opened, which grows to the
    corpus over an epoch."""

    def __init__(self, dirs: list[str], key: str = "data.path"):
        self.key, self.meta, self._shards, blocks, starts, n = key, [], [], [], [], 0
        self.scanned, self.v1 = [], []  # v1 directories without block totals (lengths read whole), and all v1
        for d in dirs:
            meta = read_prepared(d, key)
            self.meta.append(meta)
            v1 = meta["format"] == V1
            if v1:
                self.v1.append(d)
            per, root = meta.get("block_docs", BLOCK_DOCS), epath.Path(d)
            for shard in meta["shards"]:
                self._shards.append({"file": str(root / shard["file"]), "v1": v1, "tokens": shard["tokens"],
                                     "index": str(root / shard["lengths" if v1 else "offsets"]),
                                     "mask": str(root / shard["mask"]) if "mask" in shard else None})
                starts.append(n)
                if "blocks" in shard:  # their count and sum are checked by read_prepared
                    pairs = np.asarray(shard["blocks"], np.int64).reshape(-1)
                else:
                    pairs = block_pairs(read_npy_range(self._shards[-1]["index"], 0, shard["docs"]), per)
                    if d not in self.scanned:
                        self.scanned.append(d)
                blocks.append(blocks_of(pairs, shard["docs"], n, per))
                n += shard["docs"]
        self.dtype = check_dtypes(self.meta, key)
        kinds = {m.get("records", "text") for m in self.meta}
        if len(kinds) > 1:
            raise ConfigError(f"`{key}`: the prepared datasets mix {' and '.join(sorted(kinds))} records; a component "
                              f"reads one kind (prepare them with the same --format, or make them a data.mixture)")
        self.records = kinds.pop()  # text, chat or preference
        self.blocks = np.concatenate(blocks) if blocks else np.zeros((0, 3), np.int64)
        self._starts, self._firsts = np.array(starts, np.int64), np.ascontiguousarray(self.blocks[:, 0])
        self.n_docs, self.n_tokens = n, sum(m["stats"]["tokens"] for m in self.meta)
        needed = [ids_needed(m) for m in self.meta]
        self.ids = None if None in needed or not needed else max(needed)  # every id read is below it
        self.__setstate__(self.__dict__)

    def __len__(self) -> int:
        return self.n_docs

    def __getstate__(self) -> dict:  # for data.workers: a worker process opens and checks shards itself
        return {k: v for k, v in self.__dict__.items() if k not in ("_readers", "_checked", "_lock", "_offsets")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._readers, self._checked, self._lock = {}, set(), threading.Lock()
        self._offsets = functools.lru_cache(maxsize=256)(self._read_offsets)  # 32 KiB a block

    def _shard(self, i: int) -> tuple[dict, int]:
        """The shard holding document i, and i's place in it."""
        k = int(np.searchsorted(self._starts, i, side="right")) - 1
        return self._shards[k], int(i) - int(self._starts[k])

    def _read_offsets(self, b: int) -> np.ndarray:
        """Block b's offsets (v1: lengths), checked against the block's line in dataset.json: read_prepared checks
        each index's ends only, so an index edited inside, or block totals moved between blocks, fail here, on
        the block's first read, naming the shard."""
        first, count, pairs = (int(x) for x in self.blocks[b])
        shard, lo = self._shard(first)
        offs = read_npy_range(shard["index"], lo, lo + count + (0 if shard["v1"] else 1))
        lengths = offs if shard["v1"] else np.diff(offs)
        where = f"{shard['index']} (documents {lo}-{lo + count} of the shard)"
        if len(lengths) != count:
            raise self._mismatch(shard, f"{where} holds {len(lengths)} entries where dataset.json lists {count}")
        if (lengths < 0).any() or (not shard["v1"] and count and not 0 <= offs[0] <= offs[-1] <= shard["tokens"]):
            raise self._mismatch(shard, f"{where} holds offsets that go backwards or past the shard's "
                                        f"{shard['tokens']} tokens")
        got = int(np.maximum(lengths, 1).sum() - count)
        if got != pairs:
            raise self._mismatch(shard, f"{where} gives {got} (input, target) pairs where dataset.json's block totals "
                                        f"list {pairs}")
        return offs

    def block_lengths(self, b: int) -> np.ndarray:
        first = self.blocks[b, 0]
        return self._offsets(b) if self._shard(first)[0]["v1"] else np.diff(self._offsets(b))

    def spans(self, wanted: list[tuple[int, int, int, int]]) -> list[np.ndarray]:
        """Ids a..z of document i, whose lengths say it has n, for each (i, n, a, z): read at once."""
        return self._spans(wanted, masks=False)

    def masked_spans(self, wanted: list[tuple[int, int, int, int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids, mask) a..z of each (i, n, a, z), as `spans`: chat and preference records."""
        return self._spans(wanted, masks=True)

    def _spans(self, wanted, masks: bool) -> list:
        out, ranges, size = [None] * len(wanted), [], self.dtype.itemsize
        for w, (i, n, a, z) in enumerate(wanted):
            shard, at = self._shard(i)
            if shard["v1"]:
                ids = self._record(shard, at)
                if self.ids is not None and len(ids) and int(ids.max()) >= self.ids:
                    raise self._mismatch(shard, f"{shard['file']} holds token id {int(ids.max())}, but its tokenizer "
                                                f"({self.meta[0]['tokenizer'].get('name')}) has {self.ids} ids")
                if len(ids) != n:
                    raise self._mismatch(shard, f"document {i} has {len(ids)} tokens where its lengths list {n}")
                out[w] = ids[a:z]
                continue
            if shard["file"] not in self._checked:  # once per shard: a shard cut short or from another preparation
                for path, width in ((shard["file"], size), (shard["mask"], 1)):
                    got, want = (storage.size(path), shard["tokens"] * width) if path else (0, 0)
                    if got != want:
                        raise self._mismatch(shard, f"{path} holds {got} bytes where dataset.json lists {want}")
                self._checked.add(shard["file"])
            b = int(np.searchsorted(self._firsts, i, side="right")) - 1
            start = int(self._offsets(b)[i - self.blocks[b, 0]])
            ranges.append((w, (shard["file"], (start + a) * size, (start + z) * size)))
            if masks:
                ranges.append((w, (shard["mask"], start + a, start + z)))
        raws = storage.read_ranges([r for _, r in ranges])
        for (w, (path, _, _)), raw in zip(ranges[::2] if masks else ranges, raws[::2] if masks else raws):
            ids = np.frombuffer(raw, self.dtype)
            if self.ids is not None and len(ids) and int(ids.max()) >= self.ids:  # an embedding lookup would clamp it
                raise self._mismatch(self._shard(wanted[w][0])[0], f"{path} holds token id {int(ids.max())}, but its "
                                     f"tokenizer ({self.meta[0]['tokenizer'].get('name')}) has {self.ids} ids")
            out[w] = ids.astype(np.int32)
        if masks:
            for (w, _), mask in zip(ranges[::2], raws[1::2]):
                out[w] = out[w], np.frombuffer(mask, np.uint8).astype(np.int8)
        return out

    def tokens(self, i: int) -> np.ndarray:
        b = int(np.searchsorted(self._firsts, i, side="right")) - 1
        n = int(self.block_lengths(b)[i - self.blocks[b, 0]])
        return self.spans([(i, n, 0, n)])[0]

    def _mismatch(self, shard: dict, what: str) -> ConfigError:
        return ConfigError(f"`{self.key}`: {what}: the shards do not match their dataset.json; copy the whole "
                           f"directory again, or prepare it again into a fresh --out")

    def _record(self, shard: dict, at: int) -> np.ndarray:
        """A v1 shard's record `at`."""
        from array_record.python.array_record_module import ArrayRecordReader

        path = shard["file"]
        with self._lock:
            if path not in self._readers:
                self._readers[path] = ArrayRecordReader(path, "readahead_buffer_size:0", file_reader_buffer_size=32768)
        try:
            # read(begin, end), not read([index]) as grain's ArrayRecordDataSource does: that costs time in
            # proportion to the shard's records (300 us per read at 156k records, against 10 us).
            raw = self._readers[path].read(at, at + 1)[0]
        except Exception as e:  # noqa: BLE001 - array_record's own error: name the shard and the fix instead
            raise self._mismatch(shard, f"cannot read record {at} of {path} ({str(e).splitlines()[0][:200]})") from None
        return np.frombuffer(raw, self.dtype).astype(np.int32)


class _InMemoryLengths:
    """Blocks and lengths of a token source whose lengths are in memory anyway."""

    per = BLOCK_DOCS  # documents per block (tests set fewer, to cross blocks with a handful of documents)

    def __len__(self) -> int:
        return len(self.lengths)

    @functools.cached_property
    def blocks(self) -> np.ndarray:
        return blocks_of(block_pairs(self.lengths, self.per), len(self.lengths), 0, self.per)

    @property
    def n_tokens(self) -> int:
        return int(self.lengths.sum())

    def block_lengths(self, b: int) -> np.ndarray:
        return self.lengths[b * self.per:(b + 1) * self.per]

    def spans(self, wanted: list[tuple[int, int, int, int]]) -> list[np.ndarray]:
        return [self.tokens(i)[a:z] for i, _, a, z in wanted]


class SyntheticSource(_InMemoryLengths):
    """Random documents for benchmarks and smoke tests: document i has a seeded random length in
    [16, 2*seq_len] and seeded uniform token ids; nothing is read from disk."""

    def __init__(self, n_docs: int, seq_len: int, vocab: int, seed: int):
        self.vocab, self.seed = vocab, seed
        self.lengths = np.random.default_rng([seed, 1]).integers(16, 2 * seq_len + 1, n_docs).astype(np.int64)

    def tokens(self, i: int) -> np.ndarray:
        return np.random.default_rng([self.seed, 2, int(i)]).integers(0, self.vocab, self.lengths[i], dtype=np.int32)


class InMemorySource(_InMemoryLengths):
    """Already tokenized documents held in memory (the built-in pydoc corpus)."""

    def __init__(self, docs: list[np.ndarray]):
        self.docs = docs
        self.lengths = np.array([len(d) for d in docs], np.int64)

    def tokens(self, i: int) -> np.ndarray:
        return self.docs[int(i)]


def text_source(kind: str, path, field: str, key: str = "data.path", records: bool = False):
    """records: jsonl lines as parsed JSON values (chat and preference data; jsonl only, see checks.check_chat)."""
    files = resolve(path, key, suffixes=SUFFIXES[kind])
    if kind == "text":
        return TextSource(files)
    return JsonlSource(files, field, records) if kind == "jsonl" else ParquetSource(files, field, key)
