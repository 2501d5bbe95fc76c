"""Pipeline parallelism over the `stage` mesh axis (maxlm/schedules/pipeline.py), GPipe and circular: the same
losses and gradients as one device, each stage holding only its layers (checked in the compiled HLO, not
only by the losses), the start-up line, and checkpoints that move between stage counts and orders."""

import json
import math
import re

import jax
import numpy as np
import pytest
from test_step import FAMILIES, assert_trees_close, run

import train
from maxlm import checkpoint as ckpt, mesh as mesh_lib, recipe as recipe_lib, sharding
from maxlm import config
from maxlm.config import load
from maxlm.convert import peft
from maxlm.schedules import layout, pipeline
from maxlm.aot import compile_step
from maxlm.state import StateSpec

LAYERS = ["model.n_layers=4"]


@pytest.fixture(scope="module")
def single_device():
    return run(LAYERS + ["mesh.fsdp=1"], n_devices=1, n_steps=0)


# (overrides, devices); microbatches is the pipeline's M, pipeline_repeats its R. The circular schedule alone
# on 2 devices is in every circular case below, beside the splits.
MESHES = {
    "stage4_fsdp2_remat": (["mesh.stage=4", "mesh.fsdp=2", "microbatches=4", "remat=full"], 8),
    "stage2_data2_tensor2": (["mesh.stage=2", "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=2", "microbatches=2"], 8),
    "stage2_fsdp2_tensor2_circular_m4": (["mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2", "microbatches=4",
                                          "pipeline_repeats=2"], 8),
    # the context ring inside each stage: each sequence split over 2 devices of the stage
    "stage2_context2_fsdp2_circular": (["mesh.stage=2", "mesh.context=2", "mesh.fsdp=2", "microbatches=2",
                                        "pipeline_repeats=2"], 8),
}


@pytest.mark.parametrize("name", MESHES)
def test_mesh_invariance(single_device, name):
    """Pipelined vs one device (no microbatches): the loss to rtol 1e-5 and the gradients elementwise to
    rtol 1e-5 (float32), at the same parameters. A circular run holds its
    layer stacks in the pipeline's storage order: the parameters go in, and the gradients come out, through
    that order. The train step around the pipeline's gradients (the optimizer update of stage-split
    layers) runs 3 steps against fsdp in test_circular_through_the_cli, through train.py, on the
    stage2_fsdp2_tensor2_circular_m4 mesh."""
    overrides, n = MESHES[name]
    order = (2 if "stage2" in name else 4, 2 if "circular" in name else 1)
    at = layout.reorder(single_device["params"], (order[0], 1), order)
    out = run(LAYERS + overrides, n_devices=n, n_steps=0, grads_at=at)
    np.testing.assert_allclose(out["losses"], single_device["losses"], rtol=1e-5)
    assert_trees_close(layout.reorder(out["grads_at"], order, (order[0], 1)), single_device["grads"], rtol=1e-5)


@pytest.fixture(scope="module")
def moe_one_device():
    """Mixtral's loss, balance loss, per-layer loads and gradients on one device, at its initial params."""
    import test_moe
    from maxlm.data import make_loader

    one = test_moe.setup(LAYERS + ["mesh.fsdp=1"], 1)
    params = jax.device_get(one[3].init_fn(0)().params)
    batch = jax.device_get(next(make_loader(one[0], one[3].abstract_batch)))
    return params, batch, test_moe.loss_and_grads(*one, params, batch)


MOE_STAGES = ["mesh.stage=2", "mesh.fsdp=2", "mesh.expert=2", "microbatches=2", "pipeline_repeats=2"]


def test_moe_through_the_stages(moe_one_device):
    """Mixtral with its experts split over `expert` inside each of 2 circular stages (tokens exchanged by
    all-to-all in the stage's devices): the loss, the balance loss, every layer's expert load (summed over the
    pipeline's microbatches, as one pass over the batch gives it) and the gradients equal one device's. (GPipe
    is the same schedule with one chunk; the circular order is the one that can misplace a layer's load.)"""
    import test_moe

    params, batch, ref = moe_one_device
    order = (2, 2)
    out = test_moe.loss_and_grads(*test_moe.setup(LAYERS + MOE_STAGES, 8), layout.reorder(params, (2, 1), order), batch)
    np.testing.assert_allclose([out["loss"], out["aux"]], [ref["loss"], ref["aux"]], rtol=1e-5)
    np.testing.assert_allclose(out["load"], ref["load"], rtol=1e-6)
    assert_trees_close(layout.reorder(out["grads"], order, (2, 1)), ref["grads"], rtol=1e-5)


