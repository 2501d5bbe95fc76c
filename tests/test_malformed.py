"""Malformed input as a new user meets it: every case ends with exactly one `maxlm: error:` line on
stderr, the documented exit code (README "Exit codes"), and no traceback.

The table runs in-process through `train.main(argv)`, so a hundred cases cost seconds; the failures
that only a real process shows (a full disk, a second job, libtpu's start-up noise) run in
subprocesses below the table.
"""

import gzip
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

import train
from maxlm import runlock
from maxlm.data import prepare

pytestmark = pytest.mark.malformed

TINY = "configs/tiny.yml"
# A 1-layer model on 32-token rows: cases that get as far as the mesh (or a checkpoint) stay cheap.
SMALL = ["model.n_layers=1", "seq_len=32", "sample_tokens=0", "log_every=1"]

# (id, argv after the config, exit code, a substring of the error line). `{d}` is a directory of bad
# files made once (see `files`), `{run}` a run directory holding a committed step-2 checkpoint (a fresh
# copy per case), `{tmp}` the case's own empty directory.
# A valid objective=grpo run's keys, rl.rewards last, for the cases that change one of them.
GRPO = ["objective=grpo", "data.format=prompt", "data.source=jsonl", "data.path=x.jsonl", "rl.max_new_tokens=8",
        "rl.max_prompt_tokens=8", "rl.rewards={exact: {}}"]

