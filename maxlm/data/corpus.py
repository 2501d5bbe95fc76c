"""Built-in corpora that need no download."""

import numpy as np


def pydoc_documents() -> list[str]:
    """Python's own reference documentation topics (`pydoc_data.topics`, ~460 KB, 79 documents),
    which ships with every CPython: a real English/code text corpus available offline everywhere."""
    from pydoc_data.topics import topics
    return [topics[k] for k in sorted(topics)]


def concatenate(encoded: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Tokenized documents as one stream, with the document index of each token."""
    tokens = np.concatenate(encoded).astype(np.int32)
    doc_ids = np.concatenate([np.full(len(e), i, np.int32) for i, e in enumerate(encoded)])
    return tokens, doc_ids
