"""Gemma against transformers: logits (tied and untied), each Gemma feature shown to matter, the legacy
"gelu" name, the round trip, refusals."""

import jax
import pytest
from hf_parity import (assert_refused, copy_dir, TOL, assert_parity, assert_round_trip, edit_config, hf_logits, make_hf, maxlm_logits, rel_err,
                       tokens, transformers)

from maxlm.convert import hf
from maxlm.layers import mlp
from maxlm.layers.norm import rms_norm
from maxlm.models import decoder, gemma as gemma_mod

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.1)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma")
    return make_hf(transformers.GemmaConfig(**SMALL), path), path, tokens(96)


def test_gemma_parity_tied(gemma, tmp_path):
    model, path, toks = gemma
    assert hf.load_config(path).model.tie_embeddings
    assert_parity(model, path, toks)
    # Official Gemma configs say hidden_act "gelu", which GemmaConfig reads as the tanh form; so does maxlm.
    copy_dir(path, tmp_path)
    edit_config(tmp_path, hidden_act="gelu")
    assert_parity(model, tmp_path, toks)


def test_gemma_parity_untied(tmp_path):
    model = make_hf(transformers.GemmaConfig(**SMALL, tie_word_embeddings=False), tmp_path)
    assert not hf.load_config(tmp_path).model.tie_embeddings
    assert_parity(model, tmp_path, tokens(96))


def _no_embed_scale(mp):
    embed = decoder.embed
    mp.setattr(decoder, "embed", lambda params, tokens, dtype, scale=1.0: embed(params, tokens, dtype))


def _plain_norm_gain(mp):  # w instead of 1 + w
    mp.setattr(gemma_mod, "norm", lambda x, w, m: rms_norm(x, w, m.norm_eps))


def _exact_gelu(mp):
    mp.setitem(mlp.ACTIVATIONS, "gelu_tanh", lambda x: jax.nn.gelu(x, approximate=False))


@pytest.mark.parametrize("switch_off", [_no_embed_scale, _plain_norm_gain, _exact_gelu])
def test_gemma_feature_switched_off_breaks_parity(gemma, monkeypatch, switch_off):
    model, path, toks = gemma
    ref = hf_logits(model, toks)
    # Exact and tanh GELU differ by < 5e-4 anywhere, so that one shows only against the float32 match
    # itself (~2e-7 here, ~1e-4 with exact GELU).
    floor = 30 * rel_err(maxlm_logits(path, toks), ref) if switch_off is _exact_gelu else 10 * TOL
    switch_off(monkeypatch)
    err = rel_err(maxlm_logits(path, toks), ref)
    assert err > floor, (err, floor)


def test_gemma_round_trip(gemma, tmp_path):
    model, path, toks = gemma
    assert_round_trip(model, path, tmp_path / "out", toks)


@pytest.mark.malformed
@pytest.mark.parametrize("change, message", [
    (dict(hidden_act="silu"), "`hidden_act`='silu' is not supported"),
    (dict(hidden_activation="gelu_exact"), "`hidden_activation`='gelu_exact' is not supported"),
    (dict(attention_bias=True), "`attention_bias`=True is not supported"),
    (dict(use_bidirectional_attention=True), "`use_bidirectional_attention`=True is not supported"),
])
def test_gemma_refusals_name_the_field(gemma, tmp_path, change, message):
    assert_refused(gemma[1], tmp_path, change, message)
