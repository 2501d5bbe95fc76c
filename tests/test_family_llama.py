from hf_parity import assert_parity, edit_config, hf_logits, make_hf, maxlm_logits, rel_err, tokens, transformers, TOL

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


def test_tied_llama_has_no_lm_head(tmp_path):
    model = make_hf(transformers.LlamaConfig(**SMALL, tie_word_embeddings=True), tmp_path)
    assert_parity(model, tmp_path, tokens(96))
