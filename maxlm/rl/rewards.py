"""Rewards: each scores one completion of one prompt record, on the host, as a float.

Built in (each config entry's `name`):
  math     the completion's last answer, read by Hugging Face's math-verify (the checker TRL's accuracy reward
           uses: `\\boxed{}` first, then any LaTeX), equals the record's answer field mathematically: 1 or 0
  exact    the completion's answer, extracted (`####` as GSM8K writes it, `boxed` for `\\boxed{...}`, `last`
           for the last number, or a regular expression with one group), equals the record's answer field
           after both are stripped (and, for numbers, compared as numbers): 1 or 0
  format   the completion matches a regular expression (`pattern`, searched): 1 or 0
and a user's function by import path, `module:function`, called as function(record, completion) -> float.
A run's reward is the weighted sum of its entries (`weight`), each logged on its own under its name (the
`rl.rewards` mapping's key; what it is, `reward`, defaults to the key).
"""

import importlib
import math
import re
from typing import Callable, NamedTuple

from maxlm.errors import ConfigError

BUILT_IN = ("math", "exact", "format")
EXTRACT = {"####": r"####\s*([^\n]*)", "boxed": r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}",
           "last": r"(-?\d[\d,]*(?:\.\d+)?)(?!.*\d)"}


class Reward(NamedTuple):
    name: str                        # how it is logged: reward/<name>
    fn: Callable[[dict, str], float]
    weight: float


def _number(s: str):
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def exact(field: str, extract: str) -> Callable[[dict, str], float]:
    pattern = re.compile(EXTRACT.get(extract, extract), re.S)
    if pattern.groups != 1:
        raise ConfigError(f"rl.rewards: exact's extract {extract!r} must be ####, boxed, last or a regular expression "
                          f"with one group (it has {pattern.groups})")

    def score(record: dict, completion: str) -> float:
        want = str(record[field]).strip()  # first: a record without the field is named at once, matched or not
        found = pattern.findall(completion)
        if not found:
            return 0.0
        got = found[-1].strip()
        a, b = _number(got), _number(want)
        return float(got == want if a is None or b is None else math.isclose(a, b, rel_tol=0, abs_tol=1e-9))
    return score


def format_(pattern: str) -> Callable[[dict, str], float]:
    rx = re.compile(pattern, re.S)
    return lambda record, completion: float(rx.search(completion) is not None)


def math_(field: str) -> Callable[[dict, str], float]:
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError:
        raise ConfigError("rl.rewards: the math reward needs math-verify (pip install math-verify); or use exact") from None
    answer = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True), boxed_match_priority=0,
                                    try_extract_without_anchor=False)]

    def score(record: dict, completion: str) -> float:
        gold = parse(str(record[field]), parsing_timeout=None)
        if not gold:  # an answer math-verify cannot read scores nothing: the record's, not the model's, fault
            return 0.0
        got = parse(completion, extraction_config=answer, extraction_mode="first_match", parsing_timeout=None)
        return float(verify(gold, got, timeout_seconds=None))
    return score


def user(path: str) -> Callable[[dict, str], float]:
    module, _, name = path.partition(":")
    if not module or not name:
        raise ConfigError(f"rl.rewards: {path!r} is neither a built-in reward ({', '.join(BUILT_IN)}) nor an import "
                          f"path module:function")
    try:
        fn = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise ConfigError(f"rl.rewards: cannot import {module} for {path}: {e}") from None
    except AttributeError:
        raise ConfigError(f"rl.rewards: {module} has no function {name}") from None
    if not callable(fn):
        raise ConfigError(f"rl.rewards: {path} is not a function")
    return fn


def build(entries: dict) -> list[Reward]:
    """The run's rewards from `rl.rewards`: {name: {reward, weight, field, extract, pattern}}."""
    out = []
    for name, e in entries.items():
        e = e or {}
        kind, weight, field = e.get("reward", name), float(e.get("weight", 1.0)), e.get("field", "answer")
        if kind == "math":
            fn = math_(field)
        elif kind == "exact":
            fn = exact(field, e.get("extract", "last"))
        elif kind == "format":
            if not e.get("pattern"):
                raise ConfigError(f"rl.rewards.{name}: the format reward needs a `pattern` (a regular expression)")
            fn = format_(e["pattern"])
        else:
            fn = user(kind)
        out.append(Reward(name, fn, weight))
    return out


def score(rewards: list[Reward], record: dict, completion: str, where: str, mark=None) -> dict[str, float]:
    """Each reward of one completion, by name, checked: a reward that raises, or returns something other than
    a finite number, is one line naming it and the record. `mark(name)` is told which reward runs (a watcher
    names the one that hangs)."""
    out = {}
    for r in rewards:
        if mark is not None:
            mark(r.name)
        try:
            v = r.fn(record, completion)
        except KeyError as e:
            raise ConfigError(f"rl.rewards: {r.name} reads the field {e} that the record at {where} lacks") from None
        except Exception as e:  # noqa: BLE001 - a user's function: whatever it raises is named, once
            raise ConfigError(f"rl.rewards: {r.name} raised {type(e).__name__}: {e} on the record at {where}") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"rl.rewards: {r.name} returned {v!r} for the record at {where}; a reward is a finite float")
        out[r.name] = float(v)
    return out
