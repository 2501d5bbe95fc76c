"""Every configs/models/*.yml: it validates, has its published parameter count, and its full-size model
traces (fast, shapes only); its CPU dry run compiles the real train step without allocating (slow)."""

import resource

import jax
import jax.numpy as jnp
import pytest
from conftest import ROOT, run_cli

from maxlm import models
from maxlm.config import load
from maxlm.models import params as P_

CONFIGS = sorted((ROOT / "configs" / "models").glob("*.yml"))
# From each model's Hugging Face release (safetensors metadata / model card).
PUBLISHED = {"llama3-8b": 8_030_261_248, "llama3.1-70b": 70_553_706_496, "llama3.1-405b": 405_853_388_800, "mistral-7b": 7_241_732_096,
             "mixtral-8x7b": 46_702_792_704, "qwen3-8b": 8_190_735_360, "qwen3-30b-a3b": 30_532_122_624,
             "qwen2.5-7b": 7_615_616_512, "gpt-oss-20b": 20_914_757_184, "gemma2-9b": 9_241_705_984,
             "gpt2": 124_439_808}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_model_config_validates_and_traces(path):
    cfg = load(path)
    m = cfg.model
    family = models.get(m.family)
    specs = family.param_specs(m)
    if path.stem in PUBLISHED:
        assert P_.count(specs) == PUBLISHED[path.stem]
    # The forward at full size, traced on shapes alone (nothing allocated, nothing compiled).
    B, L = 1, 64
    ids = jax.ShapeDtypeStruct((B, L), jnp.int32)
    out = jax.eval_shape(lambda p, t, pos, seg: models.apply(p, t, pos, seg, m, jnp.dtype(cfg.dtype)),
                         P_.abstract(specs), ids, ids, ids)
    assert out.logits.shape == (B, L, m.vocab_size) and out.logits.dtype == jnp.float32


@pytest.mark.slow  # 10-25 s each on 2 cores: the compile of a full-size train step
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_model_config_dry_run_on_cpu(path):
    """The real step compiles; then it either fits the 8 fake CPU devices (exit 0) or is refused in one
    line naming what it needs (exit 2), all without allocating the parameters."""
    r = run_cli(str(path.relative_to(ROOT)), "dry_run=true", timeout=600)
    assert "train step compiled in" in r.stdout, r.stderr[-2000:]
    if path.stem in PUBLISHED:
        assert f"parameters {PUBLISHED[path.stem]:,}" in r.stdout
    last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    fits = r.returncode == 0 and "dry run: the step compiles and fits" in r.stdout
    refused = r.returncode == 2 and last.startswith("maxlm: error: the train step needs")
    assert fits or refused, (r.returncode, last)
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2 ** 20 < 4, "the dry run allocated parameters"
