"""Gradient accumulation: the batch's M microbatches one after another, in a scan, gradients summed.

Microbatch m takes rows m, m+M, ... (`split`): every device keeps its own rows and nothing moves. With
M = 1 the step's function runs once over the whole batch."""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from maxlm.schedules.layout import Layout
from maxlm.sharding import constrain


def split(x_B, M: int, axes: tuple | None = None):
    """[B, ...] -> [M, B/M, ...], the one way every schedule splits a batch: microbatch m takes rows m, m+M,
    ..., so every device keeps its own rows. With a field's logical `axes` (its batch's first), each
    microbatch is pinned to them."""
    x_MB = x_B.reshape(x_B.shape[0] // M, M, *x_B.shape[1:]).swapaxes(0, 1)
    return x_MB if axes is None else constrain(x_MB, (None, *axes))


class Accumulate(NamedTuple):
    """M microbatches one after another (M = 1: the whole batch at once). `axes`: the batch fields' logical
    axes, by name (maxlm.batch), which each microbatch keeps."""
    microbatches: int = 1
    axes: dict | None = None

    @property
    def layout(self) -> Layout:
        return Layout()

    def value_and_grad(self, terms, params, diff: dict, merges: dict, batch: dict):
        M = self.microbatches

        def value(p_and_diff, mb):
            # The model's auxiliary loss is a mean per microbatch, so it is averaged over them.
            t = terms(p_and_diff[0], p_and_diff[1], mb, None)
            t = t._replace(aux=t.aux / M)
            return t.loss + t.side_loss + t.aux, t

        grad_fn = jax.value_and_grad(value, has_aux=True)
        if M == 1:
            (_, t), (g, nxt) = grad_fn((params, diff), batch)
            return t, g, nxt

        def body(acc, mb):
            (_, t), (g, nxt) = grad_fn((params, diff), mb)
            # Gradients add up; a differentiated extra's next values combine by its own merge (FP8: the max).
            return (jax.tree.map(jnp.add, acc[0], g), {k: merges[k](acc[1][k], v) for k, v in nxt.items()}), t

        zeros = jax.tree.map(jnp.zeros_like, (params, diff))
        (g, nxt), ts = jax.lax.scan(body, zeros, self._split(batch))
        return jax.tree.map(lambda x: jnp.sum(x, axis=0), ts), g, nxt  # the small outputs were stacked

    def forward(self, fn, batch: dict):
        M = self.microbatches
        if M == 1:
            return fn(batch, None)

        def body(acc, mb):
            return jax.tree.map(jnp.add, acc, fn(mb, None)), None
        pieces = self._split(batch)
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(fn, jax.tree.map(lambda x: x[0], pieces), None))
        return jax.lax.scan(body, zeros, pieces)[0]

    def describe(self, n_layers: int, whole: tuple[str, ...]) -> None:
        return None

    def _split(self, batch: dict) -> dict:
        return {k: split(x, self.microbatches, (self.axes or {}).get(k)) for k, x in batch.items()}
