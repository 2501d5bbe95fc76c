"""maxlm.optim: Muon against a float64 NumPy reference, which weights it takes and how it sees each one as
a stack of matrices, its mesh invariance and bitwise resume; the WSD schedule's shapes and extension."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import run_and_resume
from test_step import MESHES, assert_trees_close

from maxlm import checkpoint as ckpt, mesh as mesh_lib, models, optim, recipe as recipe_lib, sharding
from maxlm.config import load
from maxlm.errors import ConfigError
from maxlm.data import make_loader
from maxlm.models import params as P_
from maxlm.aot import compile_step
from maxlm.state import StateSpec

MUON = ["optim.name=muon", "optim.schedule=constant", "optim.warmup_steps=0"]
# Mixtral-like: attention [L, D, H, Dh] and [L, H, Dh, D], experts [L, E, D, F], a router, norms, embed, head.
MOE = ["model.family=mixtral", "model.n_experts=4", "model.experts_per_token=2", "model.n_layers=2",
       "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=8", "model.d_ff=48"]


# ---- Muon's arithmetic -------------------------------------------------------------------------------

def newton_schulz64(x):
    """The published quintic iteration (Keller Jordan's coefficients, 5 steps) on one float64 matrix."""
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (np.linalg.norm(x) + 1e-7)
    for _ in range(5):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x.T if tall else x


def per_matrix(x, d, f):
    """f on every matrix of x, one at a time: fan-in axes x fan-out axes, every other axis indexed."""
    red, out = tuple(d.reduction_axis), tuple(d.output_axis)
    batch = [i for i in range(x.ndim) if i not in red + out]
    kept = sorted(red + out)  # the axes left after indexing the batch ones, in x's order
    perm = [kept.index(i) for i in red + out]
    y = np.empty_like(x)
    for idx in np.ndindex(*(x.shape[i] for i in batch)):
        at = [slice(None)] * x.ndim
        for i, j in zip(batch, idx):
            at[i] = j
        m = x[tuple(at)].transpose(perm)
        y[tuple(at)] = f(m.reshape(math.prod(m.shape[:len(red)]), -1)).reshape(m.shape).transpose(np.argsort(perm))
    return y


def reference(p, grads, d, decayed, o):
    """One parameter after len(grads) steps, in float64: Muon (EMA momentum 0.95, Nesterov, orthogonalised,
    times 0.2 sqrt(max(fan_in, fan_out))) where d is given, else AdamW; decoupled decay, constant lr."""
    p, m, v = p.astype(np.float64), np.zeros(p.shape), np.zeros(p.shape)
    for t, g in enumerate(grads, 1):
        g = g.astype(np.float64)
        if d is None:
            m, v = o.b1 * m + (1 - o.b1) * g, o.b2 * v + (1 - o.b2) * g * g
            u = m / (1 - o.b1 ** t) / (np.sqrt(v / (1 - o.b2 ** t)) + o.eps)
        else:
            m = 0.95 * m + 0.05 * g
            fan_in, fan_out = (math.prod(p.shape[i] for i in axes) for axes in (d.reduction_axis, d.output_axis))
            u = per_matrix(0.95 * m + 0.05 * g, d, newton_schulz64) * 0.2 * math.sqrt(max(fan_in, fan_out))
        p = p - o.lr * (u + o.weight_decay * decayed * p)
    return p


def random_like(specs, seed: int, std: float = 1.0):
    """Normal float32 arrays shaped like the params (NumPy's: drawing with JAX compiles once per shape)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: (std * rng.standard_normal(s.shape)).astype(np.float32), specs, is_leaf=P_.is_param)


def test_muon_matches_a_float64_reference():
    """Three steps of optim.optimizer (muon) on a tiny MoE model's params with random gradients: every
    parameter ends where the float64 reference puts it, Muon's and AdamW's alike."""
    cfg = load("configs/tiny.yml", MUON + MOE + ["optim.lr=0.01", "optim.grad_clip=0"])
    specs = models.get("mixtral").param_specs(cfg.model)
    tx = optim.optimizer(cfg, specs)
    p0 = jax.tree.map(lambda s, x: x + 1.0 * (not P_.is_drawn(s)), specs, random_like(specs, 0, std=0.02),
                      is_leaf=P_.is_param)  # norm gains near 1
    grads = [random_like(specs, s) for s in (1, 2, 3)]

    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s
    p, s = p0, tx.init(p0)
    for g in grads:
        p, s = step(p, s, g)
    dims = jax.tree.leaves(optim.muon_dims(specs), is_leaf=optim._is_dims)
    decayed = jax.tree.leaves(optim.decay_mask(specs))
    leaves = zip(*(jax.tree.leaves(t) for t in (p0, p, *grads)))
    for (a, b, *gs), d, dec, path in zip(leaves, dims, decayed, jax.tree_util.tree_flatten_with_path(p0)[0]):
        want = reference(np.asarray(a), [np.asarray(g) for g in gs], d, dec, cfg.optim) - a
        np.testing.assert_allclose(np.asarray(b) - a, want, rtol=1e-4, atol=1e-5 * np.abs(want).max(),
                                   err_msg=jax.tree_util.keystr(path[0]))


def test_stacked_layers_and_experts_are_orthogonalised_per_matrix():
    """Each layer's (and each expert's) matrix gets its own orthogonalised update, whatever the scale of its
    gradient: layers and experts whose gradients differ by 1e6 all come out with singular values near 1.
    Orthogonalising a flattened stack would leave the small ones near 0."""
    specs = {"layers": {"wo": P_.Param((3, 2, 4, 16), ("layers", "heads", "head_dim", "embed"), P_.normal(1.0)),
                        "w_up": P_.Param((2, 3, 4, 16), ("layers", "experts", "embed", "mlp"), P_.normal(1.0))}}
    g = random_like(specs, 0)
    g["layers"]["wo"] = g["layers"]["wo"] * jnp.array([1.0, 1e-3, 1e3])[:, None, None, None]
    g["layers"]["w_up"] = g["layers"]["w_up"] * (10.0 ** jnp.arange(-3.0, 3.0).reshape(2, 3))[:, :, None, None]
    dims = optim.muon_dims(specs)
    tx = optim.scale_by_muon_adamw(dims, 0.9, 0.95, 1e-8)
    u = jax.jit(tx.update)(g, tx.init(g))[0]
    for name, d in dims["layers"].items():
        sv = singular_values(np.asarray(u["layers"][name]) / optim.muon_scale(specs["layers"][name].shape, d), d)
        assert 0.5 < sv.min() and sv.max() < 1.5, (name, sv.min(), sv.max())
    # The check has teeth: the same stack orthogonalised as one matrix (layers joining the fan-in) fails it.
    flat = optim.MuonDimensionNumbers((0, 1, 2), (3,))
    assert singular_values(np.asarray(optim.orthogonalise(g["layers"]["wo"], flat)), dims["layers"]["wo"]).min() < 0.01


def singular_values(x, d):
    """Every singular value of every matrix of x."""
    out = []
    per_matrix(x, d, lambda m: out.append(np.linalg.svd(m, compute_uv=False)) or m)
    return np.concatenate(out)


def labels(specs) -> dict:
    """'muon' or 'adamw' for each parameter, by its path."""
    dims = jax.tree_util.tree_flatten_with_path(optim.muon_dims(specs), is_leaf=optim._is_dims)[0]
    return {jax.tree_util.keystr(p, simple=True, separator="."): "adamw" if d is None else "muon" for p, d in dims}


def test_which_weights_muon_trains():
    """Muon takes the layers' hidden matrices, with the right fan-in and fan-out axes; AdamW the embedding,
    the head, norms, biases, sinks, the router, GPT-2's position table and the constant-initialised rest."""
    llama = load("configs/tiny.yml", ["model.qkv_bias=true", "model.attn_sinks=true"]).model
    got = labels(models.get("llama").param_specs(llama))
    assert {k for k, v in got.items() if v == "muon"} == {
        f"layers.{n}" for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
    assert {k for k, v in got.items() if v == "adamw"} == {"embed", "unembed", "final_norm", *(
        f"layers.{n}" for n in ("attn_norm", "mlp_norm", "bq", "bk", "bv", "sinks"))}
    moe = load("configs/tiny.yml", MOE + ["model.shared_experts=1"]).model
    got = labels(models.get("mixtral").param_specs(moe))
    assert got["layers.router"] == "adamw" and got["embed"] == got["unembed"] == "adamw"
    assert all(got[f"layers.{n}"] == "muon" for n in ("w_gate", "w_up", "w_down", "shared_gate", "shared_down"))
    dims = optim.muon_dims(models.get("mixtral").param_specs(moe))["layers"]
    M = optim.MuonDimensionNumbers
    assert dims["wq"] == M((1,), (2, 3)) and dims["wo"] == M((1, 2), (3,))  # [L, D, H, Dh], [L, H, Dh, D]
    assert dims["w_up"] == M((2,), (3,)) and dims["w_down"] == M((2,), (3,))  # [L, E, D, F], [L, E, F, D]
    ds = load("configs/tiny.yml", ["model.family=deepseek_v3", "model.n_kv_heads=8", "model.n_experts=4",
                                   "model.mla.q_rank=16", "model.mla.kv_rank=16", "model.mla.rope_dim=8",
                                   "model.mtp_depth=1", "model.dense_layers=1", "model.dense_d_ff=64"]).model
    got = labels(models.get("deepseek_v3").param_specs(ds))
    assert all(got[f"layers.{n}"] == "muon" for n in ("wq_a", "wq_b", "wkv_a", "wk_b", "wv_b", "wk_rope", "wo"))
    assert all(got[n] == "adamw" for n in ("layers.q_norm", "layers.kv_norm", "layers.score_bias", "layers.router"))
    assert got["mtp.w_eh"] == got["dense_layers.w_up"] == "muon"
    assert optim.muon_dims(models.get("deepseek_v3").param_specs(ds))["mtp"]["w_eh"] == M((1,), (2,))  # [N, 2D, D]
    gpt2 = load("configs/tiny.yml", ["model.family=gpt2", "model.n_kv_heads=8"]).model
    got = labels(models.get("gpt2").param_specs(gpt2))
    assert got["positions"] == got["layers.b_in"] == got["layers.bq"] == "adamw" and got["layers.w_out"] == "muon"


# ---- Mesh invariance and resume ----------------------------------------------------------------------

SMALL = MUON + MOE + ["optim.lr=1e-3", "seq_len=32", "global_batch_size=8"]


def train3(overrides, n_devices=8):
    """Losses and params after 3 steps, one compile."""
    cfg = load("configs/tiny.yml", SMALL + list(overrides))
    devices = jax.devices()[:n_devices]
    m = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, len(devices)), devices)
    ss = StateSpec(recipe_lib.build(cfg, m), m, sharding.rules(cfg))
    compiled = compile_step(cfg, ss)
    loader = make_loader(cfg, ss.abstract_batch)
    state, losses = ss.init_fn(cfg.seed)(), []
    for _ in range(3):
        state, metrics = compiled(state, next(loader))
        losses.append(float(metrics["loss"]))  # blocks every step
    return np.array(losses), jax.device_get(state.params)


