"""HF <-> maxlm conversion: bit-identical round trips, sharded files, and one-line refusals."""

import json

import numpy as np
import pytest
from hf_parity import assert_parity, edit_config, make_hf, saved_tensors, tokens, torch, transformers
from maxlm.config import ConfigError
from maxlm.convert import hf

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_bit_identical_and_loads_in_transformers(tmp_path, dtype):
    src, out = tmp_path / "src", tmp_path / "out"
    model = make_hf(transformers.LlamaConfig(**SMALL), src)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
        model.save_pretrained(src)
    cfg = hf.load_config(src)
    hf.save(hf.load_params(src, cfg), cfg.model, out, dtype, max_shard_bytes=40_000)  # forces several files
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("*.safetensors"))) > 1
    a, b = saved_tensors(src), saved_tensors(out)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k
    load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)  # noqa: E731
    t = torch.as_tensor(tokens(96))
    with torch.no_grad():
        np.testing.assert_array_equal(load(out)(t).logits.numpy(), load(src)(t).logits.numpy())


def test_sharded_hf_checkpoint_imports(tmp_path):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    model.save_pretrained(tmp_path, max_shard_size="30KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert_parity(model, tmp_path, tokens(96))


def test_import_onto_a_mesh_shards_every_parameter(tmp_path):
    import jax
    from maxlm import config, mesh as mesh_lib, sharding
    make_hf(transformers.LlamaConfig(**SMALL), tmp_path)
    cfg = hf.with_hf_model(config.load("configs/tiny.yml", ["mesh.fsdp=4", "mesh.tensor=2"]), tmp_path)
    the_mesh = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, 8), jax.devices())
    params = hf.load_params(tmp_path, cfg, the_mesh, sharding.rules(cfg))
    wq = params["layers"]["wq"]
    assert wq.shape == (2, 64, 4, 16) and wq.sharding.spec == jax.sharding.PartitionSpec("stage", ("fsdp", "expert", "context"), "tensor", None)
    assert wq.addressable_shards[0].data.shape == (2, 16, 2, 16)  # each device holds only its shard
    ref = np.asarray(hf.load_params(tmp_path, cfg)["layers"]["wq"])
    np.testing.assert_array_equal(np.asarray(wq), ref)


@pytest.mark.malformed
@pytest.mark.parametrize("change, message", [
    (dict(architectures=["BertModel"]), "architectures=['BertModel'] is not supported; maxlm imports"),
    (dict(attention_bias=True), "`attention_bias`=True is not supported by maxlm"),
    (dict(hidden_act="gelu"), "`hidden_act`='gelu' is not supported by maxlm"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0}), "`rope_parameters.rope_type`='longrope'"),
    (dict(num_hidden_layers=3), "tensor `model.layers.2.input_layernorm.weight` is missing"),
    (dict(num_hidden_layers=1), "tensor `model.layers.1.input_layernorm.weight` has no place"),
])
def test_refusals_name_the_field(tmp_path, change, message):
    make_hf(transformers.LlamaConfig(**SMALL), tmp_path)
    edit_config(tmp_path, **change)
    with pytest.raises(ConfigError, match=None) as e:
        cfg = hf.load_config(tmp_path)
        hf.load_params(tmp_path, cfg)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.malformed
def test_a_command_line_model_key_equal_to_the_default_still_may_not_contradict_the_checkpoint(tmp_path):
    """model.n_layers=4 (base.yml's value too) on a 2-layer checkpoint ran with 2 layers, without a word."""
    make_hf(transformers.LlamaConfig(**SMALL), tmp_path)
    from maxlm import config
    cfg = config.load(None, ["model.n_layers=4"], model_pending=True)
    assert cfg.model.n_layers == config.load(None).model.n_layers == 4
    with pytest.raises(ConfigError, match=r"model.n_layers=4 contradicts .*config.json \(2\)"):
        hf.with_hf_model(cfg, tmp_path, explicit=["model.n_layers"])
    assert hf.with_hf_model(cfg, tmp_path).model.n_layers == 2  # not named on the command line: the checkpoint's


