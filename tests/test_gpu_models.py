"""Every configs/models/*.yml compiles for one node of 8 H100s (`compile_topology=h100-8`) with maxlm's flash
kernels, through jax's CUDA plugin on this CPU machine (as in test_gpu_compile.py), and fits: the printed total
memory per device is below the printed limit (75% of 80 GB). At full depth where the model's train state fits
one node, at reduced depth where it cannot (model.n_layers below). Measured sizes and compile times:
benchmarks/RESULTS.md. A compile proves code generation, partitioning and memory, not numerics or speed."""

import os
import re

import pytest
from conftest import ROOT, needs, run_cli

PLUGIN = os.environ.get("MAXLM_CUDA_PLUGIN", "")
needs_plugin = needs(os.path.isdir(PLUGIN),
                     reason="jax's CUDA plugin is not installed (make test installs it in .venv/cuda)")

CONFIGS = sorted((ROOT / "configs" / "models").glob("*.yml"))
# config stem -> overrides beyond the config's own seq_len, global_batch_size 8 and remat.
# Full depth unless n_layers is set: with float32 params and AdamW moments (12 bytes per parameter, plus 4 of
# gradient), 8 x 59.3 GiB holds neither 70.6B, 46.7B nor 30.5B parameters.
CASES = {
    "gemma2-9b": [],
    "gemma3-12b": [],
    "gpt-oss-20b": ["model.n_layers=12"],     # of 24: the full depth needs 74.9 GiB per device
    "gpt2": [],
    "llama3-8b": [],
    "llama3.1-70b": ["model.n_layers=20"],     # of 80: the full depth needs 155.2 GiB per device
    # of 126, and without its two pipeline stages over two slices: one node holds 2 of its 126 layers
    "llama3.1-405b": ["model.n_layers=2", "mesh.slices=1", "mesh.stage=1", "pipeline_repeats=1", "microbatches=1",
                      "global_batch_size=8"],
    "mistral-7b": [],
    "qwen2.5-7b": [],
    "mixtral-8x7b": ["model.n_layers=12"],     # of 32: the full depth needs 117.6 GiB per device
    "qwen3-30b-a3b": ["model.n_layers=2"],    # of 48: 2 layers already hold 53 GiB of temporaries
    "qwen3-8b": [],
}
# Configs no depth of which fits one node, with the smallest depth that keeps their structure: the dry run
# must refuse them in one line, before anything runs. DeepSeek-V3's first MoE layer alone (256 experts,
# 11.3B parameters) is gathered whole by fsdp=8, and XLA's GPU ragged_dot is a product masked per expert
# (benchmarks/RESULTS.md): 3 dense layers and one MoE layer need 62.1 GiB per device at 64 tokens a
# sequence and 339.6 at 4096, against 59.3.
NO_NODE = {"deepseek-v3": ["model.n_layers=4"]}


def dry_run_h100_8(stem: str, tmp_path, overrides: list):
    return run_cli(f"configs/models/{stem}.yml", *overrides, "mesh.fsdp=8", "attention=flash", "dry_run=true",
                   "compile_topology=h100-8", f"run_dir={tmp_path}", devices=1, timeout=600)


def test_every_model_config_has_a_case():
    assert sorted({**CASES, **NO_NODE}) == [p.stem for p in CONFIGS]


@pytest.mark.malformed
@needs_plugin
@pytest.mark.slow  # about a minute each
@pytest.mark.parametrize("stem", sorted(NO_NODE))
def test_a_model_no_node_can_hold_is_refused_in_one_line(tmp_path, stem):
    r = dry_run_h100_8(stem, tmp_path, NO_NODE[stem])
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"^maxlm: error: the train step needs [\d.]+ GiB per device but 75% of the NVIDIA H100 80GB "
                     r"HBM3's memory \(XLA_PYTHON_CLIENT_MEM_FRACTION\) has 59.33 GiB; shard more", r.stdout + r.stderr, re.M)


@pytest.mark.malformed
@needs_plugin
def test_tokamax_grouped_gemm_is_refused_on_b200_in_one_line(tmp_path):
    r = run_cli("configs/tiny.yml", "model.family=mixtral", "model.n_experts=4", "model.grouped_gemm=tokamax",
                "attention=xla", "dry_run=true", "compile_topology=b200-8", f"run_dir={tmp_path}", devices=1, timeout=300)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("maxlm: error: model.grouped_gemm=tokamax runs on Hopper GPUs (sm90); on the NVIDIA B200 "
                           "tokamax's grouped matmul has no backward"), last
    assert "Traceback" not in r.stderr


