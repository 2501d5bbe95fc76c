"""Compiling for NVIDIA GPUs on this CPU machine (`compile_topology=h100-8`), as for TPU topologies: jax's
CUDA plugin (installed by `make test` in .venv/cuda, named by MAXLM_CUDA_PLUGIN) compiles the whole train
step, its Triton flash kernels through ptxas for sm_90a, for a device described by XLA's target spec
(maxlm/gpu_specs/). Skipped only where the plugin is not installed, and never in CI."""

import os
import re

import pytest
from conftest import run_cli

from maxlm import topology
from maxlm.config import ConfigError

PLUGIN = os.environ.get("MAXLM_CUDA_PLUGIN", "")
needs_plugin = pytest.mark.skipif(not os.path.isdir(PLUGIN) and not os.environ.get("CI"),
                                  reason="jax's CUDA plugin is not installed (make test installs it in .venv/cuda)")
SMALL = ["model.n_layers=2", "model.d_model=256", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=64",
         "model.d_ff=512", "seq_len=256", "global_batch_size=16", "dtype=bfloat16"]


@needs_plugin
@pytest.mark.parametrize("target, kind", [("h100-8", "NVIDIA H100 80GB HBM3"), ("h200-8x2", "NVIDIA H200 141GB HBM3e"),
                                          ("b200-8", "NVIDIA B200")])
def test_the_train_step_with_flash_attention_compiles_for_the_gpu(tmp_path, target, kind):
    r = run_cli("configs/tiny.yml", *SMALL, "attention=flash", "dry_run=true", f"compile_topology={target}",
                f"run_dir={tmp_path}", devices=1)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    gpus = topology.lookup_gpu(target).gpus
    assert f"over {gpus} x {kind}" in r.stdout
    assert "attention: flash" in r.stdout
    limit = re.search(r"limit +([\d.]+) GiB \(75% of the " + re.escape(kind), r.stdout)
    assert limit and float(limit[1]) == pytest.approx(0.75 * topology.lookup_gpu(target).spec.memory_bytes / 2**30, abs=1e-3)


@pytest.mark.parametrize("name, message", [
    ("h100-3", "compile_topology `h100-3`: a GPU target is KIND-GPUS or KIND-GPUSxNODES with 1, 2, 4 or 8 GPUs per node"),
    ("h100-8x0", "compile_topology `h100-8x0`: a GPU target is KIND-GPUS"),
    ("h100", "compile_topology `h100`: a GPU target is KIND-GPUS"),
])
def test_gpu_target_names_are_checked(name, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        topology.lookup_gpu(name)


def test_tpu_names_are_not_gpu_targets():
    assert topology.lookup_gpu("v5p-8") is None
    assert topology.lookup_gpu("h100-8x4") == topology.GpuTarget("h100-8x4", "h100", 8, 4)
