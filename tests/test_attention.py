"""The `attention` key: what each choice runs where, its refusals, and that the model computes the same
function with the flash kernels (here in Pallas interpret mode) as with XLA."""

import jax
import numpy as np
import pytest
from conftest import run_cli

from maxlm import recipe as recipe_lib
from maxlm.config import ConfigError, load
from maxlm.layers import attention

TINY = ["model.n_layers=2", "model.d_model=64", "model.d_ff=128", "model.n_heads=4", "model.n_kv_heads=2",
        "model.head_dim=16", "seq_len=40", "global_batch_size=8"]


@pytest.mark.parametrize("choice, where, want", [
    ("auto", "cpu", "xla"), ("auto", "gpu", "flash"), ("auto", "tpu", "flash"),
    ("xla", "gpu", "xla"), ("flash", "tpu", "flash"), ("cudnn", "gpu", "cudnn"),
])
def test_resolve(choice, where, want):
    m = load(None, TINY).model
    assert attention.resolve(choice, where, m, "bfloat16") == (want, None)


@pytest.mark.malformed
@pytest.mark.parametrize("where, dtype, message", [
    ("tpu", "bfloat16", "attention=mosaic is the Hopper GPU kernel, and this run compiles for tpu"),
    ("gpu", "float32", "attention=mosaic: it runs bfloat16 on a GPU, and dtype=float32"),
])
def test_mosaic_refusals(where, dtype, message):
    with pytest.raises(ConfigError) as e:
        attention.resolve("mosaic", where, load(None, TINY).model, dtype)
    assert message in str(e.value)


def test_mosaic_is_chosen_only_by_name_and_says_when_it_is_the_interpreter():
    m = load(None, TINY).model
    assert attention.resolve("auto", "gpu", m, "bfloat16")[0] == "flash"  # until a GPU measures mosaic faster
    assert attention.resolve("mosaic", "gpu", m, "bfloat16") == ("mosaic", "the GPU flash kernels run head_dim 16 "
                                                                 "zero-padded to 64: attention does 300% more work than it needs")
    assert attention.resolve("mosaic", "cpu", m, "float32") == ("mosaic", attention.CPU_MOSAIC_NOTE)


def test_flash_on_cpu_says_it_is_interpret_mode():
    impl, warning = attention.resolve("flash", "cpu", load(None, TINY).model, "float32")
    assert impl == "flash" and "interpret mode" in warning


@pytest.mark.malformed
@pytest.mark.parametrize("where, overrides, dtype, message", [
    ("cpu", [], "bfloat16", "attention=cudnn needs an NVIDIA GPU, and this run compiles for cpu"),
    ("tpu", [], "bfloat16", "attention=cudnn needs an NVIDIA GPU, and this run compiles for tpu"),
    ("gpu", ["model.attn_softcap=50.0"], "bfloat16", "attention=cudnn cannot soft-cap scores"),
    ("gpu", ["model.attn_sinks=true"], "bfloat16", "attention=cudnn has no attention sinks (model.attn_sinks)"),
    ("gpu", [], "float32", "attention=cudnn runs only in bfloat16, and dtype=float32"),
])
def test_cudnn_refusals(where, overrides, dtype, message):
    with pytest.raises(ConfigError) as e:
        attention.resolve("cudnn", where, load(None, TINY + overrides).model, dtype)
    assert message in str(e.value)


@pytest.mark.malformed
def test_cli_refuses_an_attention_that_cannot_run_here():
    r = run_cli("configs/tiny.yml", "attention=cudnn", "steps=1", timeout=120)
    assert r.returncode == 2
    assert "attention=cudnn needs an NVIDIA GPU, and this run compiles for cpu" in r.stderr.strip().splitlines()[-1]


def test_cli_logs_the_choice_and_the_interpret_warning(tmp_path):
    r = run_cli("configs/tiny.yml", *TINY, "attention=flash", "dry_run=true", f"run_dir={tmp_path}", timeout=200)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "attention: flash\n" in r.stdout and f"warning: {attention.CPU_FLASH_NOTE}" in r.stdout


def model_loss_and_grads(overrides, attn):
    """Loss and gradients of one batch of packed documents, on one device."""
    from maxlm import models
    from maxlm.models import params as P_
    from maxlm.objectives import lm
    cfg = load("configs/tiny.yml", TINY + list(overrides) + [f"attention={attn}", "dtype=float32"])
    params = P_.init(models.get(cfg.model.family).param_specs(cfg.model), jax.random.key(0))
    rng = np.random.RandomState(0)
    B, L = cfg.global_batch_size, cfg.seq_len
    seg = np.sort(rng.randint(1, 4, (B, L)), axis=1).astype(np.int32)  # three documents per row
    seg[1, -5:] = 0  # and trailing padding in one
    tokens = rng.randint(0, cfg.model.vocab_size, (B, L + 1))
    pos = np.concatenate([np.arange(L)[None]] * B)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": pos, "segment_ids": seg,
             "loss_mask": (seg > 0).astype(np.int32)}
    forward = recipe_lib.build(cfg).forward
    fn = jax.value_and_grad(lambda p: lm.loss_sum(forward, p, batch)[0])
    jaxpr = str(jax.make_jaxpr(fn)(params))
    assert ("pallas_call" in jaxpr) == (attn == "flash") and ("mpmd_map" in jaxpr) == (attn == "mosaic"), \
        "not the chosen implementation"
    return jax.jit(fn)(params)


