"""LoRA: a transform over any family's params through the matmul hook, the adapters the only trained
params; exact at step 0, merged export equal to the unmerged model, PEFT-loadable, mesh-invariant."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import oracle, run_and_resume
from hf_parity import make_hf, tokens, torch, transformers
from maxlm import aot, lora, mesh as mesh_lib, models, recipe as recipe_lib, sharding
from maxlm.config import ConfigError, load
from maxlm.convert import hf, peft
from maxlm.data import make_loader
from maxlm.models import params as P_
from maxlm.state import StateSpec

SMALL = ["model.n_layers=2", "seq_len=32", "global_batch_size=8", "optim.schedule=constant", "optim.warmup_steps=0",
         "optim.lr=1e-2", "dtype=float32", "lora.rank=4", "lora.targets=[wq,wk,wv,wo,w_gate,w_up,w_down]"]
ARCH = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


def logits(params, m, toks):
    return np.asarray(_logits(params, jnp.asarray(toks, jnp.int32), m))


@functools.partial(jax.jit, static_argnames="m")  # one program, not a few hundred ops each compiled on its own
def _logits(params, toks, m):
    B, L = toks.shape
    pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    return models.apply(params, toks, pos, jnp.ones((B, L), jnp.int32), m, jnp.float32).logits


def random_adapters(cfg, base_specs, seed=1, b_std=0.05):
    """Adapters with B drawn too (a trained adapter is not zero), so every term of the product is tested."""
    specs = lora.specs(base_specs, cfg.lora)
    ad = P_.init(specs, jax.random.key(seed))
    return jax.tree.map(lambda x: x + b_std * jax.random.normal(jax.random.key(seed + 1), x.shape), ad)


def test_zero_b_is_exactly_the_base_and_merge_equals_unmerged():
    cfg = load("configs/tiny.yml", SMALL)
    specs = models.get("llama").param_specs(cfg.model)
    base = P_.init(specs, jax.random.key(0))
    toks = tokens(cfg.model.vocab_size)
    ref = logits(base, cfg.model, toks)
    fresh = P_.init(lora.specs(specs, cfg.lora), jax.random.key(1))
    assert all(not np.any(ab["b"]) and np.any(ab["a"]) for ab in fresh["layers"].values())
    scale = lora.scale_of(cfg.lora)
    np.testing.assert_array_equal(logits(lora.attach(base, fresh, scale), cfg.model, toks), ref)

    ad = random_adapters(cfg, specs)
    unmerged = logits(lora.attach(base, ad, scale), cfg.model, toks)
    assert np.abs(unmerged - ref).max() > 1e-2  # the adapters change the model
    merged = logits(lora.merge(base, ad, scale), cfg.model, toks)
    np.testing.assert_allclose(merged, unmerged, atol=1e-5 * np.abs(unmerged).max(), rtol=0)


@pytest.mark.malformed
def test_targets_are_checked_in_one_line():
    specs = models.get("llama").param_specs(load("configs/tiny.yml").model)
    with pytest.raises(ConfigError, match=r"^lora.targets: this model has no weight `q_proj`; its layer weights are "
                                          r"w_down, w_gate, w_up, wk, wo, wq, wv$"):
        lora.specs(specs, load("configs/tiny.yml", ["lora.rank=2", "lora.targets=[wq,q_proj]"]).lora)
    moe = load("configs/tiny.yml", ["model.family=mixtral", "model.n_experts=4", "lora.rank=2", "lora.targets=[w_up]"])
    with pytest.raises(ConfigError, match="`w_up` holds the MoE experts"):
        lora.specs(models.get("mixtral").param_specs(moe.model), moe.lora)


def run_steps(overrides, n_devices, n_steps=3):
    cfg = load("configs/tiny.yml", SMALL + list(overrides))
    devices = jax.devices()[:n_devices]
    m = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, len(devices)), devices)
    rules = sharding.rules(cfg)
    ss = StateSpec(recipe_lib.build(cfg, m), m, rules)
    step = aot.compile_step(cfg, ss)
    loader = make_loader(cfg, ss.abstract_batch)
    state, losses = ss.init_fn(cfg.seed)(), []
    base0 = jax.device_get(state.extras["frozen"])
    for _ in range(n_steps):
        state, metrics = step(state, next(loader))
        losses.append(float(metrics["loss"]))
    loader.close()
    return cfg, ss, state, np.array(losses), base0


LAYERS = ["model.n_layers=4"]  # 2 stages x 2 chunks below


@pytest.fixture(scope="module")
def one_device():
    """3 steps on one device: the reference of every mesh below."""
    return run_steps(LAYERS + ["mesh.fsdp=1"], 1)


def test_only_the_adapters_train_and_any_mesh_gives_the_same_losses(one_device):
    cfg, ss, one, losses1, base0 = one_device
    # The optimizer holds moments for the adapters alone; the frozen base does not move.
    assert ss.n_trained == sum(x.size for x in jax.tree.leaves(one.params)) < ss.n_params / 10
    moments = [x for x in jax.tree.leaves(one.opt_state) if x.ndim]
    assert sum(x.size for x in moments) == 2 * ss.n_trained
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(one.extras["frozen"]), base0)
    assert all(np.any(np.asarray(ab["b"])) for ab in one.params["layers"].values())  # B left zero: trained
    _, ss8, eight, losses8, _ = run_steps(LAYERS + ["mesh.fsdp=2", "mesh.tensor=2", "mesh.data=2"], 8)
    np.testing.assert_allclose(losses8, losses1, rtol=1e-5)
    # The adapters follow their weight's sharding: wq's A splits its embed rows, wo's B its embed columns.
    assert eight.params["layers"]["wq"]["a"].sharding.spec == ss8.shardings.params["layers"]["wq"]["a"].spec
    assert "fsdp" in str(ss8.shardings.params["layers"]["wq"]["a"].spec[1])
    assert "fsdp" in str(ss8.shardings.params["layers"]["wo"]["b"].spec[2])


def test_adapters_train_through_circular_pipeline_stages(one_device):
    """LoRA over 2 stages x 2 chunks (maxlm/schedules/pipeline.py): the frozen base and the adapters are both held
    in the pipeline's storage order, and the losses are one device's."""
    _, ss, state, losses, base0 = run_steps(LAYERS + ["mesh.stage=2", "mesh.fsdp=2", "microbatches=2",
                                                      "pipeline_repeats=2"], 4)
    np.testing.assert_allclose(losses, one_device[3], rtol=1e-5)
    assert ss.layout == (2, 2)
    assert state.params["layers"]["wq"]["a"].sharding.spec[0] == "stage"


def test_peft_adapter_loads_in_peft_and_reproduces_the_logits(tmp_path):
    peft_lib = oracle("peft")
    model = make_hf(transformers.LlamaConfig(**ARCH), tmp_path / "hf")
    cfg = hf.load_config(tmp_path / "hf", SMALL[7:])
    base = hf.load_params(tmp_path / "hf", cfg)
    ad = random_adapters(cfg, models.get("llama").param_specs(cfg.model))
    files = peft.save(ad, cfg, tmp_path / "adapter", str(tmp_path / "hf"))
    assert sorted(f.name for f in files) == ["adapter_config.json", "adapter_model.safetensors"]
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert conf["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    tuned = peft_lib.PeftModel.from_pretrained(model, tmp_path / "adapter").eval()
    toks = tokens(ARCH["vocab_size"])
    with torch.no_grad():
        got = tuned(torch.as_tensor(toks)).logits.numpy()
    want = logits(lora.attach(base, ad, lora.scale_of(cfg.lora)), cfg.model, toks)
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-4


def test_a_lora_run_resumes_bitwise_and_exports_merged(tmp_path, capfd):
    """init_from an HF model, 4 steps saving at 2; a copy resumed from step 2 ends with the same adapters
    and losses bit for bit (the frozen base rebuilt from init_from); the merged export is the model. A run
    that names the LoRA run as its init_from is told both ways on, not that `params.embed` is missing."""
    make_hf(transformers.LlamaConfig(**ARCH), tmp_path / "hf")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i} " + "lora " * (i % 7 + 3)}) + "\n" for i in range(64)))
    args = SMALL + [f"init_from=hf:{tmp_path / 'hf'}", "data.source=jsonl", f"data.path={data}", "sample_tokens=0",
                    "lora.dropout=0.1"]
    rows_a, rows_b, a, b = run_and_resume("configs/tiny.yml", args, tmp_path)
    assert [r["loss"] for r in rows_a][2:] == [r["loss"] for r in rows_b][-2:]
    from maxlm.api import from_pretrained
    ma, mb = from_pretrained(a), from_pretrained(b)
    jax.tree.map(np.testing.assert_array_equal, ma.params, mb.params)
    # from_pretrained merged the adapters onto the base: the HF export of it loads in transformers as is.
    out = tmp_path / "export"
    from maxlm.convert import to_hf
    assert to_hf.main(["--checkpoint", str(a), "--out", str(out)]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    toks = tokens(ARCH["vocab_size"])
    with torch.no_grad():
        ref = exported(torch.as_tensor(toks)).logits.numpy()
    np.testing.assert_allclose(ma.logits(toks), ref, atol=1e-4 * np.abs(ref).max(), rtol=0)
    import train  # the CLI, train.py
    capfd.readouterr()
    assert train.main(["configs/tiny.yml", *SMALL, f"init_from={a}", f"run_dir={tmp_path / 'next'}"]) == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert err == [f"maxlm: error: `init_from`: {a} is a LoRA run's checkpoint: it holds rank-4 adapters, not a "
                   f"model. To start from the fine-tuned model, export it merged (python -m maxlm.convert.to_hf "
                   f"--checkpoint {a} --out DIR) and set init_from=hf:DIR; to start from its base, set "
                   f"init_from=hf:{tmp_path / 'hf'}"], err
