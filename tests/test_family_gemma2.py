"""Gemma 2 against transformers: logits, each Gemma 2 feature shown to matter, the round trip, refusals."""

import pytest
from hf_parity import (assert_refused, copy_dir, TOL, assert_parity, assert_round_trip, edit_config, hf_logits, make_hf, maxlm_logits, rel_err,
                       tokens, transformers)

from maxlm.config import ConfigError
from maxlm.convert import hf

# A window (4) shorter than the batch (16), query_pre_attn_scalar unequal to head_dim, and soft caps low
# enough (with initializer_range 0.1) that each one changes the logits by several percent.
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
             initializer_range=0.1, query_pre_attn_scalar=32, sliding_window=4, attn_logit_softcapping=2.0,
             final_logit_softcapping=2.0)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma2")
    return make_hf(transformers.Gemma2Config(**SMALL), path), path, tokens(96, L=16)


def test_gemma2_parity(gemma2):
    model, path, toks = gemma2
    m = hf.load_config(path).model
    assert (m.sliding_window, m.attn_scale, m.attn_softcap, m.final_softcap) == (4, 32 ** -0.5, 2.0, 2.0)
    assert m.tie_embeddings
    assert_parity(model, path, toks)


@pytest.mark.parametrize("change", [dict(attn_logit_softcapping=None), dict(final_logit_softcapping=None),
                                    dict(sliding_window=64), dict(query_pre_attn_scalar=16)])
def test_gemma2_feature_switched_off_breaks_parity(gemma2, tmp_path, change):
    """Switch one feature off in maxlm's reading of config.json: maxlm no longer matches transformers."""
    model, path, toks = gemma2
    copy_dir(path, tmp_path)
    edit_config(tmp_path, **change)
    assert rel_err(maxlm_logits(tmp_path, toks), hf_logits(model, toks)) > 10 * TOL


@pytest.mark.malformed
@pytest.mark.parametrize("types", [["full_attention", "sliding_attention"], ["sliding_attention"] * 2])
def test_gemma2_alternation_matters_and_other_layouts_are_refused(gemma2, tmp_path, types):
    """The same weights with another layer layout in transformers: maxlm refuses the config.json, and read
    with maxlm's layout (even layers sliding) the logits differ, so the layout maxlm matches is its own."""
    model, path, toks = gemma2
    other = make_hf(transformers.Gemma2Config(**SMALL, layer_types=types), tmp_path)
    with pytest.raises(ConfigError, match="`layer_types`="):
        hf.load_config(tmp_path)
    edit_config(tmp_path, drop=("layer_types",))
    got = maxlm_logits(tmp_path, toks)
    assert rel_err(got, hf_logits(other, toks)) > 10 * TOL
    assert rel_err(got, hf_logits(model, toks)) <= TOL  # the fixture's weights, read as the fixture's model


def test_gemma2_round_trip(gemma2, tmp_path):
    model, path, toks = gemma2
    assert_round_trip(model, path, tmp_path / "out", toks)


@pytest.mark.malformed
@pytest.mark.parametrize("change, message", [
    (dict(hidden_activation="gelu"), "`hidden_activation`='gelu' is not supported"),  # exact GELU in Gemma2Config
    (dict(sliding_window=None), "`sliding_window`=None is not supported"),
    (dict(attention_bias=True), "`attention_bias`=True is not supported"),
])
def test_gemma2_refusals_name_the_field(gemma2, tmp_path, change, message):
    assert_refused(gemma2[1], tmp_path, change, message)