def test_user_model_keys_may_not_contradict_the_checkpoint(tmp_path):
    make_hf(transformers.LlamaConfig(**SMALL), tmp_path)
    with pytest.raises(ConfigError, match=r"model.d_model=128 contradicts .*config.json \(64\)"):
        hf.load_config(tmp_path, ["model.d_model=128"])
    assert hf.load_config(tmp_path, ["model.d_model=64", "model.init_std=0.5"]).model.init_std == 0.5


def test_a_tied_models_own_lm_head_is_named_in_the_log_not_read(tmp_path, capsys):
    """A checkpoint that ties its output layer (tie_word_embeddings) yet stores an lm_head.weight: transformers
    ignores that tensor, and so does maxlm, but not without a word."""
    from safetensors.numpy import save_file
    make_hf(transformers.LlamaConfig(**SMALL, tie_word_embeddings=True), tmp_path)
    tensors = saved_tensors(tmp_path)
    assert "lm_head.weight" not in tensors
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    save_file({**tensors, "lm_head.weight": np.ones((96, 64), np.float32)}, str(tmp_path / "model.safetensors"))
    cfg = hf.load_config(tmp_path)
    params = hf.load_params(tmp_path, cfg)
    assert "tensor `lm_head.weight` is not read: this llama model ties its output layer" in capsys.readouterr().out
    np.testing.assert_array_equal(np.asarray(params["embed"]), tensors["model.embed_tokens.weight"])


def test_not_an_hf_dir(tmp_path):
    with pytest.raises(ConfigError, match="not a Hugging Face model directory"):
        hf.load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, **SMALL}))
    with pytest.raises(ConfigError, match="no \\*.safetensors files"):
        hf.load_params(tmp_path, hf.load_config(tmp_path))


# ---- bad checkpoints: each a one-line ConfigError naming the field or tensor (issue 55) ---------------
LLAMA = {"architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, **SMALL}  # other families' tests reuse it
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16}


def _config_only(tmp_path, **fields) -> str:
    """A directory holding only config.json (LLAMA with `fields`; None drops one): what load_config reads."""
    c = {**LLAMA, **fields}
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in c.items() if v is not None}))
    return tmp_path


