"""The data order: every epoch is a permutation of the corpus's windows, epochs differ, the data ends
after `data.epochs`, and the run then saves and finishes cleanly."""

import jax
import numpy as np
import pytest

from maxlm import mesh as mesh_lib, sharding
from maxlm.config import ConfigError, load
from maxlm.data import make_loader

# Windows of 2048 bytes: the 493k-byte corpus has 240 of them, 30 batches of 8 per epoch.
ARGS = ["seq_len=2048", "global_batch_size=8"]


def loader(overrides=()):
    cfg = load("configs/tiny.yml", [*ARGS, *overrides])
    m = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, 8), jax.devices())
    return make_loader(cfg, sharding.named(m, ("batch", "length"), sharding.rules(cfg)))


def first_tokens(batch) -> list[bytes]:
    return [row.tobytes() for row in np.asarray(batch["inputs"])]


def test_epochs_are_fresh_permutations_and_then_the_data_ends():
    from maxlm.data.corpus import pydoc_documents

    ld = loader(["data.epochs=2"])
    spe = ld.steps_per_epoch
    assert spe == ld.rows_per_epoch // 8 > 0
    epochs = [[next(ld) for _ in range(spe)] for _ in range(2)]
    with pytest.raises(StopIteration):
        next(ld)
    # Every document's (input) tokens are trained once per epoch, except the tail that does not fill a
    # row and the rows that do not fill a batch.
    corpus = np.bincount(np.concatenate([np.frombuffer(t.encode(), np.uint8)[:-1] for t in pydoc_documents()]), minlength=256)
    dropped = (ld.rows_per_epoch % 8 + 1) * 2048
    for batches in epochs:
        x = np.concatenate([np.asarray(b["inputs"])[np.asarray(b["loss_mask"]) == 1] for b in batches])
        seen = np.bincount(x, minlength=256)
        assert (seen <= corpus).all() and corpus.sum() - seen.sum() <= dropped
        rows = [r for b in batches for r in first_tokens(b)]
        assert len(set(rows)) == len(rows)  # no row twice within an epoch
    assert first_tokens(epochs[0][0]) != first_tokens(epochs[1][0])  # another order


def test_same_seed_same_batches_and_state_round_trip():
    a, b = loader(), loader()
    for _ in range(3):
        assert first_tokens(next(a)) == first_tokens(next(b))
    state = a.get_state()
    want = [first_tokens(next(a)) for _ in range(2)]
    c = loader()
    c.set_state(state)
    assert [first_tokens(next(c)) for _ in range(2)] == want
    # A position saved by a maxlm that ordered documents one by one would land elsewhere: refused by name.
    with pytest.raises(ConfigError, match=r"^the checkpoint's data position is from a maxlm that ordered prepared data a "
                                          r"document at a time; .*init_from"):
        c.set_state(state["at"])


@pytest.mark.slow  # ~15 s; the suite budget (docs/testing.md)
def test_run_ends_cleanly_when_the_data_runs_out(tmp_path):
    from conftest import run_cli

    # One epoch of the 493k-byte corpus is about 3850 rows of 128 tokens: 7 steps of 512 rows.
    r = run_cli("configs/tiny.yml", "seq_len=128", "global_batch_size=512", "model.n_layers=1", "model.d_model=64", "model.d_ff=128",
                "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=16", "data.epochs=1", "steps=100",
                "sample_tokens=0", "log_every=1", f"run_dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "data.epochs=1 lasts about 7 steps, fewer than steps=100: the run will end when the data does" in r.stdout
    assert "the data ran out: data.epochs=1 ended after step 7; saving it and finishing early" in r.stdout
    assert (tmp_path / "checkpoints" / "7" / "commit_success.txt").exists()
