"""The data path: sources, tokenizers, packing on grain, and the `prepare` CLI.

`make_loader(cfg, batch_sharding)` yields global, sharded batches. It is imported lazily so that
`python -m maxlm.data.prepare` and its worker processes start without jax."""


def make_loader(cfg, batch_sharding):
    from maxlm.data.pipeline import Loader

    return Loader(cfg, batch_sharding)
