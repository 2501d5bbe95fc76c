"""Gemma 3 (text) against transformers: five local layers to one global, each kind with its RoPE (the
global one scaled linearly), q/k norms with Gemma's w - 1 gains; the multimodal checkpoint's text model
under both its name layouts, its vision tower dropped and said so; round trips and refusals."""

import json

import numpy as np
import pytest
from hf_parity import (TOL, assert_parity, assert_refused, assert_round_trip, edit_config, hf_logits, make_hf,
                       maxlm_logits, rel_err, saved_tensors, tokens, torch, transformers)

from maxlm.config import ConfigError, load
from maxlm.convert import adapters, hf

TEXT = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6, sliding_window=4,
            query_pre_attn_scalar=16, rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                          "rope_theta": 1e6},
                                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    return make_hf(transformers.Gemma3TextConfig(**TEXT), path), path


def test_gemma3_parity_and_its_pattern_and_ropes_matter(gemma3, tmp_path):
    """Over 24 tokens, windows of 4. Each of the three switched off in maxlm's view (all layers one kind;
    the local layers on the global RoPE; the global RoPE unscaled) no longer matches."""
    model, path = gemma3
    m = hf.load_config(path).model
    assert (m.family, m.layer_pattern, m.local_rope_theta, m.rope_scaling.kind, m.qk_norm) == \
        ("gemma3", "LLLLLG", 1e4, "linear", True)
    toks = tokens(96, L=24)
    assert_parity(model, path, toks)
    ref = hf_logits(model, toks)
    rope = TEXT["rope_parameters"]
    for change in ({"layer_types": ["sliding_attention"] * 6},
                   {"rope_parameters": {**rope, "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}},
                   {"rope_parameters": {**rope, "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}):
        (tmp_path / "x").mkdir(exist_ok=True)
        (tmp_path / "x" / "config.json").write_text((path / "config.json").read_text())
        (tmp_path / "x" / "model.safetensors").unlink(missing_ok=True)
        (tmp_path / "x" / "model.safetensors").symlink_to(path / "model.safetensors")
        edit_config(tmp_path / "x", **change)
        assert rel_err(maxlm_logits(tmp_path / "x", toks), ref) > 10 * TOL, change


def test_gemma3_round_trip(gemma3, tmp_path):
    model, path = gemma3
    assert_round_trip(model, path, tmp_path, tokens(96, L=24))


def test_the_older_config_layout_reads_the_same(gemma3, tmp_path):
    """rope_theta + rope_scaling + rope_local_base_freq and sliding_window_pattern, as published."""
    model, path = gemma3
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    c = json.loads((path / "config.json").read_text())
    for k in ("rope_parameters", "layer_types"):
        c.pop(k)
    c.update(rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_local_base_freq=1e4,
             sliding_window_pattern=6)
    (tmp_path / "config.json").write_text(json.dumps(c))
    assert hf.load_config(tmp_path).model == hf.load_config(path).model
    assert_parity(model, tmp_path, tokens(96, L=24))


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """A tiny Gemma3ForConditionalGeneration (a one-layer SigLIP tower) as transformers saves it."""
    path = tmp_path_factory.mktemp("gemma3_mm")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = transformers.Gemma3Config(text_config=TEXT, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=95, boi_token_index=93, eoi_token_index=94)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("layout", ["transformers", "published"])
def test_multimodal_checkpoint_loads_its_text_model(multimodal, tmp_path, layout):
    """Text-only logits equal the multimodal model's; the published names (language_model.model.*) read
    as transformers' own (model.language_model.*); the note says what is dropped."""
    from safetensors.numpy import save_file
    model, path = multimodal
    if layout == "published":
        rename = lambda n: n.replace("model.language_model.", "language_model.model.", 1).replace(  # noqa: E731
            "model.vision_tower.", "vision_tower.", 1).replace("model.multi_modal_projector.", "multi_modal_projector.", 1)
        save_file({rename(k): v for k, v in saved_tensors(path).items()}, str(tmp_path / "model.safetensors"))
        (tmp_path / "config.json").write_text((path / "config.json").read_text())
        path = tmp_path
        assert any(k.startswith("language_model.model.") for k in saved_tensors(path))
    toks = tokens(93, L=24)  # no image tokens
    assert hf.load_config(path).model.layer_pattern == "LLLLLG"
    assert hf.import_note(path) == ("Gemma3ForConditionalGeneration: maxlm loads its text model; the vision tower "
                                    "and the multimodal projector are dropped")
    assert_parity(model, path, toks)


@pytest.mark.malformed
def test_multimodal_refusals(multimodal, tmp_path):
    """A tensor neither text nor vision is refused by name, not dropped."""
    from safetensors.numpy import save_file
    _, path = multimodal
    save_file({**saved_tensors(path), "model.audio_tower.w": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ConfigError, match="tensor `model.audio_tower.w` has no place in maxlm's gemma3 model"):
        hf.load_params(tmp_path, hf.load_config(tmp_path))


@pytest.mark.malformed
def test_gemma3_refusals(gemma3, tmp_path):
    _, path = gemma3
    local_yarn = {**TEXT["rope_parameters"], "sliding_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}
    assert_refused(path, tmp_path / "a", dict(rope_parameters=local_yarn), "maxlm's local layers use plain RoPE")
    assert_refused(path, tmp_path / "b", dict(layer_types=["sliding_attention", "chunked_attention"] * 3),
                   "`layer_types`=")
    m = load(None, ["model.family=gemma3", "model.qk_norm=true", "model.sliding_window=8"]).model  # no local RoPE
    with pytest.raises(ConfigError, match="must be set to export as gemma3"):
        adapters.get("gemma3").config_to_hf(m)