CONFIG = [
    ("unknown-key", ["stepz=3"], "unknown config key `stepz`; did you mean `steps`?"),
    ("unknown-nested-key", ["model.d_modle=3"], "did you mean `model.d_model`?"),
    ("not-int", ["steps=ten"], "`steps` must be int, got ten (str)"),
    ("float-for-int", ["steps=3.5"], "`steps` must be int"),
    ("zero-steps", ["steps=0"], "`steps` must be > 0"),
    ("negative-steps", ["steps=-1"], "`steps` must be > 0"),
    ("not-float", ["optim.lr=abc"], "`optim.lr` must be float"),
    ("negative-lr", ["optim.lr=-1"], "`optim.lr` must be > 0"),
    ("inf-lr", ["optim.lr=.inf"], "`optim.lr` must be a finite number"),
    ("huge-lr", ["optim.lr=1e999"], "`optim.lr` must be a finite number"),
    ("nan-lr", ["optim.lr=.nan"], "`optim.lr` must be a finite number"),
    ("nan-norm-eps", ["model.norm_eps=.nan"], "`model.norm_eps` must be a finite number"),
    ("nan-init-std", ["model.init_std=.nan"], "`model.init_std` must be a finite number"),
    ("zero-norm-eps", ["model.norm_eps=0"], "`model.norm_eps` must be > 0"),
    # 0 drew every weight as zero and trained nothing (grad_norm 0.000 throughout); -1 was also accepted
    ("zero-init-std", ["model.init_std=0"], "`model.init_std` must be > 0"),
    ("negative-init-std", ["model.init_std=-1"], "`model.init_std` must be > 0"),
    ("b1-above-one", ["optim.b1=1.5"], "`optim.b1` must be in [0, 1), got 1.5"),
    ("b2-negative", ["optim.b2=-2"], "`optim.b2` must be in [0, 1), got -2.0"),
    ("eps-zero", ["optim.eps=0"], "`optim.eps` must be > 0"),
    ("seed-overflow", ["seed=99999999999999999999999"], "`seed`=99999999999999999999999 is out of range"),
    ("seed-negative", ["seed=-1"], "`seed` must be in 0..2**63-1"),
    ("data-seed-negative", ["data.seed=-5"], "`data.seed` must be in 0..2**63-1"),
    ("bool-for-int", ["steps=true"], "`steps` must be int"),
    ("list-for-int", ["steps=[1]"], "`steps` must be int"),
    ("dtype", ["dtype=float16"], "`dtype` must be one of float32, bfloat16; got `float16`"),
    ("remat", ["remat=everything"], "`remat` must be one of"),
    ("attention", ["attention=fast"], "`attention` must be one of"),
    ("quantization", ["quantization=fp4"], "`quantization` must be one of none, fp8; got `fp4` (did you mean fp8?)"),
    ("schedule", ["optim.schedule=linear"], "`optim.schedule` must be one of"),
    ("optimizer", ["optim.name=sgd"], "`optim.name` must be one of adamw, muon; got `sgd`"),
    ("decay-shape", ["optim.schedule=wsd", "optim.decay_steps=50", "optim.decay_shape=exp"],
     "`optim.decay_shape` must be one of linear, sqrt, cosine; got `exp`"),
    ("decay-shape-not-wsd", ["optim.decay_shape=linear"], "`optim.decay_shape`=linear applies to optim.schedule=wsd"),
    # without decay_steps, wsd decays over a tenth of steps (25 of tiny's 250), unless the warmup overlaps it
    ("wsd-default-decay-overlap", ["optim.schedule=wsd", "steps=32"],
     "warmup_steps=30 + decay_steps=3 (a tenth of steps, the default) exceed steps=32"),
    ("cosine-decay-in-warmup", ["optim.decay_steps=20"],
     "optim.schedule=cosine: decay_steps=20 must exceed warmup_steps=30 (decay_steps counts from step 0, warmup "
     "included), or the learning rate falls from lr to lr * min_lr_ratio in one step"),
    ("cosine-decay-is-warmup", ["optim.decay_steps=30"], "optim.schedule=cosine: decay_steps=30 must exceed warmup_steps=30"),
    ("wsd-overlap", ["optim.schedule=wsd", "optim.decay_steps=240"],
     "warmup_steps=30 + decay_steps=240 exceed steps=250, so the decay would begin before the warmup ends"),
    ("muon-lora", ["optim.name=muon", "lora.rank=4"], "optim.name=muon with lora.rank > 0"),
    ("source", ["data.source=csv"], "`data.source` must be one of"),
    ("resume", ["resume=maybe"], "`resume` must be one of auto, never"),
    ("nan-policy", ["nan_policy=ignore"], "`nan_policy` must be one of stop, skip"),
    ("tracking-unknown", ["tracking=[tensorboard,mlflow]"], "`tracking` must list each of tensorboard, wandb at most once"),
    ("tracking-twice", ["tracking=[wandb,wandb]"], "`tracking` must list each of tensorboard, wandb at most once"),
    ("family", ["model.family=gpt5"], "`model.family` must be one of"),
    ("rope-kind", ["model.rope_scaling.kind=ntk"], "`model.rope_scaling.kind` must be one of none, linear, llama3, yarn"),
    ("rope-factor", ["model.rope_scaling.kind=llama3", "model.rope_scaling.factor=0.5"],
     "`model.rope_scaling.factor` must be >= 1 for kind=llama3, got 0.5"),
    # the refusals below name the one condition that failed, not the whole rope_scaling mapping
    ("llama3-freq-factors", ["model.rope_scaling.kind=llama3", "model.rope_scaling.low_freq_factor=5"],
     "`model.rope_scaling` (llama3) needs 0 < low_freq_factor < high_freq_factor; got low_freq_factor=5.0 and "
     "high_freq_factor=4.0"),
    ("llama3-original-positions", ["model.rope_scaling.kind=llama3", "model.rope_scaling.original_max_positions=0"],
     "`model.rope_scaling.original_max_positions` must be > 0 for kind=llama3"),
    ("yarn-betas", ["model.rope_scaling.kind=yarn", "model.rope_scaling.beta_fast=0.5"],
     "`model.rope_scaling` (yarn) needs 0 < beta_slow < beta_fast; got beta_slow=1.0 and beta_fast=0.5"),
    ("yarn-mscale", ["model.rope_scaling.kind=yarn", "model.rope_scaling.mscale=-1"],
     "`model.rope_scaling.mscale` must be >= 0 for kind=yarn, got -1.0"),
    ("yarn-attention-factor", ["model.rope_scaling.kind=yarn", "model.rope_scaling.attention_factor=-0.5"],
     "`model.rope_scaling.attention_factor` must be >= 0 for kind=yarn, got -0.5"),
    ("linear-factor", ["model.rope_scaling.kind=linear", "model.rope_scaling.factor=0.5"],
     "`model.rope_scaling.factor` must be >= 1 for kind=linear"),
    ("layer-pattern", ["model.layer_pattern=LX"], "`model.layer_pattern` is a string of L (local) and G (global)"),
    ("pattern-no-window", ["model.layer_pattern=LG"], "has local layers but model.sliding_window=0"),
    ("local-rope", ["model.local_rope_theta=-1"], "`model.local_rope_theta` must be >= 0"),
    ("mesh-zero", ["mesh.data=0"], "`mesh.data` must be a positive size or -1"),
    ("mesh-minus-two", ["mesh.data=-2"], "`mesh.data` must be a positive size or -1"),
    ("mesh-two-fills", ["mesh.data=-1", "mesh.fsdp=-1"], "at most one `mesh.*` axis may be -1, and mesh.data and "
                                                         "mesh.fsdp are; give all but one a size"),
    ("stage-vs-layers", ["mesh.stage=3", "model.n_layers=4"], "`model.n_layers`=4 is not divisible by `mesh.stage`=3"),
    ("stage-fill", ["mesh.stage=-1", "mesh.fsdp=1"], "`mesh.stage`=-1: give the pipeline's stage count explicitly"),
    # with the default mesh.fsdp=-1 it was told that only one axis may be -1, not that stages take a count
    ("stage-fill-default-mesh", ["mesh.stage=-1"], "`mesh.stage`=-1: give the pipeline's stage count explicitly"),
    ("repeats-no-stage", ["pipeline_repeats=2"], "`pipeline_repeats`=2 needs pipeline stages: set mesh.stage > 1"),
    ("repeats-vs-layers", ["mesh.stage=2", "pipeline_repeats=4", "microbatches=2", "model.n_layers=4"],
     "`model.n_layers`=4 is not divisible by mesh.stage x pipeline_repeats = 2 x 4"),
    ("repeats-few-microbatches", ["mesh.stage=2", "pipeline_repeats=2", "model.n_layers=4"],
     "`pipeline_repeats`=2 with `microbatches`=1 < mesh.stage=2: a microbatch must leave the last stage"),
    ("repeats-zero", ["pipeline_repeats=0"], "`pipeline_repeats`"),
    ("stage-vs-moe-layers", ["mesh.stage=2", "microbatches=2", "model.family=deepseek_v3", "model.n_layers=4",
                             "model.n_kv_heads=8", "model.n_experts=4", "model.experts_per_token=2", "model.mla.kv_rank=16",
                             "model.mla.rope_dim=8", "model.dense_layers=1", "model.dense_d_ff=64"],
     "`model.n_layers` - `model.dense_layers` = 4 - 1 = 3 (the MoE layers the stages split) is not divisible by "
     "`mesh.stage`=2"),
    ("stage-rules", ["mesh.stage=2", "sharding_rules=[[batch, [data, fsdp, expert]], [length, context], [embed, fsdp], [vocab, tensor], [heads, tensor], [kv_heads, tensor], [head_dim, null], [mlp, tensor], [layers, null], [experts, expert]]"], "needs the sharding rule [layers, stage]"),
    ("topology-without-dry-run", ["compile_topology=v5p-8"], "`compile_topology` only compiles; add dry_run=true"),
    ("rule-axis-twice", ["sharding_rules=[[batch,[data,data]]]"], "names a mesh axis twice"),
    ("rule-unknown-logical", ["sharding_rules=[[btch,data]]"], "unknown logical axis `btch`; did you mean `batch`?"),
    ("rule-duplicate-logical", ["sharding_rules=[[batch,data],[batch,fsdp]]"], "logical axis `batch` already has a rule"),
    ("rule-unknown-mesh", ["sharding_rules=[[batch,gpu]]"], "must be [logical_axis, mesh_axis"),
    ("rule-not-pair", ["sharding_rules=[batch]"], "must be [logical_axis, mesh_axis"),
    ("section-as-value", ["model=3"], "`model` is a section"),
    ("key-under-scalar", ["steps.x=3"], "unknown config key `steps.x`"),
    ("no-equals", ["steps"], "override `steps` must look like key=value"),
    ("empty-key", ["=3"], "override `=3` must look like key=value"),
    ("empty-run-dir", ["run_dir="], "`run_dir` is empty"),
    ("heads-not-multiple", ["model.n_heads=6", "model.n_kv_heads=4"], "must be a multiple of `model.n_kv_heads`"),
    ("odd-head-dim", ["model.head_dim=33"], "must be even for RoPE"),
    ("batch-vs-microbatches", ["global_batch_size=10", "microbatches=3"], "must be divisible by `microbatches`"),
    ("min-lr-ratio", ["optim.min_lr_ratio=2"], "`optim.min_lr_ratio` must be in [0, 1]"),
    ("negative-warmup", ["optim.warmup_steps=-1"], "`optim.warmup_steps` must be >= 0"),
    ("keep-zero", ["checkpoint.keep=0"], "`checkpoint.keep` must be > 0"),
    ("every-negative", ["checkpoint.every=-1"], "`checkpoint.every` must be >= 0"),
    ("epochs-negative", ["data.epochs=-1"], "`data.epochs` must be >= 0"),
    ("sample-negative", ["sample_tokens=-1"], "`sample_tokens` must be >= 0"),
    ("skips-zero", ["max_consecutive_skips=0"], "`max_consecutive_skips` must be > 0"),
    ("experts-on-dense", ["model.n_experts=4"], "model.family=llama is dense; set model.n_experts=0"),
    ("moe-without-experts", ["model.family=mixtral"], "set model.n_experts > 0"),
    ("top-k-above-experts", ["model.family=mixtral", "model.n_experts=4", "model.experts_per_token=5"],
     "`model.experts_per_token` must be in 1..n_experts=4"),
    ("ep-slack-below-one", ["model.ep_slack=0.5"], "`model.ep_slack` must be 0 (the worst case) or >= 1, got 0.5"),
    ("negative-window", ["model.sliding_window=-1"], "`model.sliding_window` must be >= 0"),
    ("groups-not-dividing", ["model.family=mixtral", "model.n_experts=8", "model.router_groups=3",
                             "model.router_topk_groups=1"],
     "`model.router_groups`=3 needs n_experts=8 split into groups of >= 2 experts: choose one of 1, 2, 4"),
    ("top-groups-above-groups", ["model.family=mixtral", "model.n_experts=8", "model.router_groups=4",
                                 "model.router_topk_groups=5"], "`model.router_topk_groups`=5 must be in 1..router_groups=4"),
    ("experts-beyond-groups", ["model.family=mixtral", "model.n_experts=8", "model.router_groups=4",
                               "model.router_topk_groups=1", "model.experts_per_token=3"],
     "`model.experts_per_token`=3 is more than the 2 experts in router_topk_groups=1 groups of 2"),
    ("top-groups-without-groups", ["model.family=mixtral", "model.n_experts=8", "model.router_topk_groups=2"],
     "`model.router_topk_groups`=2 needs model.router_groups; set both or neither"),
    ("router-scale-on-dense", ["model.router_scale=2.5"], "`model.router_scale`=2.5 applies to MoE models"),
    ("router-scale-zero", ["model.family=mixtral", "model.n_experts=4", "model.router_scale=0"],
     "`model.router_scale` must be > 0"),
    ("mla-on-llama", ["model.mla.kv_rank=64"], "`model.mla.kv_rank` applies to deepseek_v3 (multi-head latent "
                                               "attention), not model.family=llama; remove it"),
    ("deepseek-without-latent", ["model.family=deepseek_v3", "model.n_experts=8", "model.n_kv_heads=8"],
     "`model.mla.kv_rank` must be > 0 for deepseek_v3"),
    ("mla-q-rank", ["model.family=deepseek_v3", "model.n_experts=8", "model.n_kv_heads=8", "model.mla.kv_rank=16",
                    "model.mla.rope_dim=8", "model.mla.q_rank=-1"], "`model.mla.q_rank` must be >= 0"),
    ("mla-rope-odd", ["model.family=deepseek_v3", "model.n_experts=8", "model.n_kv_heads=8", "model.mla.kv_rank=16",
                      "model.mla.rope_dim=7"], "`model.mla.rope_dim` must be even and in 1..head_dim-1 (head_dim=32), got 7"),
    ("mla-gqa", ["model.family=deepseek_v3", "model.n_experts=8", "model.mla.kv_rank=16", "model.mla.rope_dim=8"],
     "set model.n_kv_heads=8 (= n_heads), got 4"),
    ("dense-layers-all", ["model.family=deepseek_v3", "model.n_experts=8", "model.n_kv_heads=8", "model.mla.kv_rank=16",
                          "model.mla.rope_dim=8", "model.dense_layers=4", "model.dense_d_ff=64"],
     "`model.dense_layers`=4 needs fewer dense layers than n_layers=4"),
    ("dense-layers-no-width", ["model.family=deepseek_v3", "model.n_experts=8", "model.n_kv_heads=8", "model.mla.kv_rank=16",
                               "model.mla.rope_dim=8", "model.dense_layers=1"], "`model.dense_layers`=1 needs model.dense_d_ff > 0"),
    ("mtp-on-llama", ["model.mtp_depth=1"], "`model.mtp_depth` applies to deepseek_v3"),
    ("mtp-weights-not-a-list", ["model.mtp_weights=0.3"], "`model.mtp_weights` must be"),
    ("max-positions-zero", ["model.max_positions=0"], "`model.max_positions` must be > 0"),

    ("gpt2-positions", ["model.family=gpt2", "seq_len=2048", "model.max_positions=1024"], "gpt2's learned position table"),
    ("mixture-without-source", ["data.mixture={a: {source: pydoc}}"], "`data.mixture` is set but data.source=pydoc"),
    ("mixture-missing", ["data.source=mixture"], "data.source=mixture needs `data.mixture`"),
    ("mixture-zero-weight", ["data.source=mixture", "data.mixture={a: {source: pydoc, weight: 0}}"], "weight must be a number > 0"),
    ("mixture-no-path", ["data.source=mixture", "data.mixture={a: {source: jsonl}}"], "(source jsonl) needs a `path`"),
    ("mixture-bad-key", ["data.source=mixture", "data.mixture={a: {src: pydoc}}"],
     "`data.mixture.a`: unknown key `src` (did you mean `source`?)"),
    ("mixture-no-source", ["data.source=mixture", "data.mixture={a: {path: x.jsonl}}"], "`data.mixture.a` needs a `source`"),
    ("jsonl-without-path", ["data.source=jsonl"], "data.source=jsonl needs `data.path`"),
    ("eval-without-path", ["eval.every=5", "eval.source=jsonl"], "needs `eval.path`"),
    ("eval-path-on-pydoc", ["eval.every=5", "eval.path=x.jsonl"], "`eval.path` is not used with eval source pydoc"),
    ("eval-source", ["eval.source=csv"], "`eval.source` must be one of"),
    ("eval-every-negative", ["eval.every=-1"], "`eval.every` must be >= 0"),
    ("harness-every-negative", ["eval.harness.every=-1"], "`eval.harness.every` must be >= 0, got -1"),
    ("harness-limit-negative", ["eval.harness.limit=-2"], "`eval.harness.limit` must be >= 0, got -2"),
    ("harness-without-tasks", ["eval.harness.every=5"], "eval.harness.every=5 needs `eval.harness.tasks`"),
    ("harness-never-runs", ["eval.harness.tasks=[hellaswag]"], "`eval.harness.tasks` is set but eval.harness.every=0"),
    ("harness-task-not-a-name", ["eval.harness.every=5", "eval.harness.tasks=[3]"],
     "`eval.harness.tasks` must be task names or task YAML files"),
    ("bad-records-negative", ["data.max_bad_records=-1"], "`data.max_bad_records` must be >= 0"),
    ("workers-negative", ["data.workers=-1"], "`data.workers` must be >= 0"),
    ("dpo-on-text", ["objective=dpo"], "objective=dpo with data.format=text: DPO trains on preference pairs"),
    ("preference-without-dpo", ["data.format=preference", "data.source=jsonl", "data.path=x.jsonl"],
     "objective=lm with data.format=preference"),
    ("chat-on-pydoc", ["data.format=chat"], "data.format=chat reads JSONL records (or data prepared from them); set data.source=jsonl or prepared"),
    ("chat-byte-no-template", ["data.format=chat", "data.source=jsonl", "data.path=x.jsonl"],
     "data.format=chat with the byte tokenizer has no chat template to read"),
    ("bad-format", ["data.format=sharegpt"], "`data.format` must be one of text, chat, preference, prompt"),
    ("lora-negative-rank", ["lora.rank=-1"], "`lora.rank` must be >= 0 (0: off), got -1"),
    ("lora-alpha-zero", ["lora.rank=4", "lora.alpha=0"], "`lora.alpha` must be > 0, got 0.0"),
    ("lora-dropout-one", ["lora.rank=4", "lora.dropout=1.0"], "`lora.dropout` must be in [0, 1), got 1.0"),
    ("dpo-loss-unknown", ["dpo.loss=kto"], "`dpo.loss` must be one of sigmoid, simpo"),
    ("dpo-beta-zero", ["dpo.beta=0"], "`dpo.beta` must be > 0"),
    ("swiglu-limit-on-llama", ["model.swiglu_limit=5.0"], "`model.swiglu_limit`=5.0: it clamps gpt_oss's gated unit, "
                                                          "and model.family=llama has no clamp; remove it"),
    ("grpo-on-text", ["objective=grpo"], "objective=grpo with data.format=text: GRPO samples completions of prompt records"),
    ("prompts-without-grpo", ["data.format=prompt", "data.source=jsonl", "data.path=x.jsonl"], "objective=lm with data.format=prompt"),
    ("grpo-on-pydoc", ["objective=grpo", "data.format=prompt"],
     "data.format=prompt reads prompt records from JSONL or Parquet; set data.source=jsonl or parquet"),
    ("grpo-group-not-dividing", [*GRPO, "rl.group_size=3"], "`rl.group_size`=3 must be >= 2 and divide global_batch_size=16"),
    ("grpo-group-of-one", [*GRPO, "rl.group_size=1"], "`rl.group_size`=1 must be >= 2"),
    ("grpo-seq-too-short", [*GRPO, "rl.max_prompt_tokens=100", "rl.max_new_tokens=100"],
     "`seq_len`=128 cannot hold a prompt and its completion: rl.max_prompt_tokens + rl.max_new_tokens - 1 = 199"),
    ("grpo-greedy", [*GRPO, "rl.temperature=0"], "`rl.temperature` must be > 0"),
    ("grpo-top-p", [*GRPO, "rl.top_p=0"], "`rl.top_p` must be in (0, 1], got 0.0"),
    ("grpo-top-k", [*GRPO, "rl.top_k=-1"], "`rl.top_k` must be >= 0 (0: off), got -1"),
    ("grpo-eps-low", [*GRPO, "rl.eps_low=1"], "`rl.eps_low` must be in [0, 1), got 1.0"),
    ("grpo-loss-unknown", [*GRPO, "rl.loss=ppo"], "`rl.loss` must be one of grpo, dapo, dr_grpo"),
    ("grpo-negative-beta", [*GRPO, "rl.beta=-1"], "`rl.beta` must be >= 0 (0: no reference), got -1.0"),
    ("grpo-reference-absent", [*GRPO, "rl.beta=0.04"], "`rl.beta`=0.04 keeps the policy near a reference, the model the run "
                                                      "starts from, but without init_from"),
    ("grpo-no-rewards", [*GRPO[:-1]], "objective=grpo needs `rl.rewards`"),
    ("grpo-reward-bad-key", [*GRPO, "rl.rewards={exact: {weigth: 2}}"],
     "`rl.rewards.exact` must be a mapping of any of reward, weight, field, extract, pattern; got unknown key `weigth`"),
    ("grpo-reward-bad-weight", [*GRPO, "rl.rewards={exact: {weight: .nan}}"], "`rl.rewards.exact.weight` must be a finite number"),
    # a bad regular expression was a re.error traceback; a field that is not a string was read only once a
    # completion matched, so the run trained on reward 0
    ("grpo-reward-bad-extract", [*GRPO, 'rl.rewards={c: {reward: exact, extract: "([0-9"}}'],
     "`rl.rewards.c.extract` '([0-9' is not a valid regular expression (unterminated character set at position 1)"),
    ("grpo-reward-bad-pattern", [*GRPO, 'rl.rewards={c: {reward: format, pattern: "["}}'],
     "`rl.rewards.c.pattern` '[' is not a valid regular expression"),
    ("grpo-reward-field-int", [*GRPO, "rl.rewards={c: {reward: exact, field: 3}}"],
     "`rl.rewards.c.field` must be a non-empty string, got 3"),
    # names with a dot, or numbers, were a ConfigDict ValueError or a TypeError traceback
    ("grpo-reward-dotted-name", [*GRPO, "rl.rewards={a.b: {reward: exact}}"],
     "`rl.rewards`: the name 'a.b' must be a word (letters, digits, '_', '-'; no dots)"),
    ("mixture-int-name", ["data.source=mixture", "data.mixture={1: {source: synthetic}}"],
     "`data.mixture`: the name 1 must be a word"),
    ("mixture-dotted-name", ["data.source=mixture", "data.mixture={a.b: {source: synthetic}}"],
     "`data.mixture`: the name 'a.b' must be a word"),
    # keys nothing reads under the rest of the config were ignored without a word
    ("unread-data-path", ["data.source=synthetic", "data.path=x.jsonl"],
     "`data.path`='x.jsonl' is read only with data.source text, jsonl, parquet or prepared"),
    ("unread-eval-path", ["eval.path=held.jsonl"], "`eval.path`='held.jsonl' is read only with eval.every > 0"),
    ("unread-chat-template", ["data.chat_template=chatml"], "`data.chat_template`='chatml' is read only with "
                                                              "data.format chat, preference or prompt"),
    ("unread-dpo-gamma", ["dpo.gamma=2.0"], "`dpo.gamma`=2.0 is read only with objective=dpo with dpo.loss=simpo"),
    # accepted and ignored, or accepted as nonsense
    ("grpo-reward-unread-key", [*GRPO, "rl.rewards={c: {reward: exact, pattern: x}}"],
     "`rl.rewards.c.pattern`: the exact reward does not read it (it reads weight, field, extract); remove it"),
    ("grpo-reward-math-extract", [*GRPO, "rl.rewards={c: {reward: math, extract: last}}"],
     "`rl.rewards.c.extract`: the math reward does not read it"),
    ("lora-target-twice", ["lora.rank=4", "lora.targets=[wq,wq]"], "`lora.targets` names wq twice"),
    ("lora-rank-over-width", ["lora.rank=1000"], "`lora.rank`=1000 exceeds model.d_model=256"),
    ("simpo-gamma-negative", ["dpo.gamma=-5"], "`dpo.gamma` must be >= 0 (SimPO's target margin), got -5.0"),
    ("grpo-with-eval", [*GRPO, "eval.every=5", "eval.path=y.jsonl"], "eval.every with objective=grpo"),
    ("expert-grad-dtype", ["model.family=mixtral", "model.n_experts=4", "model.expert_grad_dtype=float16"],
     "`model.expert_grad_dtype` must be one of float32, bfloat16; got `float16`"),
    ("expert-grad-dtype-on-dense", ["model.expert_grad_dtype=bfloat16"], "`model.expert_grad_dtype`=bfloat16 applies "
                                                                          "to MoE models"),
    ("grouped-gemm", ["model.family=mixtral", "model.n_experts=4", "model.grouped_gemm=cutlass"],
     "`model.grouped_gemm` must be one of auto, xla, tokamax; got `cutlass`"),
    ("grouped-gemm-on-dense", ["model.grouped_gemm=tokamax"], "`model.grouped_gemm`=tokamax applies to MoE models"),
]

