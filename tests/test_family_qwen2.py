"""Qwen2 (Qwen2.5) against transformers: q/k/v biases, tied and untied heads, Qwen's window fields, YaRN
long context, round trips, and what export refuses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_parity import (TOL, assert_parity, assert_refused, assert_round_trip, exported_config, hf_logits, make_hf,
                       rel_err, tokens, transformers)

from maxlm import models
from maxlm.config import ConfigError, load
from maxlm.convert import adapters, hf

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A tiny Qwen2.5 whose q/k/v biases are far from 0 (HF initialises them to 0)."""
    path = tmp_path_factory.mktemp("qwen2")
    return make_hf(transformers.Qwen2Config(**SMALL), path, perturb_biases=True), path


def test_qwen2_parity_and_the_biases_matter(qwen2):
    model, path = qwen2
    toks = tokens(96, L=16)
    cfg = hf.load_config(path)
    assert (cfg.model.family, cfg.model.qkv_bias, cfg.model.qk_norm) == ("qwen2", True, False)
    assert_parity(model, path, toks)
    # Without its biases the same model no longer matches: the test sees them.
    params = hf.load_params(path, cfg)
    params["layers"] = {k: v for k, v in params["layers"].items() if k not in ("bq", "bk", "bv")}
    B, L = toks.shape
    out = models.apply(params, jnp.asarray(toks, jnp.int32), jnp.broadcast_to(jnp.arange(L), (B, L)),
                       jnp.ones((B, L), jnp.int32), cfg.model, jnp.float32)
    assert rel_err(np.asarray(out.logits), hf_logits(model, toks)) > 10 * TOL


def test_qwen2_round_trip(qwen2, tmp_path):
    model, path = qwen2
    assert_round_trip(model, path, tmp_path, tokens(96, L=16))


def test_tied_qwen2_with_a_window_on_every_layer_and_yarn(tmp_path):
    """Qwen2.5's small sizes tie their head; its long-context variants add YaRN; use_sliding_window with
    max_window_layers=0 slides on every layer (here over more tokens than the window)."""
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 16}
    model = make_hf(transformers.Qwen2Config(**SMALL, tie_word_embeddings=True, use_sliding_window=True,
                                             sliding_window=8, max_window_layers=0, rope_parameters=yarn),
                    tmp_path / "hf", perturb_biases=True)
    m = hf.load_config(tmp_path / "hf").model
    assert (m.tie_embeddings, m.sliding_window, m.rope_scaling.kind) == (True, 8, "yarn")
    toks = tokens(96, L=24)
    assert_parity(model, tmp_path / "hf", toks)
    assert_round_trip(model, tmp_path / "hf", tmp_path / "out", toks)


def test_qwen2_with_windows_from_max_window_layers_on(tmp_path):
    """Qwen's own layout of local layers: full attention below max_window_layers, a window from there on
    (here layers 1 and 2 of 3; 24 tokens, windows of 4), read into the per-layer table and written back."""
    model = make_hf(transformers.Qwen2Config(**{**SMALL, "num_hidden_layers": 3}, use_sliding_window=True,
                                             sliding_window=4, max_window_layers=1), tmp_path / "hf", perturb_biases=True)
    m = hf.load_config(tmp_path / "hf").model
    assert (m.sliding_window, m.layer_pattern) == (4, "GLL")
    toks = tokens(96, L=24)
    assert_parity(model, tmp_path / "hf", toks)
    assert_round_trip(model, tmp_path / "hf", tmp_path / "out", toks)


@pytest.mark.malformed
def test_qwen2_refusals(qwen2, tmp_path):
    _, path = qwen2
    assert_refused(path, tmp_path / "a", dict(use_sliding_window=True, sliding_window=8,
                                              layer_types=["full_attention", "chunked_attention"]), "`layer_types`=")
    assert_refused(path, tmp_path / "b", dict(hidden_act="gelu"), "`hidden_act`='gelu' is not supported")
    # What Qwen2ForCausalLM cannot say is refused on export, in one line.
    for key, message in (("model.qk_norm=true", "model.qk_norm=True cannot be exported as qwen2"),
                         ("model.qkv_bias=false", "model.qkv_bias=False cannot be exported as qwen2")):
        m = load(None, ["model.family=qwen2", "model.qkv_bias=true", key]).model
        with pytest.raises(ConfigError) as e:
            adapters.get("qwen2").config_to_hf(m)
        assert message in str(e.value) and "\n" not in str(e.value)
    # ... and another family with q/k/v biases has no Hugging Face form.
    with pytest.raises(ConfigError, match="model.qkv_bias=True cannot be exported: LlamaForCausalLM has no such"):
        adapters.get("llama").config_to_hf(load(None, ["model.qkv_bias=true"]).model)


def test_qwen2_export_is_what_transformers_reads(qwen2):
    m = hf.load_config(qwen2[1]).model
    c = exported_config(m)
    assert type(c).__name__ == "Qwen2Config" and c.use_sliding_window is False


def test_qwen2_biases_are_parameters_without_weight_decay():
    """bq/bk/bv start at 0 and, like norm gains, are not decayed; their axes follow the heads."""
    from maxlm.models import params as P_
    from maxlm.optim import decay_mask
    m = load(None, ["model.family=qwen2", "model.qkv_bias=true"]).model
    specs = models.get("qwen2").param_specs(m)
    layers = specs["layers"]
    assert layers["bq"].axes == ("layers", "heads", "head_dim") and layers["bk"].axes == ("layers", "kv_heads", "head_dim")
    mask = decay_mask(specs)["layers"]
    assert not any(mask[b] for b in ("bq", "bk", "bv")) and mask["wq"]
    assert float(jnp.abs(P_.init({"b": layers["bq"]}, jax.random.key(0))["b"]).sum()) == 0.0
