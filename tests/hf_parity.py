"""Shared by the per-family parity tests: build a tiny random `transformers` model from a config (no
hub), save it, import it with maxlm, and compare float32 logits on a fixed token batch."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import oracle

torch = oracle("torch")
transformers = oracle("transformers")

from maxlm import models  # noqa: E402
from maxlm.convert import adapters, hf  # noqa: E402

TOL = 1e-4  # max|delta| / max|ref| on float32 logits (issue 6)


def tokens(vocab: int, B: int = 2, L: int = 12, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (B, L)).astype(np.int64)


def make_hf(config, out: Path, seed: int = 0, perturb_norms: bool = True, perturb_biases: bool = False):
    """A random model saved as an HF directory. Norm gains (initialised to constants) get noise, so a
    swapped or ignored norm weight shows in the logits; so do biases (initialised to 0) if asked."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if perturb_norms and ("norm" in name or "ln_" in name) or perturb_biases and name.endswith(".bias"):
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
    # compiled: one program, not each of the model's ops compiled on its own as it is dispatched
    apply = jax.jit(lambda p, t: models.apply(p, t, pos, jnp.ones((B, L), jnp.int32), cfg.model, jnp.float32).logits)
    return np.asarray(apply(params, jnp.asarray(toks, jnp.int32)))


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


# ---- MoE routing and round trips (mixtral, qwen3_moe) -------------------------------------------------
def maxlm_output(path: Path, toks: np.ndarray, overrides: list[str] = (), seg: np.ndarray | None = None):
    """maxlm's whole forward output (logits, aux_loss) for the HF directory; `seg` 0 marks padding."""
    cfg = hf.load_config(path, list(overrides))
    params = hf.load_params(path, cfg)
    B, L = toks.shape
    pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    seg = np.ones((B, L), np.int32) if seg is None else seg
    return models.apply(params, jnp.asarray(toks, jnp.int32), pos, jnp.asarray(seg, jnp.int32), cfg.model, jnp.float32)


def routing_margin(model, toks: np.ndarray, k: int) -> float:
    """The smallest gap, over tokens and layers, between the k-th and (k+1)-th router probability in the
    HF model. Float32 rounding moves probabilities by ~1e-7, so a margin well above that means maxlm and
    torch cannot pick different experts for any token of this batch."""
    with torch.no_grad():
        router = model(torch.as_tensor(toks), output_router_logits=True).router_logits
    probs = torch.softmax(torch.cat([r.float() for r in router]), dim=-1)
    top = torch.sort(probs, dim=-1, descending=True).values
    return float((top[:, k - 1] - top[:, k]).min())


def saved_tensors(d: Path) -> dict:
    from safetensors import safe_open
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "np") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def assert_round_trip(model, src: Path, out: Path, toks: np.ndarray) -> None:
    """HF -> maxlm -> HF: the same tensor names with bit-identical values, a config.json that imports as
    the same maxlm model, and transformers loading the export to the very same logits."""
    cfg = hf.load_config(src)
    hf.save(hf.load_params(src, cfg), cfg.model, out)
    a, b = saved_tensors(src), saved_tensors(out)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k
    assert hf.load_config(out).model == cfg.model
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(back) is type(model)
    np.testing.assert_array_equal(hf_logits(back, toks), hf_logits(model, toks))


def exported_config(m):
    """maxlm model config -> config.json (as maxlm.convert.hf.save writes it): it imports back as the same
    model keys, and is returned as transformers reads it, for the caller to check what transformers sees."""
    import ml_collections
    c = json.loads(json.dumps(adapters.get(m.family).config_to_hf(m)))
    want = ml_collections.ConfigDict(m).to_dict()
    for k, v in hf.model_keys(c).items():
        if k == "rope_scaling":  # the keys its kind does not use are not exported
            want[k] = {key: want[k][key] for key in v}
        assert want[k] == v, (k, want[k], v)
    return transformers.AutoConfig.for_model(c["model_type"], **{k: v for k, v in c.items() if k != "model_type"})


def copy_dir(path: Path, to: Path) -> None:
    """A cheap copy of a saved model whose config.json can be edited without touching the original."""
    to.mkdir(parents=True, exist_ok=True)
    (to / "config.json").write_text((path / "config.json").read_text())
    (to / "model.safetensors").symlink_to(path / "model.safetensors")


def assert_refused(path: Path, tmp: Path, change: dict, message: str) -> None:
    """Importing `path` with `change` in its config.json fails with one line containing `message`."""
    from maxlm.config import ConfigError
    copy_dir(path, tmp)
    edit_config(tmp, **change)
    with pytest.raises(ConfigError) as e:
        hf.load_config(tmp)
    assert message in str(e.value) and "\n" not in str(e.value)
