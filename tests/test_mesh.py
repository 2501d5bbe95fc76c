import itertools

import jax
import pytest
from jax.sharding import AxisType

from maxlm import mesh as mesh_lib, recipe as recipe_lib
from maxlm.config import ConfigError, load
from maxlm.state import StateSpec
from maxlm import sharding


def _sizes(**kw):
    return mesh_lib.mesh_shape(load("configs/tiny.yml", [f"mesh.{k}={v}" for k, v in kw.items()]), 8)


def test_fill_axis():
    assert _sizes(data=2, fsdp=-1, tensor=2) == {"stage": 1, "data": 2, "fsdp": 2, "tensor": 2, "expert": 1, "context": 1}
    assert _sizes(fsdp=-1, context=4)["fsdp"] == 2


def test_product_must_match_devices():
    with pytest.raises(ConfigError, match="has 6 devices but 8 are available"):
        _sizes(data=3, fsdp=2)


def test_make_mesh_names_sizes_and_devices():
    with pytest.raises(ConfigError, match=r"^mesh data=4 x fsdp=4 x tensor=1 x expert=1 has product 16 but 8 "
                                          r"devices are given; make the product 8$"):
        mesh_lib.make_mesh({"data": 4, "fsdp": 4, "tensor": 1, "expert": 1})
    with pytest.raises(ConfigError, match=r"has product 2 but 4 devices are given; make the product 4 \(or pass "
                                          r"devices=jax.devices\(\)\[:2\]\)$"):
        mesh_lib.make_mesh({"data": 2, "fsdp": 1, "tensor": 1, "expert": 1}, jax.devices()[:4])
    with pytest.raises(ConfigError, match="`fsdp` must be a positive integer"):
        mesh_lib.make_mesh({"data": 8, "fsdp": -1, "tensor": 1, "expert": 1})
    with pytest.raises(ConfigError, match="name an unknown axis; the axes are stage, data, fsdp, tensor, expert, context"):
        mesh_lib.make_mesh({"data": 4, "seq": 2})
    assert dict(mesh_lib.make_mesh({"data": 8}).shape) == {"stage": 1, "data": 8, "fsdp": 1, "tensor": 1, "expert": 1, "context": 1}


def test_fill_must_divide():
    with pytest.raises(ConfigError, match="not divisible"):
        _sizes(data=3, fsdp=-1)


def test_seq_len_must_split_into_two_chunks_per_context_device():
    cfg = load("configs/tiny.yml", ["seq_len=36", "mesh.context=4", "mesh.fsdp=2"])
    with pytest.raises(ConfigError, match=r"seq_len=36 must split into 2 x mesh.context = 8 equal chunks"):
        mesh_lib.check_divisibility(cfg, mesh_lib.mesh_shape(cfg, 8))
    cfg = load("configs/tiny.yml", ["seq_len=40", "mesh.context=4", "mesh.fsdp=2"])
    mesh_lib.check_divisibility(cfg, mesh_lib.mesh_shape(cfg, 8))
    cfg = load("configs/tiny.yml", ["seq_len=40", "mesh.context=4", "mesh.fsdp=2", "attention=cudnn"])
    with pytest.raises(ConfigError, match=r"^attention=cudnn cannot run a context-parallel ring"):
        mesh_lib.check_divisibility(cfg, mesh_lib.mesh_shape(cfg, 8))


def test_batch_and_heads_divisibility():
    cfg = load("configs/tiny.yml", ["global_batch_size=4"])
    with pytest.raises(ConfigError, match="data-parallel size"):
        mesh_lib.check_divisibility(cfg, mesh_lib.mesh_shape(cfg, 8))
    cfg = load("configs/tiny.yml", ["model.n_kv_heads=2", "mesh.tensor=4"])
    with pytest.raises(ConfigError, match="n_kv_heads`=2 must be divisible by `mesh.tensor`=4"):
        mesh_lib.check_divisibility(cfg, mesh_lib.mesh_shape(cfg, 8))


def test_mesh_axes_and_mode():
    m = mesh_lib.make_mesh(_sizes(data=2, fsdp=2, tensor=2))
    assert m.axis_names == ("stage", "data", "fsdp", "tensor", "expert", "context")
    assert dict(m.shape) == {"stage": 1, "data": 2, "fsdp": 2, "tensor": 2, "expert": 1, "context": 1}
    assert all(t == AxisType.Auto for t in m.axis_types)
    assert sorted(d.id for d in m.devices.flat) == list(range(8))


def _factorizations(n, k):
    for sizes in itertools.product([1, 2, 4, 8], repeat=k):
        if sizes[0] * sizes[1] * sizes[2] * sizes[3] == n:
            yield sizes


def test_tiny_accepts_every_8_device_mesh_with_tensor_up_to_4():
    meshes = [s for s in _factorizations(8, 4) if s[2] <= 4]
    assert len(meshes) == 19  # (a,b,c,d) exponents summing to 3, minus tensor=8
    for d, f, t, e in meshes:
        cfg = load("configs/tiny.yml", [f"mesh.data={d}", f"mesh.fsdp={f}", f"mesh.tensor={t}", f"mesh.expert={e}"])
        sizes = mesh_lib.mesh_shape(cfg, 8)
        mesh_lib.check_divisibility(cfg, sizes)
        StateSpec(recipe_lib.build(cfg, mesh_lib.make_mesh(sizes)), mesh_lib.make_mesh(sizes), sharding.rules(cfg))  # checks every parameter dimension


@pytest.mark.malformed
def test_indivisible_parameter_is_named():
    cfg = load("configs/tiny.yml", ["model.d_ff=766", "mesh.tensor=4", "mesh.fsdp=2"])
    sizes = mesh_lib.mesh_shape(cfg, 8)
    with pytest.raises(ConfigError, match=r"\['layers'\]\['w_\w+'\] axis `mlp` has size 766"):
        StateSpec(recipe_lib.build(cfg, mesh_lib.make_mesh(sizes)), mesh_lib.make_mesh(sizes), sharding.rules(cfg))
    assert len(jax.devices()) == 8


def test_slices_split_the_data_axis_into_consecutive_device_groups():
    """Without a TPU's slice_index (GPU nodes, CPU), a slice is a consecutive block of devices in process
    order; each data index then lives inside one slice, so fsdp/tensor never cross between slices."""
    m = mesh_lib.make_mesh(_sizes(data=2, fsdp=4), slices=2)
    assert [sorted(d.id for d in m.devices[0, i].flat) for i in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    m4 = mesh_lib.make_mesh(_sizes(data=4, fsdp=2), slices=2)
    assert [sorted(d.id for d in m4.devices[0, 2 * i:2 * i + 2].flat) for i in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("overrides, message", [
    (["mesh.slices=2", "mesh.data=3", "mesh.fsdp=1"], r"`mesh.data`=3 must be a multiple of `mesh.slices`=2"),
    (["mesh.slices=0"], r"`mesh.slices` must be >= 1, got 0"),
])
def test_slices_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load("configs/tiny.yml", overrides)


def test_filled_data_axis_must_cover_the_slices():
    cfg = load("configs/tiny.yml", ["mesh.slices=4", "mesh.data=-1", "mesh.fsdp=4"])
    with pytest.raises(ConfigError, match=r"resolves to data=2, which is not a multiple of mesh.slices=4"):
        mesh_lib.mesh_shape(cfg, 8)
