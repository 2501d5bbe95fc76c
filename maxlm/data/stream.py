"""Streaming rows: each component's items (a text source's units, or documents) read and tokenized as
they come (`ReadChunk`), and packed by `Packer`, which takes the next document from the component
furthest below its weight's share of the (input, target) pairs so far. Its state (where each component's
stream is, the partial row, the counts) is the loader's data position in a checkpoint.

Chat and preference records carry a per-token mask (see maxlm.data.chat) and are fitted whole to a row
(`fit_conversation`, `fit_pair`)."""

import bisect
from typing import NamedTuple

import grain
import numpy as np

from maxlm.config import ConfigError
from maxlm.data import chat, sources, tokenizer
from maxlm.data.order import Order, fit_pair, row

CHUNK = 64  # documents per streaming element


TOO_LONG = ("too_long_truncated", "too_long_dropped")


def counted(fmt: str) -> tuple[str, ...]:
    """What the packer counts, and metrics.jsonl shows as data_skipped_*: the skips, and for chat and
    preference records the conversations cut or dropped for length."""
    return sources.SKIPS if fmt == "text" else (*sources.SKIPS, *TOO_LONG)


def fit_conversation(ids: np.ndarray, mask: np.ndarray, L: int, too_long: str):
    """(ids, mask, what happened: '' or one of TOO_LONG) of a conversation made to fit L pairs; ids None if
    dropped. A cut that leaves no trained target drops it."""
    if len(ids) - 1 <= L:
        return ids, mask, ""
    if too_long == "drop" or not mask[1:L + 1].any():
        return None, None, "too_long_dropped"
    return ids[:L + 1], mask[:L + 1], "too_long_truncated"


# Items per streaming element: a JSONL unit is UNIT_BYTES of lines, and a Parquet unit the row groups that
# start in UNIT_BYTES of a file (often none, or one of many MiB), so one or two of them; documents and text
# files go CHUNK at a time.
PER_ELEMENT = {"jsonl": 2, "parquet": 1}


class ReadChunk:
    """Element c -> this process's items of one component (items proc, proc + n_proc, ... of its order;
    `per` of them), read and tokenized. A text source's unit gives its documents shuffled; each document
    carries its item's place `m` in the order and whether it is the item's first (`lead`) and `last`. One element per chunk of
    items, not per document: a batch tokenizer call, and far fewer hand-offs between worker processes.
    Picklable, for worker processes."""

    def __init__(self, comp, order: Order, per: int, tok_spec: str, add_bos: bool, add_eos: bool,
                 proc: int, n_proc: int, n_items: int, encoder: chat.Encoder | None = None):
        self.comp, self.order, self.per, self.tok_spec = comp, order, per, tok_spec
        self.add_bos, self.add_eos, self.proc, self.n_proc, self.n_items = add_bos, add_eos, proc, n_proc, n_items
        self.encoder, self._tok = encoder, None

    def __call__(self, c: int) -> list[dict]:
        docs, texts, src = [], [], self.comp.source
        for j in range(c * self.per, (c + 1) * self.per):
            m = self.proc + self.n_proc * j
            if m >= self.n_items:
                break
            item = self.order[m]
            if self.comp.tokenized:
                ids = src.tokens(item)
                where = "" if len(ids) > 1 else f"{self.comp.name}: document {item}"  # named only if unusable
                docs.append({"tokens": ids, "skip": "", "where": where, "m": m, "lead": True, "last": True})
                continue
            unit = src.read_unit(item)  # with the encoder, chat/preference records
            shuffle = np.random.default_rng([self.order.seed, self.order.k, 1 << 22, m]).permutation(len(unit))
            for n, i in enumerate(shuffle):
                text, skip, where = unit[i]
                docs.append({"tokens": None, "skip": skip, "where": where, "m": m, "lead": n == 0,
                             "last": n == len(unit) - 1})
                if text is not None:
                    texts.append((len(docs) - 1, text))
        if texts:
            if self._tok is None:
                self._tok = tokenizer.load(self.tok_spec)
            if self.encoder is not None:
                try:
                    encoded = self.encoder(self._tok, [(t, docs[i]["where"]) for i, t in texts])
                except ConfigError as e:
                    raise ConfigError(sources.relocate(str(e), [docs[i]["where"] for i, _ in texts])) from None
                for (i, _), enc in zip(texts, encoded):
                    docs[i].update(enc)
                return docs
            ids = tokenizer.document_ids_batch(self._tok, [t for _, t in texts], self.add_bos, self.add_eos)
            for (i, _), x in zip(texts, ids):
                docs[i]["tokens"] = x
        return docs


