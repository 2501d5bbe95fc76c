"""Built-in corpora that need no download."""

import numpy as np


def pydoc_documents() -> list[str]:
    """Python's own reference documentation topics (`pydoc_data.topics`, ~460 KB, 79 documents),
    which ships with every CPython: a real English/code text corpus available offline everywhere."""
    from pydoc_data.topics import topics
    return [topics[k] for k in sorted(topics)]


def byte_tokenize(docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """UTF-8 bytes as tokens (vocab 256), concatenated, with the document index of each token."""
    encoded = [np.frombuffer(d.encode("utf-8"), np.uint8) for d in docs]
    tokens = np.concatenate(encoded).astype(np.int32)
    doc_ids = np.concatenate([np.full(len(e), i, np.int32) for i, e in enumerate(encoded)])
    return tokens, doc_ids


def byte_detokenize(tokens) -> str:
    return bytes(int(t) for t in tokens if 0 <= int(t) < 256).decode("utf-8", errors="replace")
