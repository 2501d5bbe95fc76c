"""Training rows from documents, on grain: deterministic, checkpointable, sharded per process.

A document of n tokens gives n-1 (input, target) pairs. A row holds `seq_len` pairs. With
`data.packing=true` documents are concatenated and split into rows; a document cut at a row's end
continues in another row. With `packing=false` a row holds one document (a long one continues on
further rows) and padding. Either way each document fragment in a row gets its own segment id
(attention never crosses it), positions restart at 0 for each, and padding has segment 0 and no loss.

Two ways to make rows:
- Indexed (token sources: prepared, synthetic, pydoc): every block of documents' pair total is
  known up front, so row g of the job is a pure function of g (maxlm.data.order): each epoch a fresh
  permutation of blocks (a mixture's epoch takes each component's weight's share of the pairs, in
  blocks), documents permuted within a block, rows permuted within the epoch; staged weights start a
  fresh stream of epochs at each stage (order.Staged). Each process loads only
  the rows of its share of every global batch, and the batches are the same for any process count.
- Streaming (any mixture with a text source): one stream per component, pass after pass over a fresh
  permutation of its items (`Order`: documents, or a text source's units, see sources.py). Each
  process reads every P-th item, shuffles a unit's documents, tokenizes them as they are read and packs
  its own rows, so the batches depend on the process count (a resume with another process count is
  refused anyway). The packer takes the next document from the component furthest below its weight's
  share of the (input, target) pairs taken so far. `data.workers` moves the reading and tokenizing to
  worker processes (maxlm.data.stream).

Chat and preference data (data.format: JSONL streamed, or prepared from it and indexed, order.RecordRows)
carry a per-token mask with each document (see maxlm.data.chat): a row's loss_mask at pair j is the mask
of its target token. A conversation is
never split across rows: with packing it starts a new row when it does not fit in the room left, without
packing it has a row of its own. A preference record is one row: segment 1 prompt+chosen, segment 2
prompt+rejected. One longer than seq_len pairs is truncated (its start kept) or dropped per
data.too_long, and counted (`too_long_truncated`, `too_long_dropped`) beside the skips.
"""

import time

import grain
import jax
import numpy as np

from maxlm import distributed
from maxlm.config import ConfigError, eval_source
from maxlm.data import chat, checks, say, sources, tokenizer
from maxlm.data.corpus import pydoc_documents
from maxlm.data.order import Order, Plan, RecordRows, Rows, Staged
from maxlm.data.stream import (CHUNK, PER_ELEMENT, TOO_LONG, Limits, Packer, ReadChunk, budget_error, counted,
                               find_packer, strict_error)

SYNTHETIC_DOCS = 100_000
HELDOUT_SEED = 1 << 30  # eval split of `synthetic`: documents from seed data.seed + this


class Component:
    """One source of a (possibly one-element) mixture."""

    def __init__(self, kind: str, source, weight, name: str, key: str = ""):
        self.kind, self.source, self.name, self.key = kind, source, name, key or kind
        self.stages = {int(k): float(v) for k, v in weight.items()} if hasattr(weight, "items") else {0: float(weight)}
        self.weight = self.stages[0]  # stages: {first step: weight}
        self.tokenized = kind in sources.TOKEN_KINDS

    def weight_at(self, step: int) -> float:
        return self.stages[max(k for k in self.stages if k <= step)]


