"""Benchmarks with EleutherAI's lm-evaluation-harness (`lm_eval`) on a maxlm model, sharded over a mesh.

    python -m maxlm.eval_harness RUN_DIR --tasks hellaswag,path/to/task.yaml [--include DIR] [--limit N]
        [--num-fewshot K] [--step S] [--batch-size B] [--output FILE]

RUN_DIR is a run directory (its newest checkpoint, or --step S), its checkpoints directory or one step's
directory. A task is one of lm_eval's names, a task YAML file, or a name defined by the YAML files in
--include DIR. The run's config gives the model, mesh, activation dtype and tokenizer; a results table is
printed and the JSON written (process 0 only). Every mistake is one `maxlm.eval_harness: error:` line on
stderr and exit status 2. In training, `eval.harness` runs the same every N steps (maxlm.loop).

Nothing here goes to the network: the process runs with HF_DATASETS_OFFLINE=1 and HF_HUB_OFFLINE=1 (unless
the environment sets them), so a task's data must be local files or already in the Hugging Face cache.
"""

import argparse
import contextlib
import difflib
import functools
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import yaml

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read when `datasets` is imported, below, lazily
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from maxlm import generate as gen, models, schedules, sharding  # noqa: E402
from maxlm.errors import ConfigError  # noqa: E402
from maxlm.layers import attention as attn  # noqa: E402

try:  # an optional install (requirements-eval.txt): maxlm imports and trains without it, and says how to get it when it is asked for
    from lm_eval.api.model import TemplateLM
    _MISSING = None
except ImportError as e:
    TemplateLM, _MISSING = object, e

INSTALL = "pip install -r requirements-eval.txt (lm_eval==0.4.13)"
MIN_LENGTH = 64           # the shortest padded row; the others are powers of two up to the context length
GEN_TOKS = 256            # new tokens when a task sets no max_gen_toks (lm_eval's default)
LOGITS_BYTES = 256 << 20  # float32 logits per device held at once while scoring (token chunks beyond it)
FEWSHOT_SEED = 1234       # lm_eval's default: the same few-shot examples on every process and every run


def require(what: str = "maxlm.eval_harness") -> None:
    """Raise one line if lm_eval is not importable."""
    if _MISSING is not None:
        raise ConfigError(f"{what} needs lm_eval, which is not installed ({_MISSING}); {INSTALL}")