class Limits(NamedTuple):
    """What the packer enforces as it counts: this process's share of a component's order (items proc,
    proc + n_proc, ... of passes of docs_per_epoch items), data.strict and data.max_bad_records."""

    docs_per_epoch: int
    proc: int = 0
    n_proc: int = 1
    strict: bool = False
    max_bad: int = 1000


# Why a document gave no (input, target) pair: the skip reasons, and `short` (under 2 tokens).
UNUSABLE = (*sources.SKIPS, "short", "too_long_dropped")
FIXES = {"empty": "fix the data: its documents are empty or blank",
         "invalid_utf8": "fix the data: convert it to UTF-8",
         "bad_json": "check data.source (jsonl reads one JSON object per line) or fix the data",
         "missing_field": "set data.field to the JSON key or Parquet column that holds the text",
         "not_text": "set data.field to the JSON key or Parquet column that holds the text: this one holds "
                     "numbers, lists or objects",
         "short": "fix the data: a document needs 2 tokens to make an (input, target) pair",
         "too_long_dropped": "raise seq_len: the records do not fit in a row with a trained token left "
                             "(with data.too_long=drop, any longer record is dropped)"}


def strict_error(reason: str, where: str) -> ConfigError:
    return ConfigError(f"data.strict=true: a document was {reason} at {sources.locate(where)}; fix the data or set "
                       f"data.strict=false to skip and count such documents")


def budget_error(bad: int, budget: int, reason: str, where: str) -> ConfigError:
    return ConfigError(f"data: {bad} bad records (malformed JSON, invalid UTF-8, a missing `data.field` or one that "
                       f"is not text), more than data.max_bad_records={budget}; first: {sources.locate(where)} "
                       f"({reason})")


def covers_epoch(a: int, b: int, lim: Limits) -> bool:
    """Are this process's documents a..b of the plan (every n_proc-th from proc) all of its documents of
    some epoch? A shorter run of unusable documents may be bad luck; a whole epoch is the data."""
    D, P, p = lim.docs_per_epoch, lim.n_proc, lim.proc
    e = a // D if a - a // D * D < P else a // D + 1  # the first epoch whose first document here is >= a
    while e * D + (p - e * D) % P >= (e + 1) * D:  # an epoch of fewer documents than processes may hold none here
        e += 1
    return b + P >= (e + 1) * D  # b is this process's last document of epoch e (or later)


def _listed(x) -> list:
    return list(x) if isinstance(x, list) else [x]


class Packer(grain.IterDataset):
    """Rows from one stream of document chunks per component (`parents`), mixed in `weights` (shares of
    (input, target) pairs; equal if not given), or in stages: [(first row, weights), ...] from row 0.
    `limits`: one Limits per component, or None. fmt: data.format (text, chat or preference);
    too_long: data.too_long (chat and preference)."""

    def __init__(self, parents, L: int, packing: bool, limits=None, fmt: str = "text", too_long: str = "truncate",
                 weights=None, names=None):
        super().__init__(_listed(parents))
        n = len(self.parents)
        self.L, self.packing, self.fmt, self.too_long = L, packing, fmt, too_long
        self.limits = _listed(limits) if limits is not None else [None] * n
        stages = [(0, np.ones(n))] if weights is None else weights if isinstance(weights[0], tuple) else [(0, weights)]
        self.stage_rows = [int(r) for r, _ in stages]
        self.stage_weights = [np.asarray(w, float) / np.sum(w) for _, w in stages]
        self.names = list(names or range(n))

    def __iter__(self):
        return PackerIterator([p.__iter__() for p in self.parents], self)


