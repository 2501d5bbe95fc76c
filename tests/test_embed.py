"""The per-device embedding lookup (maxlm/layers/embed.py): the rows and the table's gradient of a plain
lookup on every kind of mesh, a compiled step whose lookup sends nothing between the stages, where GSPMD's
own split gathered it across them, and a tensor-parallel step that GSPMD no longer replicates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import mesh as mesh_lib, sharding
from maxlm.config import load
from maxlm.layers import embed
from maxlm.models import decoder

MESHES = ["mesh.stage=2 mesh.fsdp=4", "mesh.stage=2 mesh.data=2 mesh.fsdp=1 mesh.tensor=2",
          "mesh.stage=2 mesh.context=2 mesh.fsdp=2", "mesh.stage=2 mesh.expert=2 mesh.fsdp=1 mesh.tensor=2",
          "mesh.stage=4 mesh.data=2 mesh.fsdp=1", "mesh.fsdp=4 mesh.tensor=2", "mesh.data=8 mesh.fsdp=1"]


@pytest.mark.parametrize("overrides", MESHES)
def test_rows_and_gradient_equal_a_plain_lookup(overrides):
    """float32: the rows exactly, the table's gradient (summed over the devices that saw other tokens)
    to rounding; a vocabulary split over `tensor` and a sequence split over `context` included."""
    V, D, B, L = 256, 64, 8, 32
    rng = np.random.default_rng(0)
    table, w = rng.normal(size=(V, D)).astype(np.float32), rng.normal(size=(B, L, D)).astype(np.float32)
    tokens = rng.integers(0, V, size=(B, L)).astype(np.int32)
    want = np.zeros_like(table)
    np.add.at(want, tokens, w)
    cfg = load("configs/tiny.yml", overrides.split())
    m, rules = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, 8), jax.devices()[:8]), sharding.rules(cfg)
    with sharding.use(m, rules):
        def f(t, k):
            x = embed.per_device(decoder.lookup, t, k, jnp.float32)
            return jnp.sum(x * w), x
        args = (jax.device_put(table, sharding.named(m, ("vocab", "embed"), rules)),
                jax.device_put(tokens, sharding.named(m, ("batch", "length"), rules)))
        (_, x), g = jax.jit(jax.value_and_grad(f, has_aux=True))(*args)
    np.testing.assert_array_equal(x, table[tokens])
    np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_a_batch_that_does_not_split_is_left_to_the_plain_lookup():
    cfg = load("configs/tiny.yml", ["mesh.stage=2", "mesh.fsdp=4"])
    m, rules = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, 8), jax.devices()[:8]), sharding.rules(cfg)
    with sharding.use(m, rules):
        assert embed.per_device(decoder.lookup, jnp.zeros((256, 64)), jnp.zeros((1, 8), jnp.int32), jnp.float32) is None


def test_a_staged_step_sends_no_lookup_between_the_stages(capfd):
    """GSPMD split the lookup over the idle `stage` axis: an all-gather of its rows and permutes of the
    tokens and the table's gradient between the stages, and XLA's "Involuntary full rematerialization"
    warning. Per device, the step's only stage-crossing collectives are the pipeline's."""
    from test_stages import compiled, stage_collectives

    c, m, _ = compiled(["mesh.stage=2", "mesh.fsdp=4", "microbatches=2", "global_batch_size=16"], 8)
    found = stage_collectives(c, m)
    assert {op for op, _ in found} == {"collective-permute", "all-reduce"}, found
    assert all(s.startswith(("f32[1,2,32,256]", "f32[2,2,32,256]", "(f32[2,2,32,256]")) for _, s in found), found
    assert "Involuntary full rematerialization" not in capfd.readouterr().err


@pytest.mark.parametrize("plain", [False, True], ids=["per_device", "gspmd"])
def test_a_tensor_parallel_step_is_not_replicated(capfd, monkeypatch, plain):
    """fsdp x tensor (the vocabulary split over `tensor`): GSPMD's plain lookup replicates the batch's rows
    before splitting them again, and XLA says so; the per-device lookup does not (the counter-example runs
    the same step with per_device switched off)."""
    from test_stages import compiled

    if plain:
        monkeypatch.setattr(decoder, "per_device", lambda *a: None)
    compiled(["mesh.fsdp=4", "mesh.tensor=2"], 8)
    assert ("Involuntary full rematerialization" in capfd.readouterr().err) == plain