def task_manager(specs, include: str = "", keys: tuple[str, str] = ("--tasks", "--include")):
    """lm_eval's TaskManager for `specs` (task names, or paths of task YAML files) and an `include`
    directory of task YAMLs; an unknown name is one line with the nearest known one. Indexing lm_eval's
    own ~15,000 task files takes seconds, so it happens only for a name neither a file nor in `include`.
    `keys` name the task list and the directory in errors."""
    key = keys[0]
    require(key)
    from lm_eval.tasks import TaskManager

    specs = list(specs)
    if not specs or not all(isinstance(s, str) and s.strip() for s in specs):
        raise ConfigError(f"{key} must name at least one task (an lm_eval task, a task YAML file, or one in the "
                          f"include directory), got {specs}")
    if include and not Path(include).is_dir():
        raise ConfigError(f"{keys[1]}: {include} is not a directory; name a directory of lm_eval task YAMLs")
    files = [s for s in specs if s.endswith((".yaml", ".yml"))]
    for f in files:
        if not Path(f).is_file():
            raise ConfigError(f"{key}: no task file {f}")
        _check_yaml(f, key)
    names = [s for s in specs if s not in files]
    with _yaml_errors(key):
        manager = TaskManager(include_path=include or None, include_defaults=False)
        if any(n not in manager.all_tasks for n in names):
            manager = TaskManager(include_path=include or None)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        near = difflib.get_close_matches(unknown[0], manager.all_tasks, n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise ConfigError(f"{key}: unknown task `{unknown[0]}`{hint}; name an lm_eval task (`lm-eval ls tasks`), a task "
                          f"YAML file, or a task defined in the include directory")
    return manager


class _AnyTag(yaml.SafeLoader):
    """YAML as lm_eval's task files are written: `!function module.name` and other tags read as plain values."""


_AnyTag.add_multi_constructor("!", lambda loader, suffix, node: None)


def _yaml_problem(e, where: str) -> str:
    mark = getattr(e, "problem_mark", None)
    at = f"{getattr(mark, 'name', None) or where}, line {mark.line + 1}" if mark else where
    return f"{at}: {getattr(e, 'problem', None) or str(e).splitlines()[0]}"


def _check_yaml(path: str, key: str) -> None:
    """A task file must be a YAML mapping: lm_eval's own error is a 53-line traceback."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.load(f, Loader=_AnyTag)
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: task file {path} is not valid YAML ({_yaml_problem(e, path)}); fix it or name "
                          f"another task") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{key}: task file {path} is not UTF-8 text; name an lm_eval task YAML file") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{key}: task file {path} holds a YAML {type(doc).__name__}, not a task (a mapping with "
                          f"`task:`, `dataset_path:`, ...); fix it or name another task")


@contextlib.contextmanager
def _yaml_errors(key: str):
    """A YAML file lm_eval reads itself (one in the include directory, or one a task file includes) that
    does not parse: one line naming it."""
    try:
        yield
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: a task YAML file lm_eval read is not valid YAML ({_yaml_problem(e, 'a task file')}); "
                          f"fix it") from None


def load_tasks(manager, specs, key: str = "--tasks") -> dict:
    """manager.load(specs), with a task's data that cannot be found (a local data file, or a Hugging Face
    dataset not in the cache: nothing here goes to the network) as one line naming it: a mistake in the
    task, exit 2, not an I/O failure."""
    try:
        with _yaml_errors(key):
            return manager.load(list(specs))
    except FileNotFoundError as e:
        what = e.filename or (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{key}: a task's data cannot be found: {what}; fix the task's dataset_path or "
                          f"dataset_kwargs (data_files), or put the dataset in the Hugging Face cache") from None


def evaluate(lm, specs, manager, limit: int = 0, num_fewshot: int | None = None, bootstrap_iters: int = 0,
             key: str = "--tasks") -> dict:
    """lm_eval's results dict for `specs` on `lm` (per task metrics under "results"). The tasks' requests are
    built the same way on every process (fixed few-shot seed, no shuffling here), so every process runs the
    same batches of the sharded model. lm_eval's `simple_evaluate` is skipped: it would also import torch
    for its environment report."""
    from lm_eval import evaluator

    loaded = load_tasks(manager, specs, key)
    for task in loaded["tasks"].values():
        if num_fewshot is not None and task.get_config("num_fewshot") != 0:  # a task fixed at 0 stays 0
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
    return evaluator.evaluate(lm=lm, task_dict=loaded, limit=limit or None, bootstrap_iters=bootstrap_iters,
                              log_samples=False)


def flat(results: dict) -> dict:
    """{harness/<task>/<metric>[/<filter>]: value} of every numeric metric (no stderrs): a metrics row's fields."""
    out = {}
    for task, row in results["results"].items():
        for k, v in row.items():
            metric, _, filt = k.partition(",")
            if metric.endswith("_stderr") or isinstance(v, bool) or not isinstance(v, (int, float)) or not filt:
                continue
            out[f"harness/{task}/{metric}" + (f"/{filt}" if filt != "none" else "")] = float(v)
    return out


def lengths(max_len: int) -> list[int]:
    """The padded row lengths: powers of two from MIN_LENGTH, and max_len. One compile each, at most."""
    out, n = [], MIN_LENGTH
    while n < max_len:
        out.append(n)
        n *= 2
    return out + [max_len]


def padded(n: int, max_len: int) -> int:
    return next(x for x in lengths(max_len) if x >= n)


