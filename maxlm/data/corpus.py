"""Built-in corpora that need no download."""

import hashlib


def pydoc_heldout(name: str) -> bool:
    """Whether a pydoc topic is in the held-out split: about 1 in 10, chosen by a hash of its name, so
    the split is the same on every Python version that has the topic (3.12: 10 of 79 topics, 45 KB)."""
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % 10 == 0


def pydoc_documents(split: str = "all") -> list[str]:
    """Python's own reference documentation topics (`pydoc_data.topics`, ~460 KB, 79 documents),
    which ships with every CPython: a real English/code text corpus available offline everywhere.
    `split`: all | train (without the held-out topics) | eval (only those)."""
    from pydoc_data.topics import topics
    keep = {"all": lambda k: True, "train": lambda k: not pydoc_heldout(k), "eval": pydoc_heldout}[split]
    return [topics[k] for k in sorted(topics) if keep(k)]
