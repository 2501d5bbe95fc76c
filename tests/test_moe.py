"""A tiny Mixtral through the real train step: it trains and reports its load-balancing loss, and a mesh
that splits the experts over `expert` gives the single-device loss and gradients. And MoE FLOPs count the
active experts."""

import json
import shutil

import jax
import numpy as np
import pytest
from conftest import run_cli
from test_resume import assert_same_state, final_state
from test_step import SMALL, assert_trees_close

from maxlm import mesh as mesh_lib, metrics, recipe as recipe_lib, sharding, step as step_lib
from maxlm.config import load
from maxlm.data import make_loader
from maxlm.state import StateSpec
from maxlm.aot import compile_step

MOE = ["model.family=mixtral", "model.n_experts=4", "model.experts_per_token=2", "model.d_ff=256"]


def setup(overrides, n_devices):
    # 4 layers, as in test_stages.py: its one-device reference is then this file's, one compile in the shared cache
    cfg = load("configs/tiny.yml", SMALL + MOE + ["model.n_layers=4", *overrides])
    devices = jax.devices()[:n_devices]
    m = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, len(devices)), devices)
    rules = sharding.rules(cfg)
    return cfg, m, rules, StateSpec(recipe_lib.build(cfg, m), m, rules)


def loss_and_grads(cfg, m, rules, ss, params, batch) -> dict:
    """Loss, aux loss, gradients and every layer's expert load at host `params` on host `batch`, both placed
    onto this mesh."""
    with sharding.use(m, rules):
        p, b = jax.device_put(params, ss.shardings.params), jax.device_put(batch, ss.abstract_batch["inputs"].sharding)
        out = jax.device_get(jax.jit(lambda p, b: step_lib.grads(p, b, ss.recipe))(p, b))
    return dict(loss=float(out.loss), aux=float(out.aux), grads=out.grads, load=out.moe["load"])


@pytest.fixture(scope="module")
def single_device():
    """3 steps of the compiled train step on one device (the metrics of each), then the loss and
    gradients at the trained parameters on the next batch."""
    cfg, m, rules, ss = setup(["mesh.fsdp=1"], 1)
    compiled = compile_step(cfg, ss)
    loader = make_loader(cfg, ss.abstract_batch)
    state = ss.init_fn(cfg.seed)()
    rows = []
    for _ in range(3):
        state, out = compiled(state, next(loader))
        rows.append({k: v if k == "moe_load" else float(v) for k, v in jax.device_get(out).items()})
    params, batch = jax.device_get(state.params), jax.device_get(next(loader))
    return dict(rows=rows, params=params, batch=batch, **loss_and_grads(cfg, m, rules, ss, params, batch))


def test_tiny_mixtral_trains(single_device):
    rows = single_device["rows"]
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in rows)
    # The metric is router_aux_loss (0.01) x the balance loss E * sum_k,e f_ke P_e, which is k = 2 for
    # even routing and at most E * k = 8: near 0.02 for a fresh router.
    assert all(0.015 < r["moe_aux_loss"] < 0.03 for r in rows), [r["moe_aux_loss"] for r in rows]
    assert rows[-1]["loss"] < rows[0]["loss"], "the tiny mixtral did not train"
    g = single_device["grads"]["layers"]
    assert all(np.abs(g[k]).max() > 0 for k in ("router", "w_gate", "w_up", "w_down"))