class PackerIterator(grain.DatasetIterator):
    """Rows from streams of chunks of documents, one per component. The next document comes from the
    component furthest below its weight's share of the pairs taken so far (ties: the first), so the
    realised shares stay within a document of the weights; a skipped document takes nothing.

    Counts skipped documents (per reason, first location) as it goes, and with limits enforces
    data.strict and data.max_bad_records as it counts: a stream of nothing but bad documents would
    otherwise never form a row, and the loader never get to judge it. For the same reason it stops once
    a whole pass over this process's items of one component (`covers_epoch`) gave nothing to train on.
    The state holds each parent's state before its current chunk and the place in it, the unfinished
    document (a text document's rest, or the conversation waiting for the next row, with its mask), the
    pairs taken per component and the counts, so a resume continues exactly."""

    def __init__(self, parents: list, ds: Packer):
        super().__init__(parents)
        self.L, self.packing, self.limits, self.fmt, self.too_long = ds.L, ds.packing, ds.limits, ds.fmt, ds.too_long
        self.stage_rows, self.stage_weights, self.names = ds.stage_rows, ds.stage_weights, ds.names
        k = len(parents)
        self._chunk, self._at, self._before = [None] * k, [0] * k, [p.get_state() for p in parents]
        self.rows, self.stage = 0, 0  # rows made so far; the weights' stage they are in
        self.pairs = np.zeros(k, np.int64)  # (input, target) pairs taken from each component in this stage
        self._rest = np.zeros(0, np.int32)  # the tokens of a document not yet fully placed
        self._rest_mask = np.zeros(0, np.int8)  # chat: their mask
        self.skips = {r: 0 for r in counted(self.fmt)}
        self.first: dict[str, str] = {}
        self._dry = [None] * k  # per component, the run of unusable documents since its last usable one

    def _next_doc(self) -> tuple[int, dict]:
        stage = bisect.bisect_right(self.stage_rows, self.rows) - 1
        if stage != self.stage:  # a new stage's shares count from its start
            self.stage, self.pairs = stage, np.zeros_like(self.pairs)
        # The component furthest below its share; with +1, the first document goes to the largest weight
        # and a weight of 0 is never taken.
        w = self.stage_weights[stage]
        k = int(np.argmax(w * (self.pairs.sum() + 1) - self.pairs)) if len(w) > 1 else 0
        while self._chunk[k] is None or self._at[k] == len(self._chunk[k]):
            self._before[k] = self._parents[k].get_state()
            self._chunk[k], self._at[k] = next(self._parents[k]), 0
        self._at[k] += 1
        return k, self._chunk[k][self._at[k] - 1]

    def _count(self, reason: str, where: str) -> None:
        self.skips[reason] += 1
        self.first.setdefault(reason, where)

    def _take(self, kd: tuple[int, dict]) -> dict | None:
        """Count one document; the document (fitted to a row) or None if it gives nothing to train."""
        k, d = kd
        reason, lim = d["skip"], self.limits[k]
        if reason:
            self._count(reason, d["where"])
            if lim and lim.strict:
                raise strict_error(reason, d["where"])
            bad = sum(self.skips[r] for r in sources.BAD_RECORDS)
            if lim and reason in sources.BAD_RECORDS and bad > lim.max_bad:  # this process alone is over: so is the job
                first = next(r for r in sources.BAD_RECORDS if self.skips[r])
                raise budget_error(bad, lim.max_bad, first, self.first[first])
        else:
            fitted, reason = self._fit(d)
            if fitted is not None:
                self._dry[k] = None
                self.pairs[k] += len(fitted["tokens"]) - 1 + max(len(fitted.get("rejected", ())) - 1, 0)
                return fitted
        if lim and "m" in d:
            dry = self._dry[k]
            if dry is None:  # after a usable document of the same unit, the run starts at this process's next item
                dry = self._dry[k] = {"from": int(d["m"]) + (0 if d.get("lead", True) else lim.n_proc), "n": {},
                                      "first": d["where"]}
            dry["n"][reason] = dry["n"].get(reason, 0) + 1
            if d.get("last", True) and covers_epoch(dry["from"], int(d["m"]), lim):
                raise self._dry_error(k)
        return None

    def _fit(self, d: dict) -> tuple[dict | None, str]:
        """(the document made to fit a row, or None and why not); counts a conversation cut or dropped."""
        if self.fmt == "text":
            return (d, "") if len(d["tokens"]) > 1 else (None, "short")
        if self.fmt == "chat":
            ids, mask, what = fit_conversation(d["tokens"], d["mask"], self.L, self.too_long)
            fitted = None if ids is None else {**d, "tokens": ids, "mask": mask}
        else:
            c, cm, r, rm, what = fit_pair(d["tokens"], d["mask"], d["rejected"], d["rejected_mask"], self.L, self.too_long)
            fitted = None if c is None else {**d, "tokens": c, "mask": cm, "rejected": r, "rejected_mask": rm}
        if what:
            self._count(what, d["where"])
        return fitted, "too_long_dropped" if fitted is None else ""

    def _dry_error(self, k: int) -> ConfigError:
        dry, lim = self._dry[k], self.limits[k]
        n = dry["n"]
        counts = ", ".join(f"{r}: {n[r]}" for r in UNUSABLE if r in n)
        who = f"process {lim.proc}'s " if lim.n_proc > 1 else ""
        of = f" of {self.names[k]}" if len(self.limits) > 1 else ""
        return ConfigError(f"data: no usable document in a whole epoch{of} of {who}{sum(n.values())} documents ({counts}; "
                           f"first: {sources.locate(dry['first'])}); {FIXES[max(n, key=n.get)]}")

    def __next__(self) -> dict:
        out = self._next_row()
        self.rows += 1
        return out

    def _next_row(self) -> dict:
        if self.fmt == "chat":
            return self._next_chat()
        if self.fmt == "preference":
            while (d := self._take(self._next_doc())) is None:
                pass
            return row([d["tokens"], d["rejected"]], self.L, [d["mask"], d["rejected_mask"]])
        frags, room = [], self.L
        while room:
            if len(self._rest) < 2:
                d = self._take(self._next_doc())
                self._rest = np.zeros(0, np.int32) if d is None else d["tokens"]
                continue
            take = min(room, len(self._rest) - 1)
            frags.append(self._rest[:take + 1])
            self._rest, room = self._rest[take:] if take < len(self._rest) - 1 else self._rest[:0], room - take
            if not self.packing and not len(self._rest):  # one document per row: pad the rest
                break
        return row(frags, self.L)

    def _next_chat(self) -> dict:
        """Whole conversations: one that does not fit in the room left waits (in _rest) for the next row."""
        frags, masks, room = [], [], self.L
        while room:
            if not len(self._rest):
                d = self._take(self._next_doc())
                if d is not None:
                    self._rest, self._rest_mask = d["tokens"], d["mask"]
                continue
            if len(self._rest) - 1 > room:  # only once the row holds one: a fitted conversation fits a row
                break
            frags.append(self._rest)
            masks.append(self._rest_mask)
            room -= len(self._rest) - 1
            self._rest, self._rest_mask = self._rest[:0], self._rest_mask[:0]
            if not self.packing:
                break
        return row(frags, self.L, masks)

    def get_state(self) -> dict:
        return {"parents": list(self._before), "at": [a if c is not None else -1 for a, c in zip(self._at, self._chunk)],
                "rows": self.rows, "stage": self.stage, "pairs": self.pairs.tolist(), "rest": self._rest.tolist(),
                "rest_mask": self._rest_mask.tolist(),
                "skips": dict(self.skips), "first": dict(self.first),
                "dry": [None if d is None else {**d, "n": dict(d["n"])} for d in self._dry]}

    def set_state(self, state: dict) -> None:
        if "parents" not in state:
            raise ConfigError("the checkpoint's data position is from a maxlm that streamed raw text a document "
                              "at a time; resume it with that maxlm, or start a fresh run_dir from its weights "
                              "(init_from=<its checkpoint>)")
        for k, parent in enumerate(self._parents):
            parent.set_state(state["parents"][k])
            self._before[k], self._chunk[k], self._at[k] = state["parents"][k], None, 0
            if state["at"][k] >= 0:  # re-read the chunk we were in, and continue at the same document
                self._chunk[k], self._at[k] = next(parent), state["at"][k]
        self.rows, self.stage, self.pairs = state["rows"], state["stage"], np.asarray(state["pairs"], np.int64)
        self._rest = np.asarray(state["rest"], np.int32)
        self._rest_mask = np.asarray(state["rest_mask"], np.int8)
        self.skips = {**{r: 0 for r in counted(self.fmt)}, **state["skips"]}
        self.first = dict(state["first"])
        self._dry = [None if d is None else {**d, "n": dict(d["n"])} for d in state["dry"]]


def find_packer(it: grain.DatasetIterator) -> "PackerIterator":
    """The packer inside the batcher: the loader reads its skip counts every step."""
    while not isinstance(it, PackerIterator):
        it = it._parents[0]
    return it
