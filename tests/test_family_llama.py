import pytest

from hf_parity import assert_parity, assert_round_trip, edit_config, hf_logits, make_hf, maxlm_logits, rel_err, tokens, transformers, TOL

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)


def test_llama_parity_gqa_untied(tmp_path):
    model = make_hf(transformers.LlamaConfig(**SMALL, rope_theta=10000.0), tmp_path)
    assert_parity(model, tmp_path, tokens(96))


def test_llama3_rope_scaling_matters(tmp_path):
    # Scaling only changes frequencies whose wavelength exceeds original_max/low_freq_factor: with a
    # short original context those are most of them, so positions within the batch see it.
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    model = make_hf(transformers.LlamaConfig(**SMALL, rope_parameters=rope), tmp_path)
    toks = tokens(96, L=24)
    assert_parity(model, tmp_path, toks)
    # The older config.json layout (top-level rope_theta + rope_scaling) reads the same.
    edit_config(tmp_path, drop=("rope_parameters",), rope_theta=500000.0, rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"})
    assert_parity(model, tmp_path, toks)
    # Switched off, maxlm no longer matches: the test sees the feature.
    edit_config(tmp_path, rope_scaling=None)
    assert rel_err(maxlm_logits(tmp_path, toks), hf_logits(model, toks)) > 10 * TOL


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize("extra", [
    pytest.param({}, id="default-temperature"),
    pytest.param({"beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}, id="betas-untruncated"),  # gpt-oss's form
    pytest.param({"mscale": 0.707, "mscale_all_dim": 1.0}, id="deepseek-mscale"),
    pytest.param({"attention_factor": 1.3}, id="attention-factor"),
])
def test_yarn_rope_matches_hf(tmp_path, extra):
    """YaRN's blended frequencies and its attention temperature (sin and cos scaled, so every score by its
    square), in each way a config.json can set them."""
    model = make_hf(transformers.LlamaConfig(**SMALL, rope_parameters={**YARN, **extra}), tmp_path)
    toks = tokens(96, L=24)
    assert_parity(model, tmp_path, toks)
    edit_config(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert rel_err(maxlm_logits(tmp_path, toks), hf_logits(model, toks)) > 10 * TOL  # the test sees YaRN


def test_linear_rope_scaling_matches_hf_and_round_trips(tmp_path):
    rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 8.0}
    model = make_hf(transformers.LlamaConfig(**SMALL, rope_parameters=rope), tmp_path / "hf")
    toks = tokens(96, L=24)
    assert_parity(model, tmp_path / "hf", toks)
    assert_round_trip(model, tmp_path / "hf", tmp_path / "out", toks)
    edit_config(tmp_path / "hf", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert rel_err(maxlm_logits(tmp_path / "hf", toks), hf_logits(model, toks)) > 10 * TOL


def test_yarn_round_trips(tmp_path):
    model = make_hf(transformers.LlamaConfig(**SMALL, rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 1.0,
                                                                       "truncate": False}), tmp_path / "hf")
    assert_round_trip(model, tmp_path / "hf", tmp_path / "out", tokens(96, L=24))


def test_tied_llama_has_no_lm_head(tmp_path):
    model = make_hf(transformers.LlamaConfig(**SMALL, tie_word_embeddings=True), tmp_path)
    assert_parity(model, tmp_path, tokens(96))