def _components(cfg, tok, split: str, template=None) -> list[Component]:
    """split: train, or eval (the held-out data: cfg is then the eval loader's config, see make_eval_loader).
    pydoc's held-out topics leave the training data whenever the eval reads them."""
    d = cfg.data
    pydoc_split = "eval" if split == "eval" else "train" if cfg.eval.every and eval_source(cfg) == "pydoc" else "all"
    comps = []
    for i, (name, s, key) in enumerate(checks.specs(cfg)):
        kind, path, field = s["source"], s["path"], s["field"]
        if kind == "pydoc":
            docs = pydoc_documents(pydoc_split)
            src = sources.InMemorySource([tokenizer.document_ids(tok, t, d.add_bos, d.add_eos) for t in docs])
        elif kind == "synthetic":
            seed = d.seed + (HELDOUT_SEED if split == "eval" else i)
            src = sources.SyntheticSource(SYNTHETIC_DOCS, cfg.seq_len, min(cfg.model.vocab_size, tok.vocab_size), seed)
        elif kind == "prepared":
            src = sources.PreparedSource(sources.resolve(path, key, dirs=True), key)
            checks.check_prepared(src.meta, d, template)
        else:
            src = sources.text_source(kind, path, field, key, records=d.format != "text")
        if len(src) == 0:
            raise ConfigError(f"data source {name} holds no documents (`{key}`={path}); point it at non-empty data")
        label = name if d.source == "mixture" else kind
        if kind == "pydoc" and pydoc_split != "all":
            label += " held-out topics" if pydoc_split == "eval" else " without the held-out topics"
        elif kind == "synthetic" and split == "eval":
            label += f" held-out (seed {seed})"
        shown = ",".join(map(str, path)) if isinstance(path, (list, tuple)) else path
        comps.append(Component(kind, src, s["weight"], f"{label} {shown}" if shown else label, name))
    return comps


def _bytes(n: int) -> str:
    return next(f"{n / 2 ** e:,.1f} {u}" for e, u in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB"), (0, "B"))
                if n >= 2 ** e or not e)


def _in_workers(ds: grain.MapDataset, workers: int) -> grain.IterDataset:
    """Prefetch `ds` with 2 threads in this process, or compute it in `workers` worker processes."""
    it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0 if workers else 2, prefetch_buffer_size=4))
    if not workers:
        return it_ds
    from absl import flags  # grain's workers read absl flags; outside absl.app.run nobody has parsed them
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))


def _row_share(batch: dict, B: int) -> tuple[list[int], int, int]:
    """The rows of each global batch this process's devices hold (whole rows: a sequence split over
    processes is loaded whole by each), and which of the equal row blocks that is, of how many."""
    mine = set()
    for a in batch.values():
        index = a.sharding.addressable_devices_indices_map(a.shape)
        mine |= {r for idx in index.values() for r in range(*idx[0].indices(B))}
    mine = sorted(mine)
    lb = len(mine)
    if B % lb or mine != list(range(mine[0], mine[0] + lb)) or mine[0] % lb:
        raise ConfigError(f"global_batch_size={B} does not split into equal blocks of rows per process (this one "
                          f"holds rows {mine[0]}..{mine[-1]}); make it a multiple of the processes' data-parallel size")
    return mine, mine[0] // lb, B // lb


