"""Permutations computed on demand: bijections at every size, nothing of size n built, and row plans
that cross blocks exactly."""

import time
import tracemalloc

import numpy as np
import pytest

from maxlm.data.order import Order, feistel


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 100, 1000, 4097, 65537])
def test_feistel_is_a_permutation_at_small_sizes(n):
    for key in ((0,), (7, 1, 3)):
        got = feistel(np.arange(n), n, key)
        assert sorted(got.tolist()) == list(range(n))
    if n >= 16:  # a different key, a different order; the same key, the same order
        assert (feistel(np.arange(n), n, (0,)) != feistel(np.arange(n), n, (1,))).any()
        assert (feistel(np.arange(n), n, (0,)) == feistel(np.arange(n), n, (0,))).all()
    if n >= 100:  # like a random permutation: about one fixed point, whatever n is
        fixed = [(feistel(np.arange(n), n, (k,)) == np.arange(n)).sum() for k in range(100)]
        assert 0.6 < np.mean(fixed) < 1.5, np.mean(fixed)


@pytest.mark.parametrize("n", [10**7, 10**10, 2**40 + 1])
def test_feistel_at_scale_without_materialising(n):
    """Spot checks on 200k samples of a permutation of 10^7 .. 10^12 items: images in range, no two samples
    sharing an image, uniform (mean and quartiles), no trace of the input order, and memory that is the
    samples' alone."""
    i = np.random.default_rng(0).choice(min(n, 1 << 62), 200_000, replace=False)
    tracemalloc.start()
    t = time.perf_counter()
    y = feistel(i, n, (3, 1, 4))
    dt = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert y.min() >= 0 and y.max() < n and len(np.unique(y)) == len(y)
    assert abs(y.mean() / n - 0.5) < 0.01 and abs(np.quantile(y, 0.25) / n - 0.25) < 0.01
    assert abs(np.corrcoef(i.astype(float), y.astype(float))[0, 1]) < 0.01
    assert peak < 64 * 200_000 and dt < 5, (peak, dt)  # a few arrays of the samples, whatever n is
    assert (feistel(i[:10], n, (3, 1, 4)) == y[:10]).all()  # the same for a few (Python ints) as for many (numpy)
    assert all(feistel([j], n, (3, 1, 4))[0] == y[k] for k, j in enumerate(i[:50]))


def test_order_passes_are_fresh_permutations_and_take_matches_indexing():
    o = Order(1000, seed=5, k=2)
    seq = o.take(0, 3000)
    for p in range(3):
        assert sorted(seq[p * 1000:(p + 1) * 1000].tolist()) == list(range(1000))
    assert (seq[:1000] != seq[1000:2000]).any()
    assert [o[m] for m in (0, 999, 1000, 2500)] == seq[[0, 999, 1000, 2500]].tolist()
    assert (o.take(950, 100) == seq[950:1050]).all()  # across a pass's end
