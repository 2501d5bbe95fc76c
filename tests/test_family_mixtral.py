"""Mixtral against transformers: logits, the routing, the load-balancing loss and the round trip."""

import numpy as np
import pytest
from hf_parity import (TOL, assert_round_trip, edit_config, exported_config, hf_logits, make_hf, maxlm_logits,
                       maxlm_output, rel_err, routing_margin, tokens, torch, transformers)

from maxlm.config import load
from maxlm.convert import hf

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, num_local_experts=4,
             num_experts_per_tok=2)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A tiny Mixtral with a sliding window shorter than the batch (Mixtral takes Mistral's window too)."""
    path = tmp_path_factory.mktemp("mixtral")
    model = make_hf(transformers.MixtralConfig(**SMALL, sliding_window=8), path)
    return model, path, tokens(96, L=24)


def test_mixtral_parity_and_balance_loss(mixtral):
    """Logits, and the load-balancing loss: maxlm's aux_loss is router_aux_loss * balance loss, which at
    weight 1 is transformers' aux_loss (pooled over layers the same way), also with right padding
    (padded tokens excluded from both)."""
    model, path, toks = mixtral
    # Top-2 routing is discontinuous: on a near-tie torch and XLA could pick different experts. This seed's
    # smallest gap between the 2nd and 3rd router probability is far above float32 rounding (~1e-7).
    assert routing_margin(model, toks, k=2) > 1e-4
    cfg = hf.load_config(path)
    assert (cfg.model.sliding_window, cfg.model.router_aux_loss) == (8, 0.001)  # the checkpoint's coefficient
    seg = np.ones(toks.shape, np.int32)
    seg[1, 17:] = 0
    for mask in (None, seg):
        with torch.no_grad():
            ref = model(torch.as_tensor(toks), attention_mask=None if mask is None else torch.as_tensor(mask),
                        output_router_logits=True)
        got = maxlm_output(path, toks, ["model.router_aux_loss=1.0"], seg=mask)
        np.testing.assert_allclose(float(got.aux_loss), float(ref.aux_loss), rtol=1e-5)
        if mask is None:
            err = rel_err(np.asarray(got.logits), ref.logits.numpy())
            assert err <= TOL, f"max|delta|/max|ref| = {err:.3g} > {TOL}"


def test_mixtral_routing_matters(mixtral, tmp_path):
    """Route each token to one expert instead of two (in maxlm's reading of config.json): parity breaks."""
    model, path, toks = mixtral
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    edit_config(tmp_path, num_experts_per_tok=1)
    assert rel_err(maxlm_logits(tmp_path, toks), hf_logits(model, toks)) > 10 * TOL


def test_mixtral_round_trip(mixtral, tmp_path):
    model, path, toks = mixtral
    assert_round_trip(model, path, tmp_path, toks)


def _keys(drop=(), **changes):
    """maxlm's model keys for a hand-written config.json (only the fields given: the defaults are tested)."""
    c = {**SMALL, "architectures": ["MixtralForCausalLM"], **changes}
    return hf.model_keys({k: v for k, v in c.items() if k not in drop})


def test_mixtral_config_fields():
    k = _keys()
    assert (k["family"], k["n_experts"], k["experts_per_token"], k["sliding_window"]) == ("mixtral", 4, 2, 0)
    assert k["rope_theta"] == 1e6 and k["router_aux_loss"] == 0.001  # MixtralConfig's defaults
    assert _keys(rope_theta=1e4)["rope_theta"] == 1e4
    # Qwen3-MoE's spelling of the expert count is read too; two spellings that disagree are refused.
    assert _keys(drop=("num_local_experts",), num_experts=4)["n_experts"] == 4
    with pytest.raises(hf.ConfigError, match="num_experts"):
        _keys(num_experts=8)
    # Jitter noise is train-mode only in transformers: accepted, it does not change the model's function.
    assert _keys(router_jitter_noise=0.1)["n_experts"] == 4


@pytest.mark.malformed
@pytest.mark.parametrize("change, message", [
    (dict(hidden_act="gelu"), "`hidden_act`='gelu' is not supported"),
    (dict(sliding_window=0), "`sliding_window`=0 is not supported"),
    (dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]), "`layer_types`="),
])
def test_mixtral_refusals(change, message):
    with pytest.raises(hf.ConfigError) as e:
        _keys(**change)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_mixtral_export_config():
    c = exported_config(load("configs/models/mixtral-8x7b.yml").model)
    assert type(c) is transformers.MixtralConfig
    assert (c.num_local_experts, c.num_experts_per_tok, c.router_aux_loss_coef, c.sliding_window) == (8, 2, 0.02, None)
    assert c.rope_parameters["rope_theta"] == 1e6
