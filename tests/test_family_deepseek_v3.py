"""DeepSeek-V3 against transformers: multi-head latent attention (low-rank query, the joint key/value latent,
the shared RoPE key in interleaved pairs), YaRN with DeepSeek's mscale, a dense first layer then MoE layers
with sigmoid scores, group-limited choice, the correction bias, the routed scale and a shared expert. FP8
weights with 128 x 128 block scales dequantized exactly; round trips, the multi-token prediction layers
dropped by name, and refusals."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_parity import (TOL, assert_parity, assert_round_trip, hf_logits, maxlm_logits, rel_err, saved_tensors, tokens,
                       torch, transformers)

from maxlm import models
from maxlm.config import ConfigError
from maxlm.convert import hf
from maxlm.convert.adapters import deepseek_v3 as adapter

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=80, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
             routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
             qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
             max_position_embeddings=64, rope_parameters={
                 "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                 "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0})


def _model(seed=0, **changes):
    """A tiny DeepseekV3ForCausalLM with norms and correction biases far from their initial values, and
    queries and keys large enough that the attention's scale (YaRN's mscale) shows in the logits."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(**{**SMALL, **changes}),
                                                          dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if "q_b_proj" in name or "q_proj" in name or "kv_b_proj" in name:
                p.mul_(5.0)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.05 * torch.randn_like(b))
    return model


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3")
    model = _model()
    model.save_pretrained(path)
    return model, path, tokens(96, L=20, seed=1)


def test_deepseek_v3_parity(ds):
    model, path, toks = ds
    m = hf.load_config(path).model
    assert (m.family, m.dense_layers, m.head_dim, m.mla.q_rank, m.mla.kv_rank, m.mla.rope_dim, m.mla.v_dim,
            m.router_groups, m.router_topk_groups, m.router_scale, m.router_score) == \
        ("deepseek_v3", 1, 24, 24, 16, 8, 12, 4, 2, 2.5, "sigmoid")
    assert_parity(model, path, toks)


def test_a_full_rank_query_and_no_dense_layers(tmp_path):
    model = _model(seed=1, q_lora_rank=None, first_k_dense_replace=0)
    model.save_pretrained(tmp_path)
    assert hf.load_config(tmp_path).model.mla.q_rank == 0
    assert_parity(model, tmp_path, tokens(96, L=16, seed=2))


def _edited(path, tmp_path, **changes):
    c = json.loads((path / "config.json").read_text())
    c.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(c))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    return tmp_path


@pytest.mark.parametrize("feature", ["groups", "scale", "mscale", "interleave", "correction_bias", "mla_rope"])
def test_each_feature_switched_off_breaks_parity(ds, monkeypatch, tmp_path, feature):
    """Each piece of the parity above is load-bearing: without it the logits move by far more than TOL."""
    model, path, toks = ds
    ref = hf_logits(model, toks)
    if feature == "mla_rope":  # no rotation of the query's and the shared key's RoPE dims
        from maxlm.layers import mla
        monkeypatch.setattr(mla, "apply_rope", lambda x, sin, cos: x)
    if feature == "correction_bias":
        cfg = hf.load_config(path)
        params = hf.load_params(path, cfg)
        params["layers"]["score_bias"] = jnp.zeros_like(params["layers"]["score_bias"])
        B, L = toks.shape
        got = models.apply(params, jnp.asarray(toks, jnp.int32), jnp.broadcast_to(jnp.arange(L), (B, L)),
                           jnp.ones((B, L), jnp.int32), cfg.model, jnp.float32).logits
        assert rel_err(np.asarray(got), ref) > 10 * TOL
        return
    src = path
    if feature == "interleave":
        monkeypatch.setattr(adapter, "_halves", np.arange)
    elif feature == "groups":
        src = _edited(path, tmp_path, n_group=1, topk_group=1)
    elif feature == "scale":
        src = _edited(path, tmp_path, routed_scaling_factor=1.0)
    else:
        src = _edited(path, tmp_path, rope_parameters={**SMALL["rope_parameters"], "mscale_all_dim": 0.0, "mscale": 0.0})
    assert rel_err(maxlm_logits(src, toks), ref) > 10 * TOL


def test_dense_first_layers_are_the_checkpoints(ds, tmp_path):
    """Read as all-MoE (first_k_dense_replace 0), the checkpoint's dense first layer has no experts to load:
    refused by name, never run as something else."""
    _, path, toks = ds
    with pytest.raises(ConfigError, match=r"tensor `model\.layers\.0\.mlp\.experts\.0\.\w+_proj\.weight` is missing"):
        maxlm_logits(_edited(path, tmp_path, first_k_dense_replace=0), toks)


def test_round_trip(ds, tmp_path):
    model, path, toks = ds
    assert_round_trip(model, path, tmp_path / "out", toks)