# Cases that need the devices (8 fake CPU devices): mesh arithmetic, kernels, run directories, files.
RUN = [
    ("batch-vs-mesh", ["global_batch_size=12"], "must be divisible by the data-parallel size"),
    ("resume-switches-optimizer", ["run_dir={run}", "steps=4", "optim.name=muon"],
     "was trained with optim.name=adamw; a resume keeps its optimizer: set optim.name=adamw, or start a new run_dir "
     "with init_from="),
    ("mesh-product", ["mesh.data=3", "mesh.fsdp=1"], "has 3 devices but 8 are available"),
    ("heads-vs-tensor", ["model.n_heads=6", "mesh.tensor=4", "model.n_kv_heads=2"], "must be divisible by `mesh.tensor`=4"),
    ("stage-microbatch-split", ["mesh.stage=2", "model.n_layers=2", "mesh.data=4", "mesh.fsdp=1", "global_batch_size=8", "microbatches=4"], "global_batch_size/microbatches = 2 sequences per microbatch must be divisible"),
    ("unknown-topology", ["dry_run=true", "compile_topology=v9x-8"], "compile_topology `v9x-8`"),
    ("stage-offload-on-tpu", ["dry_run=true", "compile_topology=v5p-8", "mesh.stage=2", "model.n_layers=2",
                              "microbatches=2", "remat=offload"],
     "mesh.stage=2 with remat=offload: libtpu fails to compile host offload inside the pipeline's schedule"),
    ("huge-seq-len", ["seq_len=100000000", "model.max_positions=100000000", "model.n_layers=4"],
     "the train step cannot be built at this size: an array would have more than 2**63 elements"),
    ("profile-past-the-end", ["profile_steps=[10,20]", "steps=2"],
     "`profile_steps` [10, 20] ends after the run's last step (steps=2); profile steps within 1..2"),
    ("flash-head-dim", ["attention=flash", "model.head_dim=320"], "attention=flash: head_dim 320 is over 256"),
    ("cudnn-on-cpu", ["attention=cudnn"], "attention=cudnn needs an NVIDIA GPU"),
    ("tokamax-on-cpu", ["model.family=mixtral", "model.n_experts=4", "model.grouped_gemm=tokamax"],
     "model.grouped_gemm=tokamax is tokamax's Mosaic GPU kernel for Hopper GPUs; this run is on cpu"),
    # (tokamax on a B200 is refused in test_gpu_models.py, where the CUDA plugin is loaded)
    # the Mosaic GPU interpreter failed here ("Barrier remains allocated"); on one device it hung until the watchdog
    ("mosaic-on-cpu", ["attention=mosaic"], "attention=mosaic is the Hopper GPU kernels, which run on CPU only in the "
                                            "Mosaic GPU interpreter that tests call directly"),
    ("mosaic-on-cpu-dry-run", ["attention=mosaic", "dry_run=true"], "Use attention=flash (the Pallas kernels in "
                                                                    "interpret mode) or xla on CPU"),
    ("run-dir-under-file", ["run_dir=/dev/null/x"], "`run_dir` /dev/null/x cannot be created (Not a directory)"),
    ("run-dir-in-proc", ["run_dir=/proc/x"], "`run_dir` /proc/x cannot be created"),
    ("checkpoint-dir-is-file", ["checkpoint.dir=/etc/passwd"], "`checkpoint.dir` /etc/passwd is a file, not a directory"),
    ("run-dir-is-file", ["run_dir={d}/garbage.parquet"], "`run_dir` {d}/garbage.parquet is a file, not a directory"),
    ("init-from-missing", ["init_from={tmp}/nope"], "`init_from`: {tmp}/nope does not exist"),
    ("init-from-empty", ["init_from={d}/empty"], "holds no committed checkpoint"),
    ("init-from-hf-missing", ["init_from=hf:{tmp}/nope"], "not a Hugging Face model directory (no config.json)"),
    # both were "not a Hugging Face model directory (no config.json)", of the file's path or the working directory
    ("init-from-hf-config-file", ["init_from=hf:{d}/hf/config.json"], "{d}/hf/config.json is the config file; give its "
                                                                      "directory: init_from=hf:{d}/hf"),
    ("init-from-hf-empty", ["init_from=hf:"], "`init_from`=hf: names no directory"),
    ("checkpoint-beyond-steps", ["run_dir={run}", "steps=1"], "holds step 2, beyond steps=1"),
    ("checkpoint-other-model", ["run_dir={run}", "steps=3", "model.d_ff=512"],
     "it does not match the model: `params.layers.w_down` has shape"),
    ("checkpoint-other-optimizer", ["run_dir={run}", "steps=3", "optim.grad_clip=0"], "the optimizer's structure changed"),
    ("init-from-other-model", ["init_from={run}/checkpoints", "model.d_model=128", "model.n_heads=4"],
     "it does not match the model"),
    ("lora-missing-target", ["lora.rank=4", "lora.targets=[wq,q_proj]"], "lora.targets: this model has no weight `q_proj`"),
    ("lora-bias-target", ["lora.rank=4", "lora.targets=[bq]", "model.family=gpt2", "model.n_kv_heads=8",
                          "model.max_positions=128"], "lora.targets: `bq` is a bias or norm gain, which LoRA does not adapt; its layer weights are w_in, w_out, wk, wo, wq, wv"),
]