@pytest.mark.parametrize("mesh", [["mesh.fsdp=2", "mesh.expert=4"],
                                  pytest.param(["mesh.fsdp=4", "mesh.expert=2"], marks=pytest.mark.slow),
                                  ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"]])
def test_mixtral_mesh_invariance(single_device, mesh):
    """On expert-parallel meshes (tokens exchanged by all-to-all; with tensor, every expert's hidden
    units split too), the loss, the aux
    loss and the gradients at the same parameters and batch equal the single-device ones: the loss to
    rtol 1e-5 and the gradients elementwise to rtol 1e-5 of each tensor's scale, as tests/test_step.py
    checks Llama (whose tests also cover the sharded optimizer update, the same code for any family).
    Routing is discrete, but no token of this batch sits on a near-tie that a different reduction order
    could flip. (tests/test_dispatch.py checks expert = 1, 2, 4, 8 at the layer.)"""
    ref = single_device
    out = loss_and_grads(*setup(mesh, 8), ref["params"], ref["batch"])
    np.testing.assert_allclose([out["loss"], out["aux"]], [ref["loss"], ref["aux"]], rtol=1e-5)
    assert_trees_close(out["grads"], ref["grads"], rtol=1e-5)


def test_gpt_oss_mesh_invariance():
    """gpt-oss's MoE in the same dispatch: its router and expert biases (drawn far from 0, so each shows),
    its clamped gated unit, attention biases and sinks, on expert x tensor x fsdp (the experts' output
    bias added once although their hidden units are split) equal one device."""
    oss = ["model.family=gpt_oss", "model.qkv_bias=true", "model.attn_sinks=true", "model.sliding_window=8"]
    cfg, m, rules, ss = setup(["mesh.fsdp=1", *oss], 1)
    params = jax.device_get(ss.init_fn(cfg.seed)().params)
    rng = np.random.default_rng(0)
    for k in ("b_router", "b_gate", "b_up", "b_down", "bq", "bk", "bv", "bo", "sinks"):
        params["layers"][k] = rng.normal(0, 0.5, params["layers"][k].shape).astype(np.float32)
    batch = jax.device_get(next(make_loader(cfg, ss.abstract_batch)))
    ref = loss_and_grads(cfg, m, rules, ss, params, batch)
    out = loss_and_grads(*setup(["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2", *oss], 8), params, batch)
    np.testing.assert_allclose([out["loss"], out["aux"]], [ref["loss"], ref["aux"]], rtol=1e-5)
    assert_trees_close(out["grads"], ref["grads"], rtol=1e-5)
    assert all(np.abs(ref["grads"]["layers"][k]).max() > 0 for k in ("b_router", "b_gate", "b_down", "sinks"))


def test_microbatches_sum_the_load_and_give_the_same_gradients(single_device):
    """Two microbatches: the same loss and gradients, and the expert load summed over both (the loss-free
    bias balances the whole batch's load). The balance loss is off: it is a mean per microbatch, as
    `step.grads` says, so with it on the gradients differ by design."""
    ref = single_device
    cfg, m, rules, ss = setup(["mesh.fsdp=1", "model.router_aux_loss=0"], 1)
    cfg2, m2, rules2, ss2 = setup(["mesh.fsdp=1", "model.router_aux_loss=0", "microbatches=2"], 1)
    one = loss_and_grads(cfg, m, rules, ss, ref["params"], ref["batch"])
    two = loss_and_grads(cfg2, m2, rules2, ss2, ref["params"], ref["batch"])
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-5)
    assert_trees_close(two["grads"], one["grads"], rtol=1e-5)
    np.testing.assert_array_equal(two["load"], one["load"])
    assert float(np.sum(one["load"])) == cfg.global_batch_size * cfg.seq_len * 2 * cfg.model.n_layers


def test_mixtral_8x7b_flops_count_the_active_experts():
    """FLOPs/token (and so MFU) count the router and the 2 experts a token uses, not all 8: Mixtral-8x7B's
    published 12.9B active parameters, less the input embedding and norms."""
    m = load("configs/models/mixtral-8x7b.yml").model
    attn = 4096 * 4096 * 2 + 4096 * 1024 * 2  # q, o; k, v
    moe = 2 * 3 * 4096 * 14336 + 4096 * 8  # top-2 experts' gate, up, down; the router
    assert metrics.matmul_params(m) == 32 * (attn + moe) + 4096 * 32000 == 12_748_587_008
    # A shared expert is one more expert every token uses.
    shared = load("configs/models/mixtral-8x7b.yml", ["model.shared_experts=1"]).model
    assert metrics.matmul_params(shared) - metrics.matmul_params(m) == 32 * 3 * 4096 * 14336


@pytest.mark.slow  # 22 s on 2 cores: in the slow suite to hold the fast one to its budget
def test_bias_gets_no_gradient_and_moves_load_toward_balance():
    """Loss-free balancing: the router bias is not a param (no gradient reaches it: it only steers the
    top-k choice), and on a skewed router (a fresh one sends 33 to 239 assignments per expert here) each
    update lowers the most loaded expert's bias and the spread of the load falls. A sign update on one
    fixed batch ends in a two-step cycle whose size follows the rate (0.02 here cycles between CVs of 0.04
    and 0.27), so the rate is small and the whole cycle is checked."""
    cfg, m, rules, ss = setup(["mesh.fsdp=1", "model.router_bias_rate=0.005", "optim.lr=1e-9"], 1)
    assert ss.abstract.extras["router_bias"].shape == (cfg.model.n_layers, 4)
    assert "router_bias" not in str(jax.tree.structure(ss.abstract.opt_state))
    state = ss.init_fn(cfg.seed)()
    batch = next(make_loader(cfg, ss.abstract_batch))
    g_bias = jax.jit(jax.grad(lambda b: ss.recipe.forward.token_losses(
        ss.model_params(state.replace(extras={"router_bias": b})), batch)[0].sum()))(state.extras["router_bias"])
    assert not np.any(np.asarray(g_bias))
    compiled = compile_step(cfg, ss)
    cvs, loads = [], []
    for _ in range(14):  # lr ~ 0: only the bias moves; the same batch each time
        state, out = compiled(state, batch)
        loads.append(np.asarray(out["moe_load"]))
        cvs.append(float(np.mean(loads[-1].std(-1) / loads[-1].mean(-1))))
    top = loads[0].argmax(-1)
    assert cvs[0] > 0.3 and np.all(np.asarray(state.extras["router_bias"])[np.arange(len(top)), top] < 0)
    assert max(cvs[-4:]) < 0.25 * cvs[0], cvs


def test_expert_load_metrics_and_idle_experts_are_logged_once():
    track = metrics.ExpertLoad(idle_steps=2)
    load = np.array([[4.0, 4.0, 0.0, 8.0], [4.0, 4.0, 4.0, 4.0]])
    fields, lines = track(load)
    assert fields["moe_load_min"] == [0.0, 4.0] and fields["moe_load_max"] == [8.0, 4.0]
    assert fields["moe_load_cv"] == [round(float(np.std(load[0]) / 4.0), 4), 0.0]
    assert lines == []
    assert track(load)[1] == ["moe: expert 2 of layer 0 has received no tokens for 2 steps (a dead expert; "
                              "router_bias_rate or router_aux_loss balance the load)"]
    assert track(load)[1] == []  # once


RUN = ["configs/tiny.yml", *SMALL, *MOE, "model.router_bias_rate=0.01", "model.capacity_factor=1.0",
       "model.shared_experts=1", "model.router_z_loss=0.001", "log_every=1", "sample_tokens=0", "checkpoint.every=3",
       "optim.decay_steps=6", "eval.every=0"]


def moe_run(run_dir, *extra, devices=8):
    r = run_cli(*RUN, f"run_dir={run_dir}", *extra, devices=devices)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def expert_parallel_run(tmp_path_factory):
    """6 steps with every routing option on an expert-parallel mesh, and the same stopped after 3."""
    full, half = tmp_path_factory.mktemp("moe_full"), tmp_path_factory.mktemp("moe_half")
    mesh = ["mesh.fsdp=2", "mesh.expert=4"]
    return moe_run(full, "steps=6", *mesh), full, moe_run(half, "steps=3", *mesh), half


@pytest.mark.slow  # ~30 s: three CLI runs
def test_moe_run_reports_load_and_drops_and_resumes_bitwise(expert_parallel_run, tmp_path):
    """Through the CLI: the log names the dispatch, metrics.jsonl carries the per-layer load and the
    capacity's drops, the bias is checkpointed (it moved), and a run resumed at step 3 ends bit for bit
    where the uninterrupted one did, bias included."""
    r, full, _, half = expert_parallel_run
    assert "moe: tokens sorted by expert, grouped matmul by a blocked batched matmul" in r.stdout
    assert "experts split 4 ways, rows exchanged by a padded all-to-all" in r.stdout
    rows = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    layers = len(rows[0]["moe_load_cv"])
    assert layers == 2 and all(len(row["moe_load_min"]) == layers for row in rows)
    assert all(row["moe_dropped"] >= 0 for row in rows) and any(row["moe_dropped"] > 0 for row in rows)
    state = final_state(full, 6)
    bias = next(v for k, v in state.items() if "router_bias" in k)
    assert bias.shape == (2, 4) and np.abs(bias).max() > 0
    run_dir = tmp_path / "resumed"
    shutil.copytree(half, run_dir)
    moe_run(run_dir, "steps=6", "mesh.fsdp=2", "mesh.expert=4")
    assert_same_state(final_state(run_dir, 6), state)


@pytest.mark.slow
def test_moe_checkpoint_reshards_onto_another_expert_mesh(expert_parallel_run, tmp_path):
    """The step-3 checkpoint of the expert=4 run continues on expert=2 x tensor=2 (and the losses track)."""
    _, full, _, half = expert_parallel_run
    run_dir = tmp_path / "reshard"
    shutil.copytree(half, run_dir)
    r = moe_run(run_dir, "steps=6", "mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2")
    assert "restored resharded onto" in r.stdout
    got = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(line)["loss"] for line in (full / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(got, want, rtol=2e-4)


@pytest.mark.slow  # the run above, and a subprocess
def test_a_router_bias_is_never_dropped_silently(expert_parallel_run, tmp_path):
    """The bias is train state: the notebook API refuses such a checkpoint (logits would differ without
    it), and HF export refuses the run in one line (its first refusal here is the shared expert;
    test_family_qwen3 checks the bias's own)."""
    import maxlm
    from maxlm.config import ConfigError
    _, full, _, _ = expert_parallel_run
    with pytest.raises(ConfigError, match="trained with model.router_bias_rate > 0") as e:
        maxlm.from_pretrained(full)
    assert "\n" not in str(e.value)
    r = run_cli_module("maxlm.convert.to_hf", "--checkpoint", str(full), "--out", str(tmp_path / "hf"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cannot be exported" in r.stderr, r.stderr[-500:]
    assert not (tmp_path / "hf").exists()


def run_cli_module(module, *args):
    import subprocess
    import sys
    from conftest import ROOT, cli_env
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                          timeout=300)


# A tiny Mixtral's train step compiled by libtpu for v5p-16 (expert=4 x fsdp=2, bfloat16), once per
# model.expert_grad_dtype: each collective of its compiled HLO as (kind, dtype, elements). XLA:CPU cannot
# show this: it promotes every bfloat16 collective to float32 (its reduce-scatters' `_promoted` regions).
EXPERT_COLLECTIVES = """
import json, math, re, sys
from maxlm import aot, config, hardware
from maxlm import recipe as recipe_lib
from maxlm.state import StateSpec
out = {}
for choice in ("float32", "bfloat16"):
    cfg = config.load("configs/tiny.yml", ["dry_run=true", "compile_topology=v5p-16", "mesh.fsdp=2", "mesh.expert=4",
                                           "dtype=bfloat16", "seq_len=32", "global_batch_size=8", "model.n_layers=1",
                                           *sys.argv[1:], f"model.expert_grad_dtype={choice}"])
    hw = hardware.Hardware(cfg)
    hlo = aot.compile_step(cfg, StateSpec(recipe_lib.build(cfg, hw.mesh), hw.mesh, hw.rules)).as_text()
    # A collective's result is one array or a tuple of them (libtpu combines small sums into one all-reduce).
    ops = re.findall(r"^\\s*\\S+ = (.*?) (all-gather|reduce-scatter|all-reduce)(?:-start)?\\(", hlo, re.M)
    out[choice] = [(kind, t, math.prod(int(x) for x in d.split(",") if x))
                   for res, kind in ops for t, d in re.findall(r"(\\w+)\\[([0-9,]*)\\]", res)]
print(json.dumps(out))
"""


def test_expert_weights_gather_in_the_compute_dtype_and_reduce_in_the_chosen_one():
    """The bytes, not only the numbers: in the compiled step the experts' weights (E_loc x D x F = 1 x 256
    x 192 elements each, a size no other weight has) are gathered over fsdp in bfloat16, the compute dtype,
    not as their float32 masters; their gradients are summed over fsdp in float32 by default and in
    bfloat16 with model.expert_grad_dtype=bfloat16 (libtpu writes some of those sums as all-reduces
    of the whole gradient, the others as reduce-scatters to each device's half)."""
    import subprocess
    import sys
    from conftest import ROOT, cli_env
    r = subprocess.run([sys.executable, "-c", EXPERT_COLLECTIVES, *MOE[:2], "model.d_ff=192"], cwd=ROOT, env=cli_env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    whole, half = 256 * 192, 256 * 192 // 2
    for choice, dtype in (("float32", "f32"), ("bfloat16", "bf16")):
        gathers = [t for kind, t, n in got[choice] if kind == "all-gather" and n == whole]
        sums = [t for kind, t, n in got[choice] if (kind, n) in {("reduce-scatter", half), ("all-reduce", whole)}]
        assert gathers == ["bf16"] * 3, (choice, got[choice])  # w_gate, w_up, w_down
        assert sums == [dtype] * 3, (choice, got[choice])
