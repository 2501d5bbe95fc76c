"""Mistral against transformers: the sliding window, and how config.json's window fields are read."""

import jax
import pytest
from hf_parity import (TOL, assert_parity, edit_config, exported_config, hf_logits, make_hf, maxlm_logits, rel_err,
                       tokens, transformers)

from maxlm import models
from maxlm.config import load
from maxlm.convert import hf
from maxlm.models import params as P_

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)


def test_mistral_sliding_window_parity_and_matters(tmp_path):
    """A window of 8 over 24 tokens: maxlm matches (transformers' query i sees key j when i - j < window,
    as maxlm's). Read without the window, maxlm no longer matches: the test sees the feature."""
    model = make_hf(transformers.MistralConfig(**SMALL, sliding_window=8), tmp_path)
    toks = tokens(96, L=24)
    assert hf.load_config(tmp_path).model.sliding_window == 8
    assert_parity(model, tmp_path, toks)
    edit_config(tmp_path, sliding_window=None)
    assert rel_err(maxlm_logits(tmp_path, toks), hf_logits(model, toks)) > 10 * TOL


def _keys(drop=(), **changes):
    c = {**SMALL, "architectures": ["MistralForCausalLM"], "sliding_window": 8, **changes}
    return hf.model_keys({k: v for k, v in c.items() if k not in drop})


def test_mistral_window_fields():
    assert _keys(drop=("sliding_window",))["sliding_window"] == 4096  # MistralConfig's default (v0.1)
    assert _keys(sliding_window=None)["sliding_window"] == 0  # v0.2 and later: full attention
    assert _keys(layer_types=["sliding_attention"] * 2)["sliding_window"] == 8
    assert _keys(head_dim=None)["head_dim"] == 16 and _keys(head_dim=32)["head_dim"] == 32


@pytest.mark.malformed
@pytest.mark.parametrize("change, message", [
    (dict(hidden_act="gelu"), "`hidden_act`='gelu' is not supported"),
    (dict(sliding_window=0), "`sliding_window`=0 is not supported"),
    # MistralForCausalLM ignores layer_types (Ministral reads them): a list that disagrees is ambiguous.
    (dict(layer_types=["sliding_attention", "full_attention"]), "`layer_types`="),
    (dict(sliding_window=None, layer_types=["sliding_attention"] * 2), "`layer_types`="),
])
def test_mistral_refusals(change, message):
    with pytest.raises(hf.ConfigError) as e:
        _keys(**change)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("window", [4096, 0])
def test_mistral_export_config(window):
    """configs/models/mistral-7b.yml exported: it reads back as itself, and transformers sees the window."""
    c = exported_config(load("configs/models/mistral-7b.yml", [f"model.sliding_window={window}"]).model)
    assert type(c) is transformers.MistralConfig and c.sliding_window == (window or None) and c.head_dim == 128


TINY = ["model.vocab_size=32", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
        "model.head_dim=16", "model.d_ff=32"]


@pytest.mark.malformed
@pytest.mark.parametrize("family, override", [
    ("mistral", "model.qk_norm=true"), ("mixtral", "model.attn_softcap=50.0"),
    ("qwen3", "model.qk_norm=false"), ("qwen3_moe", "model.final_softcap=30.0"),
])
def test_what_the_hf_family_cannot_express_is_refused(tmp_path, family, override):
    """Model keys any maxlm family may set, but these Hugging Face families fix: export refuses them before
    writing a file, and import refuses an override that contradicts the checkpoint."""
    keys = [f"model.family={family}", *TINY, *(["model.n_experts=2"] if family in ("mixtral", "qwen3_moe") else []),
            *(["model.qk_norm=true"] if family.startswith("qwen3") else [])]
    m = load(None, keys + [override]).model
    params = P_.init(models.get(family).param_specs(m), jax.random.key(0))
    key = override.split("=")[0]
    with pytest.raises(hf.ConfigError, match=f"{key}=.* cannot be exported as {family}"):
        hf.save(params, m, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything is created
    ok = load(None, keys).model  # the same model without the override exports
    hf.save(P_.init(models.get(family).param_specs(ok), jax.random.key(0)), ok, tmp_path / "ok")
    if override == "model.qk_norm=false":  # the default value: indistinguishable from no override
        assert hf.load_config(tmp_path / "ok", [override]).model.qk_norm
        return
    with pytest.raises(hf.ConfigError, match=f"{key}=.* contradicts"):
        hf.load_config(tmp_path / "ok", [override])