@needs_plugin
@pytest.mark.slow  # about a minute each: Qwen3-30B-A3B at 2 layers, DeepSeek-V3 at 4 (its refusal compiles twice)
@pytest.mark.parametrize("stem, bound", [("qwen3-30b-a3b", "temporaries"), ("deepseek-v3", "total")])
def test_tokamax_grouped_gemm_holds_no_dense_expansion_on_h100(tmp_path, stem, bound):
    """XLA:GPU's ragged_dot is a product masked per expert: Qwen3-30B-A3B's 2 layers hold 53.17 GiB of
    temporaries and DeepSeek-V3's 4 layers 345.82 GiB in all. Tokamax's grouped kernel (2026-11-29, this
    commit's measure): 5.11 GiB of temporaries, and 90.56 GiB in all, which still exceeds one H100, so the
    dry run's refusal with XLA says what tokamax would need. Either coming back above 10 / 100 GiB fails."""
    if stem == "qwen3-30b-a3b":
        r = dry_run_h100_8(stem, tmp_path, [*CASES[stem], "model.grouped_gemm=tokamax"])
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "grouped matmul by tokamax's Mosaic GPU kernel" in r.stdout
        got = float(re.search(r"^ +temporaries +([\d.]+) GiB", r.stdout, re.M)[1])
        assert got < 10, r.stdout[-2000:]
        return
    r = dry_run_h100_8(stem, tmp_path, NO_NODE[stem])  # auto: XLA, which does not fit
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    m = re.search(r"with model.grouped_gemm=tokamax \(.*\) it needs ([\d.]+) GiB, which does not fit either",
                  r.stdout + r.stderr)
    assert m and float(m[1]) < 100, r.stderr[-2000:]


@needs_plugin
@pytest.mark.slow  # about 40 s
def test_tokamax_grouped_gemm_compiles_with_expert_parallelism_on_h100(tmp_path):
    """expert=8: each GPU multiplies its 16 experts over the rows the ragged all-to-all brought it. With
    XLA's grouped matmul Qwen3-30B-A3B's 2 layers hold 15.07 GiB of temporaries, with tokamax's 3.86."""
    r = run_cli("configs/models/qwen3-30b-a3b.yml", *CASES["qwen3-30b-a3b"], "mesh.expert=8", "attention=flash",
                "model.grouped_gemm=tokamax", "dry_run=true", "compile_topology=h100-8", f"run_dir={tmp_path}",
                devices=1, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "tokamax's Mosaic GPU kernel" in r.stdout and "experts split 8 ways" in r.stdout
    assert float(re.search(r"^ +temporaries +([\d.]+) GiB", r.stdout, re.M)[1]) < 6, r.stdout[-2000:]


@needs_plugin
@pytest.mark.slow  # two compiles, about 80 s
def test_an_moe_step_that_only_tokamax_fits_is_refused_saying_so(tmp_path):
    """Qwen3-30B-A3B's 2 layers at twice the batch: XLA's grouped matmul needs 82.28 GiB per H100, and the
    refusal names model.grouped_gemm=tokamax with what it needs (8.89 GiB) and what is left."""
    r = dry_run_h100_8("qwen3-30b-a3b", tmp_path, [*CASES["qwen3-30b-a3b"], "global_batch_size=16"])
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    m = re.fullmatch(r"maxlm: error: the train step needs ([\d.]+) GiB per device but .* has 59.33 GiB; shard more .*; "
                     r"with model.grouped_gemm=tokamax \(.*\) it needs ([\d.]+) GiB, which fits, ([\d.]+) GiB to "
                     r"spare", last)
    assert m and float(m[1]) > 59.33 > float(m[2]), last
    assert abs(float(m[2]) + float(m[3]) - 59.33) < 0.02, last


@needs_plugin
@pytest.mark.slow  # 20 s to minutes each; the fast suite compiles GPT-2 for 8 H100s through the launcher (test_launch.py)
@pytest.mark.parametrize("stem", sorted(CASES))
def test_model_config_compiles_and_fits_on_one_h100_node(tmp_path, stem):
    r = dry_run_h100_8(stem, tmp_path, CASES[stem])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "over 8 x NVIDIA H100 80GB HBM3" in r.stdout
    assert "attention: flash" in r.stdout
    total = re.search(r"^ +total +([\d.]+) GiB", r.stdout, re.M)
    limit = re.search(r"^ +limit +([\d.]+) GiB \(75% of the NVIDIA H100", r.stdout, re.M)
    assert total and limit, r.stdout[-2000:]
    assert float(total[1]) < float(limit[1])
    assert "dry run: the step compiles and fits" in r.stdout
    # qwen3-30b-a3b's MoE sorts 4096 tokens x top-8 rows per device, which XLA:GPU would give CUB's radix sort; that
    # cannot compile without a GPU (aot.prepare), and the log says the sort is XLA's own here.
    assert "large sorts use XLA's own kernel, not CUB's radix sort" in r.stdout
