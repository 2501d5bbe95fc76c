"""Shared by the per-family parity tests: build a tiny random `transformers` model from a config (no
hub), save it, import it with maxlm, and compare float32 logits on a fixed token batch."""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from maxlm import models  # noqa: E402
from maxlm.convert import hf  # noqa: E402

TOL = 1e-4  # max|delta| / max|ref| on float32 logits (issue 6)


def tokens(vocab: int, B: int = 2, L: int = 12, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (B, L)).astype(np.int64)


def make_hf(config, out: Path, seed: int = 0, perturb_norms: bool = True):
    """A random model saved as an HF directory. Norm gains (initialised to constants) get noise, so a
    swapped or ignored norm weight shows in the logits."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if perturb_norms:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or "ln_" in name:
                    p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    return model


def hf_logits(model, toks: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(toks)).logits.float().numpy()


def maxlm_logits(path: Path, toks: np.ndarray, overrides: list[str] = ()) -> np.ndarray:
    cfg = hf.load_config(path, list(overrides))
    params = hf.load_params(path, cfg)
    B, L = toks.shape
    pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    out = models.get(cfg.model.family).forward(params, jnp.asarray(toks, jnp.int32), pos, jnp.ones((B, L), jnp.int32),
                                              cfg.model, jnp.float32)
    return np.asarray(out.logits)


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def assert_parity(model, path: Path, toks: np.ndarray, overrides: list[str] = ()) -> None:
    ref = hf_logits(model, toks)
    got = maxlm_logits(path, toks, overrides)
    assert got.shape == ref.shape and np.isfinite(got).all()
    err = rel_err(got, ref)
    assert err <= TOL, f"max|delta|/max|ref| = {err:.3g} > {TOL}"


def edit_config(path: Path, drop: tuple = (), **changes) -> None:
    """Rewrite (or `drop`) fields of a saved config.json, e.g. to switch a feature off in maxlm's view."""
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    for k in drop:
        cfg.pop(k)
    (path / "config.json").write_text(json.dumps(cfg))
