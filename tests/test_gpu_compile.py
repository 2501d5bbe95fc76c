"""Compiling for NVIDIA GPUs on this CPU machine (`compile_topology=h100-8`), as for TPU topologies: jax's
CUDA plugin (installed by `make test` in .venv/cuda, named by MAXLM_CUDA_PLUGIN) compiles the whole train
step, its Triton flash kernels through ptxas for sm_90a, for a device described by XLA's target spec
(maxlm/gpu_specs/). Skipped only where the plugin is not installed, and never in CI."""

import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT, cli_env, needs, run_cli

from maxlm import topology
from maxlm.config import ConfigError

PLUGIN = os.environ.get("MAXLM_CUDA_PLUGIN", "")
needs_plugin = needs(os.path.isdir(PLUGIN),
                     reason="jax's CUDA plugin is not installed (make test installs it in .venv/cuda)")
SMALL = ["model.n_layers=2", "model.d_model=256", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=64",
         "model.d_ff=512", "seq_len=256", "global_batch_size=16", "dtype=bfloat16"]


@needs_plugin
@pytest.mark.parametrize("target, kind, mesh", [("h200-8x2", "NVIDIA H200 141GB HBM3e", "fsdp=8 x tensor=2"),
                                                ("b200-8", "NVIDIA B200", "fsdp=4 x tensor=2")])
def test_the_train_step_with_flash_attention_compiles_for_the_gpu(tmp_path, target, kind, mesh):
    """attention=auto picks the flash kernels on a GPU, and the sharded step compiles with them inside
    shard_map. (The H100 is compiled by test_gpu_models.py and the launcher's test.)"""
    fsdp, tensor = re.findall(r"\d+", mesh)
    r = run_cli("configs/tiny.yml", *SMALL, f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}", "dry_run=true",
                f"compile_topology={target}", f"run_dir={tmp_path}", devices=1)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    gpus = topology.lookup_gpu(target).gpus
    assert f"{mesh} x expert=1 x context=1 over {gpus} x {kind}" in r.stdout
    assert "attention: flash (auto on gpu)" in r.stdout
    limit = re.search(r"limit +([\d.]+) GiB \(75% of the " + re.escape(kind), r.stdout)
    assert limit and float(limit[1]) == pytest.approx(0.75 * topology.lookup_gpu(target).spec.memory_bytes / 2**30, abs=1e-3)


def flash_matrix(target: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "flash_compile.py"), target, *args], cwd=ROOT,
                          env=cli_env(1), capture_output=True, text=True, timeout=1200)


TRITON_OK = r" ok \(forward \d+x\d+, \d warps, \d stages; backward \d+x\d+"
MOSAIC_OK = r" ok \(forward 2x64 query rows, (64|128) keys a step, 2 stages; backward [12]x64 rows"


def check_matrix(r: subprocess.CompletedProcess, cells: int, ok=TRITON_OK,
                 refused="refused: head_dim 512 is over 256, the largest the GPU flash kernels have tiles for") -> None:
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("head_dim")]
    assert r.returncode == 0 and len(lines) == cells, r.stdout[-3000:] + r.stderr[-3000:]
    for ln in lines:
        D = int(ln.split()[1])
        if D > 256:
            assert refused in ln, ln
        else:
            assert re.search(ok, ln), ln


def kernel_lines(r: subprocess.CompletedProcess, kernel: str) -> subprocess.CompletedProcess:
    """The cells of one kernel's block of flash_compile.py's output (which prints a heading per kernel)."""
    block = r.stdout.split(f"{kernel} flash kernels, forward and backward")[1].split(" flash kernels, forward and backward")[0]
    return subprocess.CompletedProcess(r.args, r.returncode, block, r.stderr)


# The fast suite compiles one mask cell per head_dim and dtype, with a window and a soft-cap at once: its
# kernels carry every instruction of the causal, window and soft-cap ones at the same tiles, so it is the
# cell closest to a limit, at a third of the compiles. The slow whole-matrix case compiles each mask alone.
@needs_plugin
def test_triton_and_mosaic_kernels_compile_for_every_head_dim_on_h100():
    """head_dim 64, 128, 256 and 512 (refused), forward and backward, through Triton and ptxas for sm_90a, and
    the Mosaic GPU (wgmma, TMA) kernels, forward, dq and dk/dv, in bfloat16, in one process. Every cell carries
    packed segment ids, a window and a soft-cap. Their compiles check shared memory against the H100's 232,448
    bytes per block (by hand: the Mosaic forward with an eight-stage ring at head_dim 256 asks 612,704 bytes and
    is refused). H200 shares the H100's sm_90a and its shared memory. A head_dim between runs zero-padded as the
    next one's kernel, the same compile: tests/test_flash_gpu.py checks the padding."""
    r = flash_matrix("h100", "--kernel", "triton,mosaic", "--dtypes", "bfloat16", "--head-dims", "64,128,256,512",
                     "--masks", "both")
    check_matrix(kernel_lines(r, "triton"), 4)
    check_matrix(kernel_lines(r, "mosaic"), 4, ok=MOSAIC_OK,
                 refused="refused: head_dim 512 is over 256, the largest the Mosaic GPU flash kernels take")