@pytest.mark.parametrize("overrides", [
    ["model.sliding_window=7", "remat=full"],  # remat: the kernel inside jax.checkpoint
    # Gemma 2: the window alternates per layer inside the scan (a cond between two kernels) and scores are capped.
    ["model.family=gemma2", "model.sliding_window=7", "model.attn_softcap=5.0", "model.tie_embeddings=true"],
    # DeepSeek-V3's latent attention: values 8 wide, zero-padded to the kernels' 16 (the keys' width)
    ["model.family=deepseek_v3", "model.n_kv_heads=4", "model.n_experts=4", "model.experts_per_token=2",
     "model.d_ff=32", "model.mla.kv_rank=16", "model.mla.rope_dim=4", "model.mla.v_dim=8"],
], ids=["llama_window", "gemma2", "deepseek_v3"])
def test_model_with_flash_equals_xla(overrides):
    loss_x, g_x = model_loss_and_grads(overrides, "xla")
    loss_f, g_f = model_loss_and_grads(overrides, "flash")
    np.testing.assert_allclose(loss_f, loss_x, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_f), jax.tree.leaves(g_x)):
        assert np.max(np.abs(a - b)) <= 1e-4 * np.max(np.abs(b)), "flash gradients differ from xla's"


@pytest.mark.slow  # ~2 minutes: the Mosaic GPU interpreter runs every warpgroup of every layer's kernels
def test_model_with_mosaic_equals_xla():
    """A train step's loss and gradients with the Hopper kernels (through the interpreter) equal XLA's in
    float32: Gemma 2's alternating window inside the scan, soft-capped scores, packed documents, padding."""
    overrides = ["model.family=gemma2", "model.sliding_window=7", "model.attn_softcap=5.0", "model.tie_embeddings=true"]
    loss_x, g_x = model_loss_and_grads(overrides, "xla")
    loss_m, g_m = model_loss_and_grads(overrides, "mosaic")
    np.testing.assert_allclose(loss_m, loss_x, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_m), jax.tree.leaves(g_x)):
        assert np.max(np.abs(a - b)) <= 1e-4 * np.max(np.abs(b)), "mosaic gradients differ from xla's"


def test_attention_benchmark_runs_and_checks_every_path_at_a_tiny_size():
    """benchmarks/attention.py --tiny: flash (interpret mode) agrees with XLA, and cuDNN says why it is
    not timed here instead of vanishing from the table."""
    import json
    import subprocess
    import sys

    from conftest import ROOT, cli_env
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention.py"), "--tiny"], cwd=ROOT,
                       env=cli_env(1), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {row["impl"]: row for row in map(json.loads, (l for l in r.stdout.splitlines() if l.startswith("{")))}
    assert 0 < rows["flash"]["max_rel_err_vs_xla"] <= 2e-2 and rows["flash"]["fwd_bwd_ms"] > 0
    assert rows["cudnn"]["skipped"] == "needs an NVIDIA GPU (this is cpu)"
    assert rows["mosaic"]["skipped"].startswith("needs an NVIDIA Hopper GPU (this is cpu;")
    assert "| 200 | 2 | flash |" in r.stdout


def _traced_step(overrides):
    from maxlm import mesh as mesh_lib, sharding, step
    from maxlm.state import StateSpec
    cfg = load("configs/tiny.yml", TINY + ["attention=flash", "dtype=float32"] + overrides)
    m = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, 8), jax.devices()[:8])
    rules = sharding.rules(cfg)
    ss = StateSpec(recipe_lib.build(cfg, m), m, rules)
    with sharding.use(m, rules):
        return str(jax.make_jaxpr(lambda p, b: step.grads(p, b, ss.recipe))(ss.abstract.params, ss.abstract_batch))


def test_under_a_mesh_each_device_runs_the_kernel_on_its_shard():
    jaxpr = _traced_step(["mesh.fsdp=4", "mesh.tensor=2"])
    assert "shard_map" in jaxpr and "pallas_call" in jaxpr


@pytest.mark.malformed
def test_heads_and_kv_heads_on_different_mesh_axes_are_refused():
    # Query heads split over `tensor` with K/V replicated: a shard's kernel would pair head h with K/V head
    # h // G of its own slice, the wrong one.
    rules = ("sharding_rules=[[batch, [data, fsdp, expert]], [length, null], [embed, fsdp], [vocab, tensor], "
             "[heads, tensor], [kv_heads, null], [head_dim, null], [mlp, tensor], [layers, null], [experts, expert]]")
    with pytest.raises(ConfigError, match="attention kernels need `heads` and `kv_heads` on the same mesh axes"):
        _traced_step(["mesh.fsdp=4", "mesh.tensor=2", rules])


def test_mla_values_padded_for_the_kernels_are_logged():
    """DeepSeek-V3's values (128) are narrower than its keys (192): the kernels run them padded, and say so."""
    m = load("configs/models/deepseek-v3.yml").model
    assert attention.resolve("flash", "gpu", m, "bfloat16") == ("flash", (
        "the GPU flash kernels run head_dim 192 zero-padded to 256: attention does 33% more work than it needs; the "
        "kernels take one head width, so MLA's values (128 wide) are zero-padded to the keys' 192: 20% more "
        "attention work"))
    # splash takes the keys' 192 as they are; the values are padded to it
    assert attention.resolve("auto", "tpu", m, "bfloat16") == ("flash", (
        "the kernels take one head width, so MLA's values (128 wide) are zero-padded to the keys' 192: 20% more "
        "attention work"))
    assert attention.resolve("xla", "gpu", m, "bfloat16") == ("xla", None)
