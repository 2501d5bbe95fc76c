"""gpt-oss against transformers: attention biases and sinks, alternating windows, YaRN, the biased router
with a softmax over the chosen experts, biased experts with the clamped gated unit; MXFP4 experts
dequantized exactly; round trips and refusals."""

import json

import numpy as np
import pytest
from hf_parity import (TOL, assert_parity, assert_refused, assert_round_trip, copy_dir, edit_config, exported_config,
                       hf_logits, maxlm_logits, rel_err, routing_margin, saved_tensors, tokens, torch, transformers)

from maxlm.config import ConfigError, load
from maxlm.convert import adapters, hf

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
             sliding_window=4, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                "original_max_position_embeddings": 16})


def _model(seed=0, **config):
    """A tiny GptOssForCausalLM whose biases, sinks and norms are far from their initial values, and whose
    expert gates are large enough that the clamp at 7 bites."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**SMALL, **config),
                                                          dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "sinks" in name or "norm" in name:
                p.add_(0.5 * torch.randn_like(p))
            if "gate_up_proj" in name and not name.endswith("bias"):
                p.mul_(40.0)
    return model


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    model = _model()
    model.save_pretrained(path)
    return model, path, tokens(96, L=24, seed=3)


def test_gpt_oss_parity(oss):
    model, path, toks = oss
    m = hf.load_config(path).model
    assert (m.family, m.layer_pattern, m.sliding_window, m.attn_sinks, m.qkv_bias, m.rope_scaling.kind) == \
        ("gpt_oss", "LG", 4, True, True, "yarn")
    assert routing_margin(model, toks, k=2) > 1e-4  # no expert choice is a float32 near-tie
    assert_parity(model, path, toks)


@pytest.mark.parametrize("feature", ["sinks", "clamp", "yarn", "pattern"])
def test_each_feature_switched_off_breaks_parity(oss, tmp_path, feature):
    model, path, toks = oss
    ref = hf_logits(model, toks)
    src = tmp_path
    c = json.loads((path / "config.json").read_text())
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    if feature == "clamp":  # the limit comes from config.json (model.swiglu_limit): this one never bites
        c["swiglu_limit"] = 1e9
    if feature == "yarn":
        c["rope_parameters"] = {"rope_type": "default", "rope_theta": 150000.0}
    if feature == "pattern":
        c["layer_types"] = ["full_attention"] * 2
    (tmp_path / "config.json").write_text(json.dumps(c))
    if feature == "sinks":  # -inf sinks take nothing from the softmax (0 would still be a logit)
        import jax.numpy as jnp
        from maxlm import models
        cfg = hf.load_config(path)
        params = hf.load_params(path, cfg)
        params["layers"]["sinks"] = jnp.full_like(params["layers"]["sinks"], -jnp.inf)
        B, L = toks.shape
        got = models.apply(params, jnp.asarray(toks, jnp.int32), jnp.broadcast_to(jnp.arange(L), (B, L)),
                           jnp.ones((B, L), jnp.int32), cfg.model, jnp.float32).logits
        assert rel_err(np.asarray(got), ref) > 10 * TOL
        return
    assert rel_err(maxlm_logits(src, toks), ref) > 10 * TOL


def test_gpt_oss_round_trip(oss, tmp_path):
    model, path, toks = oss
    assert_round_trip(model, path, tmp_path, toks)
    assert type(exported_config(hf.load_config(path).model)).__name__ == "GptOssConfig"


def _e2m1(code: np.ndarray) -> np.ndarray:
    """The FP4 (E2M1) value of a 4-bit code from its bits, per the OCP MX spec: sign, two exponent bits
    (bias 1), one mantissa bit; exponent 0 is subnormal (0.5 x mantissa)."""
    s, e, m = code >> 3 & 1, code >> 1 & 3, code & 1
    mag = np.where(e == 0, 0.5 * m, 2.0 ** (e.astype(np.float64) - 1) * (1 + 0.5 * m))
    return np.where(s == 1, -mag, mag)


def _quantized(rng, E, rows, cols, exponents):
    """Random MXFP4 blocks [E, rows, cols/32, 16] and scales [E, rows, cols/32] (E8M0, drawn from
    `exponents` + 127), and the float32 [E, cols, rows] they stand for, decoded bit by bit."""
    blocks = rng.integers(0, 256, (E, rows, cols // 32, 16), dtype=np.uint8)
    scales = (rng.integers(*exponents, (E, rows, cols // 32)) + 127).astype(np.uint8)
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(E, rows, cols // 32, 32)
    vals = _e2m1(codes) * 2.0 ** (scales.astype(np.float64)[..., None] - 127)
    return blocks, scales, vals.reshape(E, rows, cols).swapaxes(1, 2).astype(np.float32)


def test_mxfp4_experts_are_dequantized_exactly(tmp_path):
    """A checkpoint as published: expert weights as MXFP4 blocks and scales, config.json with its
    quantization_config. maxlm's weights equal the format's values, decoded here bit by bit, exactly, and
    its logits equal transformers' on the same weights unquantized."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(0)
    model = _model(seed=1)
    E, D, F = 4, 64, 32
    stored, decoded = {}, {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for proj, rows, cols, exps in (("gate_up_proj", 2 * F, D, (-5, 1)), ("down_proj", D, F, (-9, -5))):
                blocks, scales, w = _quantized(rng, E, rows, cols, exps)
                getattr(layer.mlp.experts, proj).copy_(torch.from_numpy(w))
                name = f"model.layers.{i}.mlp.experts.{proj}"
                stored[name + "_blocks"], stored[name + "_scales"], decoded[name] = blocks, scales, w
    model.save_pretrained(tmp_path / "float")
    tensors = {k: v for k, v in saved_tensors(tmp_path / "float").items() if k not in decoded}
    (tmp_path / "mxfp4").mkdir()
    save_file({**tensors, **stored}, str(tmp_path / "mxfp4" / "model.safetensors"))
    c = json.loads((tmp_path / "float" / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(c))
    cfg = hf.load_config(tmp_path / "mxfp4")
    params = hf.load_params(tmp_path / "mxfp4", cfg)["layers"]
    for i in range(2):
        gate_up = decoded[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        np.testing.assert_array_equal(np.asarray(params["w_gate"][i]), gate_up[..., 0::2])
        np.testing.assert_array_equal(np.asarray(params["w_up"][i]), gate_up[..., 1::2])
        np.testing.assert_array_equal(np.asarray(params["w_down"][i]), decoded[f"model.layers.{i}.mlp.experts.down_proj"])
    toks = tokens(96, L=24, seed=3)
    assert_parity(model, tmp_path / "mxfp4", toks)


def test_swiglu_limit_comes_from_config_json(tmp_path):
    """transformers clamps at config.json's swiglu_limit: so does maxlm (model.swiglu_limit), and export
    writes it back."""
    model = _model(seed=2, swiglu_limit=3.0)
    model.save_pretrained(tmp_path)
    m = hf.load_config(tmp_path).model
    assert m.swiglu_limit == 3.0 and hf.load_config(tmp_path, ["model.swiglu_limit=3.0"]).model == m
    toks = tokens(96, L=24, seed=3)
    assert routing_margin(model, toks, k=2) > 1e-4
    assert_parity(model, tmp_path, toks)
    assert exported_config(m).swiglu_limit == 3.0
    with pytest.raises(ConfigError, match=r"model.swiglu_limit=5.0 contradicts .*config.json \(3.0\)"):
        hf.load_config(tmp_path, ["model.swiglu_limit=5.0"])
    copy_dir(tmp_path, tmp_path / "at7")  # the default limit does not fit this model: the limit is used
    edit_config(tmp_path / "at7", swiglu_limit=7.0)
    assert rel_err(maxlm_logits(tmp_path / "at7", toks), hf_logits(model, toks)) > 10 * TOL


@pytest.mark.malformed
@pytest.mark.parametrize("change, message", [
    (dict(swiglu_limit=0), "`swiglu_limit`=0 is not supported by maxlm; expected a number > 0, or leave it out"),
    (dict(swiglu_limit=-7.0), "`swiglu_limit`=-7.0 is not supported by maxlm; expected a number > 0"),
    (dict(swiglu_alpha=1.0), "`swiglu_alpha`=1.0 is not supported by maxlm; expected 1.702"),
    (dict(quantization_config={"quant_method": "fp8"}), "`quantization_config.quant_method`='fp8' is not supported "
     "by maxlm; its gpt_oss import dequantizes mxfp4 only; import the unquantized (float) checkpoint"),
    (dict(quantization_config={}), "`quantization_config.quant_method`=None is not supported"),
    (dict(layer_types=[]), "`layer_types`=[] is not supported by maxlm; expected a list of sliding_attention and "
     "full_attention, one per layer (num_hidden_layers=2)"),
    (dict(layer_types=["sliding_attention"]), "`layer_types`=['sliding_attention'] is not supported"),
])
def test_gpt_oss_refusals(oss, tmp_path, change, message):
    _, path, _ = oss
    assert_refused(path, tmp_path, change, str(tmp_path / "config.json") + ": " + message)


def test_router_score_is_not_exportable():
    m = load(None, ["model.family=gpt_oss", "model.n_experts=4", "model.qkv_bias=true", "model.attn_sinks=true",
                    "model.router_score=sigmoid"]).model
    with pytest.raises(ConfigError, match="model.router_score='sigmoid' cannot be exported as gpt_oss"):
        adapters.get("gpt_oss").config_to_hf(m)


def _with_tensors(path, out, **tensors):
    """A copy of the saved model at `path` with some tensors replaced (None: removed) or added."""
    from safetensors.numpy import save_file
    t = saved_tensors(path)
    for k, v in tensors.items():
        t.pop(k) if v is None else t.__setitem__(k, v)
    out.mkdir()
    save_file(t, str(out / "model.safetensors"))
    (out / "config.json").write_text((path / "config.json").read_text())
    return out


SINKS = "model.layers.0.self_attn.sinks"


@pytest.mark.malformed
@pytest.mark.parametrize("name, value, message", [
    (SINKS, np.zeros(5, np.float32), f"tensor `{SINKS}` has the shape [5], expected [4] from its config.json"),
    (SINKS, np.zeros((1, 4), np.float32), f"tensor `{SINKS}` has the shape [1, 4], expected [4]"),
    (SINKS, np.zeros(4, np.int32), f"tensor `{SINKS}` holds I32 integers, not weights"),
    ("model.layers.1.mlp.experts.down_proj", np.zeros((4, 32, 72), np.float32),
     "tensor `model.layers.1.mlp.experts.down_proj` has the shape [4, 32, 72], expected [4, 32, 64]"),
])
def test_tensors_of_the_wrong_shape_or_type_are_refused(oss, tmp_path, name, value, message):
    _, path, _ = oss
    d = _with_tensors(path, tmp_path / "x", **{name: value})
    with pytest.raises(ConfigError) as e:
        hf.load_params(d, hf.load_config(d))
    assert str(e.value).startswith(f"{d}: ") and message in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.malformed
def test_mxfp4_sources_that_do_not_fit_are_refused(oss, tmp_path):
    _, path, _ = oss
    name = "model.layers.0.mlp.experts.down_proj"
    d = _with_tensors(path, tmp_path / "x", **{name: None, name + "_blocks": np.zeros((4, 64, 1, 16), np.uint8),
                                               name + "_scales": np.zeros((4, 64, 2), np.uint8)})
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**c, "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(ConfigError) as e:
        hf.load_params(d, hf.load_config(d))
    assert f"tensor `{name}` cannot be made from `{name}_blocks` uint8 [4, 64, 1, 16], `{name}_scales` uint8 " \
           f"[4, 64, 2]: MXFP4 needs uint8 blocks" in str(e.value) and "\n" not in str(e.value), str(e.value)
