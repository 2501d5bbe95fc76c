"""The data config's cheap checks, without jax: paths resolve, the tokenizer loads and fits the model,
prepared datasets agree with the config, chat templates render. The Loader runs them as it builds the sources; `preflight`
runs them before the trainer compiles, so a typo fails in a second rather than after the compile.
Cheap means listing files and globs, opening the tokenizer, and reading small metadata (a prepared
directory's dataset.json, a Parquet file's footer); never a dataset's documents."""

from maxlm.config import ConfigError, eval_source
from maxlm.data import sources, tokenizer

FREE = ("pydoc", "synthetic")  # sources with no path: they make their own documents


def specs(cfg) -> list[tuple[str, dict, str]]:
    """(name, {source, path, field, weight}, the key that sets its path) for each component."""
    d = cfg.data
    if d.source != "mixture":
        return [(d.source, {"source": d.source, "path": d.path, "field": d.field, "weight": 1.0}, "data.path")]
    return [(name, {"source": s["source"], "path": s.get("path", ""), "field": s.get("field", d.field),
                    "weight": s.get("weight", 1.0)}, f"data.mixture.{name}.path") for name, s in d.mixture.items()]


def load_tokenizer(cfg) -> tokenizer.Tokenizer:
    """data.tokenizer, checked: it loads, has the BOS/EOS the config adds, and fits model.vocab_size."""
    d = cfg.data
    tok = tokenizer.load(d.tokenizer)
    tokenizer.document_ids(tok, "", d.add_bos, d.add_eos)  # a missing BOS/EOS fails here, not in a reader thread
    needed = tokenizer.ids_needed(tok, d.add_bos, d.add_eos)
    if needed > cfg.model.vocab_size:
        raise ConfigError(f"tokenizer {tok.name} produces ids up to {needed - 1} but `model.vocab_size`="
                          f"{cfg.model.vocab_size}; set model.vocab_size={needed} (or more)")
    return tok


def check_prepared(metas: list[dict], d, template=None, vocab_size: int | None = None) -> None:
    """A prepared dataset fixes its tokenizer and BOS/EOS, and chat or preference records their chat
    template: the config must agree, or samples decode wrong and generation stops at the wrong token.
    With `vocab_size` (model.vocab_size), the ids its dataset.json says its tokenizer uses must fit the model:
    an id past the embedding table would be clamped silently, not refused."""
    want = tokenizer.fingerprint(d.tokenizer)
    for m in metas:
        records = m.get("records", "text")
        if records != d.format:
            again = f"prepare it again with --format {d.format}" if d.format != "text" else "prepare the text apart"
            raise ConfigError(f"the prepared dataset holds {records} records, not data.format={d.format}; set "
                              f"data.format={records}, or {again}")
        if template is not None and m["chat_template"]["sha256"] != template.sha256:
            raise ConfigError(f"the prepared dataset was rendered with chat template {m['chat_template']['name']}, not "
                              f"data.chat_template={template.name}; set data.chat_template to the template it was "
                              f"prepared with (or prepare it again)")
        t = m["tokenizer"]
        if t["sha256"] != want:
            raise ConfigError(f"the prepared dataset was tokenized with {t['spec']} ({t['name']}), not data.tokenizer="
                              f"{d.tokenizer}; set data.tokenizer={t['spec']}")
        for key in ("add_bos", "add_eos"):
            if m[key] != d[key]:
                raise ConfigError(f"the prepared dataset was made with {key}={str(m[key]).lower()}; set "
                                  f"data.{key}={str(m[key]).lower()} (or prepare it again)")
        needed = sources.ids_needed(m)
        if vocab_size is not None and needed is not None and needed > vocab_size:
            t = m["tokenizer"]
            raise ConfigError(f"the prepared dataset was tokenized with {t.get('spec')} ({t.get('name')}), whose ids go "
                              f"up to {needed - 1} (its dataset.json's vocab_size, bos_id and eos_id), but "
                              f"`model.vocab_size`={vocab_size}; set model.vocab_size={needed} (or more), or prepare the "
                              f"data with the model's tokenizer")


def check_paths(cfg) -> None:
    """Every component's path resolves to data of its kind (without reading the documents)."""
    for _, s, key in specs(cfg):
        kind = s["source"]
        if kind in FREE:
            continue
        if kind == "prepared":
            metas = [sources.read_prepared(p, key) for p in sources.resolve(s["path"], key, dirs=True)]
            sources.check_dtypes(metas, key)
            check_prepared(metas, cfg.data, vocab_size=cfg.model.vocab_size)
            continue
        files = sources.resolve(s["path"], key, suffixes=sources.SUFFIXES[kind])
        if kind == "parquet":  # the first file's footer: the others are read as their units come up
            sources.parquet_meta(files[0], s["field"], key)


def check_chat(cfg):
    """data.format chat/preference: every component is JSONL, or all are prepared records (check_prepared
    checks their kind and template), no BOS/EOS is added on top of what the template
    writes, and the chat template loads and renders the built-in example conversation. The Template, or
    None for text."""
    from maxlm.data import chat

    d = cfg.data
    if d.format == "text":
        return None
    if d.format == "prompt":  # GRPO's prompts: rendered by a template when there is one, else as plain text
        template = chat.load_template(d, required=False)
        if template is not None:
            chat.check_template(template)
        return template
    kinds = set()
    for name, s, key in specs(cfg):
        kinds.add(s["source"])
        if s["source"] not in ("jsonl", "prepared"):
            where = f"data.mixture.{name}.source" if d.source == "mixture" else "data.source"
            raise ConfigError(f"data.format={d.format} reads JSONL records (or data prepared from them), but "
                              f"{where}={s['source']}; use jsonl or prepared data")
    if len(kinds) > 1:
        raise ConfigError(f"data.format={d.format} with both jsonl and prepared components: a mixture of records is "
                          f"read one way; prepare the jsonl ones too (python -m maxlm.data.prepare --format {d.format})")
    if d.add_bos or d.add_eos:
        raise ConfigError(f"data.add_bos/add_eos with data.format={d.format}: the chat template writes the special "
                          f"tokens itself; set data.add_bos=false data.add_eos=false")
    template = chat.load_template(d)
    chat.check_template(template)
    return template


def as_eval(e: ConfigError) -> ConfigError:
    """An error of the eval loader's config, naming the eval keys."""
    return ConfigError(f"eval: {str(e).replace('data.path', 'eval.path').replace('data.source', 'eval.source')}")


def preflight(cfg) -> None:
    """The checks above for the training data and, with eval on, the held-out data."""
    from maxlm.data import eval_config

    check_chat(cfg)
    load_tokenizer(cfg)
    check_paths(cfg)
    if cfg.eval.every and eval_source(cfg) not in FREE:
        try:
            check_paths(eval_config(cfg))
        except ConfigError as e:
            raise as_eval(e) from None