def _token_chunks(B: int, L: int, V: int, devices: int) -> int:
    """Token chunks (a power of two dividing L) keeping one chunk's logits within LOGITS_BYTES per device."""
    n = 1
    while B * (L // n) * V * 4 > LOGITS_BYTES * devices and L % (2 * n) == 0:
        n *= 2
    return n


@functools.partial(jax.jit, static_argnames=("m", "dtype", "attention", "chunks", "out_sharding", "rules"))
def _token_logprobs(params, tokens_BL, targets_BL, *, m, dtype, attention, chunks, out_sharding, rules):
    """log p(target) under the model's log_softmax at every position [B, L] float32, and whether the target
    is the argmax. Each row is one sequence from position 0; right padding changes nothing before it. The
    logits are made `chunks` token chunks at a time, never all [B, L, V] at once. Attention is the run's
    kernel (`attention`), as in training, unless the rules split the sequence (a ring wants its own layout):
    then XLA's, as in generation."""
    del rules  # the sharding rules in effect when traced: part of the cache key, since `constrain` reads them
    family = models.get(m.family)
    B, L = tokens_BL.shape
    pos_BL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    attend = attn.attend_fn(attention, m, dtype.name) if attn.context_axis()[1] == 1 else None
    x_BLD = family.forward(params, tokens_BL, pos_BL, jnp.ones((B, L), jnp.int32), m, dtype, attend=attend,
                           stack=schedules.inference_stack()).x_BLD

    def chunk(xs):
        x_BCD, t_BC = xs
        logits_BCV = family.unembed(params, x_BCD, m)
        lp_BC = jnp.take_along_axis(jax.nn.log_softmax(logits_BCV, axis=-1), t_BC[..., None], axis=-1)[..., 0]
        return lp_BC, jnp.argmax(logits_BCV, axis=-1) == t_BC

    split = lambda a: jnp.moveaxis(a.reshape(B, chunks, L // chunks, *a.shape[2:]), 1, 0)  # noqa: E731
    lp_NBC, hit_NBC = jax.lax.map(chunk, (split(x_BLD), split(targets_BL)))
    lp_BL, hit_BL = (jnp.moveaxis(a, 0, 1).reshape(B, L) for a in (lp_NBC, hit_NBC))
    if out_sharding is not None:  # every process reads the whole result
        lp_BL, hit_BL = (jax.lax.with_sharding_constraint(a, out_sharding) for a in (lp_BL, hit_BL))
    return lp_BL, hit_BL


def special_ids(tok, data, vocab_size: int) -> tuple[int | None, int | None, int]:
    """(bos, eos, prefix) token ids inside the vocabulary. BOS starts every request when the run trained
    with data.add_bos. The prefix conditions a text with no context (lm_eval's rolling loglikelihood, an
    empty context): BOS if trained with it, else EOS (lm_eval's usual prefix; with data.add_eos what packing
    put before every document), else a newline, the nearest thing to a document break that a model trained
    without special tokens (a byte model's 256 ids have none) has seen."""
    inside = lambda t: t if t is not None and 0 <= t < vocab_size else None  # noqa: E731
    bos = inside(tok.bos_id) if data.add_bos else None
    eos = inside(tok.eos_id)
    newline = [int(t) for t in tok.encode("\n")] or [0]
    prefix = bos if bos is not None else eos if eos is not None else inside(tok.bos_id)
    return bos, eos, prefix if prefix is not None else newline[-1]


class MaxLM(TemplateLM):
    """A maxlm model as an lm_eval LM: loglikelihood (+ is_greedy), loglikelihood_rolling and generate_until.

    Batching: requests are sorted longest first and cut into batches of exactly `batch_size` rows (the last
    filled with dummy rows); rows are right-padded (scoring) or left-padded (generation) to the next of a
    few lengths, powers of two up to the context (`lengths`). So jit compiles the scorer at most once per
    length, and generation once per length and max_gen_toks, whatever the tasks. Each batch is one global
    array sharded over the mesh's batch axes, built from the same host data on every process."""

    def __init__(self, cfg, recipe, params, mesh, rules, tokenizer, batch_size: int = 0, beat=None):
        """The model `recipe` (maxlm.recipe) runs with `params` (natural layer order, transforms attached) on
        `mesh` under `rules`; `cfg` the run's config, for how it was trained: its context, its special tokens."""
        super().__init__()
        m = recipe.model
        self.m, self.params, self.mesh, self.rules, self.tok = m, params, mesh, tuple(rules), tokenizer
        self.dtype, self.attention = recipe.forward.dtype, recipe.forward.attention
        self.max_length = min(cfg.seq_len, m.max_positions)  # the context the model was trained on
        self.bos, self.eos, self.prefix = special_ids(tokenizer, cfg.data, m.vocab_size)
        axes = sharding.spec(("batch",), self.rules)[0] or ()
        dp = int(np.prod([mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes)]))
        B = batch_size or recipe.batch.rows // recipe.schedule.microbatches  # a row count training already fits
        self.batch_size = -(-B // dp) * dp  # whole rows on every device of the batch axes
        self.rows = sharding.named(mesh, ("batch", None), self.rules)
        self.replicated = NamedSharding(mesh, P())
        self.beat = beat or (lambda: None)  # called before each batch: a watchdog sees progress

    @property
    def eot_token_id(self) -> int:
        return self.eos if self.eos is not None else self.prefix

    @property
    def prefix_token_id(self) -> int:
        return self.prefix

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kw) -> list[int]:
        ids = [int(t) for t in self.tok.encode(string)]
        return [self.bos] + ids if self.bos is not None and add_special_tokens is not False else ids

    def tok_decode(self, ids) -> str:
        return self.tok.decode(ids)

    @staticmethod
    def _same_everywhere(what: str, args: list) -> None:
        """Every process must run the same batches of the sharded model: a request list that differs (a task's
        files differing between hosts) is refused here, rather than hanging at a collective."""
        if jax.process_count() > 1:
            digest = hashlib.sha256(json.dumps(args, default=str).encode()).digest()[:8]  # int32s: jax has no x64 here
            try:
                multihost_utils.assert_equal(np.frombuffer(digest, np.int32))
            except AssertionError:
                raise ConfigError(f"{what}: the processes built different requests from the tasks; every process "
                                  f"must see the same task files and lm_eval version") from None

    def _global(self, a: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(a.shape, self.rows, lambda idx: a[idx])

    def _batches(self, n: int, key):
        """Index lists of `batch_size` requests, longest first (by `key`), ties in request order."""
        order = sorted(range(n), key=lambda i: (-key(i), i))
        return [order[i:i + self.batch_size] for i in range(0, n, self.batch_size)]

    def score(self, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """For each (tokens, k): the summed log-probability of its last k tokens, each given those before
        it, and whether every one of them is the greedy choice. len(tokens) <= max_length + 1."""
        out = [None] * len(rows)
        for idx in self._batches(len(rows), lambda i: len(rows[i][0])):
            L = padded(max(len(rows[i][0]) - 1 for i in idx), self.max_length)
            tokens, targets = np.zeros((2, self.batch_size, L), np.int32)
            for r, i in enumerate(idx):
                t = rows[i][0]
                tokens[r, :len(t) - 1], targets[r, :len(t) - 1] = t[:-1], t[1:]
            self.beat()
            with sharding.use(self.mesh, self.rules):
                lp, hit = _token_logprobs(
                    self.params, self._global(tokens), self._global(targets), m=self.m, dtype=self.dtype,
                    attention=self.attention, chunks=_token_chunks(self.batch_size, L, self.m.vocab_size, self.mesh.size),
                    out_sharding=self.replicated, rules=sharding.current_rules())
            lp, hit = np.asarray(jax.device_get(lp), np.float64), np.asarray(jax.device_get(hit))
            for r, i in enumerate(idx):
                n, k = len(rows[i][0]) - 1, rows[i][1]
                out[i] = (float(lp[r, n - k:n].sum()), bool(hit[r, n - k:n].all()))
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw) -> list[tuple[float, bool]]:
        """lm_eval's (key, context ids, continuation ids) requests: the context is cut on the left to fit."""
        self._same_everywhere("loglikelihood", [r[1:] for r in requests])
        rows = []
        for _, ctx, cont in requests:
            ctx = list(ctx) or [self.prefix]  # a context of spaces only: lm_eval moves them all to the continuation
            if len(cont) > self.max_length:
                raise ConfigError(f"a continuation of {len(cont)} tokens is longer than the model's context "
                                  f"({self.max_length} tokens, the run's seq_len)")
            rows.append(((ctx + list(cont))[-(self.max_length + 1):], len(cont)))
        return self.score(rows)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-probability, in windows of the context length, as lm_eval's own models do."""
        from lm_eval import utils

        windows, owner = [], []
        for j, req in enumerate(requests):
            ids = self.tok_encode(req.args[0], add_special_tokens=False)
            for ctx, pred in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=ids, prefix_token=self.prefix, max_seq_len=self.max_length, context_len=1)):
                windows.append(((None, None), ctx, pred))
                owner.append(j)
        total = [0.0] * len(requests)
        for j, (lp, _) in zip(owner, self._loglikelihood_tokens(windows)):
            total[j] += lp
        return total

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with do_sample and a temperature) text for each (context, gen_kwargs), cut at
        the first of its `until` strings. Each batch runs max_gen_toks steps, or stops early when every row
        has emitted EOS; the stop strings are applied to the text after."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

        self._same_everywhere("generate_until", [r.args for r in requests])
        out = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):  # one generation setting per batch
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        eos_text = self.tok_decode([self.eos]) if self.eos is not None else None
        for members in groups.values():
            kw = normalize_gen_kwargs(requests[members[0]].args[1], GEN_TOKS)
            until = [s for s in handle_stop_sequences(kw.pop("until", None), eos=eos_text or None) if s]
            n_new = int(kw.pop("max_gen_toks"))
            if n_new >= self.max_length:
                raise ConfigError(f"a task asks for max_gen_toks={n_new} new tokens, not fewer than the model's "
                                  f"context ({self.max_length} tokens, the run's seq_len)")
            temperature = float(kw.get("temperature") or 0.0) if kw.get("do_sample") else 0.0
            prompts = {i: self.tok_encode(requests[i].args[0])[-(self.max_length - n_new):] or [self.prefix]
                       for i in members}
            for idx in self._batches(len(members), lambda j: len(prompts[members[j]])):
                rows = [prompts[members[j]] for j in idx]
                for j, text in zip(idx, self._generate(rows, n_new, temperature)):
                    for s in until:
                        text = text.split(s)[0]
                    out[members[j]] = text
        return out

    def _generate(self, rows: list[list[int]], n_new: int, temperature: float) -> list[str]:
        """The new text of each prompt. maxlm.generate's jitted loop, called with the prompts left-padded to
        one of `lengths` (its `decode` rounds only to a multiple of 8, a compile per length seen)."""
        n = len(rows)
        rows = rows + [[self.prefix]] * (self.batch_size - n)  # dummy rows: every batch has one shape
        tokens, seg, pos = gen.left_pad(rows, 0, padded(max(map(len, rows)), self.max_length))
        eos = np.asarray([-1 if self.eos is None else self.eos], np.int32)
        fill = 0 if self.eos is None else self.eos
        self.beat()
        with sharding.use(self.mesh, self.rules):
            toks = gen._generate(
                self.params, tokens, seg, pos, np.int32(0), np.float32(temperature or 1.0), np.int32(self.m.vocab_size),
                np.float32(1.0), eos, np.int32(fill), m=self.m, dtype=self.dtype, n_new=n_new,
                greedy=temperature == 0, filtered=False, return_logits=False, return_logps=False, return_routes=False,
                out_sharding=self.replicated, rules=sharding.current_rules())[0]
        toks = np.asarray(jax.device_get(toks))
        texts = []
        for row in toks[:n]:
            stop = np.flatnonzero(row == self.eos) if self.eos is not None else []
            texts.append(self.tok_decode(row[:stop[0]] if len(stop) else row))
        return texts