@pytest.fixture(scope="module")
def one_device():
    return train3(["mesh.fsdp=1"], n_devices=1)


def test_muon_is_mesh_invariant(one_device):
    """Newton-Schulz on sharded matrices (the model width split over fsdp, heads and the MLP over tensor,
    experts over expert, all at once) gives one device's losses and params after 3 steps. (A data split leaves
    every matrix whole on each device: the batch split is test_step's; the matrices' own moves are
    test_newton_schulz_moves_whole_matrices_rather_than_gathering_them's.)"""
    losses, params = train3(["mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"])
    np.testing.assert_allclose(losses, one_device[0], rtol=1e-5)
    assert_trees_close(params, one_device[1], rtol=1e-5)


def collectives(overrides) -> dict:
    """{kind: count} of the compiled train step's collectives on 4 devices, fsdp=2 x tensor=2 (a tiny dense model,
    4 layers)."""
    import re
    cfg = load("configs/tiny.yml", [*MUON, "model.n_layers=4", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2",
                                    "model.head_dim=8", "model.d_ff=64", "seq_len=16", "global_batch_size=4",
                                    "mesh.fsdp=2", "mesh.tensor=2", *overrides])
    m = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, 4), jax.devices()[:4])
    hlo = compile_step(cfg, StateSpec(recipe_lib.build(cfg, m), m, sharding.rules(cfg))).as_text()
    kinds = re.findall(r" (all-gather|all-reduce|reduce-scatter|all-to-all)(?:-start)?\(", hlo)
    return {k: kinds.count(k) for k in set(kinds)}


