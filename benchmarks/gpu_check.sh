#!/usr/bin/env bash
# Everything that needs a GPU, in one call (a lent GPU machine's time is short): the Triton flash
# kernels compiled and checked on the GPU, the attention benchmark, and the train step's time and MFU.
# Logs go to $OUT (the device tool's output folder) or /tmp/gpu_check.
#
# The GPU image has jax, flax, optax, orbax, tensorstore, tokenizers and safetensors, but not these:
# fetch their wheels into .whl/ first (git-ignored; see the device tool's README) and carry `.whl`:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl grain==0.2.18 ml-collections==1.1.0 array-record==0.8.6 tensorboardX==2.6.5
# Then: bash benchmarks/gpu_check.sh [STAGE ...]   (no stage: all of them, in this order)
# Stages, each meant to fit one 10-minute device call:
#   check      nvidia-smi, versions, the flash and FP8 tests on the GPU, the GEMM ceiling (bf16, fp8)
#   attention  benchmarks/attention.py: maxlm flash vs cuDNN vs XLA, seq 1k-16k
#   step       Llama-3-8B width, 8 layers: seq 4096 flash and xla, seq 8192, and both in FP8
#   moe        the MoE layer: dense dispatch vs dropless grouped GEMM
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

stages=${*:-check attention step moe long}
for stage in $stages; do
  case $stage in
  check)
    step nvidia-smi nvidia-smi
    step versions python3 -c "import jax, flax, optax; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())"
    # The kernel tests, compiled by Triton on the GPU instead of interpreted (tests/conftest.py).
    step test_flash_gpu env MAXLM_TEST_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider tests/test_flash_gpu.py
    # FP8's casts and delayed-scaling arithmetic with real FP8 GEMMs (the hand-written formulas accumulate in float32).
    step test_fp8_gpu env MAXLM_TEST_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider tests/test_fp8.py \
      -k "round_trip or delayed_scaling or compiled"
    # The measured GEMM ceiling that MFU is read against, and the FP8 GEMM beside it.
    step matmul python3 benchmarks/matmul.py --size 8192 --dtypes bfloat16,fp8 ;;
  attention)
    step attention python3 benchmarks/attention.py ;;
  step)
    L8="configs/models/llama3-8b.yml model.n_layers=8"
    step step_time_4k python3 benchmarks/step_time.py $L8 seq_len=4096 global_batch_size=4 --steps 10 --ceiling
    step step_time_4k_xla python3 benchmarks/step_time.py $L8 seq_len=4096 global_batch_size=4 attention=xla --steps 10
    step step_time_8k python3 benchmarks/step_time.py $L8 seq_len=8192 global_batch_size=2 --steps 10 --ceiling
    # FP8 against the bf16 runs above: the log's `fp8:` line counts the cuBLASLt FP8 GEMMs compiled.
    step step_time_4k_fp8 python3 benchmarks/step_time.py $L8 seq_len=4096 global_batch_size=4 quantization=fp8 --steps 10
    step step_time_8k_fp8 python3 benchmarks/step_time.py $L8 seq_len=8192 global_batch_size=2 quantization=fp8 --steps 10 ;;
  moe)
    # The MoE layer in bf16: dense dispatch vs ragged_dot dropless, the grouped GEMM against a dense matmul
    # of the same FLOPs (target >= 60%), and the compiled temporaries (a dense ragged_dot fallback shows there).
    step moe python3 benchmarks/moe.py --devices 1 ;;
  long)
    # Long context on one GPU (context > 1 needs more than one device): the chunked loss against whole logits
    # (it is the default only where it is at least as fast), and a 32k-token step with the flash kernels.
    step loss python3 benchmarks/loss.py --sizes 8192x4096x128256,8192x3584x256000 --dtype bfloat16 --repeat 10
    step step_time_32k python3 benchmarks/step_time.py configs/models/llama3-8b.yml model.n_layers=4 seq_len=32768 \
      global_batch_size=1 remat=full --steps 5
    step step_time_32k_plain_loss python3 benchmarks/step_time.py configs/models/llama3-8b.yml model.n_layers=4 \
      seq_len=32768 global_batch_size=1 remat=full chunked_loss=false --steps 5 ;;
  *)
    echo "gpu_check.sh: unknown stage \`$stage\`; stages: check attention step moe long" >&2; exit 2 ;;
  esac
done