class Harness:
    """In training: `harness(params, beat)` -> that step's fields {harness/<task>/<metric>: value, ...,
    harness_time_s}, every `eval.harness.every` steps (and after the last, as eval.every). Made at start-up,
    before the compile: lm_eval must be installed and every task known; the task index is built once, and
    each evaluation reloads the tasks' documents from it."""

    def __init__(self, cfg, recipe, mesh, rules, log):
        from maxlm.data import tokenizer

        h = cfg.eval.harness
        self.cfg, self.recipe, self.mesh, self.rules = cfg, recipe, mesh, rules
        self.tasks, self.every, self.limit = list(h.tasks), h.every, h.limit
        self.manager = task_manager(self.tasks, h.include, ("eval.harness.tasks", "eval.harness.include"))
        load_tasks(self.manager, self.tasks, "eval.harness.tasks")  # a task's missing data, before the compile
        self.tok = tokenizer.load(cfg.data.tokenizer)
        limit = f", the first {self.limit} documents of each" if self.limit else ""
        log(f"benchmarks every {self.every} steps and after the last: {', '.join(self.tasks)}{limit} (lm_eval)")

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def __call__(self, params, beat=None) -> dict:
        t = time.perf_counter()
        lm = MaxLM(self.cfg, self.recipe, params, self.mesh, self.rules, self.tok, beat=beat)
        fields = flat(evaluate(lm, self.tasks, self.manager, self.limit, key="eval.harness.tasks"))
        return {**fields, "harness_time_s": time.perf_counter() - t}

    @staticmethod
    def summary(fields: dict, most: int = 8) -> str:
        """The log line's part: `task metric value, ...` (a group's many subtasks cut short), and the time."""
        shown = [f"{k.split('/', 1)[1].replace('/', ' ')} {v:.4f}" for k, v in fields.items() if k.startswith("harness/")]
        more = f" and {len(shown) - most} more in the metrics" if len(shown) > most else ""
        return f"{', '.join(shown[:most])}{more} ({fields['harness_time_s']:.2f}s)"