@pytest.mark.malformed
@pytest.mark.parametrize("fields, message", [
    # a present 0 (or other falsy value) is refused, never replaced by the default an absent field gets
    (dict(rope_parameters={**YARN, "factor": 0}), "`rope_parameters.factor`=0 is not supported by maxlm; expected a "
     "number >= 1, or leave it out"),
    (dict(rope_parameters={**YARN, "original_max_position_embeddings": 0}),
     "`rope_parameters.original_max_position_embeddings`=0 is not supported by maxlm; expected a positive integer"),
    (dict(rope_parameters={**YARN, "beta_fast": 0}), "`rope_parameters.beta_fast`=0 is not supported by maxlm; "
     "expected a number > beta_slow=1"),
    (dict(rope_parameters={**YARN, "beta_slow": 0.0}), "`rope_parameters.beta_slow`=0.0 is not supported"),
    (dict(rope_parameters={**YARN, "beta_slow": 40}), "`rope_parameters.beta_slow`=40 is not supported by maxlm; "
     "expected a number below beta_fast=32"),
    (dict(rope_parameters={**YARN, "attention_factor": 0}), "`rope_parameters.attention_factor`=0 is not supported"),
    (dict(rope_parameters={**YARN, "mscale": -1}), "`rope_parameters.mscale`=-1 is not supported"),
    (dict(rope_parameters={**YARN, "factor": "4"}), "`rope_parameters.factor`='4' is not supported"),
    (dict(rope_parameters={**YARN, "truncate": "false"}), "`rope_parameters.truncate`='false' is not supported by "
     "maxlm; expected true or false"),
    (dict(rope_parameters={**YARN, "factor": None, "original_max_position_embeddings": 128}),
     "`rope_parameters.factor`=None is not supported by maxlm; the factor it implies, max_position_embeddings / "
     "original_max_position_embeddings = 64/128, is below 1; set it"),
    (dict(rope_parameters={**YARN, "partial_rotary_factor": 0.5}), "`rope_parameters.partial_rotary_factor`=0.5"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 0}),
     "`rope_parameters.original_max_position_embeddings`=0 is not supported"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 4.0,
                           "high_freq_factor": 4.0}), "`rope_parameters.high_freq_factor`=4.0 is not supported by "
     "maxlm; expected a number > low_freq_factor=4.0"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 0}), "`rope_parameters.factor`=0"),
    (dict(rope_parameters=None, rope_theta=1e4, rope_scaling={**YARN, "factor": 0}), "`rope_scaling.factor`=0"),
    (dict(rope_parameters=None, rope_scaling="yarn"), "`rope_scaling`='yarn' is not supported by maxlm; expected a "
     "JSON object, or null"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 0}), "`rope_parameters.rope_theta`=0 is not supported"),
    (dict(num_key_value_heads=0), "`num_key_value_heads`=0 is not supported by maxlm; expected a positive integer, or "
     "leave it out"),
    (dict(head_dim=0), "`head_dim`=0 is not supported by maxlm; expected a positive integer, or leave it out"),
    (dict(architectures="LlamaForCausalLM"), "architectures='LlamaForCausalLM' must be a list of class names"),
    # each was read as something else, or blamed on a model.* key the user never set
    (dict(model_type="gpt2"), "model_type='gpt2' contradicts architectures=['LlamaForCausalLM'] (maxlm's llama family)"),
    (dict(num_hidden_layers=2.5), "`num_hidden_layers`=2.5 is not supported by maxlm; expected a positive integer"),
    (dict(vocab_size="32000"), "`vocab_size`='32000' is not supported by maxlm; expected a positive integer"),
    (dict(rms_norm_eps=0), "`rms_norm_eps`=0 is not supported by maxlm; expected a number > 0"),
    (dict(tie_word_embeddings="false"), "`tie_word_embeddings`='false' is not supported by maxlm; expected true or false"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rope_scaling={"rope_type": "linear", "factor": 4.0}),
     "`rope_scaling`={'rope_type': 'linear', 'factor': 4.0} is not supported by maxlm; it differs from rope_parameters"),
    (dict(hidden_size=None), "(LlamaForCausalLM) lacks the field 'hidden_size'"),
])
def test_bad_config_fields_are_refused_naming_field_and_file(tmp_path, fields, message):
    d = _config_only(tmp_path, **fields)
    with pytest.raises(ConfigError) as e:
        hf.load_config(d)
    assert str(e.value).startswith(f"{d / 'config.json'}") and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_absent_or_null_fields_take_transformers_defaults(tmp_path):
    m = hf.load_config(_config_only(tmp_path, rope_parameters={**YARN, "factor": None, "beta_fast": None},
                                    num_key_value_heads=None, head_dim=None)).model
    r = m.rope_scaling
    assert (r.factor, r.original_max_positions, r.beta_fast, r.beta_slow, r.attention_factor) == (4.0, 16, 32.0, 1.0, 0.0)
    assert (m.n_kv_heads, m.head_dim) == (4, 16)


@pytest.mark.malformed
@pytest.mark.parametrize("q", [{"quant_method": "awq", "bits": 4, "group_size": 128}, {"quant_method": "gptq", "bits": 4},
                               {"quant_method": "bitsandbytes", "load_in_4bit": True}, {"quant_method": "mxfp4"},
                               {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}, {}])
def test_quantized_checkpoints_are_refused_before_any_tensor_is_read(tmp_path, q):
    d = _config_only(tmp_path, quantization_config=q)  # no safetensors at all: refused from config.json alone
    with pytest.raises(ConfigError) as e:
        hf.load_config(d)
    assert str(e.value) == (f"{d / 'config.json'}: `quantization_config.quant_method`={q.get('quant_method')!r} is not "
                            f"supported by maxlm; its weights cannot be dequantized; import the unquantized (float) "
                            f"checkpoint")