# Bad data (files made by `files`); all refused before anything compiles, most by the data preflight.
J = ["data.source=jsonl"]
DATA = [
    ("jsonl-missing", [*J, "data.path={tmp}/nope.jsonl"], "`data.path`: {tmp}/nope.jsonl does not exist"),
    ("jsonl-all-empty", [*J, "data.path={d}/empty.jsonl"], "data: no usable document in a whole epoch of 2000 documents (empty: 2000"),
    ("jsonl-all-blank", [*J, "data.path={d}/blank.jsonl"], "(empty: 2000; first:"),
    ("jsonl-not-json", [*J, "data.path={d}/notjson.jsonl"], "data: 1001 bad records (malformed JSON, invalid UTF-8, a missing `data.field` or one that is not text), more than data.max_bad_records=1000"),
    ("jsonl-not-json-no-budget", [*J, "data.path={d}/notjson.jsonl", "data.max_bad_records=100000"], "(bad_json: 2000; first:"),
    # invalid UTF-8 was skipped without limit by the loader, while prepare's --max-bad-records counted it
    ("jsonl-not-utf8", [*J, "data.path={d}/latin1.jsonl", "data.max_bad_records=10"],
     "data: 11 bad records (malformed JSON, invalid UTF-8, a missing `data.field` or one that is not text), more than data.max_bad_records=10; "
     "first: {d}/latin1.jsonl:"),
    ("jsonl-strict", [*J, "data.path={d}/notjson.jsonl", "data.strict=true"], "data.strict=true: a document was bad_json at {d}/notjson.jsonl:"),
    ("jsonl-wrong-field", [*J, "data.path={d}/body.jsonl", "data.epochs=1"], "set data.field to the JSON key or Parquet column"),
    ("jsonl-too-short", [*J, "data.path={d}/short.jsonl"], "(short: 50; first:"),
    ("jsonl-empty-dir", [*J, "data.path={d}/empty"], "`data.path`: {d}/empty"),
    # a named pipe was said not to exist
    # every line was "invalid_utf8 ... convert it to UTF-8"
    ("jsonl-gzip", [*J, "data.path={d}/gz/docs.jsonl.gz"], "`data.path`: {d}/gz/docs.jsonl.gz is compressed (.gz); maxlm "
                                                          "reads uncompressed text, JSONL and Parquet: decompress it first"),
    ("jsonl-fifo", [*J, "data.path={d}/fifo/pipe.jsonl"], "`data.path`: {d}/fifo/pipe.jsonl is a named pipe (FIFO), not "
                                                         "a regular file"),
    ("jsonl-no-jsonl-in-dir", [*J, "data.path={d}/notes"], "holds no .jsonl or .json files (1 other file)"),
    ("path-list-of-ints", [*J, "data.path=[1,2]"], "`data.path`: item 1 of the list is 1 (int), not a path; write every path as a string: data.path=['1', '2']"),
    ("path-list-empty-item", [*J, "data.path=['', {d}/blank.jsonl]"], "`data.path`: item 1 of the list is an empty string"),
    ("mixture-int-paths", ["data.source=mixture", "data.mixture={web: {source: jsonl, path: [1, 2]}}"],
     "`data.mixture.web.path`: item 1 of the list is 1 (int), not a path"),
    ("prepared-glob-of-files", ["data.source=prepared", "data.path={d}/prep/*"],
     "matches 4 files but no prepared directory (one holding dataset.json); pass the directory itself: data.path={d}/prep"),
    ("prepared-parent", ["data.source=prepared", "data.path={d}"], "is not a prepared dataset (no dataset.json) but holds prepared directories"),
    ("prepared-a-file", ["data.source=prepared", "data.path={d}/blank.jsonl"], "is a file, not a prepared directory"),
    ("parquet-garbage", ["data.source=parquet", "data.path={d}/garbage.parquet"], "{d}/garbage.parquet is not a valid Parquet file ("),
    # an empty template trained on nothing and spun in the data stage; null content was trained as "None"
    ("chat-template-empty", ["data.source=jsonl", "data.path={d}/chat.jsonl", "data.format=chat",
                             "data.chat_template={d}/empty.jinja"],
     "data.chat_template {d}/empty.jinja renders nothing for assistant turn 2 of the conversation at the built-in"),
    ("chat-content-null", ["data.source=jsonl", "data.path={d}/null.jsonl", "data.format=chat", "data.chat_template=chatml"],
     "data.format=chat: the record at {d}/null.jsonl:4 has content None (NoneType) in messages[1]"),
    ("tokenizer-empty", ["data.tokenizer="], "`data.tokenizer` is empty; set it to byte, a tokenizer.json or a SentencePiece .model"),
    ("tokenizer-missing", ["data.tokenizer={tmp}/tok.json"], "`data.tokenizer`: no file {tmp}/tok.json"),
    ("tokenizer-dir", ["data.tokenizer={d}/empty"], "`data.tokenizer`: {d}/empty is a directory"),
    ("tokenizer-fifo", ["data.tokenizer={d}/fifo/tok.json"], "`data.tokenizer`: {d}/fifo/tok.json is not a regular file"),
    ("tokenizer-garbage", ["data.tokenizer={d}/garbage.json"], "{d}/garbage.json does not load as a Hugging Face tokenizer"),
    ("vocab-below-tokenizer", ["model.vocab_size=100"], "set model.vocab_size=256"),
    ("harness-task-file-missing", ["eval.harness.every=2", "eval.harness.tasks=[{tmp}/mine.yaml]"],
     "eval.harness.tasks: no task file {tmp}/mine.yaml"),
    ("harness-include-missing", ["eval.harness.every=2", "eval.harness.tasks=[mine]", "eval.harness.include={tmp}/t"],
     "eval.harness.include: {tmp}/t is not a directory"),
    ("eval-path-missing", [*J, "data.path={d}/body.jsonl", "eval.every=5", "eval.path={tmp}/held.jsonl"],
     "eval: `eval.path`: {tmp}/held.jsonl does not exist"),
]

