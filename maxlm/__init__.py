"""maxlm: a compiler-first SPMD trainer for LLMs on TPU and GPU."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `import maxlm` stays cheap (no jax); the notebook API loads on first use.
    if name in ("from_pretrained", "Model"):
        from maxlm import api
        return getattr(api, name)
    raise AttributeError(f"module 'maxlm' has no attribute {name!r}")
