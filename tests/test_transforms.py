"""The transform seam (maxlm.transforms): what each feature declares, the one TrainState shape, the
checkpoint layout it keeps, and a resume that switches a transform on or off."""

import dataclasses

import jax
import numpy as np
import pytest

from maxlm import mesh as mesh_lib, recipe as recipe_lib, sharding
from maxlm.config import load
from maxlm.state import StateSpec, TrainState

MOE = ["model.family=mixtral", "model.n_experts=4", "model.router_bias_rate=0.001"]


def spec(overrides):
    cfg = load("configs/tiny.yml", overrides)
    m = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, 1), jax.devices()[:1])
    return cfg, StateSpec(recipe_lib.build(cfg, m), m, sharding.rules(cfg))


def test_build_order_and_extras():
    cfg, ss = spec(MOE + ["lora.rank=4", "quantization=fp8"])
    assert [t.name for t in ss.transforms] == ["lora", "fp8", "router bias"]  # the order they attach
    assert {k: e.saved for k, e in ss.extra_specs.items()} == {"frozen": False, "fp8": True, "router_bias": True}
    assert [k for k, e in ss.extra_specs.items() if e.merge] == ["fp8"]  # differentiated through
    # DPO alone keeps the reference as `frozen`; under LoRA the reference is LoRA's base, one copy.
    _, dpo = spec(["objective=dpo", "data.format=preference", "data.source=jsonl", "data.path=x.jsonl", "data.chat_template=chatml", "lora.rank=4"])
    assert [t.name for t in dpo.transforms] == ["lora"] and list(dpo.extra_specs) == ["frozen"]
    _, plain = spec([])
    assert plain.transforms == () and plain.extra_specs == {} and plain.specs is plain.base_specs


def test_train_state_is_params_opt_state_step_rng_and_extras():
    """No train state rides inside the param tree: the router bias and FP8 state are extras, attached only
    for the forward."""
    assert [f.name for f in dataclasses.fields(TrainState)] == ["step", "params", "opt_state", "rng", "extras"]
    _, ss = spec(MOE + ["quantization=fp8"])
    assert "router_bias" not in ss.abstract.params["layers"]
    ran = ss.model_params(ss.abstract)["layers"]
    assert ran["router_bias"].shape == (4, 4) and type(ran["wq"]).__name__ == "Fp8"


def test_checkpoint_layout_1_is_kept():
    """The on-disk tree is layout 1's, which TrainState's old fields fixed: core arrays and each saved
    extra at the top, None for router_bias/frozen/fp8 when absent. Checkpoints written before the seam
    restore unchanged (checked against one written by that code, benchmarks/RESULTS.md)."""
    _, ss = spec(MOE + ["lora.rank=4"])
    disk = ss.on_disk(ss.saved)
    assert sorted(disk) == ["fp8", "frozen", "opt_state", "params", "rng", "router_bias", "step"]
    assert disk["fp8"] is None and disk["frozen"] is None and disk["router_bias"].shape == (4, 4)
    assert ss.from_disk(disk, ss.saved) == ss.saved


def test_a_resume_that_switches_a_transform_starts_or_drops_its_state():
    cfg_off, off = spec(MOE[:2])
    cfg_on, on = spec(MOE)
    state = off.init_fn(0)()
    was, now = recipe_lib.saved_transforms(cfg_off, on.base_specs), recipe_lib.saved_transforms(cfg_on, off.base_specs)
    restored = on.saved_under(was)
    assert "router_bias" not in restored.extras  # what the checkpoint holds is read as it was written
    state_on, notes = on.resumed(state, was)
    np.testing.assert_array_equal(state_on.extras["router_bias"], np.zeros((4, 4)))
    assert notes == ["model.router_bias_rate 0 -> 0.001 at this resume: the router bias starts at zero"]
    back, notes = off.resumed(state_on, now)
    assert back.extras == {} and "the checkpoint's router bias is dropped" in notes[0]


@pytest.mark.malformed
def test_check_refuses_the_device():
    _, ss = spec(["quantization=fp8"])
    fake = type("Device", (), {"platform": "tpu", "device_kind": "TPU v5p"})()
    with pytest.raises(Exception, match="quantization=fp8 needs an NVIDIA GPU"):
        for t in ss.transforms:
            t.check(fake)
