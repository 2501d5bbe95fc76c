"""Document order and packed rows for token sources, computed on demand: nothing per document is kept.

Permutations are Feistel ciphers over [0, n) (cycle walking), so the i-th element of a shuffle of 10^10
items is a few integer operations away and nothing of size n is ever built, as in grain's index_shuffle
and Levanter's PermutationDataset. `feistel` is vectorised: a pass over a million indices is one numpy
expression per round.

A token source comes in blocks (`sources.BLOCK_DOCS` documents in storage order, within one shard) with
their (input, target) pair totals known up front: `prepare` writes them into dataset.json. An epoch
(`Plan`) is a permutation of blocks; within a block the documents are permuted when the block is first
read, which needs only that block's lengths (one ranged read). Row g of the job (`Rows`) is then a pure
function of g: its epoch from the epochs' row counts, its place in the epoch from a permutation of the
epoch's rows, its pairs from the blocks' running totals. Batches are therefore the same for any process
count, and a resume is exact: the loader's position is g.

Shuffle quality: rows are a full permutation of the epoch's rows. The documents within one row are
neighbours in the epoch's stream: drawn at random from one block of BLOCK_DOCS storage neighbours, or
from two blocks adjacent in the epoch's block order.
"""

import functools

import numpy as np

from maxlm.batch import Field
from maxlm.errors import ConfigError

ROUNDS = 6
M1, M2, U64 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, (1 << 64) - 1
_M1, _M2 = np.uint64(M1), np.uint64(M2)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a cheap 64-bit hash for the Feistel round function."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _mix_int(z: int) -> int:
    """_mix on one Python int: the same bits, without numpy's per-call cost (a row asks for one index)."""
    z = ((z ^ (z >> 30)) * M1) & U64
    z = ((z ^ (z >> 27)) * M2) & U64
    return z ^ (z >> 31)


@functools.lru_cache(maxsize=256)
def _round_keys(key: tuple) -> np.ndarray:
    return np.random.default_rng(list(key)).integers(0, 1 << 63, ROUNDS, dtype=np.uint64)


def feistel(i, n: int, key) -> np.ndarray:
    """The images of indices `i` (array-like, all in [0, n)) under a permutation of [0, n) chosen by `key`
    (a sequence of ints, as numpy's SeedSequence takes). O(len(i)) time and memory, whatever n is."""
    x = np.atleast_1d(np.asarray(i, np.uint64)).copy()
    if n <= 1:
        return x.astype(np.int64)
    h = (int(n - 1).bit_length() + 1) // 2  # the cipher permutes [0, 4^h), 4^h < 4n
    keys = _round_keys(tuple(key))
    if len(x) <= 8:
        return np.array([_feistel_int(int(v), n, h, keys) for v in x], np.int64)
    shift, mask = np.uint64(h), np.uint64((1 << h) - 1)

    def encrypt(y):
        a, b = y >> shift, y & mask
        for k in keys:
            a, b = b, a ^ (_mix(b ^ k) & mask)
        return (a << shift) | b

    todo = np.ones(len(x), bool)
    while todo.any():  # cycle walking: an image outside [0, n) is encrypted again until it lands inside
        x[todo] = encrypt(x[todo])
        todo = x >= np.uint64(n)
    return x.astype(np.int64)


def _feistel_int(y: int, n: int, h: int, keys: np.ndarray) -> int:
    mask = (1 << h) - 1
    ks = [int(k) for k in keys]
    while True:
        a, b = y >> h, y & mask
        for k in ks:
            a, b = b, a ^ (_mix_int(b ^ k) & mask)
        y = (a << h) | b
        if y < n:
            return y