@pytest.mark.malformed
@pytest.mark.parametrize("q", ["gptq", "fp8", ["fp8"]])
def test_a_quantization_config_that_is_not_an_object_is_refused(tmp_path, q):
    """A bare "fp8" must not pass as DeepSeek-V3's method with its block size unread."""
    d = _config_only(tmp_path, quantization_config=q)
    with pytest.raises(ConfigError, match=r"`quantization_config`=.* expected an object holding quant_method"):
        hf.load_config(d)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_hf(transformers.LlamaConfig(**SMALL), path)
    return path


def _edited(src, out, config: dict = {}, **tensors):
    """A copy of the checkpoint at `src` with tensors replaced (name -> array) and config.json fields changed."""
    from safetensors.numpy import save_file
    out.mkdir()
    save_file({**saved_tensors(src), **tensors}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), **config}))
    return out


O, K = "model.layers.1.self_attn.o_proj.weight", "model.layers.0.self_attn.k_proj.weight"
F32 = np.float32


@pytest.mark.malformed
@pytest.mark.parametrize("config, tensors, message", [
    ({}, {O: np.zeros((64, 72), F32)}, f"tensor `{O}` has the shape [64, 72], expected [64, 64] from its config.json"),
    ({}, {K: np.zeros((64, 32), F32)}, f"tensor `{K}` has the shape [64, 32], expected [32, 64]"),  # transposed
    ({}, {K: np.zeros((1, 32, 64), F32)}, f"tensor `{K}` has the shape [1, 32, 64], expected [32, 64]"),
    ({"vocab_size": 100}, {}, "tensor `model.embed_tokens.weight` has the shape [96, 64], expected [100, 64]"),
    ({}, {K: np.zeros((32, 64), np.int32)}, f"tensor `{K}` holds I32 integers, not weights: maxlm reads float "
     "tensors (a quantized export's packed weights? import the unquantized checkpoint)"),
    ({}, {K: np.zeros((32, 64), np.uint8)}, f"tensor `{K}` holds U8 integers"),
    ({}, {K: np.zeros((32, 64), bool)}, f"tensor `{K}` holds BOOL integers"),
    # was "non-finite loss at step 1", exit 3, naming no tensor
    ({}, {K: np.full((32, 64), np.nan, F32)}, f"tensor `{K}` holds 2048 NaN or infinite value(s) of 2048; the "
     "checkpoint is damaged"),
])
def test_tensors_that_do_not_match_are_refused(llama, tmp_path, config, tensors, message):
    d = _edited(llama, tmp_path / "x", config, **tensors)
    with pytest.raises(ConfigError) as e:
        hf.load_params(d, hf.load_config(d))
    assert str(e.value).startswith(f"{d}: ") and message in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.malformed
def test_a_tensor_in_two_files_without_an_index_is_refused(llama, tmp_path):
    """One of the two was read, whichever came first."""
    from safetensors.numpy import save_file
    d = _edited(llama, tmp_path / "x")
    save_file({K: np.zeros((32, 64), F32)}, str(d / "stale.safetensors"))
    with pytest.raises(ConfigError, match=rf"tensor `{K}` is in both model.safetensors and stale.safetensors, and no "
                                          r"model.safetensors.index.json says which to read"):
        hf.load_params(d, hf.load_config(d))


@pytest.mark.malformed
def test_a_malformed_index_is_one_line(llama, tmp_path):
    d = _edited(llama, tmp_path / "x")
    (d / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ConfigError, match=r"model.safetensors.index.json cannot be read as a safetensors index "
                                          r"\(KeyError: 'weight_map'\)"):
        hf.load_params(d, hf.load_config(d))


