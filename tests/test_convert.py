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
    assert wq.shape == (2, 64, 4, 16) and wq.sharding.spec == jax.sharding.PartitionSpec("stage", ("fsdp", "context"), "tensor", None)
    assert wq.addressable_shards[0].data.shape == (2, 16, 2, 16)  # each device holds only its shard
    ref = np.asarray(hf.load_params(tmp_path, cfg)["layers"]["wq"])
    np.testing.assert_array_equal(np.asarray(wq), ref)


@pytest.mark.parametrize("change, message", [
    (dict(architectures=["BertModel"]), "architectures=['BertModel'] is not supported; maxlm imports"),
    (dict(attention_bias=True), "`attention_bias`=True is not supported by maxlm"),
    (dict(hidden_act="gelu"), "`hidden_act`='gelu' is not supported by maxlm"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0}), "`rope_scaling.rope_type`='longrope'"),
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


def test_user_model_keys_may_not_contradict_the_checkpoint(tmp_path):
    make_hf(transformers.LlamaConfig(**SMALL), tmp_path)
    with pytest.raises(ConfigError, match=r"model.d_model=128 contradicts .*config.json \(64\)"):
        hf.load_config(tmp_path, ["model.d_model=128"])
    assert hf.load_config(tmp_path, ["model.d_model=64", "model.init_std=0.5"]).model.init_std == 0.5


def test_not_an_hf_dir(tmp_path):
    with pytest.raises(ConfigError, match="not a Hugging Face model directory"):
        hf.load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, **SMALL}))
    with pytest.raises(ConfigError, match="no \\*.safetensors files"):
        hf.load_params(tmp_path, hf.load_config(tmp_path))