# Damage done to a copy of `{run}` before resuming it with steps=3.


def _tensors(run: Path, how) -> None:
    for f in (run / "checkpoints" / "2" / "state").rglob("d/*"):
        f.write_bytes(how(f.read_bytes()))


def _meta(run: Path, change) -> None:
    path = run / "checkpoints/2/meta/metadata"
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


DAMAGE = {
    "meta-key-removed-since": (lambda run: _meta(run, lambda m: m["config"]["optim"].update(nesterov=True)),
                               "the saved config has `optim.nesterov`, which this version of maxlm does not know"),
    "meta-newer-layout": (lambda run: _meta(run, lambda m: m.update(schema=2)),
                          "it has checkpoint layout 2 (written by maxlm"),
    "tensors-garbage": (lambda run: _tensors(run, lambda b: os.urandom(100)), "cannot be read, the checkpoint is damaged"),
    "tensors-truncated": (lambda run: _tensors(run, lambda b: b[:10]), "cannot be read, the checkpoint is damaged"),
    "metadata-deleted": (lambda run: (run / "checkpoints/2/state/_METADATA").unlink(),
                         "its state/_METADATA file is missing, so the checkpoint is damaged"),
    "metadata-garbage": (lambda run: (run / "checkpoints/2/state/_METADATA").write_text("{not json"),
                         "its array metadata cannot be read, the checkpoint is damaged"),
    "meta-truncated": (lambda run: (run / "checkpoints/2/meta/metadata").write_text('{"step": 2'),
                       "its metadata cannot be read, the checkpoint is damaged"),
    "data-state-deleted": (lambda run: shutil.rmtree(run / "checkpoints/2/data"), "checkpoint step 2 at"),
}

