"""Qwen3 and Qwen3-MoE against transformers: q/k norms, the MoE variant, round trips, refusals."""

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from hf_parity import (TOL, assert_parity, assert_round_trip, exported_config, hf_logits, make_hf, maxlm_logits,
                       maxlm_output, rel_err, routing_margin, tokens, torch, transformers)

from maxlm import config, models
from maxlm.config import load
from maxlm.convert import hf

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6)
# Every layer sparse; moe_intermediate_size differs from intermediate_size, so reading the wrong one fails.
MOE = dict(SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def test_qwen3_parity_and_qk_norm_matters(tmp_path):
    """Dense Qwen3, here with its (optional) sliding window on every layer, over more tokens than the
    window. make_hf perturbs the q/k norm gains; without the q/k norms maxlm no longer matches."""
    model = make_hf(transformers.Qwen3Config(**SMALL, use_sliding_window=True, sliding_window=8,
                                             max_window_layers=0), tmp_path)
    toks = tokens(96, L=24)
    cfg = hf.load_config(tmp_path)
    assert cfg.model.qk_norm and cfg.model.sliding_window == 8
    assert_parity(model, tmp_path, toks)
    # Switch the q/k norms off: maxlm's attention applies them when the parameters are there.
    params = hf.load_params(tmp_path, cfg)
    params["layers"] = {k: v for k, v in params["layers"].items() if k not in ("q_norm", "k_norm")}
    d = config.to_dict(cfg)
    d["model"]["qk_norm"] = False
    m = ml_collections.FrozenConfigDict(d).model
    B, L = toks.shape
    out = models.apply(params, jnp.asarray(toks, jnp.int32), jnp.broadcast_to(jnp.arange(L), (B, L)),
                       jnp.ones((B, L), jnp.int32), m, jnp.float32)
    assert rel_err(np.asarray(out.logits), hf_logits(model, toks)) > 10 * TOL


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    model = make_hf(transformers.Qwen3MoeConfig(**MOE), path)
    return model, path, tokens(96, L=16, seed=1)


def test_qwen3_moe_parity_and_balance_loss(qwen3_moe):
    model, path, toks = qwen3_moe
    # Top-2 routing flips on near-ties; this seed's smallest top-2 vs 3rd gap is far above float32 rounding.
    assert routing_margin(model, toks, k=2) > 1e-4
    m = hf.load_config(path).model
    assert (m.family, m.n_experts, m.experts_per_token, m.d_ff, m.qk_norm) == ("qwen3_moe", 4, 2, 32, True)
    with torch.no_grad():
        ref = model(torch.as_tensor(toks), output_router_logits=True)
    got = maxlm_output(path, toks, ["model.router_aux_loss=1.0"])
    err = rel_err(np.asarray(got.logits), ref.logits.numpy())
    assert err <= TOL, f"max|delta|/max|ref| = {err:.3g} > {TOL}"
    np.testing.assert_allclose(float(got.aux_loss), float(ref.aux_loss), rtol=1e-5)


def test_qwen3_moe_without_renormalisation_parity(tmp_path):
    """norm_topk_prob false (Qwen3MoeConfig's default): the chosen experts keep their softmax weights."""
    model = make_hf(transformers.Qwen3MoeConfig(**dict(MOE, norm_topk_prob=False)), tmp_path)
    toks = tokens(96, L=16, seed=1)
    assert routing_margin(model, toks, k=2) > 1e-4
    assert hf.load_config(tmp_path).model.router_renorm is False
    err = rel_err(maxlm_logits(tmp_path, toks), hf_logits(model, toks))
    assert err <= TOL, f"max|delta|/max|ref| = {err:.3g} > {TOL}"
    assert exported_config(hf.load_config(tmp_path).model).norm_topk_prob is False
    # Keys a Qwen3-MoE config.json cannot say are refused on export, in one line.
    for key in ("model.router_score=sigmoid", "model.shared_experts=1", "model.router_bias_rate=0.001"):
        m = load(None, ["model.family=qwen3_moe", "model.qk_norm=true", "model.n_experts=8", key]).model
        with pytest.raises(hf.ConfigError, match=f"model.{key[6:].split('=')[0]}=.* cannot be exported"):
            exported_config(m)


def test_qwen3_moe_round_trip(qwen3_moe, tmp_path):
    model, path, toks = qwen3_moe
    assert_round_trip(model, path, tmp_path, toks)


def test_qwen3_round_trip(tmp_path):
    model = make_hf(transformers.Qwen3Config(**SMALL, tie_word_embeddings=True), tmp_path / "src")
    assert_round_trip(model, tmp_path / "src", tmp_path / "out", tokens(96))


def _keys(arch="Qwen3ForCausalLM", drop=(), **changes):
    c = {**(MOE if "Moe" in arch else SMALL), "architectures": [arch], **changes}
    return hf.model_keys({k: v for k, v in c.items() if k not in drop})


def test_qwen3_config_fields():
    assert _keys(drop=("head_dim",))["head_dim"] == 128  # Qwen3Config's default, not hidden / heads
    assert _keys("Qwen3MoeForCausalLM", drop=("head_dim",))["head_dim"] == 16  # Qwen3-MoE: hidden / heads
    # The window counts only with use_sliding_window; the layers it covers are the per-layer table.
    window = lambda **c: (lambda k: (k["sliding_window"], k["layer_pattern"]))(_keys(**c))  # noqa: E731
    assert window(sliding_window=8) == (0, "")
    assert window(use_sliding_window=True, sliding_window=8, max_window_layers=2) == (0, "")
    assert window(use_sliding_window=True, sliding_window=8, max_window_layers=0) == (8, "")
    assert window(use_sliding_window=True, sliding_window=8, max_window_layers=1) == (8, "GL")
    assert window(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"]) == \
        (8, "LG")
    assert window(layer_types=["sliding_attention", "full_attention"]) == (0, "")  # no window: none slides
    assert _keys("Qwen3MoeForCausalLM", use_sliding_window=True, sliding_window=8)["sliding_window"] == 8
    # transformers 5.x saves the expert count as num_local_experts; hub files say num_experts.
    k = _keys("Qwen3MoeForCausalLM", drop=("num_experts",), num_local_experts=4)
    assert (k["family"], k["n_experts"]) == ("qwen3_moe", 4)


@pytest.mark.malformed
@pytest.mark.parametrize("arch, change, message", [
    ("Qwen3ForCausalLM", dict(attention_bias=True), "`attention_bias`=True is not supported"),
    ("Qwen3ForCausalLM", dict(hidden_act="gelu"), "`hidden_act`='gelu' is not supported"),
    ("Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=8,
                              layer_types=["full_attention", "chunked_attention"]), "`layer_types`="),
    ("Qwen3MoeForCausalLM", dict(decoder_sparse_step=2), "`decoder_sparse_step`=2 is not supported"),
    ("Qwen3MoeForCausalLM", dict(mlp_only_layers=[0]), "`mlp_only_layers`=[0] is not supported"),
    ("Qwen3MoeForCausalLM", dict(num_local_experts=8), "`num_experts`=4 is not supported"),
])
def test_qwen3_refusals(arch, change, message):
    with pytest.raises(hf.ConfigError) as e:
        _keys(arch, **change)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("window", [0, 4096])
def test_qwen3_export_config(window):
    """configs/models/qwen3-8b.yml exported: it reads back as itself; transformers sees q/k norms' head_dim
    and the window on every layer or none."""
    c = exported_config(load("configs/models/qwen3-8b.yml", [f"model.sliding_window={window}"]).model)
    assert type(c) is transformers.Qwen3Config and c.head_dim == 128
    assert c.sliding_window == (window or None)
    assert c.layer_types == ["sliding_attention" if window else "full_attention"] * 36


def test_qwen3_moe_export_config():
    m = load(None, ["model.family=qwen3_moe", "model.qk_norm=true", "model.n_experts=8",
                    "model.sliding_window=64"]).model
    c = exported_config(m)
    assert type(c) is transformers.Qwen3MoeConfig and c.norm_topk_prob and c.mlp_only_layers == []
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.sliding_window) == (8, 2, m.d_ff, 64)
