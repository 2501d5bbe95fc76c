"""The order a schedule holds its layer stacks in. A circular pipeline (maxlm.schedules.pipeline) with S
stages and R > 1 repeats holds the rows of each stack in its storage order, so that stage s's rows are
its own block; every other schedule holds them in natural layer order. A run's state is laid out once,
at init or restore, never per step. Checkpoints hold that order and record it in their config; restoring
under another (S, R), or reading the params for export, reorders them (`Layout.move`, `Layout.natural`).
"""

from typing import NamedTuple

import jax
import numpy as np


# ---- storage order: stage s's block holds its R chunks, row s*R*K + r*K + k = layer r*S*K + s*K + k ----

def storage_order(L: int, S: int, R: int) -> np.ndarray:
    """The true layer index of each storage row."""
    return np.arange(L).reshape(R, S, L // (S * R)).swapaxes(0, 1).reshape(L)


def to_storage(a, S: int, R: int):
    """A natural-order stack [L, ...] in (S, R)'s storage order (a transpose of [R, S, K] blocks)."""
    if R == 1:
        return a
    K = a.shape[0] // (S * R)
    return a.reshape(R, S, K, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)


def to_natural(a, S: int, R: int):
    if R == 1:
        return a
    K = a.shape[0] // (S * R)
    return a.reshape(S, R, K, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)


SMALL_ROW = 1 << 14  # elements per layer below which `reorder` gathers a stack whole (FP8's scaling state, gains)


def reorder(tree, was: tuple[int, int], now: tuple[int, int]):
    """Every layer stack of `tree` (a leaf under a `layers` key: params, their moments, extras) from the
    storage order `was` = (S, R) to `now`."""
    if not _moves(was, now):
        return tree

    def one(path, a):
        if not (any(getattr(k, "key", None) == "layers" for k in path) and getattr(a, "ndim", 0)):
            return a
        if a.size // a.shape[0] <= SMALL_ROW:  # gathered whole: GSPMD cannot all-to-all a stack sharded on `stage` alone
            return a[np.argsort(storage_order(a.shape[0], *was))[storage_order(a.shape[0], *now)]]
        return to_storage(to_natural(a, *was), *now)  # an all-to-all of each stage's rows
    return jax.tree_util.tree_map_with_path(one, tree)


def _moves(was: tuple[int, int], now: tuple[int, int]) -> bool:
    """Whether the storage orders (S, R) `was` and `now` differ (every R = 1 order is the natural one)."""
    return was != now and (was[1] > 1 or now[1] > 1)


class Layout(NamedTuple):
    """The order the layer stacks are held in: (stages, repeats) of the schedule that runs them; the
    natural layer order unless repeats > 1. The state, the router bias and the exports ask it, and none of
    them knows the pipeline. A checkpoint holds its stacks in its run's layout, which the run's saved
    config records (mesh.stage, pipeline_repeats) and `saved` reads back."""
    stages: int = 1
    repeats: int = 1

    @classmethod
    def saved(cls, config: dict) -> "Layout":
        """The layout of a checkpoint's stacks, from the config dict its run saved."""
        return cls(config.get("mesh", {}).get("stage", 1), config.get("pipeline_repeats", 1))

    @property
    def natural_order(self) -> bool:
        return self.repeats == 1

    def store(self, tree):
        """A tree with natural-order stacks in this layout (inside a trace, or eagerly)."""
        return reorder(tree, (self.stages, 1), tuple(self))

    def natural(self, tree):
        """A tree held in this layout with its stacks in natural layer order."""
        return reorder(tree, tuple(self), (self.stages, 1))

    def store_stack(self, a):
        """One natural-order stack [L, ...] (the router bias) in this layout."""
        return to_storage(a, *self)

    def move(self, tree, was: "Layout"):
        """Placed arrays held in layout `was` moved into this one, in place: the same shardings, the old
        arrays donated (a restore under another pipeline shape)."""
        if not _moves(tuple(was), tuple(self)):
            return tree
        return jax.jit(lambda t: reorder(t, tuple(was), tuple(self)), out_shardings=jax.tree.map(lambda a: a.sharding, tree),
                       donate_argnums=0)(tree)
