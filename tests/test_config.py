import os

import pytest

from maxlm import config, remat
from maxlm.config import ConfigError, load

TINY = "configs/tiny.yml"


def test_every_base_key_has_a_comment():
    for line in config.BASE.read_text().splitlines():
        s = line.strip()
        if s and not s.startswith(("#", "-")) and ":" in s:
            assert "#" in line, f"base.yml key without a one-line comment: {line!r}"


def test_tiny_inherits_base_and_overrides():
    cfg = load(TINY)
    assert cfg.dtype == "float32" and cfg.model.d_model == 256
    assert cfg.optim.b2 == 0.95  # inherited from base.yml


def test_overrides_are_typed():
    cfg = load(TINY, ["steps=7", "optim.lr=3e-4", "dry_run=true", "run_dir=2024", "mesh.tensor=2",
                      "sharding_rules=[[batch, [data, fsdp]], [embed, null]]", "optim.weight_decay=0"])
    assert cfg.steps == 7 and isinstance(cfg.steps, int)
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.dry_run is True
    assert cfg.run_dir == os.path.join(os.getcwd(), "2024")  # a string, made absolute against the cwd
    assert cfg.optim.weight_decay == 0.0 and isinstance(cfg.optim.weight_decay, float)
    assert tuple(cfg.sharding_rules[0]) == ("batch", ("data", "fsdp"))


def test_yaml_float_without_dot(tmp_path):
    p = tmp_path / "c.yml"
    p.write_text(f"base_config: {config.BASE}\noptim:\n  lr: 1e-3\n")
    assert load(p).optim.lr == pytest.approx(1e-3)


def test_base_config_chain_is_relative_to_the_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.yml").write_text(f"base_config: {config.BASE}\nsteps: 11\nseed: 3\n")
    (tmp_path / "sub" / "b.yml").write_text("base_config: ../a.yml\nsteps: 12\n")
    cfg = load(tmp_path / "sub" / "b.yml")
    assert (cfg.steps, cfg.seed) == (12, 3)


