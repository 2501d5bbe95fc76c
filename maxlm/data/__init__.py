"""The data path: sources, tokenizers, packing on grain, and the `prepare` CLI.

`make_loader(cfg, batch_sharding)` yields global, sharded batches; `make_eval_loader` the held-out ones;
`preflight(cfg)` checks the data config cheaply, before the trainer compiles. They are imported lazily
so that `python -m maxlm.data.prepare` and its worker processes, and `preflight`, start without jax."""


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


def make_loader(cfg, batch_sharding, log=None):
    """The training batches; the loader says what it skips or drops through `log` (default: print)."""
    from maxlm.data.pipeline import Loader

    return Loader(cfg, batch_sharding, log=log)


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


def make_eval_loader(cfg, batch_sharding, log=None):
    """The held-out batches (see `eval_config`); pydoc gives its held-out topics, synthetic another seed's
    documents. Errors name the eval keys."""
    from maxlm.errors import ConfigError
    from maxlm.data.checks import as_eval
    from maxlm.data.pipeline import Loader

    try:
        return Loader(eval_config(cfg), batch_sharding, split="eval", log=log)
    except ConfigError as e:
        raise as_eval(e) from None