class Order:
    """A component's endless sequence of items (its blocks, or a text source's units): pass p is a fresh
    permutation of them, from (seed, k, p)."""

    def __init__(self, n: int, seed: int, k: int):
        self.n, self.seed, self.k = n, seed, k

    def take(self, start: int, count: int) -> np.ndarray:
        """Items start..start+count of the sequence."""
        out = []
        for p in range(start // self.n, (start + count - 1) // self.n + 1):
            lo, hi = max(start - p * self.n, 0), min(start + count - p * self.n, self.n)
            out.append(feistel(np.arange(lo, hi), self.n, (self.seed, self.k, p)))
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def __getitem__(self, m: int) -> int:
        return int(self.take(m, 1)[0])


class Plan:
    """Which blocks make epoch e, in order. A mixture's epoch takes from each component about its weight's
    share of the (input, target) pairs, in whole blocks: the component with the fewest pairs for its
    weight passes once per epoch, the others take the number of blocks whose average holds their share
    (each continues where it stopped in the next epoch, a fresh permutation after each of its passes)."""

    def __init__(self, comps, seed: int, weights: list[float] | None = None):
        self.seed, self.blocks = seed, [c.source.blocks for c in comps]
        pairs = np.array([b[:, 2].sum() for b in self.blocks], np.float64)
        for c, p in zip(comps, pairs):
            if not p:
                raise ConfigError(f"data source {c.key} ({c.name}) has no (input, target) pairs: every document "
                                  f"is shorter than 2 tokens; point it at real data")
        w = np.array(weights if weights is not None else [c.weight for c in comps], np.float64)
        w, nb = w / w.sum(), np.array([len(b) for b in self.blocks])
        scarce = int(np.argmin(np.where(w > 0, pairs / np.maximum(w, 1e-300), np.inf)))  # a weight of 0 takes none
        want = w * (pairs[scarce] / w[scarce])  # pairs per epoch, per component
        self.take = np.where(w > 0, np.maximum(np.round(nb * want / pairs), 1), 0).astype(np.int64)  # blocks per epoch
        self.take[scarce] = nb[scarce]
        self.orders = [Order(n, seed, k) for k, n in enumerate(nb)]

    @functools.lru_cache(maxsize=2)
    def epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """(component, block) of each of epoch e's blocks, in the epoch's order."""
        comp = np.concatenate([np.full(t, k) for k, t in enumerate(self.take)])
        block = np.concatenate([o.take(e * int(t), int(t)) for o, t in zip(self.orders, self.take)])
        at = feistel(np.arange(len(comp)), len(comp), (self.seed, 1 << 20, e))
        return comp[at], block[at]

    def pairs(self, e: int) -> np.ndarray:
        """Epoch e's (input, target) pairs per component."""
        comp, block = self.epoch(e)
        got = np.zeros(len(self.blocks), np.int64)
        for k, b in enumerate(self.blocks):
            got[k] = b[block[comp == k], 2].sum()
        return got


class Rows:
    """Row g of the job as a pure function of g. packing: an epoch is the stream of its blocks' documents,
    cut into rows of L pairs (the pairs left over at its end are dropped). Without packing a document
    takes ceil(pairs / L) rows of its own, so each block's row count needs its documents' lengths:
    `row_counts` reads them once (8 bytes per document) at start."""

    def __init__(self, comps, plan: Plan, L: int, packing: bool, seed: int):
        self.comps, self.plan, self.L, self.packing, self.seed = comps, plan, L, packing, seed
        self.by_pairs = packing  # units are pairs, cut into rows of L; else each block's row count
        self.units = [b[:, 2] for b in plan.blocks] if packing else [self.row_counts(c.source, L) for c in comps]
        self._cum_rows = [0]  # rows before epoch e, grown as far as asked

    @staticmethod
    def row_counts(src, L: int) -> np.ndarray:
        return np.array([(-(-np.maximum(src.block_lengths(b) - 1, 0) // L)).sum() for b in range(len(src.blocks))],
                        np.int64)

    @functools.lru_cache(maxsize=2)
    def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        comp, block = self.plan.epoch(e)
        units = np.empty(len(comp), np.int64)
        for k, u in enumerate(self.units):
            at = comp == k
            units[at] = u[block[at]]
        cum = np.cumsum(units)  # pairs (packing) or rows up to the end of each of the epoch's blocks
        total = int(cum[-1]) if len(cum) else 0
        return comp, block, cum, total // self.L if self.by_pairs else total

    def rows_in_epoch(self, e: int) -> int:
        return self._epoch(e)[3]

    def rows_before(self, e: int) -> int:
        while len(self._cum_rows) <= e:
            self._cum_rows.append(self._cum_rows[-1] + self.rows_in_epoch(len(self._cum_rows) - 1))
        return self._cum_rows[e]

    @functools.lru_cache(maxsize=64)
    def _block(self, e: int, j: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """Epoch e's j-th block: its component, its documents in this epoch's order, their lengths, and
        where each ends in the epoch (in pairs, or in rows without packing)."""
        comp, block, cum, _ = self._epoch(e)
        k, b = int(comp[j]), int(block[j])
        first, count, _ = self.plan.blocks[k][b]
        at = np.random.default_rng([self.seed, 1 << 22, e, j]).permutation(count)
        lengths = self.comps[k].source.block_lengths(b)[at]
        units = np.maximum(lengths - 1, 0)
        if not self.packing:
            units = -(-units // self.L)
        return k, first + at, lengths, cum[j] - self.units[k][b] + np.cumsum(units)

    def __call__(self, g: int) -> dict:
        while self._cum_rows[-1] <= g:
            self.rows_before(len(self._cum_rows))
        e = int(np.searchsorted(self._cum_rows, g, side="right")) - 1
        _, _, cum, rows = self._epoch(e)
        r, L = int(feistel([g - self.rows_before(e)], rows, (self.seed, 1 << 21, e))[0]), self.L
        frags = []
        if self.packing:  # pairs [rL, rL+L) of the epoch's stream
            at, end = r * L, r * L + L
            j = int(np.searchsorted(cum, at, side="right"))
            while at < end:
                k, docs, lengths, ends = self._block(e, j)
                for i in range(int(np.searchsorted(ends, at, side="right")), len(docs)):
                    pairs = max(int(lengths[i]) - 1, 0)
                    lo = int(ends[i]) - pairs
                    a, b = at - lo, min(end - lo, pairs)
                    if b > a:
                        frags.append((k, (docs[i], lengths[i], a, b + 1)))
                    at = lo + b
                    if at >= end:
                        break
                j += 1
        else:  # chunk c of one document
            j = int(np.searchsorted(cum, r, side="right"))
            k, docs, lengths, ends = self._block(e, j)
            i = int(np.searchsorted(ends, r, side="right"))
            pairs = max(int(lengths[i]) - 1, 0)
            c = r - (int(ends[i]) - -(-pairs // L))
            frags.append((k, (docs[i], lengths[i], c * L, min(c * L + L, pairs) + 1)))
        out = row(self._read(frags), L)
        if len(self.comps) > 1:  # a mixture's pairs per component, for its realised shares (Loader.shares)
            out["comp_pairs"] = np.bincount([k for k, _ in frags], [z - a - 1 for _, (_, _, a, z) in frags],
                                            len(self.comps)).astype(np.int64)
        return out

    def _read(self, frags: list[tuple[int, tuple]]) -> list[np.ndarray]:
        """Each (component, (document, its length, a, z)) fragment's ids, read together per component."""
        out = [None] * len(frags)
        for k in sorted({k for k, _ in frags}):
            at = [w for w, (c, _) in enumerate(frags) if c == k]
            for w, ids in zip(at, self.comps[k].source.spans([frags[w][1] for w in at]), strict=True):
                out[w] = ids
        return out


class RecordRows(Rows):
    """Rows of whole records, for prepared chat and preference data (`fmt`): a conversation is never cut
    across rows, and a preference record (two documents: prompt+chosen, prompt+rejected) is one row.

    A block's records are laid out once, in an order seeded by the block alone: a record longer than L
    pairs is cut to L (too_long=truncate; a preference pair by fit_pair, prompts kept whole) or left out
    (drop), and conversations are packed greedily (one per row without packing). Each block's row count is
    therefore fixed, and counted at start from every record's length (8 bytes each, read once); epochs
    permute the blocks and the rows as `Rows` does. A row holds the same conversations in every epoch, in
    other batches: attention never crosses them, so a conversation's gradient does not depend on its
    row-mates. A conversation cut with no trained token left trains nothing in its row (streaming drops
    it). `too_long` counts what one epoch cuts and drops, for the log."""

    def __init__(self, comps, plan: Plan, L: int, packing: bool, seed: int, fmt: str, too_long: str):
        self.comps, self.plan, self.L, self.packing, self.seed = comps, plan, L, packing, seed
        self.fmt, self.drop, self.by_pairs, self._cum_rows = fmt, too_long == "drop", False, [0]
        self.too_long = {"too_long_truncated": 0, "too_long_dropped": 0}
        self.units = []
        for k, c in enumerate(comps):
            rows = np.zeros(len(plan.blocks[k]), np.int64)
            for b in range(len(rows)):
                _, _, row_of, cut = self._layout(k, b)
                rows[b] = row_of.max() + 1 if len(row_of) else 0
                self.too_long["too_long_dropped" if self.drop else "too_long_truncated"] += cut
            self.units.append(rows)

    @functools.lru_cache(maxsize=64)
    def _layout(self, k: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """Block b of component k: its records' first documents in layout order, their lengths (a preference
        record's two), the row of each (-1: left out), and how many are longer than L pairs."""
        first, count, _ = self.plan.blocks[k][b]
        lengths = self.comps[k].source.block_lengths(b)
        if self.fmt == "preference":
            lengths = lengths.reshape(-1, 2)
        at = np.random.default_rng([self.seed, 1 << 23, k, b]).permutation(len(lengths))
        lengths = lengths[at]
        pairs = (lengths - 1).sum(1) if self.fmt == "preference" else lengths - 1
        long = pairs > self.L
        keep = (pairs >= 1) & ~(long & self.drop)
        if self.fmt == "preference" or not self.packing:
            row_of = np.where(keep, np.cumsum(keep) - 1, -1)
        else:
            row_of, row, room = np.full(len(pairs), -1), -1, 0
            for i in np.flatnonzero(keep):
                n = min(int(pairs[i]), self.L)
                if n > room:
                    row, room = row + 1, self.L
                row_of[i], room = row, room - n
        step = 2 if self.fmt == "preference" else 1
        return first + step * at, lengths, row_of, int(long.sum())

    def __call__(self, g: int) -> dict:
        while self._cum_rows[-1] <= g:
            self.rows_before(len(self._cum_rows))
        e = int(np.searchsorted(self._cum_rows, g, side="right")) - 1
        comp, block, cum, rows = self._epoch(e)
        r = int(feistel([g - self.rows_before(e)], rows, (self.seed, 1 << 21, e))[0])
        j = int(np.searchsorted(cum, r, side="right"))
        k, b = int(comp[j]), int(block[j])
        docs, lengths, row_of, _ = self._layout(k, b)
        mine = np.flatnonzero(row_of == r - (int(cum[j]) - int(self.units[k][b])))
        src, L = self.comps[k].source, self.L
        if self.fmt == "preference":
            i = int(mine[0])
            (c, cm), (x, xm) = src.masked_spans([(docs[i] + s, lengths[i, s], 0, lengths[i, s]) for s in (0, 1)])
            c, cm, x, xm, _ = fit_pair(c, cm, x, xm, L, "drop" if self.drop else "truncate")
            got = [] if c is None else [(c, cm), (x, xm)]
        else:
            got = src.masked_spans([(docs[i], lengths[i], 0, min(int(lengths[i]), L + 1)) for i in mine])
        out = row([ids for ids, _ in got], L, [m for _, m in got])
        if len(self.comps) > 1:
            out["comp_pairs"] = np.bincount([k], [sum(len(ids) - 1 for ids, _ in got)], len(self.comps)).astype(np.int64)
        return out


def fit_pair(c, cm, r, rm, L: int, too_long: str):
    """(c, cm, r, rm, what happened) of a preference pair made to fit L pairs in one row: the prompts stay
    whole and each response is cut, the longer first, so both keep as many tokens as they can (c None if
    dropped: also when a prompt alone leaves a response no trained target)."""
    if len(c) + len(r) - 2 <= L:
        return c, cm, r, rm, ""
    # Each sequence's first trained token (after token 0, which is never a target) starts its response.
    sc, sr = int(np.argmax(cm[1:])) + 1, int(np.argmax(rm[1:])) + 1
    room = L + 2 - sc - sr  # response tokens the row holds, both together
    if too_long == "drop" or room < 2 or not cm[1:].any() or not rm[1:].any():
        return None, None, None, None, "too_long_dropped"
    rc, rr = len(c) - sc, len(r) - sr
    kc = min(rc, max(room // 2, room - rr))
    kr = min(rr, room - kc)
    c, cm, r, rm = c[:sc + kc], cm[:sc + kc], r[:sr + kr], rm[:sr + kr]
    if not (cm[1:].any() and rm[1:].any()):
        return None, None, None, None, "too_long_dropped"
    return c, cm, r, rm, "too_long_truncated"


class Staged:
    """Rows of an indexed mixture whose weights change at given steps (a curriculum). Stage t, from global
    row starts[t] on, is a stream of epochs of its own, planned with its weights and permuted afresh; the
    unfinished epoch of the stage before is left there. Row g stays a pure function of g, so batches do
    not depend on the process count and a resume across a change is exact."""

    def __init__(self, starts: list[int], rows: list[Rows]):
        self.starts, self.rows = starts, rows

    def __call__(self, g: int) -> dict:
        t = int(np.searchsorted(self.starts, g, side="right")) - 1
        return self.rows[t](g - self.starts[t])


def fields(L: int) -> tuple[Field, ...]:
    """What a packed row holds, every token source's (text, chat and preference data): at each of its L
    places, the input token, the target (the next one), its position in its document, the document's
    segment id (1, 2, ...; 0 is padding) and whether the loss counts it."""
    return tuple(Field(name, (L,), "int32", ("batch", "length"))
                 for name in ("inputs", "targets", "positions", "segment_ids", "loss_mask"))


def row(frags: list[np.ndarray], L: int, masks: list[np.ndarray] | None = None) -> dict:
    """One row from document fragments: a fragment of m+1 tokens gives m (input, target) pairs. With `masks`
    (one per fragment, per token), a pair is trained where its target token's mask is 1; else every pair."""
    out = {f.name: f.zeros() for f in fields(L)}
    at = 0
    for seg, f in enumerate(frags, 1):
        m = len(f) - 1
        out["inputs"][at:at + m], out["targets"][at:at + m] = f[:-1], f[1:]
        out["positions"][at:at + m] = np.arange(m)
        out["segment_ids"][at:at + m] = seg
        out["loss_mask"][at:at + m] = 1 if masks is None else masks[seg - 1][1:]
        at += m
    return out
