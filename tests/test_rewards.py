"""maxlm.rl.rewards: the built-in rewards score what they say, a user's function is imported by path, and every
mistake (an import that fails, a reward that raises or returns a non-float, a missing field) is one line."""

import math
import sys
import types

import pytest

from maxlm.errors import ConfigError
from maxlm.rl import rewards


def one(entry: dict, completion: str, record: dict | None = None) -> float:
    entry = dict(entry)
    (r,) = rewards.build({entry.pop("name"): entry})
    return rewards.score([r], record or {"answer": "42"}, completion, "x.jsonl:1")[r.name]


@pytest.mark.parametrize("extract, completion, want", [
    ("####", "so 6 x 7 = 42\n#### 42", 1.0), ("####", "#### 41", 0.0), ("####", "42", 0.0),
    ("boxed", r"the answer is \boxed{42}.", 1.0), ("boxed", r"\boxed{4} then \boxed{42}", 1.0),
    ("last", "6 x 7 is 42.0", 1.0), ("last", "42 or 43", 0.0), ("last", "no number", 0.0),
    (r"answer: (\w+)", "answer: 42", 1.0),
])
def test_exact_extracts_the_answer(extract, completion, want):
    assert one({"name": "exact", "extract": extract}, completion) == want


def test_exact_compares_numbers_as_numbers_and_reads_the_field_named():
    assert one({"name": "exact", "extract": "last", "field": "solution"}, "it is 1,000", {"solution": 1000}) == 1.0


def test_format_searches_its_pattern():
    entry = {"name": "format", "pattern": r"^<think>.*</think>"}
    assert one(entry, "<think>hm</think> 42") == 1.0 and one(entry, "42") == 0.0


def test_math_verify_reads_latex_answers():
    entry = {"name": "math", "field": "answer"}
    assert one(entry, r"so \boxed{\frac{1}{2}}", {"answer": "0.5"}) == 1.0
    assert one(entry, r"so \boxed{\frac{1}{3}}", {"answer": "0.5"}) == 0.0


def test_a_users_function_by_import_path_with_weights(monkeypatch):
    mod = types.ModuleType("my_rewards")
    mod.length = lambda record, completion: float(len(completion))
    monkeypatch.setitem(sys.modules, "my_rewards", mod)
    rs = rewards.build({"length": {"reward": "my_rewards:length", "weight": 0.5}, "exact": {"weight": 2.0}})
    assert [(r.name, r.weight) for r in rs] == [("length", 0.5), ("exact", 2.0)]
    assert rewards.score(rs, {"answer": "42"}, "42", "x") == {"length": 2.0, "exact": 1.0}


@pytest.mark.malformed
@pytest.mark.parametrize("entry, message", [
    ({"name": "no_such_module:f"}, r"rl.rewards: cannot import no_such_module for no_such_module:f"),
    ({"name": "math:nope"}, r"rl.rewards: math has no function nope"),
    ({"name": "nonsense"}, r"rl.rewards: 'nonsense' is neither a built-in reward \(math, exact, format\) nor an import path"),
    ({"name": "format"}, r"rl.rewards.format: the format reward needs a `pattern`"),
    ({"name": "exact", "extract": "(a)(b)"}, r"must be ####, boxed, last or a regular expression with one group \(it has 2\)"),
])
def test_mistakes_in_the_reward_list_are_one_line(entry, message):
    entry = dict(entry)
    with pytest.raises(ConfigError, match=message):
        rewards.build({entry.pop("name"): entry})


def test_two_of_one_kind_have_names_of_their_own():
    rs = rewards.build({"think": {"reward": "format", "pattern": "<think>"}, "answer": {"reward": "format", "pattern": "="}})
    assert rewards.score(rs, {}, "<think>", "x") == {"think": 1.0, "answer": 0.0}


@pytest.mark.parametrize("fn, message", [
    (lambda record, completion: 1 / 0, r"rl.rewards: bad raised ZeroDivisionError: division by zero on the record at x.jsonl:3"),
    (lambda record, completion: "1.0", r"rl.rewards: bad returned '1.0' for the record at x.jsonl:3; a reward is a finite float"),
    (lambda record, completion: math.nan, r"rl.rewards: bad returned nan for the record at x.jsonl:3"),
    (lambda record, completion: True, r"rl.rewards: bad returned True"),
    (lambda record, completion: record["gold"], r"rl.rewards: bad reads the field 'gold' that the record at x.jsonl:3 lacks"),
])
def test_a_reward_that_fails_names_itself_and_the_record(fn, message):
    bad = rewards.Reward("bad", fn, 1.0)
    with pytest.raises(ConfigError, match=message):
        rewards.score([bad], {"answer": "1"}, "1", "x.jsonl:3")


@pytest.mark.malformed
def test_a_missing_field_is_named_before_any_completion_matches():
    """The field was read only once a completion matched, so a run whose completions never matched trained on
    reward 0 and exited 0."""
    with pytest.raises(ConfigError, match=r"rl.rewards: exact reads the field 'solution' that the record at x.jsonl:1 "
                                          r"lacks"):
        one({"name": "exact", "field": "solution"}, "no number here")
