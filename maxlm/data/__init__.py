"""Data pipelines on grain. `make_loader(cfg, mesh_batch_sharding)` yields global, sharded batches."""

from maxlm.data.pipeline import Loader, make_loader  # noqa: F401