# ---- The command line --------------------------------------------------------------------------------


def load_run(path: str, step: int | None):
    """(config, maxlm.api.Model on the run's mesh, step) of a run directory, checkpoints dir or step dir."""
    from maxlm import api, checkpoint, config

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{path} does not exist; name a run directory (holding checkpoints/), its checkpoints "
                          f"directory or one step's directory")
    if (p / "config.json").is_file() and not (p / "checkpoints").is_dir():
        raise ConfigError(f"{path} is a Hugging Face model directory, not a maxlm run; evaluate it with lm_eval's "
                          f"own hf model (lm-eval run --model hf --model_args pretrained={path})")
    ck, newest = checkpoint.resolve_init_from(path, "RUN_DIR")
    try:
        step = newest if step is None else step
        if step not in ck.steps():
            raise ConfigError(f"--step {step}: {ck.dir} has no committed step {step}; it has "
                              f"{', '.join(map(str, ck.steps()))}")
        where = str(ck.step_path(step))
        cfg = config.from_saved(ck.meta(step)["config"], where)
    finally:
        ck.close()
    mesh = run_mesh(cfg)
    model = api.from_pretrained(where, mesh=mesh, dtype=cfg.dtype)
    return cfg, model, step


def run_mesh(cfg):
    """The run's mesh on this job's devices, or (when its sizes do not fit them) fsdp over all of them."""
    from maxlm import mesh as mesh_lib

    n = jax.device_count()
    try:
        return mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, n), jax.devices(), cfg.mesh.slices)
    except ConfigError as e:
        say(f"the run's mesh does not fit this job's {n} devices ({e}); using fsdp={n}")
        return mesh_lib.make_mesh({"fsdp": n})


