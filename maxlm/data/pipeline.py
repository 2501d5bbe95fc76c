"""Fixed-length training windows over a token stream, shuffled per epoch by grain, sharded per process.

A window may span document boundaries; it is then a packed row: each document gets its own segment id
(attention never crosses it), positions restart at 0 for each, and the token that would predict across
the boundary is masked out of the loss.
"""

import functools
import time

import grain
import jax
import numpy as np

from maxlm.config import ConfigError
from maxlm.data import tokenizer
from maxlm.data.corpus import concatenate, pydoc_documents


def _window(tokens: np.ndarray, doc_ids: np.ndarray, start: int, seq_len: int) -> dict:
    tok = tokens[start:start + seq_len + 1]
    doc = doc_ids[start:start + seq_len + 1]
    seg = doc[:-1] - doc[0] + 1  # 1, 2, ... ; 0 is reserved for padding
    first = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
    seg_start = first[np.searchsorted(first, np.arange(seq_len), side="right") - 1]
    return {
        "inputs": tok[:-1],
        "targets": tok[1:],
        "positions": (np.arange(seq_len) - seg_start).astype(np.int32),
        "segment_ids": seg.astype(np.int32),
        "loss_mask": (doc[1:] == doc[:-1]).astype(np.int32),
    }


class Loader:
    """Iterates global batches: each process loads its share and `make_array_from_process_local_data`
    assembles the sharded global array. `wait_s` accumulates time spent waiting on the host pipeline."""

    def __init__(self, cfg, batch_sharding):
        d = cfg.data
        self.tokenizer = tok = tokenizer.load(d.tokenizer)
        needed = tokenizer.ids_needed(tok, d.add_bos, d.add_eos)
        if needed > cfg.model.vocab_size:
            raise ConfigError(f"tokenizer {tok.name} produces ids up to {needed - 1} but `model.vocab_size`="
                              f"{cfg.model.vocab_size}; set model.vocab_size={needed} (or more)")
        tokens, doc_ids = concatenate([tokenizer.document_ids(tok, doc, d.add_bos, d.add_eos)
                                       for doc in pydoc_documents()])
        L = cfg.seq_len
        n_windows = (len(tokens) - 1) // L
        n_proc, proc = jax.process_count(), jax.process_index()
        if cfg.global_batch_size % n_proc:
            raise ConfigError(f"global_batch_size={cfg.global_batch_size} must be divisible by the "
                              f"{n_proc} processes")
        self.local_batch = cfg.global_batch_size // n_proc
        if n_windows < cfg.global_batch_size:
            raise ConfigError(f"the corpus has {n_windows} windows of seq_len={L}: too few for a batch of "
                              f"{cfg.global_batch_size}; lower seq_len or global_batch_size")
        B, lb = cfg.global_batch_size, self.local_batch
        rows_per_epoch = n_windows // B * B  # the tail that does not fill a batch waits for the next epoch
        perms = functools.lru_cache(maxsize=2)(
            lambda epoch: np.random.default_rng([cfg.data.seed, epoch]).permutation(n_windows))

        def window_of(i: int) -> int:
            # This process's i-th row is row `proc*lb + r` of global batch k, so every global batch is the
            # same for any process count, and each process reads only its own rows.
            k, r = divmod(int(i), lb)
            epoch, j = divmod(k * B + proc * lb + r, rows_per_epoch)
            return perms(epoch)[j]  # a fresh permutation every epoch

        self.steps_per_epoch = rows_per_epoch // B
        rows = d.epochs * self.steps_per_epoch * lb if d.epochs else lb << 40  # 0 epochs: unbounded
        ds = (grain.MapDataset.range(rows)
              .map(lambda i: _window(tokens, doc_ids, window_of(i) * L, L))
              .batch(lb, drop_remainder=True))
        self.n_windows, self.tokens_in_corpus = n_windows, len(tokens)
        self._it = iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)))
        self._sharding = batch_sharding
        self.wait_s = 0.0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        """The next global batch; StopIteration once `data.epochs` have been read."""
        t = time.perf_counter()
        local = next(self._it)
        self.wait_s += time.perf_counter() - t
        return {k: jax.make_array_from_process_local_data(self._sharding, v) for k, v in local.items()}

    def get_state(self) -> dict:
        return self._it.get_state()

    def set_state(self, state: dict) -> None:
        self._it.set_state(state)


def make_loader(cfg, batch_sharding) -> Loader:
    return Loader(cfg, batch_sharding)
