"""The embedding lookup written per device: GSPMD partitions it badly on some meshes.

- With pipeline stages, XLA splits the lookup's batch over the idle `stage` axis and gathers it back: an
  activation-sized all-gather across the slices.
- With the vocabulary split (over `tensor`), it replicates the batch's rows before splitting them again.
  Llama-3-8B's step all-gathered 0.5 GiB more per chip on 8 H100s at fsdp=4 x tensor=2, for 0.125 GiB less
  all-to-all, and 1.0 GiB more on v5p-8 at fsdp=2 x tensor=2, for 0.25 GiB less (benchmarks/embed_hlo.py).
- XLA logs "Involuntary full rematerialization" for both, on CPU and GPU (libtpu logs nothing).
Here each device gathers the tokens of the devices that share its slice of the table's `embed` dimension,
looks up its slice of their rows (rows of other vocabulary shards are zero, then summed over those
shards), and an all-to-all hands each device its own tokens' rows whole. Nothing is split over `stage`:
every stage computes the same lookup and its gradient. With the table split over fsdp alone, the step has
the plain lookup's collectives and memory (the 8-H100 Llama-3-8B step at fsdp=8).
"""

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from maxlm.sharding import active_spec


def _axes(entry, mesh) -> tuple[str, ...]:
    """A spec entry's mesh axes that split anything (a size-1 axis would only add a mask or a collective)."""
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return tuple(a for a in axes if mesh.shape[a] > 1)


def per_device(take, table_VD, tokens_BL, dtype):
    """take(table, tokens, dtype) (decoder.lookup) run on each device's shards, or None where this layout
    does not apply (no mesh, a vocabulary axis that also splits the tokens, or a batch that does not
    divide): the caller then looks up as usual."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    vocab, embed = (_axes(e, mesh) for e in active_spec(("vocab", "embed")))
    batch, length = (_axes(e, mesh) for e in active_spec(("batch", "length")))
    shards = lambda axes: math.prod(mesh.shape[a] for a in axes)  # noqa: E731
    B, L = tokens_BL.shape
    if set(vocab) & set(batch + length) or B % shards(batch) or L % shards(length):
        return None
    V_loc = table_VD.shape[0] // shards(vocab)

    # The table's rows meet other tokens on each device along these axes: its gradient sums over them.
    spread = tuple(a for a in batch + length if a not in embed + vocab)

    def body(table_vd, tok_bl):
        table_vd = jax.lax.pcast(table_vd, spread, to="varying")
        for a in embed:  # the tokens of every device holding another slice of my rows' width
            if a in batch + length:
                tok_bl = jax.lax.all_gather(tok_bl, a, axis=0 if a in batch else 1, tiled=True)
        if vocab:  # my vocabulary shard's rows; the others' are zero here, summed over the shards
            local = tok_bl - jax.lax.axis_index(vocab) * V_loc
            ok = (local >= 0) & (local < V_loc)
            x = take(table_vd, jnp.where(ok, local, 0), dtype) * ok[..., None].astype(dtype)
            x = jax.lax.psum(x, vocab)
        else:
            x = take(table_vd, tok_bl, dtype)
        for a in reversed(embed):  # my tokens back, each with every slice of the width, in the width's order
            if a in batch + length:
                x = jax.lax.all_to_all(x, a, 0 if a in batch else 1, 2, tiled=True)
            else:
                x = jax.lax.all_gather(x, a, axis=2, tiled=True)
        return x

    spec = lambda axes: axes if len(axes) != 1 else axes[0]  # noqa: E731
    tok = P(spec(batch) or None, spec(length) or None)
    return jax.shard_map(body, in_specs=(P(spec(vocab) or None, spec(embed) or None), tok),
                         out_specs=P(*tok, None))(table_VD, tokens_BL)
