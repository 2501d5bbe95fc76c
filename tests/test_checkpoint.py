"""maxlm.checkpoint in one process: round trips are bitwise, restore reshards onto any mesh, and a
checkpoint that cannot be used is refused in one line that names the step, the path and the array."""

import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import checkpoint as ckpt, mesh as mesh_lib, recipe as recipe_lib, sharding
from maxlm.config import load
from maxlm.data import make_loader
from maxlm.state import StateSpec
from maxlm.step import train_step
from maxlm.aot import compile_step

SMALL = ["model.n_layers=2", "model.d_model=64", "model.d_ff=128", "model.n_heads=4", "model.n_kv_heads=2",
         "model.head_dim=16", "seq_len=32", "global_batch_size=8"]
STEP = 3


def spec(overrides=(), n_devices=8):
    cfg = load("configs/tiny.yml", SMALL + list(overrides))
    devices = jax.devices()[:n_devices]
    m = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, len(devices)), devices)
    return cfg, m, StateSpec(recipe_lib.build(cfg, m), m, sharding.rules(cfg))


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def assert_bitwise(a, b):
    la, lb = jax.tree.leaves(host(a)), jax.tree.leaves(host(b))
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()  # bit for bit (NaN included)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of step 3 (two real train steps, so the Adam moments are not zeros), saved on fsdp=8."""
    cfg, m, ss = spec(["mesh.fsdp=8"])
    compiled = compile_step(cfg, ss)
    loader = make_loader(cfg, ss.abstract_batch)
    state = ss.init_fn(0)()
    for _ in range(2):
        state, _ = compiled(state, next(loader))
    directory = tmp_path_factory.mktemp("ckpt")
    ck = ckpt.Checkpointer(str(directory))
    ss.save(ck, STEP, state, loader.get_state(), ckpt.metadata({"steps": 7}, m, STEP, 0))
    ck.wait()
    ck.close()
    return directory, host(state), loader.get_state()


