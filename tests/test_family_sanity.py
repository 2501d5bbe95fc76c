"""Llama, Gemma 2, Gemma 3, GPT-2, gpt-oss and DeepSeek-V3 as maxlm runs them (no transformers): packed rows equal their documents run
alone (learned positions restart per document; Gemma 2's window stays inside one), KV-cache decoding equals
full recomputation (the window measured from the cache index, positions continuing), and the real-size
configs have the published parameter counts. Gemma differs from Gemma 2 here only by what it lacks. Also the
embedding lookup every family shares."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import metrics, models
from maxlm.config import ConfigError, load
from maxlm.convert import adapters
from maxlm.models import decoder, params as P_

TINY = ["model.vocab_size=128", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.head_dim=8",
        "model.d_ff=64", "model.init_std=0.3", "seq_len=64", "dtype=float32"]
FAMILIES = {
    "llama": ["model.family=llama", "model.n_kv_heads=2"],
    # window 3 < every document below; soft caps low enough to bite on these logits
    "gemma2": ["model.family=gemma2", "model.n_kv_heads=2", "model.sliding_window=3", "model.attn_softcap=2.0",
               "model.final_softcap=3.0", "model.attn_scale=0.25", "model.tie_embeddings=true"],
    "gpt2": ["model.family=gpt2", "model.n_kv_heads=4", "model.max_positions=64", "model.tie_embeddings=true"],
    # a local and a global layer, each with its RoPE (the global one scaled); windows inside each document
    "gemma3": ["model.family=gemma3", "model.n_kv_heads=2", "model.sliding_window=3", "model.layer_pattern=LG",
               "model.qk_norm=true", "model.local_rope_theta=100.0", "model.rope_scaling.kind=linear",
               "model.rope_scaling.factor=4.0", "model.tie_embeddings=true"],
    "qwen2": ["model.family=qwen2", "model.n_kv_heads=2", "model.qkv_bias=true"],
    # gpt-oss: sinks, biases, a local and a global layer, its MoE
    "gpt_oss": ["model.family=gpt_oss", "model.n_kv_heads=2", "model.attn_sinks=true", "model.qkv_bias=true",
                "model.sliding_window=3", "model.n_experts=4", "model.experts_per_token=2"],
    # DeepSeek-V3: latent attention (keys 8 wide, values 6), a dense first layer, grouped routing
    "deepseek_v3": ["model.family=deepseek_v3", "model.n_kv_heads=4", "model.n_experts=8", "model.experts_per_token=2",
                    "model.router_score=sigmoid", "model.router_groups=4", "model.router_topk_groups=2",
                    "model.router_scale=2.5", "model.shared_experts=1", "model.dense_layers=1", "model.dense_d_ff=48",
                    "model.mla.q_rank=16", "model.mla.kv_rank=12", "model.mla.rope_dim=4", "model.mla.v_dim=6"],
}


def _model(family):
    cfg = load(None, TINY + FAMILIES[family])
    return cfg.model, P_.init(models.get(cfg.model.family).param_specs(cfg.model), jax.random.key(0))


@functools.partial(jax.jit, static_argnames="m")
def _fwd(params, toks, pos, seg, m, cache=None):
    out = models.apply(params, toks, pos, seg, m, jnp.float32, cache=cache)
    return out.logits, out.cache


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_row_equals_documents_run_alone(family):
    m, p = _model(family)
    docs = [np.array([5, 9, 100, 32, 7], np.int32), np.array([65, 66, 67, 68, 69, 70, 71], np.int32)]
    packed = np.concatenate(docs)[None]
    pos = np.concatenate([np.arange(len(d)) for d in docs])[None].astype(np.int32)
    seg = np.array([[1] * 5 + [2] * 7], np.int32)
    got = np.asarray(_fwd(p, packed, pos, seg, m)[0][0])
    # Each document alone, as one right-padded batch (causal: the padding changes nothing before it).
    alone_toks, alone_seg = np.zeros((2, 7), np.int32), np.zeros((2, 7), np.int32)
    for i, d in enumerate(docs):
        alone_toks[i, :len(d)], alone_seg[i, :len(d)] = d, 1
    alone = np.asarray(_fwd(p, alone_toks, np.tile(np.arange(7, dtype=np.int32), (2, 1)), alone_seg, m)[0])
    np.testing.assert_allclose(got[:5], alone[0, :5], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[5:], alone[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_cache_decoding_equals_full_recomputation(family):
    m, p = _model(family)
    L, P = 10, 6
    toks = np.random.default_rng(0).integers(0, 128, (2, L)).astype(np.int32)
    pos, seg = np.tile(np.arange(L, dtype=np.int32), (2, 1)), np.ones((2, L), np.int32)
    full = np.asarray(_fwd(p, toks, pos, seg, m)[0])
    logits, cache = _fwd(p, toks[:, :P], pos[:, :P], seg[:, :P], m, decoder.init_cache(m, 2, L, jnp.float32))
    steps = [np.asarray(logits)]
    for t in range(P, L):
        logits, cache = _fwd(p, toks[:, t:t + 1], pos[:, t:t + 1], seg[:, t:t + 1], m, cache)
        steps.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path, n_params, n_matmul", [
    # Gemma-2-9B: 42 x (attention 44,040,192 + MLP 3 x 3584 x 14336 + 4 norms) + tied 256000 x 3584 + final norm
    ("configs/models/gemma2-9b.yml", 9_241_705_984, 42 * (44_040_192 + 154_140_672) + 917_504_000),
    # GPT-2 small: wte + wpe (1024 x 768) + 12 x 7,087,872 + ln_f; matmuls: 12 x (4 D^2 + 2 D F) + D V
    ("configs/models/gpt2.yml", 124_439_808, 12 * (4 * 768 ** 2 + 2 * 768 * 3072) + 768 * 50257),
    # Gemma-3-12B's text model: 48 x (attention 3840 x 256 x (16 + 8 + 8 + 16) + MLP 3 x 3840 x 15360 + 4 norms
    # + q/k norms 2 x 256) + tied 262208 x 3840 + final norm
    ("configs/models/gemma3-12b.yml", 11_766_034_176, 48 * (47_185_920 + 176_947_200) + 1_006_878_720),
    # DeepSeek-V3: 61 x (MLA: q 7168 x 1536 + 1536 x 128 x 192, kv 7168 x (512 + 64) + 512 x 128 x (128 + 128),
    # o 128 x 128 x 7168; 2 latent and 2 layer norms) + 3 dense MLPs 3 x 7168 x 18432 + 58 x (router and
    # correction bias 7168 x 256 + 256, 257 experts 3 x 7168 x 2048) + embed, unembed, norm = 671,026,419,200;
    # plus its MTP module, one such MoE layer, 3 norms and the 2 x 7168 -> 7168 projection: 11,610,068,224.
    # Active matmuls: MLA, the dense MLPs, the router and 8 + 1 experts per MoE layer, the unembedding, and
    # the module's projection, layer and output head.
    ("configs/models/deepseek-v3.yml", 671_026_419_200 + 11_610_068_224,
     61 * 187_105_280 + 3 * 396_361_728 + 58 * (1_835_008 + 9 * 44_040_192) + 926_679_040
     + 2 * 7168 ** 2 + 187_105_280 + 1_835_008 + 9 * 44_040_192 + 926_679_040),
])
def test_real_sizes_have_the_published_parameter_counts(path, n_params, n_matmul):
    m = load(path).model
    assert P_.count(models.get(m.family).param_specs(m)) == n_params
    assert metrics.matmul_params(m) == n_matmul


@pytest.mark.malformed
@pytest.mark.parametrize("family, overrides, message", [
    ("gemma", ["model.sliding_window=8"], "model.sliding_window=8 cannot be exported: GemmaForCausalLM has no"),
    ("gemma2", ["model.attn_scale=0.3"], "model.attn_scale=0.3 cannot be exported: Gemma2ForCausalLM scales"),
    ("gpt2", ["model.n_kv_heads=2", "model.max_positions=64"], "exports to GPT2LMHeadModel only with n_kv_heads = n_heads"),
    ("llama", ["model.sliding_window=16"], "model.sliding_window=16 cannot be exported: LlamaForCausalLM has no"),
    ("llama", ["model.attn_softcap=50.0"], "model.attn_softcap=50.0 cannot be exported: LlamaForCausalLM has no"),
    # DeepSeek-V3's routing on a Mixtral: its config.json cannot say it
    ("mixtral", ["model.n_experts=4", "model.router_scale=2.5"],
     "model.router_scale=2.5 cannot be exported as mixtral: its Hugging Face model has router_scale=1.0"),
    ("mixtral", ["model.n_experts=8", "model.router_groups=4", "model.router_topk_groups=2"],
     "model.router_groups=4 cannot be exported as mixtral: its Hugging Face model has router_groups=0"),
])
def test_export_refuses_a_config_hf_cannot_express(family, overrides, message):
    m = load(None, TINY + [f"model.family={family}"] + overrides).model
    with pytest.raises(ConfigError, match=None) as e:
        adapters.get(family).config_to_hf(m)
    assert message in str(e.value)


def test_embedding_lookup_gathers_in_dtype_and_sums_its_gradient_in_float32():
    """decoder.lookup is take-then-cast bit for bit, forward and gradient, with tokens repeated many times
    (their gradients summed in the table's float32, not in bf16), while the gather itself moves bf16 rows."""
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.standard_normal((300, 64)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 20, (8, 128)))
    ct = jnp.asarray(rng.standard_normal((8, 128, 64)), jnp.bfloat16)
    old = jax.vjp(lambda t: jnp.take(t, ids, axis=0).astype(jnp.bfloat16), table)
    new = jax.vjp(lambda t: decoder.lookup(t, ids, jnp.bfloat16), table)
    np.testing.assert_array_equal(new[0], old[0])
    np.testing.assert_array_equal(jax.jit(new[1])(ct)[0], jax.jit(old[1])(ct)[0])
    summed_bf16 = jnp.zeros((300, 64), jnp.bfloat16).at[ids].add(ct).astype(jnp.float32)
    assert not np.array_equal(jax.jit(new[1])(ct)[0], summed_bf16)  # the case really tells the two sums apart
    hlo = jax.jit(lambda t: decoder.lookup(t, ids, jnp.bfloat16)).lower(table).as_text()
    assert re.findall(r"gather.*\((tensor<300x64x\w+>)", hlo) == ["tensor<300x64xbf16>"]