def say(msg: str) -> None:
    if jax.process_index() == 0:
        print(f"maxlm.eval_harness: {msg}", flush=True)


def default_output(path: str, step: int) -> str:
    """<run dir>/harness/step_<S>.json for a run directory; harness_step_<S>.json here otherwise."""
    name = f"step_{step}.json"
    return str(Path(path) / "harness" / name) if (Path(path) / "checkpoints").is_dir() else f"harness_{name}"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage and a second line; a usage mistake gets one line, as ours do
        print(f"maxlm.eval_harness: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return int(text)


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m maxlm.eval_harness", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", metavar="RUN_DIR", help="a run directory, its checkpoints/ or one step's directory")
    ap.add_argument("--tasks", required=True, help="comma-separated lm_eval task names and/or task YAML files")
    ap.add_argument("--include", default="", help="a directory of task YAMLs whose tasks --tasks may name")
    ap.add_argument("--limit", type=_count, default=0, help="the first N documents of each task (0: all)")
    ap.add_argument("--num-fewshot", type=_count, default=None, help="few-shot examples (default: each task's own)")
    ap.add_argument("--step", type=_count, default=None, help="the checkpoint step (default: the newest)")
    ap.add_argument("--batch-size", type=_positive, default=None,
                    help="rows per batch (default: the run's global_batch_size / microbatches)")
    ap.add_argument("--output", default="", help="the results JSON (default: RUN_DIR/harness/step_<S>.json)")
    return ap


