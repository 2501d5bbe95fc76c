"""maxlm: a compiler-first SPMD trainer for LLMs on TPU and GPU."""

__version__ = "0.1.0"