class Loader:
    """Iterates global batches: each process loads its share and `make_array_from_process_local_data`
    assembles the sharded global array. `wait_s` accumulates time spent waiting on the host pipeline."""

    def __init__(self, cfg, batch: dict, split: str = "train", log=None):
        d = cfg.data
        self.template = checks.check_chat(cfg)  # chat/preference: the loaded template; None for text
        self.tokenizer = tok = checks.load_tokenizer(cfg)
        self.epochs = d.epochs  # passes over the data before it ends (0: endless)
        B, L = cfg.global_batch_size, cfg.seq_len
        mine, group, n_groups = _row_share(batch, B)
        self.local_batch = lb = len(mine)
        self.comps = comps = _components(cfg, tok, split, self.template)
        self.indexed = all(c.tokenized for c in comps)
        self._counted = counted(d.format)
        self.skips = {r: 0 for r in self._counted}
        self.first_skip: dict[str, str] = {}
        self._strict, self._budget, self._L, self._format = d.strict, d.max_bad_records, L, d.format
        self._steps = sorted({k for c in comps for k in c.stages})  # where a staged mixture's weights change
        if self.indexed:
            plans, stages = [], []
            for t, step in enumerate(self._steps):  # stage 0 keeps data.seed: an unstaged mixture is unchanged
                seed = d.seed + (t << 32)
                plans.append(Plan(comps, seed, [c.weight_at(step) for c in comps]))
                stages.append(Rows(comps, plans[-1], L, d.packing, seed) if self.template is None else
                              RecordRows(comps, plans[-1], L, d.packing, seed, d.format, d.too_long))
                per_epoch = stages[-1].rows_in_epoch(0)
                if per_epoch < B:
                    raise ConfigError(f"the data makes {per_epoch} rows of seq_len={L} per epoch: too few for a batch "
                                      f"of {B}; lower seq_len or global_batch_size")
            self.rows = rows = stages[0] if len(stages) == 1 else Staged([step * B for step in self._steps], stages)
            self.rows_per_epoch = stages[0].rows_in_epoch(0)
            self.steps_per_epoch = self.rows_per_epoch // B
            self.epoch_pairs = [p.pairs(0) for p in plans]  # per stage, per component: shown by describe()
            total = rows.rows_before(d.epochs) // B * lb if d.epochs else lb << 40  # 0 epochs: unbounded

            def row_of(i: int) -> dict:
                # This process's i-th row is row `mine[r]` of global batch k, so every global batch is the
                # same for any process count, and each process reads only the rows its devices hold.
                k, r = divmod(int(i), lb)
                return rows(k * B + mine[r])

            it_ds = _in_workers(grain.MapDataset.range(total).map(row_of).batch(lb, drop_remainder=True), d.workers)
        else:
            self.rows = self.rows_per_epoch = self.steps_per_epoch = self.epoch_pairs = None  # unknown until tokenized
            it_ds = self._streams(d, comps, group, n_groups).batch(lb, drop_remainder=True)
        self._it = iter(it_ds)
        self._packer = None if self.indexed else find_packer(self._it)
        self._batch = batch  # each field's global shape and sharding
        self._copies = jax.process_count() // n_groups  # processes reading the same documents count them once
        self._gather = distributed.HostGather("data") if jax.process_count() > 1 and not self.indexed else None
        self.pairs = np.zeros(len(comps), np.int64)  # (input, target) pairs taken per component in this stage
        self.batches = 0  # taken so far (the step)
        self.wait_s = 0.0
        self.messages: list[str] = []  # what it has said, each line also given to `log` as it happens
        self._log = log or say
        for c in comps:
            for where in getattr(c.source, "v1", []):
                self._say(f"data: {where} was prepared by an older maxlm (maxlm-tokens-v1, ArrayRecord shards): each "
                          f"shard a process opens keeps 8 bytes per document in memory, and a document is read whole "
                          f"for every row it touches; prepare it again (python -m maxlm.data.prepare) for neither")
            for where in getattr(c.source, "scanned", []):
                self._say(f"data: {where} was prepared without its blocks' totals, so every document's length was read "
                          f"at start; prepare it again to start without reading them")
        if self.indexed and self.template is not None:
            what = "conversation" if d.format == "chat" else "preference pair"
            cut = stages[0].too_long
            self._say(f"data: whole {what}s per row: every {what}'s length was read at start to lay out the rows "
                      f"(8 bytes each); {cut['too_long_truncated']:,} longer than seq_len={L} pairs are truncated and "
                      f"{cut['too_long_dropped']:,} dropped in each epoch, per data.too_long")
        elif self.indexed and not d.packing and any(c.kind == "prepared" for c in comps):
            self._say("data: packing=false gives each document rows of its own, so every document's length was read at "
                      "start to count them (8 bytes each)")

    def _say(self, msg: str) -> None:
        self.messages.append(msg)
        self._log(msg)

    def _streams(self, d, comps: list[Component], group: int, n_groups: int) -> Packer:
        """Streaming: one stream per component, pass after pass over its items (documents, or a text
        source's units), this process's share of them; the packer mixes them in their weights' shares of
        pairs. Processes that hold the same rows (the sequence split over them: mesh.context) read and
        pack the same items; each group of rows reads every n_groups-th."""
        encoder = chat.Encoder(d.format, self.template) if self.template is not None else None
        streams, limits = [], []
        for k, c in enumerate(comps):
            n, per = len(c.source), PER_ELEMENT.get(c.kind, CHUNK)
            items = n * d.epochs if d.epochs else n << 30  # 0 epochs: unbounded
            if items < n_groups:  # some process would read nothing, and so end the job's data at once
                what = "documents" if c.tokenized else "units"
                if c.kind in PER_ELEMENT:
                    what += f" (the {'lines' if c.kind == 'jsonl' else 'row groups'} that start in one MiB of a file)"
                raise ConfigError(f"data: {c.name} has {n} {what} for {d.epochs} epoch(s) over {n_groups} reading "
                                  f"processes, so some would read nothing; give it more data, or set data.epochs=0")
            read = ReadChunk(c, Order(n, d.seed, k), per, d.tokenizer, d.add_bos, d.add_eos, group, n_groups, items,
                              encoder)
            streams.append(_in_workers(grain.MapDataset.range(-(-items // (per * n_groups))).map(read), d.workers))
            limits.append(Limits(n, group, n_groups, d.strict, d.max_bad_records))
        stages = [(step * self.local_batch, [c.weight_at(step) for c in comps]) for step in self._steps]
        return Packer(streams, self._L, d.packing, limits, d.format, d.too_long, stages, [c.name for c in comps])

    def describe(self) -> str:
        parts = []
        for k, c in enumerate(self.comps):
            src = c.source
            if c.tokenized:
                size = f"{len(src):,} documents, {src.n_tokens:,} tokens"
            elif isinstance(src, (sources.JsonlSource, sources.ParquetSource)):
                size = f"{len(src.files):,} file(s), {_bytes(int(src.sizes.sum()))} in {len(src):,} unit(s)"
            else:
                size = f"{len(src):,} files"
            if len(self.comps) > 1:
                if self.indexed:
                    size += "; " + ", ".join(f"{p[k] / p.sum():.1%} of an epoch's tokens" + (f" from step {st}" if st else "")
                                             for st, p in zip(self._steps, self.epoch_pairs))
                else:
                    size += "; " + ", ".join(
                        f"{c.weight_at(st) / sum(x.weight_at(st) for x in self.comps):.0%} of the tokens"
                        + (f" from step {st}" if st else "") for st in self._steps)
            parts.append(f"{c.name} ({size})")
        how = ("indexed: batches independent of the process count" if self.indexed
               else "streaming: tokenized as read, shuffled a unit at a time")
        if self.template is not None:
            rows = ("one preference pair per row (data.packing does not apply)" if self._format == "preference"
                    else "whole conversations per row")
            how += f"; {self._format} records, chat template {self.template.name}, loss on assistant tokens; {rows}"
        return f"{' + '.join(parts)}; {how}"

    def shares(self) -> dict[str, float]:
        """A mixture's realised shares of the (input, target) pairs taken in the current stage, per component:
        streaming, the job's (the processes' counts are summed every step anyway); indexed, this process's
        rows' (no process reads another's rows; every epoch's shares are exact by plan)."""
        if len(self.comps) < 2 or not self.pairs.sum():
            return {}
        return {c.key: float(x) for c, x in zip(self.comps, self.pairs / self.pairs.sum())}

    def metrics(self) -> dict:
        """What a step's metrics row reports of the data: a mixture's realised shares (`shares`)."""
        return {f"data_share_{k}": v for k, v in self.shares().items()}

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        """The next global batch; StopIteration once `data.epochs` have been read."""
        t = time.perf_counter()
        error = None
        try:
            local = next(self._it)
        except StopIteration:
            local = None
        except ConfigError as e:  # the packer's verdict on this process's documents (see PackerIterator)
            if self.indexed or jax.process_count() == 1:
                raise
            local, error = None, e
        self.wait_s += time.perf_counter() - t
        if not self.indexed:  # also when the data ends: skips in its last documents count too
            packer = self._packer
            n = len(self._counted)
            counts = np.r_[local is not None, error is not None, [packer.skips[r] for r in self._counted], packer.pairs]
            if jax.process_count() > 1:
                # Streaming processes pack their own rows, so one may run out a step before another, and
                # a bad-record budget must be judged on the job's total: decide both together. A process
                # whose packer stopped on bad data (its own share, or its own count over the budget) says
                # so here, and every process stops at this same step: it with its reason, the others
                # pointing at it, rather than waiting for it at the next collective.
                counts = self._gather(counts)
                failed = np.flatnonzero(counts[:, 1])
                if len(failed):
                    raise error or ConfigError(f"data: process {failed[0]} stopped on bad data in its share of the "
                                               f"documents (its log names the problem); stopping with it")
                counts = np.r_[counts[:, 0].min(), 0, counts[:, 2:].sum(0) // self._copies]
            self.pairs = counts[2 + n:]  # the job's, per component
            self._account(dict(zip(self._counted, counts[2:2 + n].tolist())), packer.first)
            if local is not None and not counts[0]:
                self._say("data: another process ran out of data; dropping this process's last batch")
                local = None
        if local is None:
            raise StopIteration
        if self.indexed and "comp_pairs" in local:  # this process's rows' pairs, counted from the stage's start
            if self.batches in self._steps:
                self.pairs[:] = 0
            self.pairs += local.pop("comp_pairs").sum(0)
        self.batches += 1
        return {k: jax.make_array_from_process_local_data(self._batch[k].sharding, v, self._batch[k].shape)
                for k, v in local.items()}

    def _account(self, skips: dict, first: dict) -> None:
        """Record skips; say the first of each kind; stop once they exceed what the config allows."""
        for reason, n in skips.items():
            if n and not self.skips[reason]:
                where = sources.locate(first.get(reason, "in another process's share"))
                what = f"skipping documents: {reason}"
                if reason in TOO_LONG:
                    what = (f"{self._format} records longer than seq_len={self._L} pairs are "
                            f"{reason.removeprefix('too_long_')} per data.too_long")
                self._say(f"data: {what} (first: {where}); counted in metrics.jsonl as data_skipped_{reason}")
            self.skips[reason] = n
        self.first_skip = {r: sources.locate(w) for r, w in first.items()}
        bad = sum(self.skips[r] for r in sources.BAD_RECORDS)
        if self._strict and any(self.skips[r] for r in sources.SKIPS):
            reason = next(r for r in sources.SKIPS if self.skips[r])
            raise strict_error(reason, first.get(reason, "another process"))
        if bad > self._budget:
            reason = next(r for r in sources.BAD_RECORDS if self.skips[r])
            raise budget_error(bad, self._budget, reason, first.get(reason, "on another process"))

    def close(self) -> None:
        """Stop worker processes and prefetch threads (left open, they complain at interpreter exit)."""
        close = getattr(self._it, "close", None)
        if close:
            close()
        # grain's close cancels the queued reads but leaves the running ones; wait for those here (they
        # take milliseconds), not at interpreter exit, where a read from a bucket that has gone away
        # (the GCS emulator at the end of the tests) would retry for minutes.
        executor = getattr(self._it, "_executor", None)
        if executor is not None:
            executor.shutdown(wait=True)

    def get_state(self) -> dict:
        state = self._it.get_state()
        return {"order": "blocks", "at": state, "batches": self.batches, "pairs": self.pairs.tolist()} if self.indexed \
            else state

    def set_state(self, state: dict) -> None:
        if self.indexed:
            if state.get("order") != "blocks":
                raise ConfigError("the checkpoint's data position is from a maxlm that ordered prepared data a document "
                                  "at a time; resume it with that maxlm, or start a fresh run_dir from its weights "
                                  "(init_from=<its checkpoint>)")
            self.batches, self.pairs[:] = state.get("batches", 0), state.get("pairs", [0] * len(self.pairs))
            state = state["at"]
        self._it.set_state(state)


