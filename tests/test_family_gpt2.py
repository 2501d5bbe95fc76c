"""GPT-2 against transformers: logits (tied, untied), each GPT-2 feature shown to matter, the round trip,
refusals, and the learned position table bounding seq_len."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_parity import (assert_refused, TOL, assert_parity, assert_round_trip, hf_logits, make_hf, rel_err, saved_tensors,
                       tokens, torch, transformers)

from maxlm import config, models
from maxlm.config import ConfigError
from maxlm.convert import hf
from maxlm.layers import mlp

# n_positions 1024 keeps maxlm's default seq_len valid; the table is 1024 x 64, still tiny.
SMALL = dict(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=1024, initializer_range=0.1, bos_token_id=0,
             eos_token_id=0)


def make_gpt2(path, **kw):
    """make_hf, with every bias random too (transformers initialises them to zero)."""
    model = make_hf(transformers.GPT2Config(**{**SMALL, **kw}), path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    return make_gpt2(path), path, tokens(96, L=16)


def test_gpt2_parity_tied(gpt2_dir):
    model, path, toks = gpt2_dir
    m = hf.load_config(path).model
    assert (m.tie_embeddings, m.d_ff, m.n_kv_heads, m.head_dim, m.max_positions) == (True, 256, 4, 16, 1024)
    assert_parity(model, path, toks)


def test_gpt2_parity_untied_and_reorder_and_upcast(tmp_path):
    # reorder_and_upcast_attn (used by eager attention only) computes the same scores in float32, as maxlm does.
    model = make_gpt2(tmp_path, tie_word_embeddings=False, reorder_and_upcast_attn=True, attn_implementation="eager")
    assert not hf.load_config(tmp_path).model.tie_embeddings
    assert_parity(model, tmp_path, tokens(96, L=16))


@functools.partial(jax.jit, static_argnames="m")
def _logits(params, toks, m):
    pos = jnp.broadcast_to(jnp.arange(toks.shape[1], dtype=jnp.int32), toks.shape)
    return models.apply(params, toks, pos, jnp.ones(toks.shape, jnp.int32), m, jnp.float32).logits


def _zero(names):
    """Params with the named top-level or per-layer entries set to zero."""
    zero = lambda tree: {k: jnp.zeros_like(v) if k in names else v for k, v in tree.items()}  # noqa: E731
    return lambda p: {**zero(p), "layers": zero(p["layers"])}


SWITCH_OFF = {
    "learned_positions": _zero(["positions"]),
    "projection_biases": _zero(["bq", "bk", "bv", "bo", "b_in", "b_out"]),
    "layer_norm_biases": _zero(["attn_norm_bias", "mlp_norm_bias", "final_norm_bias"]),
    "c_attn_order_q_k_v": lambda p: {**p, "layers": {**p["layers"], "wq": p["layers"]["wk"], "wk": p["layers"]["wq"]}},
}


@pytest.mark.parametrize("feature", [*SWITCH_OFF, "tanh_gelu"])
def test_gpt2_feature_switched_off_breaks_parity(gpt2_dir, monkeypatch, feature):
    model, path, toks = gpt2_dir
    cfg = hf.load_config(path)
    params = hf.load_params(path, cfg)
    ref = hf_logits(model, toks)
    exact = rel_err(np.asarray(_logits(params, toks, cfg.model)), ref)
    if feature == "tanh_gelu":
        monkeypatch.setitem(mlp.ACTIVATIONS, "gelu_tanh", lambda x: jax.nn.gelu(x, approximate=False))
        err = rel_err(np.asarray(_logits.__wrapped__(params, toks, cfg.model)), ref)  # not the jit-cached one
        assert err > 30 * exact, (err, exact)  # exact and tanh GELU differ by < 5e-4 anywhere
    else:
        err = rel_err(np.asarray(_logits(SWITCH_OFF[feature](params), toks, cfg.model)), ref)
        assert err > 10 * TOL, err


def test_gpt2_hub_layout_without_the_transformer_prefix(gpt2_dir, tmp_path):
    """The hub's GPT-2 files were saved from GPT2Model: `h.0.ln_1.weight`, `wte.weight`, ..., no
    `transformer.` and no lm_head, plus the old causal-mask buffers `h.{i}.attn.bias`. Both transformers
    and maxlm read them."""
    from safetensors.numpy import save_file
    model, path, toks = gpt2_dir
    bare = {k.removeprefix("transformer."): v for k, v in saved_tensors(path).items()}
    assert not any(k.startswith("lm_head") for k in bare)
    bare.update({f"h.{i}.attn.bias": np.tril(np.ones((1, 1, 8, 8), np.float32)) for i in range(2)})
    save_file(bare, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    np.testing.assert_array_equal(hf_logits(reloaded, toks), hf_logits(model, toks))
    assert_parity(model, tmp_path, toks)


def test_gpt2_round_trip(gpt2_dir, tmp_path):
    model, path, toks = gpt2_dir
    assert_round_trip(model, path, tmp_path / "out", toks)


@pytest.mark.malformed
@pytest.mark.parametrize("change, message", [
    (dict(activation_function="gelu"), "`activation_function`='gelu' is not supported"),
    (dict(scale_attn_weights=False), "`scale_attn_weights`=False is not supported"),
    (dict(scale_attn_by_inverse_layer_idx=True), "`scale_attn_by_inverse_layer_idx`=True is not supported"),
    (dict(add_cross_attention=True), "`add_cross_attention`=True is not supported"),
])
def test_gpt2_refusals_name_the_field(gpt2_dir, tmp_path, change, message):
    assert_refused(gpt2_dir[1], tmp_path, change, message)


def test_gpt2_seq_len_is_bounded_by_the_position_table():
    assert config.load(None, ["model.family=gpt2", "model.max_positions=1024", "seq_len=1024"]).seq_len == 1024
    with pytest.raises(ConfigError, match="`seq_len`=2048 exceeds `model.max_positions`=1024"):
        config.load(None, ["model.family=gpt2", "model.max_positions=1024", "seq_len=2048"])
    assert config.load(None, ["model.max_positions=1024", "seq_len=2048"]).seq_len == 2048  # RoPE models: a hint only


def test_short_context_gpt2_loads_for_inference(tmp_path):
    """A 64-position GPT-2: base.yml's seq_len (1024) is capped at its table, so from_pretrained gives
    logits and generation equal to transformers'; a seq_len the user sets above the table is refused."""
    import maxlm
    model = make_gpt2(tmp_path, n_positions=64)
    m = maxlm.from_pretrained(tmp_path)
    assert (m.config.model.max_positions, m.config.seq_len) == (64, 64)
    toks = tokens(96, L=64)  # the whole table
    assert rel_err(np.asarray(m.logits(toks)), hf_logits(model, toks)) <= TOL
    prompt = toks[0, :8]
    with torch.no_grad():
        want = model.generate(torch.as_tensor(prompt[None]), attention_mask=torch.ones(1, 8, dtype=torch.long),
                              max_new_tokens=56, do_sample=False, pad_token_id=0, eos_token_id=None)[0, 8:].tolist()
    assert m.generate(prompt.tolist(), 56) == want  # up to the last position
    with pytest.raises(ValueError, match="= 65 exceeds the model's max_positions=64"):
        m.generate(prompt.tolist(), 57)
    with pytest.raises(ConfigError, match="`seq_len`=128 exceeds `model.max_positions`=64"):
        hf.load_config(tmp_path, ["seq_len=128"])  # a fine-tune asking for more positions than the table has
    assert hf.load_config(tmp_path, ["seq_len=32"]).seq_len == 32