@pytest.mark.parametrize("overrides, n_devices", [
    (["mesh.fsdp=8"], 8),
    (["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], 8),
    (["mesh.fsdp=4"], 4),
    ([], 1),
])
def test_restore_is_bitwise_onto_any_mesh(saved, overrides, n_devices):
    directory, state0, data0 = saved
    _, _, ss = spec(overrides, n_devices)
    ck = ckpt.Checkpointer(str(directory))
    assert ck.steps() == [STEP]
    state, data_state, meta = ss.restore(ck, STEP)
    assert_bitwise(state, state0)
    assert data_state == data0 and meta["step"] == STEP and meta["config"] == {"steps": 7}
    assert meta["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1, "expert": 1, "context": 1}
    # Every array lands in the target mesh's sharding, not the one it was saved with.
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(ss.shardings)):
        assert got.sharding == want


def test_restore_params_only(saved):
    directory, state0, _ = saved
    _, _, ss = spec(["mesh.data=2", "mesh.fsdp=4"])
    src, step = ckpt.resolve_init_from(str(directory))
    assert step == STEP
    assert_bitwise(src.restore_params(STEP, ss.abstract.params), state0.params)
    src, step = ckpt.resolve_init_from(str(directory / str(STEP)))  # one step's directory works too
    assert step == STEP


def refusal(directory, overrides) -> str:
    _, _, ss = spec(overrides)
    ck = ckpt.Checkpointer(str(directory))
    with pytest.raises(ckpt.CheckpointError) as e:
        ss.restore(ck, STEP)
    ck.close()
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 600, msg  # one readable line, never a pytree dump
    assert msg.startswith(f"checkpoint step {STEP} at {directory}/{STEP}: "), msg
    assert msg.endswith("or start over with resume=never or a new run_dir"), msg
    return msg


def test_incompatible_shape_names_parameter_and_both_shapes(saved):
    msg = refusal(saved[0], ["model.d_ff=256"])
    assert "`params.layers.w_down` has shape (2, 128, 64) in the checkpoint but (2, 256, 64) in this config" in msg


@pytest.mark.malformed
def test_missing_parameter_is_named(saved):
    msg = refusal(saved[0], ["model.tie_embeddings=true"])
    assert "the checkpoint has `params.unembed` (64, 256), which this config does not" in msg, msg
    assert "optimizer" not in msg


def test_changed_optimizer_structure_is_explained(saved):
    msg = refusal(saved[0], ["optim.grad_clip=0"])
    assert "the optimizer's structure changed" in msg


@pytest.mark.malformed
def test_corrupted_checkpoint_is_refused(saved, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(saved[0], directory)
    for f in (directory / str(STEP) / "state" / "d").iterdir():
        f.write_bytes(b"\0" * 16)  # clobber every data file
    msg = refusal(directory, [])
    # The reason, not only the prefix: damaged, and the root cause naming a clobbered file.
    assert "cannot be read, the checkpoint is damaged (" in msg, msg
    assert f"{directory}/{STEP}/state/d/" in msg and "is not valid for value of size 16" in msg, msg


@pytest.mark.malformed
def test_unreadable_metadata_is_refused(saved, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(saved[0], directory)
    (directory / str(STEP) / "state" / "_METADATA").write_text("{not json")
    assert "metadata cannot be read" in refusal(directory, [])


@pytest.mark.malformed
def test_another_process_count_is_refused(saved, tmp_path):
    import json
    directory = tmp_path / "ckpt"
    shutil.copytree(saved[0], directory)
    meta_file = directory / str(STEP) / "meta" / "metadata"
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "processes": 2}))
    msg = refusal(directory, [])
    assert "it was written by 2 process(es) and this run has 1; data positions are per process" in msg


def test_partial_checkpoints_are_not_steps(saved, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(saved[0], directory)
    (directory / f"9{ckpt.TMP_SUFFIX}" / "state").mkdir(parents=True)
    ck = ckpt.Checkpointer(str(directory))
    assert ck.steps() == [STEP] and [p.name for p in ck.partials()] == [f"9{ckpt.TMP_SUFFIX}"]
    assert ck.remove_partials() == ([f"9{ckpt.TMP_SUFFIX}"], 0.0) and ck.partials() == []


def test_partials_a_live_previous_holder_may_write_are_left_alone(saved, tmp_path, monkeypatch):
    """Taken over from a lease holder that renewed it recently: its save may be in flight, so the partial
    step is named but not deleted (Orbax replaces it when it saves that step)."""
    from maxlm import runlock

    directory = tmp_path / "ckpt"
    shutil.copytree(saved[0], directory)
    (directory / f"9{ckpt.TMP_SUFFIX}" / "state").mkdir(parents=True)
    monkeypatch.setattr(runlock, "_taken_over", {"gs://b/run": time.time() + 60})
    ck = ckpt.Checkpointer(str(directory))
    names, busy = ck.remove_partials()
    assert names == [f"9{ckpt.TMP_SUFFIX}"] and 55 < busy <= 60 and ck.steps() == [STEP]
    assert [p.name for p in ck.partials()] == [f"9{ckpt.TMP_SUFFIX}"]  # still there
    monkeypatch.setattr(runlock, "_taken_over", {"gs://b/run": time.time() - 1})  # that holder's time is up
    assert ck.remove_partials() == ([f"9{ckpt.TMP_SUFFIX}"], 0.0) and ck.partials() == []


def test_init_from_errors(tmp_path):
    with pytest.raises(ckpt.ConfigError, match="does not exist"):
        ckpt.resolve_init_from(str(tmp_path / "nope"))
    with pytest.raises(ckpt.ConfigError, match="holds no committed checkpoint"):
        ckpt.resolve_init_from(str(tmp_path))


def test_nan_skip_leaves_params_and_optimizer_untouched():
    cfg, m, ss = spec(["nan_policy=skip", "mesh.fsdp=8"])
    loader = make_loader(cfg, ss.abstract_batch)
    step = jax.jit(lambda s, b: train_step(s, b, ss.recipe))
    with sharding.use(m, sharding.rules(cfg)):
        state = ss.init_fn(0)()
        state, metrics = step(state, next(loader))  # a finite step updates
        assert int(metrics["skipped"]) == 0
        poisoned = state.replace(params={**state.params, "final_norm": state.params["final_norm"].at[0].set(jnp.nan)})
        before = host(poisoned)
        after, metrics = step(poisoned, next(loader))
    assert int(metrics["skipped"]) == 1 and not np.isfinite(float(metrics["loss"]))
    assert int(after.step) == int(poisoned.step) + 1  # the batch was consumed
    assert_bitwise((after.params, after.opt_state), (before.params, before.opt_state))


def test_keep_newest_and_every_mth(tmp_path):
    _, m, ss = spec(["mesh.fsdp=8"])
    state = ss.init_fn(0)()
    ck = ckpt.Checkpointer(str(tmp_path), keep=2, keep_every=4)
    for step in range(1, 10):
        ss.save(ck, step, state, {"next_index": step}, ckpt.metadata({}, m, step, 0))
    ck.wait()
    assert ck.steps() == [4, 8, 9]  # the newest two (8, 9) and every 4th (4, 8)
    ck.close()