def test_router_bias_through_circular_stages():
    """Loss-free balancing (the router bias, train state with a row per MoE layer) under the circular
    schedule, which holds every layer stack in its storage order: the bias rows must be held in that order
    too, and each moved by its own layer's load. 3 steps at a rate that changes which experts are chosen:
    the losses and the final bias (in layer order) equal one device's. The compiled step keeps the experts'
    all-to-all inside a stage and gathers no layer across stages."""
    import test_moe
    from maxlm.data import make_loader

    def train(overrides, n):
        cfg, m, ss = spec(test_moe.MOE + ["model.router_bias_rate=0.05", *overrides], n)
        step, loader, state = compile_step(cfg, ss), make_loader(cfg, ss.abstract_batch), ss.init_fn(0)()
        losses = []
        for _ in range(3):
            state, metrics = step(state, next(loader))
            losses.append(float(metrics["loss"]))  # blocks every step
        return np.array(losses), ss.layout.natural(jax.device_get(state.extras)), step, m

    one_l, one, _, _ = train(["mesh.fsdp=1"], 1)
    out_l, out, step, m = train(MOE_STAGES, 8)
    assert len({tuple(r) for r in one["router_bias"][1:3]}) == 2  # the layers a circular stage holds swapped differ
    np.testing.assert_array_equal(out["router_bias"], one["router_bias"])
    np.testing.assert_allclose(out_l, one_l, rtol=1e-5)
    found = stage_collectives(step, m)
    assert not layer_gathers(found, 4) and "all-to-all" not in {op for op, _ in found}, found
    assert " all-to-all(" in step.as_text()  # it is there, between the stage's expert shards


def test_storage_order():
    """Circular: stage s runs chunk r as layers r*S*K + s*K + k, and holds its R chunks in its own block."""
    assert layout.storage_order(8, 2, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]  # K=2: stage 0 runs 0-1, 4-5
    assert layout.storage_order(8, 4, 1).tolist() == list(range(8))
    a = np.arange(24).reshape(12, 2)
    s = layout.to_storage(a, 2, 3)
    np.testing.assert_array_equal(s, a[layout.storage_order(12, 2, 3)])
    np.testing.assert_array_equal(layout.to_natural(s, 2, 3), a)
    tree = {"layers": {"w": a}, "embed": a, "opt": ({"layers": {"w": a}},)}
    moved = layout.reorder(tree, (1, 1), (2, 3))
    np.testing.assert_array_equal(moved["layers"]["w"], s)
    np.testing.assert_array_equal(moved["opt"][0]["layers"]["w"], s)
    np.testing.assert_array_equal(moved["embed"], a)
    np.testing.assert_array_equal(layout.reorder(moved, (2, 3), (3, 2))["layers"]["w"], layout.to_storage(a, 3, 2))


def test_layer_pattern_uses_true_layer_indices():
    """Gemma 3's alternating local/global layers with their own RoPE: stage s must run layers s*K + k
    as those layers (a stage that restarted its indices at 0 would attend globally where it should not)."""
    g = FAMILIES["gemma3"]  # 4 layers
    ref = run(g + ["mesh.fsdp=1"], n_devices=1, n_steps=0)
    # one layer per stage, so a stage that numbered its layers from 0 would make layers 1 and 3 local
    out = run(g + ["mesh.stage=4", "mesh.fsdp=1", "microbatches=4"], n_devices=4, n_steps=0, grads_at=ref["params"])
    np.testing.assert_allclose(out["losses"], ref["losses"], rtol=1e-5)
    assert_trees_close(out["grads_at"], ref["grads"], rtol=1e-5)