def test_base_config_cycle(tmp_path):
    (tmp_path / "a.yml").write_text("base_config: b.yml\n")
    (tmp_path / "b.yml").write_text("base_config: a.yml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load(tmp_path / "a.yml")


@pytest.mark.malformed
@pytest.mark.parametrize("override, message", [
    ("stepz=3", "did you mean `steps`"),
    ("model.d_modl=3", "did you mean `model.d_model`"),
    ("steps=abc", "`steps` must be int"),
    ("steps=1.5", "`steps` must be int"),
    ("dry_run=3", "`dry_run` must be bool"),
    ("model=3", "is a section"),
    ("dtype=float16", "`dtype` must be one of float32, bfloat16"),
    ("remat=ful", "did you mean full"),
    ("global_batch_size=10", "divisible by `microbatches`"),
    ("model.n_kv_heads=3", "multiple of `model.n_kv_heads`"),
    ("mesh.data=0", "positive size or -1"),
    ("sharding_rules=[[batch, model]]", "mesh axes from"),
    ("compile_topology=v5p-8", "add dry_run=true"),
    ("steps", "key=value"),
    ("resume=always", "`resume` must be one of auto, never"),
    ("nan_policy=skp", "did you mean skip"),
    ("data.source=arrayrecord", r"`data.source`: `arrayrecord` is now called `prepared` \(it reads every directory made "
                                r"by maxlm.data.prepare, old ones too\); set data.source=prepared$"),
    ("checkpoint.every=-1", "`checkpoint.every` must be >= 0"),
    ("checkpoint.keep=0", "`checkpoint.keep` must be > 0"),
    ("optim.decay_steps=-5", "`optim.decay_steps` must be >= 0"),
    ("model.router_score=sigmod", "did you mean sigmoid"),
    ("model.shared_experts=1", "`model.shared_experts`=1 applies to MoE models, and model.family=llama is dense"),
    ("model.capacity_factor=-1.0", "`model.capacity_factor` must be >= 0"),
])
def test_bad_overrides_are_one_line_errors(override, message):
    overrides = [override] + (["microbatches=4"] if "microbatches" in message else [])
    with pytest.raises(ConfigError, match=message) as e:
        load(TINY, overrides)
    assert "\n" not in str(e.value)


@pytest.mark.malformed
def test_unknown_key_in_file(tmp_path):
    p = tmp_path / "c.yml"
    p.write_text(f"base_config: {config.BASE}\noptim:\n  learning_rate: 1.0\n")
    with pytest.raises(ConfigError, match="unknown config key `optim.learning_rate`"):
        load(p)


def test_saved_config_reloads_identically(tmp_path):
    cfg = load(TINY, ["steps=9", "mesh.tensor=2"])
    p = tmp_path / "config.yml"
    p.write_text(config.to_yaml(cfg))
    assert load(p) == cfg


def test_remat_names_match_the_implementation():
    assert set(config.REMAT) == {"none", *remat.POLICIES}


def test_config_module_does_not_import_jax():
    import subprocess
    import sys
    code = "import sys; import maxlm.config; sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=config.BASE.parent.parent).returncode == 0


def test_from_saved_fills_keys_added_since_and_says_so():
    saved = config.to_dict(load(TINY, ["steps=7"]))
    del saved["profile_steps"], saved["model"]["qk_norm"]  # a config written before these keys existed
    said = []
    cfg = config.from_saved(saved, "ckpt/7", log=said.append)
    assert cfg.steps == 7 and cfg.profile_steps == () and cfg.model.qk_norm is False
    assert said == ["ckpt/7: the saved config predates `profile_steps`, `model.qk_norm`; today's defaults apply"]


@pytest.mark.malformed
def test_from_saved_refuses_a_key_that_no_longer_exists():
    saved = config.to_dict(load(TINY))
    saved["optim"]["nesterov"] = True  # a key an older maxlm had
    with pytest.raises(ConfigError, match=r"^ckpt/7: the saved config has `optim.nesterov`, which this version of "
                                          r"maxlm does not know \(it was removed or renamed\)"):
        config.from_saved(saved, "ckpt/7")
    with pytest.raises(ConfigError, match="the saved config is a list"):
        config.from_saved([], "ckpt/7")


def test_from_saved_keeps_free_form_keys_and_validates():
    saved = config.to_dict(load(TINY, ["data.source=mixture", "data.mixture={a: {source: pydoc, weight: 2}}"]))
    assert config.from_saved(saved, "x").data.mixture.a.weight == 2
    saved["optim"]["b2"] = 2.0
    with pytest.raises(ConfigError, match=r"`optim.b2` must be in \[0, 1\)"):
        config.from_saved(saved, "x")


def test_replace_validates_what_it_derives():
    cfg = load(TINY)
    assert config.replace(cfg, {"data": {"epochs": 1}}).data.epochs == 1
    with pytest.raises(ConfigError, match="unknown config key `data.epoch`"):
        config.replace(cfg, {"data": {"epoch": 1}})
    with pytest.raises(ConfigError, match="`data.epochs` must be >= 0"):
        config.replace(cfg, {"data": {"epochs": -1}})


@pytest.mark.parametrize("value, ok", [("[]", True), ("[3, 5]", True), ("[4, 4]", True), ("[5, 3]", False),
                                       ("[0, 2]", False), ("[1]", False), ("[1, 2, 3]", False), ("[a, b]", False)])
def test_profile_steps(value, ok):
    if ok:
        load(TINY, [f"profile_steps={value}"])
    else:
        with pytest.raises(ConfigError, match="`profile_steps` must be"):
            load(TINY, [f"profile_steps={value}"])



def test_a_saved_rule_table_gains_the_logical_axes_added_since():
    """A run saved before a logical axis existed (its rule table has no `stack` row) reloads with that axis's
    default rule, and says so; the rows it has keep their mapping."""
    saved = config.to_dict(load("configs/tiny.yml", ["sharding_rules=[[batch, [data, fsdp, expert]], [length, context], "
                                                     "[embed, fsdp], [vocab, tensor], [heads, tensor], [kv_heads, tensor], "
                                                     "[head_dim, null], [mlp, tensor], [layers, stage], [experts, expert], "
                                                     "[matrices, [stage, fsdp, tensor]], [stack, null]]"]))
    saved["sharding_rules"] = [r for r in saved["sharding_rules"] if r[0] != "stack"]
    logs = []
    cfg = config.from_saved(saved, "an old run", log=logs.append)
    rules = {r[0]: r[1] for r in cfg.sharding_rules}
    assert rules["stack"] is None and rules["embed"] == "fsdp" and rules["layers"] == "stage"
    assert any("sharding_rules: [stack, ...]" in line for line in logs), logs
