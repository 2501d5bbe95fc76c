"""Parameter spec trees: one tree of `Param(shape, axes, init)` per model from which the real params,
their abstract shapes, their logical axes and their count all derive, so these can never disagree."""

import math
import zlib
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp


class Param(NamedTuple):
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: Callable  # (key, shape) -> float32 array


def normal(std: float) -> Callable:
    return lambda key, shape: std * jax.random.normal(key, shape, jnp.float32)


def ones(key, shape):
    return jnp.ones(shape, jnp.float32)


def zeros(key, shape):
    return jnp.zeros(shape, jnp.float32)


def is_param(x) -> bool:
    return isinstance(x, Param)


def is_drawn(s: Param) -> bool:
    """A randomly initialised weight (a matrix, an embedding, the router), not a norm gain or bias that
    starts at 1 or 0."""
    return s.init not in (ones, zeros)


def _path_key(root: jax.Array, path) -> jax.Array:
    # Each leaf's key depends only on its name, so adding a parameter or changing the mesh changes no
    # other parameter's initial value.
    return jax.random.fold_in(root, zlib.crc32(jax.tree_util.keystr(path).encode()) & 0x7FFFFFFF)


def init(specs, key: jax.Array):
    return jax.tree_util.tree_map_with_path(lambda p, s: s.init(_path_key(key, p), s.shape), specs, is_leaf=is_param)


def abstract(specs):
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), specs, is_leaf=is_param)


def axes(specs):
    return jax.tree.map(lambda s: s.axes, specs, is_leaf=is_param)


def count(specs) -> int:
    return sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=is_param))