def test_deepseek_v3_dense_layers_and_mtp_run_beside_the_stages():
    """DeepSeek-V3's dense first layer and its multi-token prediction module run whole on every stage, as
    the embedding and head do, while its 4 MoE layers go through 2 stages x 2 circular chunks (experts split
    inside each stage): the loss and gradients equal one device's, and only the MoE stack is split."""
    ds = FAMILIES["deepseek_v3"]  # 5 layers: dense_layers=1, mtp_depth=1
    mesh = ["mesh.stage=2", "mesh.fsdp=2", "mesh.expert=2", "microbatches=2", "pipeline_repeats=2"]
    ref = run(ds + ["mesh.fsdp=1"], n_devices=1, n_steps=0)
    out = run(ds + mesh, n_steps=0, grads_at=layout.reorder(ref["params"], (2, 1), (2, 2)))
    np.testing.assert_allclose(out["losses"], ref["losses"], rtol=1e-5)
    assert_trees_close(layout.reorder(out["grads_at"], (2, 2), (2, 1)), ref["grads"], rtol=1e-5)
    shardings = spec(ds + mesh, 8)[2].shardings.params
    assert shardings["layers"]["wkv_a"].spec[0] == "stage"
    assert all(s.spec[0] is None for s in jax.tree.leaves(
        {k: shardings[k] for k in ("dense_layers", "mtp")}, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)))
    assert pipeline.describe(2, 4, 2, 2, ("embedding", "head", "1 dense layer", "1 MTP module")).endswith(
        "(circular, 2 chunks of 1 per stage; embedding, head, 1 dense layer and 1 MTP module replicated over stage)")


def _fp8_step(overrides, n, state=None):
    """FP8 grads twice at the initial params (`state`, host arrays in natural order, or this mesh's own): the
    first fills the amax histories (scales still 1), the second scales by them. Returns the second's loss,
    gradients and next scaling state, the first's scaling state, all in natural order, and the initial state."""
    from maxlm import step as step_lib
    from maxlm.data import make_loader
    cfg, m, ss = spec(["quantization=fp8", *overrides], n)
    natural = ss.layout.natural
    if state is None:
        state = jax.device_get(ss.init_fn(cfg.seed)())
    placed = jax.device_put(ss.layout.store(state), ss.shardings)
    batch = next(make_loader(cfg, ss.abstract_batch))
    with sharding.use(m, sharding.rules(cfg)):
        fn = jax.jit(lambda p, b, s: step_lib.grads(p, b, ss.recipe, {"fp8": s}))
        first = fn(placed.params, batch, placed.extras["fp8"]).next_extras["fp8"]
        out = jax.device_get(fn(placed.params, batch, first))
    return out.loss, natural(out.grads), natural(out.next_extras["fp8"]), natural(jax.device_get(first)), state


def test_fp8_through_the_stages():
    """FP8's scaling state through 2 circular stages with fsdp: each layer's state is used once per microbatch
    at ticks whose gradients the scan would sum (the bubble's too), but its next value is the microbatches'
    maximum, as the train step's microbatches merge it. The loss, the gradients and the next scaling state
    (scales off 1, the histories rolled on one step) equal one device's without microbatches. (GPipe runs the
    same schedule with one chunk; the circular order is the one that can misplace a layer's state.)"""
    one = _fp8_step(["mesh.fsdp=1"], 1)
    loss, grads, state, first, _ = _fp8_step(["mesh.stage=2", "mesh.fsdp=2", "microbatches=2", "pipeline_repeats=2"], 4,
                                             one[4])
    assert_trees_close(first, one[3], rtol=1e-6)
    assert_trees_close(state, one[2], rtol=1e-6)  # summed over the ticks, the scales were 2x and more
    # Simulated FP8 on XLA:CPU turns float32 rounding into whole FP8 steps (e5m2 keeps 2 mantissa bits),
    # so the schedule's other order of operations shows: measured 7e-6 in the loss and up to 2e-2 in the
    # gradients (the same one-device step at -O0 and -O2 differs by 3e-2). Summed states gave 5e-4 and 1e-1.
    np.testing.assert_allclose(loss, one[0], rtol=5e-5)
    for path, a, b in zip(*zip(*jax.tree_util.tree_leaves_with_path(grads)), jax.tree.leaves(one[1])):
        assert np.linalg.norm(a - b) <= 4e-2 * np.linalg.norm(b), jax.tree_util.keystr(path)
    for t, s in one[2]["layers"].items():
        assert (s["scale"] != 1).all() and (s["amax"][..., -1] == one[3]["layers"][t]["amax"][..., 0]).all(), t


