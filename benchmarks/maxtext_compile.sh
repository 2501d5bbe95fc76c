#!/usr/bin/env bash
# MaxText 0.2.5's train step for Llama-3-8B, compiled ahead of time for a TPU v5p-8 (4 chips, 2x2x1) on a
# machine without a TPU, then counted by maxlm's own counter, for a side-by-side with
#   TPU_LIBRARY_PATH=... JAX_PLATFORMS=cpu .venv/bin/python benchmarks/compiled_step.py configs/models/llama3-8b.yml \
#       --topology v5p-8 --set seq_len=8192 global_batch_size=8 remat=full attention=splash
#
#   benchmarks/maxtext_compile.sh [OUT_DIR]        # default /tmp/maxtext_compile
#
# It prints MaxText's memory analysis of the compiled step (per chip) and then
#   .venv/bin/python benchmarks/compiled_step.py --from-hlo OUT_DIR/jit_train_step.after_optimizations.txt
# (maxlm's venv; the counter only reads the saved module). The full log is OUT_DIR/compile.log.
#
# Settings: model_name=llama3-8b (32 layers, d 4096, 32 q / 8 kv heads of 128, mlp 14336, vocab 128256,
# rope 500000), compile_topology=v5p-8, compile_topology_num_slices=1, max_target_length=8192,
# per_device_batch_size=2 (global batch 8 over 4 chips), remat_policy=full, attention=flash (MaxText's splash
# kernel on TPU), weight_dtype=float32, dtype=bfloat16 (activations), opt_type=adamw, ici_fsdp_parallelism=-1
# (all 4 chips FSDP), synthetic data, no checkpointing. Everything else is MaxText's base.yml default.
#
# MaxText is NOT a maxlm dependency. It lives in its own venv (MAXTEXT_VENV, default /work/maxtext-venv):
#   /root/.pyenv/versions/3.12.1/bin/python3.12 -m venv /work/maxtext-venv
#   /work/maxtext-venv/bin/pip install maxtext==0.2.5 --no-deps
#   /work/maxtext-venv/bin/pip install "jax[cpu]==0.12.0.1" flax optax orbax-checkpoint grain omegaconf \
#       pydantic aqtp qwix tokamax tensorboardx pathwaysutils jinja2 huggingface-hub transformers drjax \
#       pillow tiktoken sentencepiece sympy ml-collections
#   /work/maxtext-venv/bin/pip install libtpu==0.0.50.1      # jax 0.12.0.1's tpu extra pins libtpu==0.0.50.*
#   (jax/jaxlib 0.12.0.1, libtpu 0.0.50.1, flax 0.12.12, optax 0.2.8, orbax-checkpoint 0.12.8, tokamax 0.0.17.)
# The TPU compile on a CPU-only host needs only the libtpu library; run with DECOUPLE_GCLOUD=TRUE (no GCP).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-/tmp/maxtext_compile}
venv=${MAXTEXT_VENV:-/work/maxtext-venv}
py=$venv/bin/python
test -x "$py" || { echo "maxtext_compile.sh: no MaxText venv at $venv (see this script's header)" >&2; exit 2; }
mkdir -p "$out"
rm -rf "$out/xla_dump"
base=$("$py" -c 'import maxtext, os; print(os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml"))')
export DECOUPLE_GCLOUD=TRUE JAX_PLATFORMS=cpu
# As maxlm's platforms.compile_only_tpu does on a machine without TPU chips: name the lone worker and its type
# (else libtpu looks for TPU VM metadata) and skip libtpu's one-process-per-machine lock (else a concurrent or
# stale holder of /tmp/libtpu_lockfile aborts the compile: "Internal error when accessing libtpu multi-process lockfile").
export TPU_WORKER_HOSTNAMES=localhost TPU_ACCELERATOR_TYPE=v5p-8 ALLOW_MULTIPLE_LIBTPU_LOAD=1
export XLA_FLAGS="--xla_dump_to=$out/xla_dump --xla_dump_hlo_module_re=jit_train_step --xla_dump_hlo_pass_re=NOTHING"
"$py" -m maxtext.trainers.pre_train.train_compile "$base" \
  run_name=llama3-8b-v5p-8 base_output_directory="$out/run" \
  model_name=llama3-8b compile_topology=v5p-8 compile_topology_num_slices=1 \
  max_target_length=8192 per_device_batch_size=2 remat_policy=full attention=flash \
  weight_dtype=float32 dtype=bfloat16 opt_type=adamw \
  ici_fsdp_parallelism=-1 ici_data_parallelism=1 ici_tensor_parallelism=1 \
  dataset_type=synthetic enable_checkpointing=false \
  >"$out/compile.log" 2>&1 || { tail -30 "$out/compile.log" >&2; echo "maxtext_compile.sh: failed; log: $out/compile.log" >&2; exit 1; }
grep -E "^Memory analysis|Total estimated memory|number parameters" "$out/compile.log" || true
hlo=$(ls -S "$out"/xla_dump/*jit_train_step*after_optimizations.txt | head -1)
cp "$hlo" "$out/jit_train_step.after_optimizations.txt"
echo "optimized HLO: $out/jit_train_step.after_optimizations.txt (from $hlo)"
cd "$here" && .venv/bin/python benchmarks/compiled_step.py --from-hlo "$out/jit_train_step.after_optimizations.txt"
