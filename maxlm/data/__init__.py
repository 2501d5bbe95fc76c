"""The data path: sources, tokenizers, packing on grain, and the `prepare` CLI.

`schema(cfg)` declares the batch the data yields (maxlm.batch); `make_loader(cfg, batch)` yields global
batches of it, each field sharded as the abstract `batch` says; `make_eval_loader` the held-out ones;
`preflight(cfg)` checks the data config cheaply, before the trainer compiles. They are imported lazily
so that `python -m maxlm.data.prepare` and its worker processes, and `preflight`, start without jax."""


def schema(cfg):
    """The batch every token source yields: packed rows (order.fields) of global_batch_size x seq_len. Chat
    and preference rows also report what share of each row's tokens the loss mask leaves out."""
    from maxlm.batch import Schema
    from maxlm.data.order import fields

    return Schema(fields(cfg.seq_len), cfg.global_batch_size, masked_fraction if cfg.data.format != "text" else None)


def masked_fraction(batch: dict) -> dict:
    """Per row, the share of its tokens (padding aside) that the loss mask leaves out (prompts, system text):
    the mean and the largest over the batch."""
    import jax.numpy as jnp

    real_BL = batch["segment_ids"] > 0
    kept_B = jnp.sum((batch["loss_mask"] > 0) & real_BL, axis=1)
    frac_B = 1.0 - kept_B / jnp.maximum(jnp.sum(real_BL, axis=1), 1)
    return {"masked_frac": jnp.mean(frac_B), "masked_frac_max": jnp.max(frac_B)}


def preflight(cfg) -> None:
    """The Loader's cheap checks, without jax and without reading any documents: data.path, eval.path
    (with eval on) and the mixture's paths resolve to data of their kind; data.tokenizer loads, has the
    BOS/EOS the config adds and fits model.vocab_size; prepared datasets match the tokenizer and BOS/EOS;
    for chat/preference data (data.format) the chat template loads and renders a built-in conversation.
    Raises ConfigError (one line) on the first problem. The Loader repeats these checks."""
    from maxlm.data.checks import preflight

    preflight(cfg)


def say(msg: str) -> None:
    """The log of a loader made without one (a notebook, a benchmark): maxlm's own, from process 0."""
    import jax

    if jax.process_index() == 0:
        print(f"maxlm: {msg}", flush=True)


def placed(cfg, batch) -> dict:
    """The abstract batch a loader fills: `batch` itself (StateSpec.abstract_batch, each field placed), or
    for one jax Sharding (a notebook's single device), every field of `schema(cfg)` placed by it."""
    if isinstance(batch, dict):
        return batch
    import jax

    s = schema(cfg)
    return {f.name: jax.ShapeDtypeStruct((s.rows, *f.shape), f.dtype, sharding=batch) for f in s.fields}


def make_loader(cfg, batch, log=None):
    """The training batches, laid out as `batch` says (see `placed`); the loader says what it skips or drops
    through `log` (default: print)."""
    from maxlm.data.pipeline import Loader

    return Loader(cfg, placed(cfg, batch), log=log)


def eval_config(cfg):
    """The config the eval loader reads: the held-out source (`eval.source` or `data.source`) at `eval.path`,
    read once (data.epochs=1) in threads; everything else (field, tokenizer, BOS/EOS, packing, seed) as in
    training."""
    from maxlm import config

    src = config.eval_source(cfg)
    path = "" if src in ("pydoc", "synthetic") else cfg.eval.path
    data = dict(source=src, path=list(path) if isinstance(path, tuple) else path, mixture={}, epochs=1, workers=0)
    # The eval loader's config evaluates nothing itself (its data *is* eval.path).
    return config.replace(cfg, {"data": data, "eval": {"every": 0}})


def make_eval_loader(cfg, batch, log=None):
    """The held-out batches (see `eval_config`); pydoc gives its held-out topics, synthetic another seed's
    documents. Errors name the eval keys."""
    from maxlm.errors import ConfigError
    from maxlm.data.checks import as_eval
    from maxlm.data.pipeline import Loader

    try:
        return Loader(eval_config(cfg), placed(cfg, batch), split="eval", log=log)
    except ConfigError as e:
        raise as_eval(e) from None