# ---- the compiled step: what each device holds and which collectives cross the stage axis ----

OPS = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
_OP = re.compile(r"= (.+?) (" + "|".join(OPS) + r")(?:-start)?\(")


def _groups(line: str, n: int) -> list:
    """The device groups of one HLO collective (each source-target pair is a group of two)."""
    if m := re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line):
        return [[int(v) for v in p.split(",")] for p in re.findall(r"\{(\d+,\d+)\}", m.group(1))]
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line):  # named axes
        sizes = [(k.strip("'"), int(v)) for k, v in (kv.split("=") for kv in m.group(1).split(","))]
        over = {a.strip().strip("'") for a in m.group(2).split(",") if a.strip()}
        keep = [i for i, (a, _) in enumerate(sizes) if a not in over]
        red = [i for i, (a, _) in enumerate(sizes) if a in over]
        ids = np.arange(n).reshape([s for _, s in sizes]).transpose(keep + red)
        return ids.reshape(-1, math.prod(sizes[i][1] for i in red)).tolist()
    if m := re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line):  # iota
        ids = np.arange(n).reshape([int(v) for v in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(v) for v in m.group(3).split(",")])
        return ids.reshape([int(v) for v in m.group(1).split(",")]).tolist()
    if m := re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line):
        return [[int(v) for v in g.split(",") if v] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    raise AssertionError(f"unparsed collective: {line[:200]}")


def stage_collectives(compiled, mesh) -> list[tuple[str, str]]:
    """(op, result shape) of every collective whose device groups span more than one stage."""
    S = mesh.shape["stage"]
    stage_of = {d.id: s for s, row in enumerate(mesh.devices.reshape(S, -1)) for d in row}
    out = []
    for line in compiled.as_text().splitlines():
        if m := _OP.search(line):
            if any(len({stage_of[d] for d in g}) > 1 for g in _groups(line, mesh.size)):
                out.append((m.group(2), m.group(1)))
    return out


def layer_gathers(found, n_layers: int) -> list:
    """All-gathers over the stage axis whose result is a whole layer stack [n_layers, ...]."""
    return [(op, s) for op, s in found if op == "all-gather" and re.match(rf"\(?f32\[{n_layers},\d", s)]


def spec(overrides, n):
    cfg = load("configs/tiny.yml", ["model.n_layers=4", "seq_len=32", "global_batch_size=8", *overrides])
    m = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, n), jax.devices()[:n])
    return cfg, m, StateSpec(recipe_lib.build(cfg, m), m, sharding.rules(cfg))


def compiled(overrides, n):
    cfg, m, ss = spec(overrides, n)
    return compile_step(cfg, ss), m, ss


def _layer_bytes(ss) -> int:
    """Per-device bytes of the layers' params and Adam moments (every leaf with a leading layer axis)."""
    total = 0
    for (path, a), sh in zip(jax.tree_util.tree_flatten_with_path(ss.abstract)[0], jax.tree.leaves(ss.shardings)):
        if "'layers'" in jax.tree_util.keystr(path):
            total += math.prod(sh.shard_shape(a.shape)) * a.dtype.itemsize
    return total


