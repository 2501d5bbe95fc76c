#!/usr/bin/env bash
# MaxText 0.2.5's trainer on CPU, on the same tiny Llama that maxlm's step-time benchmark runs, for a side-by-side
# step time. Prints one line: `maxtext step median ms: X` (median of MaxText's own per-step "seconds:" log,
# steps 4..N as maxlm counts them, i.e. the first 3 of 23 dropped, as benchmarks/step_time.py drops its first 3).
#
#   benchmarks/maxtext_step.sh 1        # one CPU device
#   benchmarks/maxtext_step.sh 4        # XLA_FLAGS=--xla_force_host_platform_device_count=4, all FSDP (fsdp=4)
#
# maxlm's side (its `loop step` median is the comparable number: wall time per step of the real loop):
#   JAX_PLATFORMS=cpu .venv/bin/python benchmarks/step_time.py configs/tiny.yml model.vocab_size=32000 \
#       seq_len=256 global_batch_size=4 remat=full --steps 20       # (and the same XLA_FLAGS for 4 devices)
# Alternate the two on a quiet machine; single runs on a shared CPU are noise.
#
# MaxText is NOT a maxlm dependency. It lives in its own venv (MAXTEXT_VENV, default /work/maxtext-venv):
#   /root/.pyenv/versions/3.12.1/bin/python3.12 -m venv /work/maxtext-venv
#   /work/maxtext-venv/bin/pip install maxtext==0.2.5 --no-deps
#   /work/maxtext-venv/bin/pip install "jax[cpu]==0.12.0.1" flax optax orbax-checkpoint grain omegaconf \
#       pydantic aqtp qwix tokamax tensorboardx pathwaysutils jinja2 huggingface-hub transformers drjax \
#       pillow tiktoken sentencepiece sympy ml-collections
#   (what the imports of maxtext.trainers.pre_train.train demand under DECOUPLE_GCLOUD=TRUE; no torch, no CUDA,
#   no tensorflow. Resolved then: jax/jaxlib 0.12.0.1, flax 0.12.12, optax 0.2.8, orbax-checkpoint 0.12.8,
#   grain 0.2.18, tokamax 0.0.17, qwix 0.1.8, aqtp 0.9.0, transformers 5.24.0.)
#
# The model, against configs/tiny.yml + base.yml with the overrides above (maxlm key -> MaxText key):
#   same: d_model 256 -> base_emb_dim; n_layers 4 -> base_num_decoder_layers; n_heads 8 -> base_num_query_heads;
#         n_kv_heads 4 -> base_num_kv_heads; head_dim 32 -> head_dim; d_ff 768 -> base_mlp_dim (SwiGLU:
#         mlp_activations [silu, linear]); vocab 32000; seq_len 256 -> max_target_length; global batch 4 ->
#         per_device_batch_size 4/devices; rope_theta 10000 -> rope_max_timescale (default RoPE, no scaling);
#         norm_eps 1e-5 -> normalization_layer_epsilon (RMSNorm); untied embeddings (logits_via_embedding false);
#         dtype float32 -> dtype and weight_dtype float32; remat full -> remat_policy full; layers scanned
#         (scan_layers true); AdamW b1 0.9, b2 0.95, eps 1e-8, weight decay 0.1, clip 1.0, peak lr 3e-3;
#         synthetic data; no checkpoints; attention: maxlm's `auto` is plain XLA on CPU -> attention=dot_product;
#         4 devices: maxlm's mesh default fsdp=-1 (all FSDP, data=1) -> ici_fsdp_parallelism=-1, ici_data 1.
#   differ (no MaxText key, or not the same thing):
#         loss: maxlm's chunked_loss=true (cross-entropy over token x vocab chunks, never the whole float32
#         logits); MaxText computes whole logits (num_vocab_tiling=1, its default; its tiling is not the same scheme).
#         lr schedule: maxlm cosine with 30 warmup steps of 250; MaxText warmup_steps_fraction of its own steps
#         (irrelevant to step time). init: maxlm normal(0.02) everywhere, MaxText its own initialisers (likewise).
#         data: maxlm step_time.py's loop feeds tiny.yml's pydoc byte text tokens; MaxText's synthetic iterator
#         (host-side data costs of both are small next to the step).
#         MaxText's metrics (TFLOP/s, tensorboard) and maxlm's metrics.jsonl are each trainer's own bookkeeping.
set -euo pipefail
n=${1:?usage: maxtext_step.sh 1|4}
case $n in 1|4) ;; *) echo "maxtext_step.sh: device count must be 1 or 4, got $n" >&2; exit 2 ;; esac
venv=${MAXTEXT_VENV:-/work/maxtext-venv}
py=$venv/bin/python
test -x "$py" || { echo "maxtext_step.sh: no MaxText venv at $venv (see this script's header)" >&2; exit 2; }
steps=${STEPS:-23}
out=$(mktemp -d /tmp/maxtext_step.XXXXXX)
log=${LOG:-$out/train.log}
base=$("$py" -c 'import maxtext, os; print(os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml"))')
export DECOUPLE_GCLOUD=TRUE JAX_PLATFORMS=cpu
if [ "$n" = 4 ]; then export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=4"; fi
"$py" -m maxtext.trainers.pre_train.train "$base" \
  run_name=tiny base_output_directory="$out" skip_jax_distributed_system=true \
  enable_checkpointing=false dataset_type=synthetic steps="$steps" log_period=1000 \
  enable_goodput_recording=false monitor_goodput=false enable_gcp_goodput_metrics=false \
  base_emb_dim=256 base_num_decoder_layers=4 base_num_query_heads=8 base_num_kv_heads=4 head_dim=32 \
  base_mlp_dim=768 'mlp_activations=["silu","linear"]' vocab_size=32000 decoder_block=llama2 \
  logits_via_embedding=false enable_dropout=false normalization_layer_epsilon=1e-5 \
  rope_max_timescale=10000 rope_type=default \
  max_target_length=256 per_device_batch_size=$((4 / n)) dtype=float32 weight_dtype=float32 \
  remat_policy=full scan_layers=true attention=dot_product \
  opt_type=adamw learning_rate=3e-3 adam_b1=0.9 adam_b2=0.95 adam_eps=1e-8 adam_weight_decay=0.1 \
  gradient_clipping_threshold=1.0 \
  ici_fsdp_parallelism=-1 ici_data_parallelism=1 ici_tensor_parallelism=1 dcn_data_parallelism=1 \
  >"$log" 2>&1 || { tail -30 "$log" >&2; echo "maxtext_step.sh: MaxText failed; log: $log" >&2; exit 1; }
"$py" - "$log" <<'EOF'
import re, statistics, sys
t = [float(s) for s in re.findall(r"completed step: \d+, seconds: ([0-9.]+)", open(sys.argv[1]).read())]
if len(t) < 5:
    sys.exit(f"maxtext_step.sh: only {len(t)} step times in {sys.argv[1]}")
print(f"steps timed {len(t) - 3} (of {len(t)}), min {min(t[3:]) * 1e3:.2f} ms, max {max(t[3:]) * 1e3:.2f} ms")
print(f"maxtext step median ms: {statistics.median(t[3:]) * 1e3:.2f}")
EOF
echo "log: $log"