GPT2 = {"architectures": ["GPT2LMHeadModel"], "vocab_size": 96, "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 64}
DEEPSEEK = {**LLAMA, "architectures": ["DeepseekV3ForCausalLM"], "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
            "v_head_dim": 16, "kv_lora_rank": 32, "q_lora_rank": 32, "moe_intermediate_size": 32, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}


@pytest.mark.malformed
@pytest.mark.parametrize("config, message", [
    ({**GPT2, "n_inner": 0}, "`n_inner`=0 is not supported by maxlm; expected a positive integer, or leave it out"),
    ({**GPT2, "n_head": 0}, "`n_head`=0 is not supported by maxlm; expected a positive integer"),
    ({**DEEPSEEK, "q_lora_rank": 0}, "`q_lora_rank`=0 is not supported by maxlm; expected a positive integer, or null "
     "for a full-rank query"),
    ({**LLAMA, "architectures": ["Gemma3ForCausalLM"], "layer_types": []}, "`layer_types`=[] is not supported"),
    ({**LLAMA, "architectures": ["Qwen3ForCausalLM"], "head_dim": 0}, "`head_dim`=0 is not supported"),
    ({**DEEPSEEK, "n_group": 0}, "`n_group`=0 is not supported by maxlm; expected an integer >= 1"),
    ({**DEEPSEEK, "routed_scaling_factor": 0}, "`routed_scaling_factor`=0 is not supported"),
    ({**DEEPSEEK, "n_shared_experts": -1}, "`n_shared_experts`=-1 is not supported"),
    # transformers divides the scores by the cap: 0 makes every logit NaN
    ({**LLAMA, "architectures": ["Gemma2ForCausalLM"], "final_logit_softcapping": 0},
     "`final_logit_softcapping`=0 is not supported by maxlm; expected a positive number, or null for no cap"),
    ({**LLAMA, "architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": 0}, "`attn_logit_softcapping`=0"),
    # a ZeroDivisionError, a modulo by zero and a TypeError; a string read as true
    ({**LLAMA, "architectures": ["Gemma2ForCausalLM"], "query_pre_attn_scalar": 0}, "`query_pre_attn_scalar`=0 is not "
     "supported by maxlm; expected a number > 0"),
    ({**LLAMA, "architectures": ["Gemma3ForCausalLM"], "sliding_window_pattern": 0}, "`sliding_window_pattern`=0"),
    ({**LLAMA, "architectures": ["Gemma3ForCausalLM"], "sliding_window_pattern": "6"}, "`sliding_window_pattern`='6'"),
    ({**LLAMA, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": "false"}, "`use_sliding_window`='false' is "
     "not supported by maxlm; expected true or false"),
    ({**LLAMA, "architectures": ["Gemma3ForConditionalGeneration"]}, "`text_config`=None is not supported by maxlm; a "
     "Gemma3ForConditionalGeneration config holds its text model's fields in a text_config object"),
    ({**LLAMA, "num_hidden_layers": None}, "`num_hidden_layers`=None is not supported by maxlm; expected a positive "
     "integer"),  # was blamed on `model.n_layers`, a key the user never set
    ({**DEEPSEEK, "qk_rope_head_dim": None}, "`qk_rope_head_dim`=None is not supported by maxlm; expected a positive "
     "integer"),
])
def test_other_families_refuse_falsy_fields(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        hf.load_config(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'config.json'}: ") and message in str(e.value), str(e.value)


def test_other_families_take_defaults_for_absent_or_null_fields(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**GPT2, "n_inner": None}))
    assert hf.load_config(tmp_path).model.d_ff == 256
    (tmp_path / "config.json").write_text(json.dumps({**DEEPSEEK, "q_lora_rank": None}))
    assert hf.load_config(tmp_path).model.mla.q_rank == 0
    # DeepseekV3Config's routing defaults, not "off": a config without n_group still routes in 8 groups
    absent = {k: v for k, v in DEEPSEEK.items() if k not in ("n_group", "topk_group")} | {"n_routed_experts": 16}
    (tmp_path / "config.json").write_text(json.dumps(absent))
    m = hf.load_config(tmp_path).model
    assert (m.router_groups, m.router_topk_groups, m.shared_experts, m.router_scale) == (8, 4, 1, 2.5)
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "architectures": ["Gemma2ForCausalLM"],
                                                      "final_logit_softcapping": None}))
    assert (hf.load_config(tmp_path).model.final_softcap, hf.load_config(tmp_path).model.attn_softcap) == (0.0, 50.0)
    # GemmaConfig's head_dim is 256, not hidden_size / num_attention_heads
    gemma = {k: v for k, v in LLAMA.items() if k != "head_dim"} | {"architectures": ["GemmaForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(gemma))
    assert hf.load_config(tmp_path).model.head_dim == 256