def _fp8(w: np.ndarray, b: int = 128):
    """w [out, in] in DeepSeek's format: float8 e4m3 values and one float32 scale_inv per b x b block."""
    rows, cols = -(-w.shape[0] // b), -(-w.shape[1] // b)
    s = np.zeros((rows, cols), np.float32)
    q = np.zeros(w.shape, np.float32)
    for r in range(rows):
        for c in range(cols):
            blk = w[r * b:(r + 1) * b, c * b:(c + 1) * b]
            s[r, c] = max(np.abs(blk).max(), 1e-12) / 448.0
            q[r * b:(r + 1) * b, c * b:(c + 1) * b] = blk / s[r, c]
    return torch.from_numpy(q).to(torch.float8_e4m3fn), torch.from_numpy(s)


def test_fp8_block_scaled_weights_dequantize_exactly(tmp_path):
    """A checkpoint written in the published format (FP8 projections, 128 x 128 scale blocks, ragged at
    the edges: dense_d_ff 200 is one full block and a part) loads as the format defines it: each value
    times its block's scale_inv, exactly, and gives transformers' logits for those weights."""
    from safetensors.torch import save_file
    model = _model(seed=2, intermediate_size=200, hidden_size=136)
    model.save_pretrained(tmp_path / "f32")
    src = saved_tensors(tmp_path / "f32")
    stored, dequant = {}, {}
    for name, w in src.items():
        projection = ("self_attn" in name or "mlp" in name) and "norm" not in name and "gate.weight" not in name
        if projection and w.ndim == 2:
            q, s = _fp8(w)
            stored[name], stored[name + "_scale_inv"] = q, s
            # the format's definition, computed apart from maxlm: the float8 value times its block's scale
            scale = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:w.shape[0], :w.shape[1]]
            dequant[name] = (q.float() * scale).numpy()
        else:
            stored[name] = dequant[name] = torch.from_numpy(w)
    assert sum(n.endswith("_scale_inv") for n in stored) > 10 and any(s.shape == (2, 2) for s in stored.values())
    (tmp_path / "fp8").mkdir()
    save_file(stored, str(tmp_path / "fp8" / "model.safetensors"))
    c = json.loads((tmp_path / "f32" / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(c))
    # the reference: the dequantized weights as float32, loaded the ordinary way
    (tmp_path / "ref").mkdir()
    save_file({k: torch.as_tensor(np.asarray(v)).contiguous() for k, v in dequant.items()},
              str(tmp_path / "ref" / "model.safetensors"))
    (tmp_path / "ref" / "config.json").write_text((tmp_path / "f32" / "config.json").read_text())
    cfg = hf.load_config(tmp_path / "fp8")
    got, want = hf.load_params(tmp_path / "fp8", cfg), hf.load_params(tmp_path / "ref", cfg)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    assert not np.array_equal(np.asarray(got["layers"]["wkv_a"]),
                              np.asarray(hf.load_params(tmp_path / "f32", cfg)["layers"]["wkv_a"]))  # FP8 rounded them
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32).eval()
    toks = tokens(96, L=12, seed=4)
    assert rel_err(maxlm_logits(tmp_path / "fp8", toks), hf_logits(ref_model, toks)) <= TOL


def test_multi_token_prediction_modules_import_as_far_as_mtp_depth_asks(ds, tmp_path):
    """The published checkpoints carry module k as layer num_hidden_layers + k, with copies of the embedding
    and output head: import reads the first model.mtp_depth modules (the copies never: the model's own are
    shared), drops the rest, and says so in one line; any other unknown tensor is still refused."""
    from safetensors.torch import save_file
    model, path, toks = ds
    t = {k: torch.from_numpy(v) for k, v in saved_tensors(path).items()}
    for k, v in list(t.items()):  # module 0: an MoE layer like layer 2, and its own pieces
        if k.startswith("model.layers.2."):
            t[k.replace("layers.2.", "layers.3.")] = v + 0.01
    eh = torch.randn(64, 128)
    t.update({"model.layers.3.eh_proj.weight": eh, "model.layers.3.enorm.weight": torch.ones(64) * 1.1,
              "model.layers.3.hnorm.weight": torch.ones(64) * 0.9, "model.layers.3.shared_head.norm.weight": torch.ones(64),
              "model.layers.3.embed_tokens.weight": t["model.embed_tokens.weight"].clone(),
              "model.layers.3.shared_head.head.weight": t["lm_head.weight"].clone()})
    save_file(t, str(tmp_path / "model.safetensors"))
    c = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**c, "num_nextn_predict_layers": 1}))
    assert hf.import_note(tmp_path) == (
        "deepseek_v3: the checkpoint has 1 multi-token prediction module(s) (model.layers.3.*): import reads the "
        "first model.mtp_depth of them (0 unless set) and drops the rest")
    assert rel_err(maxlm_logits(tmp_path, toks), hf_logits(model, toks)) <= TOL  # mtp_depth 0: not read
    cfg = hf.load_config(tmp_path, ["model.mtp_depth=1"])
    params = hf.load_params(tmp_path, cfg)
    np.testing.assert_array_equal(np.asarray(params["mtp"]["w_eh"][0]), eh.numpy().T)
    np.testing.assert_array_equal(np.asarray(params["mtp"]["wo"][0]), np.asarray(params["layers"]["wo"][1]) + 0.01)
    assert rel_err(maxlm_logits(tmp_path, toks, ["model.mtp_depth=1"]), hf_logits(model, toks)) <= TOL
    t["model.layers.2.mlp.mystery.weight"] = torch.zeros(3)
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="tensor `model.layers.2.mlp.mystery.weight` has no place"):
        maxlm_logits(tmp_path, toks)


@pytest.mark.malformed
@pytest.mark.parametrize("changes, message", [
    ({"rope_interleave": False}, "`rope_interleave`=False is not supported by maxlm; expected True"),
    ({"topk_method": "greedy"}, "`topk_method`='greedy' is not supported"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 64]}},
     "maxlm reads fp8 e4m3 with weight_block_size [128, 128], or none"),
])
def test_what_maxlm_would_compute_differently_is_refused(ds, tmp_path, changes, message):
    _, path, _ = ds
    with pytest.raises(ConfigError, match=None) as e:
        hf.load_config(_edited(path, tmp_path, **changes))
    assert message in str(e.value)