# Config files: (id, file text or bytes, substring).
FILES = [
    ("binary", bytes(range(256)) * 4, "not a UTF-8 text file"),
    ("utf16", "steps: 3\n".encode("utf-16"), "not a UTF-8 text file"),
    ("invalid-yaml", "steps: [3\n", "invalid YAML"),
    ("list-at-top", "- steps\n", "a config must be a mapping of keys, got list"),
    ("duplicate-key", "steps: 3\nseed: 1\nsteps: 4\n", "key `steps` is given twice"),
    ("duplicate-nested-key", "model:\n  d_model: 64\n  d_model: 32\n", "key `d_model` is given twice"),
    ("base-config-int", "base_config: 5\n", "`base_config` must name a YAML file (relative to this one), got 5"),
    ("base-config-list", "base_config: [a.yml]\n", "`base_config` must name a YAML file"),
    ("base-config-empty", "base_config: ''\n", "`base_config` must name a YAML file"),
    ("base-config-missing", "base_config: nope.yml\n", "config file not found: "),
    ("base-config-cycle", "base_config: CYCLE.yml\n", "base_config cycle"),
    ("section-as-scalar", "model: 3\n", "`model` is a section"),
    ("unknown-key-in-file", "stepz: 3\n", "unknown config key `stepz`; did you mean `steps`?"),
    ("wrong-type-in-file", "steps: many\n", "`steps` must be int"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Bad data files, an empty directory, a garbage parquet file."""
    d = tmp_path_factory.mktemp("bad")
    (d / "empty").mkdir()
    rng = np.random.default_rng(0)
    (d / "garbage.parquet").write_bytes(rng.bytes(4096))
    (d / "garbage.json").write_bytes(rng.bytes(512))
    (d / "empty.jsonl").write_text('{"text": ""}\n' * 2000)
    (d / "blank.jsonl").write_text("\n" * 2000)
    (d / "notjson.jsonl").write_text("not json\n" * 2000)
    (d / "body.jsonl").write_text(json.dumps({"body": "x" * 50}) + "\n" * 1 + (json.dumps({"body": "x" * 50}) + "\n") * 19)
    (d / "latin1.jsonl").write_bytes('{"text": "café crème brûlée"}\n'.encode("latin-1") * 200)
    (d / "short.jsonl").write_text('{"text": "a"}\n' * 50)
    (d / "empty.jinja").write_text("")
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    (d / "chat.jsonl").write_text((json.dumps(good) + "\n") * 50)
    null = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}
    (d / "null.jsonl").write_text((json.dumps(good) + "\n") * 3 + json.dumps(null) + "\n" + (json.dumps(good) + "\n") * 50)
    (d / "fifo").mkdir()  # named pipes, apart: nothing else here opens them
    os.mkfifo(d / "fifo" / "pipe.jsonl")
    os.mkfifo(d / "fifo" / "tok.json")
    (d / "notes").mkdir()
    (d / "notes" / "a.txt").write_text("a note")
    (d / "doc.txt").write_text("some text to prepare " * 200)
    (d / "gz").mkdir()
    (d / "gz" / "docs.jsonl.gz").write_bytes(gzip.compress(b'{"text": "hello"}\n' * 100))
    (d / "hf").mkdir()
    (d / "hf" / "config.json").write_text("{}")
    assert prepare.main([str(d / "doc.txt"), "--tokenizer", "byte", "--out", str(d / "prep")]) == 0
    return d


@pytest.fixture(scope="module")
def run(tmp_path_factory, files):
    """A run directory with a committed step-2 checkpoint (SMALL), made in-process."""
    d = tmp_path_factory.mktemp("run")
    assert train.main([TINY, *SMALL, "steps=2", f"run_dir={d}"]) == 0
    return d


def one_error(capfd, argv, code=2) -> str:
    """Run the CLI in-process; assert the exit code, one stderr line, no traceback; return the line."""
    rc = train.main(argv)
    out, err = capfd.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == code, (rc, err[-3000:], out[-2000:])
    assert len(lines) == 1 and lines[0].startswith("maxlm: error: "), err[-3000:]
    assert "Traceback" not in out + err
    return lines[0]


@pytest.mark.parametrize("args, want", [c[1:] for c in CONFIG], ids=[c[0] for c in CONFIG])
def test_config(capfd, args, want):
    assert want in one_error(capfd, [TINY, *args])


@pytest.mark.parametrize("args, want", [c[1:] for c in RUN], ids=[c[0] for c in RUN])
def test_run(capfd, tmp_path, files, run, args, want):
    case_run = tmp_path / "run"
    shutil.copytree(run, case_run)
    fill = dict(d=files, run=case_run, tmp=tmp_path)
    args = [a.format(**fill) for a in args]
    if not any(a.startswith("run_dir=") for a in args):
        args.append(f"run_dir={tmp_path}/fresh")
    if not any(a.startswith("steps=") for a in args):
        args.append("steps=2")
    small = [a for a in SMALL if a.split("=")[0] not in {b.split("=")[0] for b in args}]
    assert want.format(**fill) in one_error(capfd, [TINY, *small, *args])


@pytest.mark.parametrize("args, want", [c[1:] for c in DATA], ids=[c[0] for c in DATA])
def test_data(capfd, tmp_path, files, args, want):
    fill = {"{d}": str(files), "{tmp}": str(tmp_path)}
    msg = one_error(capfd, [TINY, *SMALL, "steps=2", f"run_dir={tmp_path}/run", *(_fill(a, fill) for a in args)])
    assert _fill(want, fill) in msg, msg


def _fill(text: str, fill: dict) -> str:
    for k, v in fill.items():
        text = text.replace(k, v)
    return text


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_checkpoint(capfd, tmp_path, run, damage):
    case_run = tmp_path / "run"
    shutil.copytree(run, case_run)
    harm, want = DAMAGE[damage]
    harm(case_run)
    msg = one_error(capfd, [TINY, *SMALL, "steps=3", f"run_dir={case_run}"])
    assert msg.startswith(f"maxlm: error: checkpoint step 2 at {case_run}/checkpoints/2: ") and want in msg, msg
    assert sorted(p.name for p in (case_run / "checkpoints").iterdir()) == ["2"]  # nothing removed or added


@pytest.mark.parametrize("text, want", [c[1:] for c in FILES], ids=[c[0] for c in FILES])
def test_config_file(capfd, tmp_path, text, want):
    path = tmp_path / "c.yml"
    if isinstance(text, str):
        (tmp_path / "CYCLE.yml").write_text("base_config: c.yml\n")
        if "base_config" not in text and not text.startswith("-"):
            text = f"base_config: {ROOT / TINY}\n{text}"
        path.write_text(text)
    else:
        path.write_bytes(text)
    assert want in one_error(capfd, [str(path)])


def test_config_path_is_a_directory(capfd, tmp_path):
    assert f"config file {tmp_path} is a directory; give a YAML file in it" in one_error(capfd, [str(tmp_path)])


def test_lock_held_by_another_job(capfd, tmp_path, run):
    with runlock.hold(run, print):  # a second open file description: as another process would be
        capfd.readouterr()
        msg = one_error(capfd, [TINY, *SMALL, "steps=3", f"run_dir={run}"])
    assert f"`run_dir` {run} is in use by another job (pid {os.getpid()} on host " in msg


def test_checkpoint_from_before_a_key_existed_resumes(capfd, tmp_path, run):
    """A checkpoint whose saved config lacks a key added since: it resumes, with today's default, and
    the log names the key."""
    case_run = tmp_path / "run"
    shutil.copytree(run, case_run)
    _meta(case_run, lambda m: m["config"].pop("profile_steps"))
    assert train.main([TINY, *SMALL, "steps=3", f"run_dir={case_run}"]) == 0
    out = capfd.readouterr().out
    assert f"checkpoint step 2 at {case_run}/checkpoints/2: the saved config predates `profile_steps`; today's default applies" in out
    assert "resuming from step 2" in out


def test_a_key_given_twice_on_the_command_line_is_said(capfd, tmp_path):
    """Scripts layer overrides (a base set, then a change): the last one applies, and the log says so."""
    assert train.main([TINY, *SMALL, "steps=3", "steps=1", f"run_dir={tmp_path}"]) == 0
    out = capfd.readouterr().out
    assert "maxlm: `steps` is given 2 times on the command line (steps=3, steps=1); the last one applies" in out
    assert "trained steps 1-1" in out


@pytest.fixture
def wandb_env(monkeypatch, tmp_path):
    """W&B as a logged-in machine has it (a key), nothing else from this machine's environment."""
    pytest.importorskip("wandb")
    for k in ("WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef" * 3)
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # train.main's exit-4 path quiets these
    import logging
    monkeypatch.setattr(logging.getLogger("asyncio"), "disabled", False)
    return [TINY, *SMALL, "steps=2", f"run_dir={tmp_path / 'run'}", "tracking=[wandb]"]


def test_an_unknown_wandb_mode_is_named_with_its_values(capfd, monkeypatch, wandb_env):
    """Before: `not logged in to W&B`, with a key set; the variable itself was never named."""
    monkeypatch.setenv("WANDB_MODE", "offlne")
    msg = one_error(capfd, wandb_env)
    assert msg == ("maxlm: error: WANDB_MODE='offlne' is not a W&B mode: set it to one of online, offline, shared, "
                   "disabled, dryrun, run (offline: `wandb sync` the run later), or unset it")


def test_an_unreachable_wandb_server_is_one_line_and_exit_4_before_the_compile(capfd, monkeypatch, wandb_env, tmp_path):
    """Before: the compile, then W&B's 31-line CommError and exit 1. Now a probe before anything compiles:
    exit 4, which the launchers retry."""
    import socket
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("WANDB_BASE_URL", url)
    msg = one_error(capfd, wandb_env, code=4)
    assert msg.startswith(f"maxlm: error: `tracking` names wandb, but the W&B server {url} did not answer (") and \
        msg.endswith("check the network or WANDB_BASE_URL, or set WANDB_MODE=offline and `wandb sync` the run later")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_wandb_server_that_answers_passes_the_probe(monkeypatch, wandb_env):
    """Any HTTP answer is a reachable server, a 404 included."""
    import http.server
    import threading

    from maxlm import tracking
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # answers 501
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.server_address[1]}")
        tracking.check(["wandb"])
    finally:
        server.shutdown()
        server.server_close()