def test_hlo_stage_holds_its_layers_and_only_boundaries_cross():
    """stage=2 x fsdp=2 x tensor=2 against the same fsdp x tensor without stages: (a) the stage axis
    carries collective-permutes of one microbatch's activations and all-reduces (the replicated head's
    input, the input's gradient, the scalars), no all-gather; (b) no all-gather over the stage axis
    returns a whole layer stack, and the same check does fire when the layers are scanned without the
    pipeline (GSPMD then gathers them); (c) each device's layer weights and moments are half, and the
    compiled argument bytes fall by exactly that."""
    c1, m1, ss1 = compiled(["mesh.fsdp=2", "mesh.tensor=2"], 4)
    c2, m2, ss2 = compiled(["mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2", "microbatches=2"], 8)
    found = stage_collectives(c2, m2)
    ops = {op for op, _ in found}
    assert "collective-permute" in ops, found
    # the shifted state buffer: [1 stage, B/M / (data*fsdp) rows, seq, d_model]
    assert any(op == "collective-permute" and s.startswith("f32[1,2,32,256]") for op, s in found), found
    assert ops <= {"collective-permute", "all-reduce"}, found  # the lookup is split per device (layers/embed.py)
    assert not layer_gathers(found, 4), layer_gathers(found, 4)
    for a, sh in zip(jax.tree.leaves(ss2.abstract.params["layers"]), jax.tree.leaves(ss2.shardings.params["layers"])):
        assert sh.shard_shape(a.shape)[0] == 2, (a.shape, sh)  # L/S layers on each device
    lb1, lb2 = _layer_bytes(ss1), _layer_bytes(ss2)
    assert lb2 * 2 == lb1
    a1, a2 = c1.memory_analysis().argument_size_in_bytes, c2.memory_analysis().argument_size_in_bytes
    assert a1 - a2 == lb1 - lb2, (a1, a2, lb1, lb2)

    # Circular (2 chunks of 1 layer per stage, 4 microbatches): the same collectives, no layer moved,
    # the same bytes held; only the shifted buffer's traffic grows with the ticks.
    c4, m4, _ = compiled(["mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2", "microbatches=4", "pipeline_repeats=2"], 8)
    found4 = stage_collectives(c4, m4)
    assert {op for op, _ in found4} <= {"collective-permute", "all-reduce"}, found4
    assert any(op == "collective-permute" and s.startswith("f32[1,1,32,256]") for op, s in found4), found4
    assert not layer_gathers(found4, 4), layer_gathers(found4, 4)
    assert c4.memory_analysis().argument_size_in_bytes == a2

    # the plain layer scan (a recipe built without the mesh's stages) on the same stage-split params
    cfg3, m3, _ = spec(["mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2", "microbatches=2"], 8)
    c3 = compile_step(cfg3, StateSpec(recipe_lib.build(cfg3), m3, sharding.rules(cfg3)))
    assert layer_gathers(stage_collectives(c3, m3), 4), "the check did not see GSPMD gather the stage dimension"


def test_circular_through_the_cli(capfd, tmp_path):
    """train.py with 2 stages x 2 chunks of 2 layers (8 layers, 4 microbatches) on 8 devices against
    fsdp=8 (the circular run with fsdp=2 x tensor=2 inside each stage): the same losses, eval loss and greedy sample (which decodes in natural layer order), and the
    start-up line states the circular schedule's bubble."""
    common = ["configs/tiny.yml", "model.n_layers=8", "seq_len=32", "global_batch_size=8", "steps=3", "log_every=1",
              "eval.every=3", "eval.steps=1", "sample_tokens=6", "checkpoint.every=0"]
    outs = []
    for name, extra in (("fsdp", []), ("circular", ["mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2", "microbatches=4", "pipeline_repeats=2"])):
        rc = train.main(common + extra + [f"run_dir={tmp_path / name}"])
        out, err = capfd.readouterr()
        assert rc == 0, err[-3000:]
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        outs.append((out, [r["loss"] for r in rows if "loss" in r], [r["eval_loss"] for r in rows if "eval_loss" in r]))
    (ref, ref_loss, ref_eval), (got, loss, eval_) = outs
    assert ("pipeline: 2 stages x 4 layers, 4 microbatches, bubble (S-1)/(M*R+S-1) = 11.1% (circular, 2 chunks of 2 "
            "per stage; embedding and head replicated over stage)") in got
    assert len(loss) == 3 and len(eval_) == 1
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(eval_, ref_eval, rtol=1e-5)
    sample = lambda out: out.split("greedy sample:\n")[1].split("\nmaxlm")[0]  # noqa: E731
    assert sample(got) == sample(ref)
    assert pipeline.describe(4, 4, 4) == ("pipeline: 4 stages x 1 layers, 4 microbatches, bubble (S-1)/(M*R+S-1) = "
                                          "42.9% (GPipe; embedding and head replicated over stage)")
    assert pipeline.bubble(4, 4) == pytest.approx(3 / 7) and pipeline.bubble(4, 4, repeats=2) == pytest.approx(3 / 11)


def _bytes(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(jax.device_get(tree))]


