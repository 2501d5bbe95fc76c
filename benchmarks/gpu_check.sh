#!/usr/bin/env bash
# Everything that needs a GPU, in stages that each fit one device call: the Triton flash and FP8 tests on
# the GPU, the GEMM ceiling, train.py end to end, the attention benchmark, and the train step's time and MFU.
# Each step's log is written to $OUT (the device tool's output folder) or /tmp/gpu_check as it runs, so a
# call cut off at its limit still returns what finished. The tool returns at most 8 files a call: run one
# stage per call (results of the first run, 2026-11-24: benchmarks/RESULTS.md, logs in benchmarks/logs/).
#
# The GPU image has jax, flax, optax, orbax, tensorstore, tokenizers and safetensors, but not these (and
# grain imports portpicker):
# fetch their wheels into .whl/ first (git-ignored; see the device tool's README) and carry `.whl`:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl grain==0.2.18 ml-collections==1.1.0 array-record==0.8.6 tensorboardX==2.6.5 portpicker==1.6.0
# and, for the `grouped` stage, tokamax and what it imports (the same flags, into the same .whl/):
#       tokamax==0.0.17 xprof==2.24.2 qwix==0.1.8 einshape==1.0 jaxtyping==0.3.11 wadler-lindig==0.1.8 \
#       immutabledict==4.3.1 gviz-api==1.10.0 cheroot==11.1.2 werkzeug==3.1.9 jaraco.functools==4.6.0 \
#       pydantic pydantic-core annotated-types typing-inspection
# Then: bash benchmarks/gpu_check.sh [STAGE ...]   (no stage: all but `compile`, in this order)
# Stages, each meant to fit one 10-minute device call:
#   compile    needs no GPU (runs on any machine; ~12 min on 2 cores): the flash kernels' whole head_dim x
#              dtype x mask matrix and every configs/models/*.yml compiled for H100/H200/B200 through jax's
#              CUDA plugin (.venv/cuda, or MAXLM_CUDA_PLUGIN), and on a GPU the matrix for that GPU too
#   check      nvidia-smi, versions, the flash and FP8 tests on the GPU
#   ceiling    the GEMM ceiling (bf16, fp8) that MFU is read against
#   train      train.py as a user runs it: 40 steps of a head_dim-128 model with each attention and FP8
#   attention  benchmarks/attention.py: maxlm flash vs cuDNN vs XLA, seq 1k-16k
#   step       Llama-3-8B width, 8 layers, flash: seq 4096 and 8192, remat full and save_dots
#   compare    the same at seq 4096 with cuDNN and XLA attention, and in FP8 at 4096 and 8192
#   moe        the MoE layer: dense dispatch vs dropless grouped GEMM
#   grouped    tokamax's grouped GEMM as maxlm calls it (model.grouped_gemm=tokamax): forward, dx and dw against
#              float64, empty experts and rows past the groups; its time beside XLA's ragged_dot. A pass is
#              what lets model.grouped_gemm=auto pick tokamax on that GPU (layers/gmm.py VERIFIED)
#   long       the chunked loss vs whole logits, and 32k-token steps
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
step() { local name=$1; shift; echo "=== $name: $*"; "$@" 2>&1 | tee "$out/$name.txt"; echo "=== $name exit ${PIPESTATUS[0]}"; }