def main(argv=None) -> int:
    try:
        a = parser().parse_args(argv)
    except SystemExit as e:  # a usage mistake (one line said) or --help, as an exit status for in-process callers
        return e.code
    try:
        require()  # every argument is checked before the (long) restore
        specs = [s.strip() for s in a.tasks.split(",") if s.strip()]
        manager = task_manager(specs, a.include)
        if a.output:
            check_output(a.output)
        from maxlm import distributed, platforms
        from maxlm.data import tokenizer as tokenizer_lib

        platforms.skip_absent_tpu()  # before jax starts: libtpu on a machine without a TPU says nothing
        distributed.initialize()  # a multi-process job: every process runs the sharded model
        cfg, model, step = load_run(a.run_dir, a.step)
        tok = tokenizer_lib.load(cfg.data.tokenizer, key="the run's data.tokenizer")
        lm = MaxLM(cfg, model.recipe, model.params, model.mesh, model.rules, tok, a.batch_size or 0)
        say(f"{cfg.model.family} step {step} on mesh {' x '.join(f'{k}={v}' for k, v in model.mesh.shape.items())}, "
            f"batches of {lm.batch_size} rows up to {lm.max_length} tokens: {', '.join(specs)}")
        t = time.perf_counter()
        results = evaluate(lm, specs, manager, a.limit, a.num_fewshot, bootstrap_iters=100_000)
        out = a.output or default_output(a.run_dir, step)
        if jax.process_index() == 0:
            write_results(results, out, dict(run=str(a.run_dir), step=step, tasks=specs, limit=a.limit,
                                             seconds=time.perf_counter() - t))
    except ConfigError as e:
        print(f"maxlm.eval_harness: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # reading the checkpoint, a task's files, writing the results
        print(f"maxlm.eval_harness: error: {e.filename or a.run_dir}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


def check_output(out: str) -> None:
    """--output, before the restore and the evaluation: its directory made and writable, and not a directory
    itself (only the whole evaluation would reach the write)."""
    path = Path(out)
    if path.is_dir():
        raise ConfigError(f"--output {out} is a directory; name the results file, e.g. {path / 'results.json'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--output {out}: its directory cannot be created ({e.strerror or e}); choose a writable "
                          f"path") from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"--output {out}: not writable here; choose a writable path")


def write_results(results: dict, out: str, meta: dict) -> None:
    """Print lm_eval's results table(s) and write the JSON (with `meta` under "maxlm")."""
    from lm_eval.utils import handle_non_serializable, make_table

    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({**results, "maxlm": meta}, indent=2, default=handle_non_serializable))
    say(f"results in {out}")


if __name__ == "__main__":
    sys.exit(main())