def test_checkpoint_moves_between_stage_counts(tmp_path):
    """Params are stored [n_layers, ...] in layer order at any stage count under GPipe: a state saved at
    stage=1 restores bitwise at stage=2, and back. A circular run's checkpoint holds its storage order
    and says so in its config: it restores bitwise into natural order (a resume at stage=1, init_from,
    export), and a natural one into the circular order."""
    _, m1, ss1 = spec(["mesh.fsdp=4"], 4)
    state = ss1.init_fn(0)()
    ck = ckpt.Checkpointer(str(tmp_path / "a"))
    ss1.save(ck, 1, state, {}, ckpt.metadata({}, m1, 1, 0))
    ck.wait()
    _, _, ss2 = spec(["mesh.stage=2", "mesh.fsdp=2", "microbatches=2"], 4)
    got, _, _ = ss2.restore(ckpt.Checkpointer(str(tmp_path / "a")), 1)
    for x, y in zip(jax.tree.leaves(jax.device_get(got)), jax.tree.leaves(jax.device_get(state))):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    assert jax.tree.leaves(got.params["layers"])[0].sharding.spec[0] == "stage"
    ck2 = ckpt.Checkpointer(str(tmp_path / "b"))
    ss2.save(ck2, 1, got, {}, ckpt.metadata({}, m1, 1, 0))
    ck2.wait()
    back, _, _ = ss1.restore(ckpt.Checkpointer(str(tmp_path / "b")), 1)
    for x, y in zip(jax.tree.leaves(jax.device_get(back)), jax.tree.leaves(jax.device_get(state))):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()

    cfg3, _, ss3 = spec(["mesh.stage=2", "mesh.fsdp=2", "microbatches=2", "pipeline_repeats=2"], 4)
    assert ss3.layout == (2, 2)
    circ, _, _ = ss3.restore(ckpt.Checkpointer(str(tmp_path / "a")), 1)
    assert _bytes(circ) == _bytes(layout.reorder(jax.device_get(state), (1, 1), (2, 2)))
    assert _bytes(circ) != _bytes(state)  # the order did move the layers
    np.testing.assert_array_equal(jax.device_get(circ.params["layers"]["w_down"])[1],  # storage row 1 is layer 2
                                  jax.device_get(state.params["layers"]["w_down"])[2])
    ck3 = ckpt.Checkpointer(str(tmp_path / "c"))
    ss3.save(ck3, 1, circ, {}, ckpt.metadata(config.to_dict(cfg3), ss3.mesh, 1, 0))
    ck3.wait()
    assert layout.Layout.saved(ck3.meta(1)["config"]) == (2, 2)
    back, _, _ = ss1.restore(ckpt.Checkpointer(str(tmp_path / "c")), 1)
    assert _bytes(back) == _bytes(state)
    assert _bytes(peft.params_of(ck3, 1, ss1.abstract.params)) == _bytes(state.params)


def test_stages_span_slices():
    """mesh.slices=2 with stage=2: the stage axis, not data, spans the slices (a slice is a block of
    consecutive devices on CPU), so only the stage boundary crosses between them."""
    cfg = load("configs/tiny.yml", ["mesh.slices=2", "mesh.stage=2", "mesh.data=1", "mesh.fsdp=-1"])
    sizes = mesh_lib.mesh_shape(cfg, 8)
    m = mesh_lib.make_mesh(sizes, jax.devices(), slices=2)
    assert dict(m.shape) == {"stage": 2, "data": 1, "fsdp": 4, "tensor": 1, "expert": 1, "context": 1}
    assert [sorted(d.id for d in m.devices[s].flat) for s in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_eval_step_matches_one_device():
    """The eval step (forward only, which splits the batch into `microbatches` itself) through the
    pipeline: the pipeline picks microbatches whose rows still split over fsdp=4 (2 rows each would not)."""
    from maxlm.data import make_loader
    from maxlm.evaluation import compile_eval
    got = []
    for overrides, n in ((["mesh.fsdp=1", "microbatches=2"], 1),
                         (["mesh.stage=2", "mesh.fsdp=4", "microbatches=2"], 8)):
        cfg, m, ss = spec(overrides, n)
        state = ss.init_fn(0)()
        step = compile_eval(ss)
        loss, tokens = step(ss.model_params(state), next(make_loader(cfg, ss.abstract_batch)))
        got.append((float(loss), float(tokens)))
    np.testing.assert_allclose(got[1], got[0], rtol=1e-5)