@needs_plugin
def test_flash_kernels_compile_for_every_head_dim_on_b200():
    """The Triton kernels for sm_100a, bfloat16, as above."""
    check_matrix(flash_matrix("b200", "--dtypes", "bfloat16", "--head-dims", "64,128,256,512", "--masks", "both"), 4)


@needs_plugin
def test_flash_kernels_compile_in_float32_at_head_dim_128():
    check_matrix(flash_matrix("h100", "--dtypes", "float32", "--head-dims", "128", "--masks", "causal"), 1)


@needs_plugin
@pytest.mark.slow
@pytest.mark.full_size
def test_flash_kernels_compile_for_the_whole_matrix():
    """Every head_dim x dtype x mask for the H100, each mask alone, and the Mosaic kernels' bfloat16 cells:
    float32 (IEEE dots, no TF32) takes ptxas 10-20 s a cell on 2 cores. The B200's cells with both masks
    compile in the fast suite; its cells by mask and in float32 (the same tiles, and the same 228 KiB of
    shared memory per SM) are left out: 2-6 minutes for a dtype nobody trains a GPU model in.
    `python benchmarks/flash_compile.py b200` compiles them."""
    check_matrix(flash_matrix("h100"), 30)
    check_matrix(flash_matrix("h100", "--kernel", "mosaic", "--dtypes", "bfloat16"), 15, ok=MOSAIC_OK,
                 refused="refused: head_dim 512 is over 256, the largest the Mosaic GPU flash kernels take")


@pytest.mark.malformed
@needs_plugin
def test_a_kernel_over_the_shared_memory_limit_is_named_not_called_device_memory(tmp_path):
    """With three pipelining stages in the dk/dv kernel at head_dim 128 (248,832 bytes, the tile maxlm had
    before the table), the compile fails. The line names the kernel, its tile and the limit, and does not
    send the user to shard more."""
    script = ("import sys; sys.path.insert(0, '.'); import train; from maxlm.kernels_pallas import flash_gpu as f; "
              "f.TILES[(128, 'bfloat16')] = (f.Tile(128, 64, 8, 3), f.Tile(128, 64, 8, 3)); "
              "sys.exit(train.main(sys.argv[1:]))")
    small = [a for a in SMALL if not a.startswith("model.head_dim")] + ["model.head_dim=128"]
    r = subprocess.run([sys.executable, "-c", script, "configs/tiny.yml", *small, "attention=flash", "dry_run=true",
                        "compile_topology=h100-8", f"run_dir={tmp_path}"], cwd=ROOT, env=cli_env(1),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("maxlm: error: a GPU kernel does not fit the NVIDIA H100 80GB HBM3's per-block limits: "
                           "the flash dk/dv kernel at head_dim 128 in bfloat16 (tile 128x64, 8 warps, 3 stages): "
                           "Shared memory size limit exceeded: requested 248832, available: 232448"), line
    assert "forward kernel" not in line and "dq kernel" not in line
    assert "not device memory: sharding or remat will not change it; use attention=xla" in line
    assert "Traceback" not in r.stderr


def test_attention_auto_picks_xla_where_the_gpu_kernels_cannot_take_the_head_dim():
    from maxlm.config import load
    from maxlm.layers import attention
    m = load("configs/tiny.yml", [a for a in SMALL if not a.startswith("model.head_dim")] + ["model.head_dim=512"]).model
    assert attention.resolve("auto", "gpu", m, "bfloat16") == (
        "xla", "attention=auto picks xla: head_dim 512 is over 256, the largest the GPU flash kernels have tiles for")
    with pytest.raises(ConfigError, match=r"^attention=flash: head_dim 512 is over 256, .*; use attention=xla"):
        attention.resolve("flash", "gpu", m, "bfloat16")
    m96 = load("configs/tiny.yml", ["model.head_dim=96"]).model
    assert attention.resolve("auto", "gpu", m96, "bfloat16") == (
        "flash", "the GPU flash kernels run head_dim 96 zero-padded to 128: attention does 33% more work than it needs")
    assert attention.resolve("flash", "tpu", m96, "bfloat16") == ("flash", None)  # splash takes 96 as it is
    m72 = load("configs/tiny.yml", ["model.head_dim=72"]).model
    with pytest.raises(ConfigError, match="the TPU flash kernel takes head_dim 16..256, a multiple of 16"):
        attention.resolve("flash", "tpu", m72, "bfloat16")


@pytest.mark.malformed
def test_an_explicit_flash_that_cannot_take_the_shape_is_refused_in_one_line(tmp_path):
    r = run_cli("configs/tiny.yml", "model.head_dim=512", "attention=flash", "dry_run=true", f"run_dir={tmp_path}",
                devices=1, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "maxlm: error: attention=flash: head_dim 512 is over 256, the largest the GPU flash kernels have tiles for; "
        "use attention=xla (or auto, which picks xla for this shape)")


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
