"""Built-in corpora that need no download."""


def pydoc_documents() -> list[str]:
    """Python's own reference documentation topics (`pydoc_data.topics`, ~460 KB, 79 documents),
    which ships with every CPython: a real English/code text corpus available offline everywhere."""
    from pydoc_data.topics import topics
    return [topics[k] for k in sorted(topics)]