def test_newton_schulz_moves_whole_matrices_rather_than_gathering_them():
    """Each device orthogonalises whole matrices of its share of the stack (optim.whole_matrices), the fsdp and
    the tensor shards moved one at a time: Muon's step has AdamW's all-gathers and all-reduces, plus
    all-to-alls. Without the resharding, or with both axes moved at once, GSPMD gathers every sharded
    momentum matrix (Llama-3-8B, v5p-8: 78-80 GiB per chip per step; benchmarks/RESULTS.md)."""
    adamw, muon = collectives(["optim.name=adamw"]), collectives([])
    assert muon.get("all-gather", 0) == adamw.get("all-gather", 0), (adamw, muon)
    assert muon.get("all-reduce", 0) == adamw.get("all-reduce", 0), (adamw, muon)
    assert muon.get("all-to-all", 0) > adamw.get("all-to-all", 0), (adamw, muon)


RESUME = MUON + ["model.n_layers=1", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=8",
                 "model.d_ff=64", "seq_len=32", "global_batch_size=8", "sample_tokens=0"]


def saved_state(run_dir, step):
    """A step's saved state as host arrays, read back as Orbax wrote it (no model, no mesh)."""
    import orbax.checkpoint as ocp
    ck = ckpt.Checkpointer(str(run_dir / "checkpoints"), read_only=True)
    state = ck.mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore())).state
    ck.close()
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def test_muon_resumes_bitwise_and_its_state_reshards(tmp_path):
    """4 steps saving at 2, and a copy resumed from step 2: the same losses and final state (params,
    momentum, AdamW moments) bit for bit. The step-2 state restored onto another mesh holds the same bytes,
    each slot sharded like its parameter there."""
    rows_a, rows_b, a, b = run_and_resume("configs/tiny.yml", RESUME, tmp_path)
    assert [r["loss"] for r in rows_a][2:] == [r["loss"] for r in rows_b][-2:]
    want, got = saved_state(a, 4), saved_state(b, 4)
    assert want.keys() == got.keys() and any("momentum" in k for k in want)
    assert all(want[k].tobytes() == got[k].tobytes() for k in want)

    _, here = restored(a, 2, [])
    ss, there = restored(a, 2, MESHES["data2_fsdp2_tensor2"])
    for x, y in zip(jax.tree.leaves(here), jax.tree.leaves(there), strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    for x, want in zip(jax.tree.leaves(there.opt_state), jax.tree.leaves(ss.shardings.opt_state), strict=True):
        assert x.sharding.is_equivalent_to(want, x.ndim)
    shard = lambda state: state.opt_state[1][0].momentum["layers"]["wq"].addressable_shards[0].data.shape  # noqa: E731
    assert (shard(here), shard(there)) == ((1, 32 // 8, 4, 8), (1, 32 // 2, 4 // 2, 8))  # wq [L, D, H, Dh]: fsdp, tensor


def restored(run_dir, step, mesh):
    """(StateSpec, the step's state restored onto `mesh`, all 8 devices), as a resume restores it."""
    cfg = load("configs/tiny.yml", RESUME + mesh)
    m = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, 8), jax.devices())
    ss = StateSpec(recipe_lib.build(cfg, m), m, sharding.rules(cfg))
    ck = ckpt.Checkpointer(str(run_dir / "checkpoints"), read_only=True)
    state = ss.restore(ck, step)[0]
    ck.close()
    return ss, state


# ---- WSD ---------------------------------------------------------------------------------------------

def lrs(*overrides, steps=1000):
    cfg = load("configs/tiny.yml", ["optim.schedule=wsd", "optim.lr=1.0", f"steps={steps}", *overrides])
    return np.asarray(jax.vmap(optim.schedule(cfg))(jnp.arange(steps + 1)))


@pytest.mark.parametrize("shape, middle", [("linear", 0.5), ("sqrt", 1 - math.sqrt(0.5)), ("cosine", 0.5)])
def test_wsd_shapes(shape, middle):
    """Warmup to lr at warmup_steps, lr until steps - decay_steps, then down to lr * min_lr_ratio at `steps`
    along the shape, never rising; halfway through the decay the shape's own midpoint."""
    lr = lrs("optim.warmup_steps=100", "optim.decay_steps=200", "optim.min_lr_ratio=0.1", f"optim.decay_shape={shape}")
    np.testing.assert_allclose(lr[[0, 50, 100, 500, 800]], [0, 0.5, 1, 1, 1], rtol=1e-6)
    np.testing.assert_allclose(lr[900], 0.1 + 0.9 * middle, rtol=1e-6)
    np.testing.assert_allclose(lr[1000], 0.1, rtol=1e-6)
    assert (np.diff(lr[100:]) <= 0).all() and lr[801] < 1


def test_wsd_extended_before_its_decay_changes_nothing_trained():
    """A run extended (steps raised) before its decay began: every step up to the old decay start has
    exactly the old learning rate; the decay then starts decay_steps before the new end."""
    old = lrs("optim.warmup_steps=100", "optim.decay_steps=200", steps=1000)
    new = lrs("optim.warmup_steps=100", "optim.decay_steps=200", steps=3000)
    np.testing.assert_array_equal(new[:800], old[:800])
    assert old[900] < 1 and new[900] == new[2800] == 1 and new[2900] < 1
    constant = lrs("optim.warmup_steps=100", "optim.schedule=constant")
    np.testing.assert_array_equal(old[:800], constant[:800])  # the same warmup as the other schedules


@pytest.mark.malformed
def test_wsd_without_decay_steps_decays_over_the_last_tenth_and_says_so():
    """MaxText's default: decay_steps = steps // 10, chosen at load and logged; then the same schedule as
    with decay_steps set to it."""
    notes = []
    cfg = load("configs/tiny.yml", ["optim.schedule=wsd", "steps=1000"], notes)
    assert cfg.optim.decay_steps == 100
    assert notes == ["optim.decay_steps: 100 (a tenth of steps=1000, the default for optim.schedule=wsd; set "
                     "optim.decay_steps to choose the final decay's length)"]
    np.testing.assert_array_equal(lrs("optim.warmup_steps=30"), lrs("optim.warmup_steps=30", "optim.decay_steps=100"))
    assert load("configs/tiny.yml", ["optim.schedule=wsd", "steps=1000", "optim.decay_steps=7"]).optim.decay_steps == 7


@pytest.mark.malformed
def test_cosine_decay_steps_within_the_warmup_is_refused_only_once_the_run_passes_it():
    """decay_steps <= warmup_steps drops lr to its floor in one step at the warmup's end: refused when the
    run goes past the warmup, kept for a short run that ends inside it (it never reaches the cliff)."""
    with pytest.raises(ConfigError, match=r"decay_steps=20 must exceed warmup_steps=30"):
        load("configs/tiny.yml", ["optim.decay_steps=20", "steps=100"])
    assert load("configs/tiny.yml", ["optim.decay_steps=20", "steps=24"]).optim.decay_steps == 20
    assert load("configs/tiny.yml", ["optim.decay_steps=31", "steps=100"]).optim.decay_steps == 31