stages=${*:-check ceiling train attention step compare moe grouped long}
for stage in $stages; do
  case $stage in
  compile)
    # What a compile proves: code generation (Triton, ptxas), shared-memory and register limits, SPMD
    # partitioning, memory per GPU. Not numerics, not speed, and no autotuning (docs/dry-run.md).
    plugin=${MAXLM_CUDA_PLUGIN:-$PWD/.venv/cuda}
    py=python3; [ -x .venv/bin/python ] && py=.venv/bin/python  # `make test` builds .venv; the GPU image has none
    for t in h100 b200; do
      step flash_compile_$t env JAX_PLATFORMS=cpu MAXLM_CUDA_PLUGIN=$plugin $py benchmarks/flash_compile.py $t
    done
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
      step flash_compile_local $py benchmarks/flash_compile.py local
    fi
    step test_gpu_compile env JAX_PLATFORMS=cpu MAXLM_CUDA_PLUGIN=$plugin $py -m pytest -q -p no:cacheprovider \
      -m "slow or not slow" tests/test_gpu_compile.py tests/test_gpu_models.py ;;
  check)
    step nvidia-smi nvidia-smi
    step versions python3 -c "import jax, flax, optax; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())"
    # The kernel tests, compiled by Triton on the GPU instead of interpreted (tests/conftest.py).
    step test_flash_gpu env MAXLM_TEST_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider -m "slow or not slow" \
      tests/test_flash_gpu.py
    # FP8's casts and delayed-scaling arithmetic with real FP8 GEMMs (the hand-written formulas accumulate in float32).
    step test_fp8_gpu env MAXLM_TEST_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider tests/test_fp8.py \
      -k "round_trip or delayed_scaling or compiled"
    ;;
  ceiling)
    # The measured GEMM ceiling that MFU is read against, and the FP8 GEMM beside it; XLA's choice of GEMM
    # (its Triton GEMMs or cuBLAS, autotuned) against cuBLAS alone.
    step matmul python3 benchmarks/matmul.py --size 8192 --dtypes bfloat16,fp8
    step matmul_no_triton env XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python3 benchmarks/matmul.py --size 8192 --dtypes bfloat16 ;;
  train)
    # A small bf16 model at head_dim 128 (the width nearly every model trains at) on pydoc text, through the
    # whole loop: data, step, metrics, checkpoint, sample. The losses of the four runs should agree closely.
    T="configs/tiny.yml dtype=bfloat16 model.d_model=512 model.n_heads=8 model.n_kv_heads=2 model.head_dim=128
       model.d_ff=1536 seq_len=2048 global_batch_size=8 steps=40 log_every=10 sample_tokens=40"
    for a in flash cudnn xla; do step train_$a python3 train.py $T attention=$a run_dir=/tmp/gpu_check_runs/$a; done
    step train_fp8 python3 train.py $T quantization=fp8 run_dir=/tmp/gpu_check_runs/fp8 ;;
  attention)
    step attention python3 benchmarks/attention.py ;;
  step|compare)
    # The second compile of each run (step_time.py times the loop, then the bare step) hits this cache.
    export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/gpu_check_jax_cache} JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
    # XLA takes 75% of GPU memory by default; the 8-layer 8B state alone is ~45 GB, and attention=xla's
    # step needs 63.5 GiB at seq 4096.
    export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
    S="timeout 300 python3 benchmarks/step_time.py configs/models/llama3-8b.yml model.n_layers=8 --steps 10"
    if [ $stage = step ]; then  # remat policies with the flash kernels (each run ~1.5 min on an H100)
      step step_4k $S seq_len=4096 global_batch_size=4 --ceiling
      step step_8k $S seq_len=8192 global_batch_size=2
      step step_4k_save_dots $S seq_len=4096 global_batch_size=4 remat=save_dots
      step step_8k_save_dots $S seq_len=8192 global_batch_size=2 remat=save_dots
    else  # the other attentions, and FP8 (its compile alone took 91 s); `fp8:` in the log counts the FP8 GEMMs
      step step_4k_cudnn $S seq_len=4096 global_batch_size=4 attention=cudnn
      step step_4k_xla $S seq_len=4096 global_batch_size=4 attention=xla
      step step_4k_fp8 $S seq_len=4096 global_batch_size=4 quantization=fp8
      step step_8k_fp8 $S seq_len=8192 global_batch_size=2 quantization=fp8
    fi ;;
  moe)
    # The MoE layer in bf16: dense dispatch vs ragged_dot dropless, the grouped GEMM against a dense matmul
    # of the same FLOPs (target >= 60%), and the compiled temporaries (a dense ragged_dot fallback shows there).
    step moe python3 benchmarks/moe.py --devices 1 ;;
  grouped)
    step grouped python3 benchmarks/grouped_check.py ;;
  long)
    # Long context on one GPU (context > 1 needs more than one device): the chunked loss against whole logits
    # (it is the default only where it is at least as fast), and a 32k-token step with the flash kernels.
    step loss python3 benchmarks/loss.py --sizes 8192x4096x128256,8192x3584x256000 --dtype bfloat16 --repeat 10
    step step_time_32k python3 benchmarks/step_time.py configs/models/llama3-8b.yml model.n_layers=4 seq_len=32768 \
      global_batch_size=1 remat=full --steps 5
    step step_time_32k_plain_loss python3 benchmarks/step_time.py configs/models/llama3-8b.yml model.n_layers=4 \
      seq_len=32768 global_batch_size=1 remat=full chunked_loss=false --steps 5 ;;
  *)
    echo "gpu_check.sh: unknown stage \`$stage\`; stages: compile check ceiling train attention step compare moe grouped long" >&2; exit 2 ;;
  esac
done
