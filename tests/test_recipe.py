"""The recipe and its seams (maxlm.recipe, maxlm.objectives, maxlm.batch, layers.dense's weight nodes): a new
objective reading a new float batch field, and a new weight node, plug in without a change anywhere else;
and the house rules that keep it so (the step, the state and the loop read no config). That a run builds its
recipe once is checked in test_train.py, in a run made there anyway."""

import ast
import dataclasses
import functools
import pathlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import mesh as mesh_lib, recipe as recipe_lib, schedules, sharding, step as step_lib
from maxlm.aot import compile_step
from maxlm.batch import Field, Schema
from maxlm.config import ConfigError, load
from maxlm.data import make_loader
from maxlm.lora import Lora
from maxlm.layers.dense import WeightNode, dense, innermost, wrap_innermost
from maxlm.objectives import Terms, masked_tokens
from maxlm.state import StateSpec

SRC = pathlib.Path(__file__).resolve().parent.parent / "maxlm"
SMALL = ["model.n_layers=1", "seq_len=32", "global_batch_size=8", "optim.schedule=constant", "optim.warmup_steps=0"]


# ---- an objective that reads a float field of its own, declared here and nowhere else ----

WEIGHT = Field("weight", (), "float32", ("batch",))  # one float per sequence (a reward, an advantage)


class Weighted(NamedTuple):
    """Each sequence's summed cross-entropy times its weight, over the batch's kept tokens."""
    fields = ("inputs", "targets", "positions", "segment_ids", "loss_mask", "weight")
    reference = False
    tokens = staticmethod(masked_tokens)

    @staticmethod
    def denominator(batch):
        return jnp.maximum(masked_tokens(batch), 1.0)

    def terms(self, forward, params, ref, mb, denom, stack) -> Terms:
        s = forward.token_losses(params, mb, stack)
        loss = jnp.sum(mb["weight"][:, None] * s.tok_BL) / denom
        # a metric is a share like the loss (summed over microbatches): the kept tokens' mean weight
        return Terms(loss, 0.0, s.aux, s.moe, {"token_weight": jnp.sum(mb["weight"][:, None] * mb["loss_mask"]) / denom})


def weighted(cfg, mesh):
    """The run's recipe with the objective above and the data's schema plus its field: composed, not edited."""
    r = recipe_lib.build(cfg, mesh)
    batch = Schema((*r.batch.fields, WEIGHT), r.batch.rows)
    batch.check(Weighted.fields, "the weighted objective")
    sched = schedules.build(cfg.microbatches, mesh.shape["stage"], cfg.pipeline_repeats, batch.axes)
    return r._replace(objective=Weighted(), batch=batch, schedule=sched)


def weighted_run(overrides, n_devices, params=None):
    """The weighted objective's loss, metrics and gradients on one batch: from the mesh's own initial params
    through the compiled train step, or at host `params` through the gradient program alone."""
    cfg = load("configs/tiny.yml", SMALL + overrides)
    m = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, n_devices), jax.devices()[:n_devices])
    rules = sharding.rules(cfg)
    ss = StateSpec(weighted(cfg, m), m, rules)
    assert ss.abstract_batch["weight"].shape == (8,) and ss.abstract_batch["weight"].dtype == jnp.float32
    # the token loader fills the fields it yields; the weight comes from elsewhere (a reward model, say)
    tokens = next(make_loader(cfg, {k: a for k, a in ss.abstract_batch.items() if k != "weight"}))
    w = np.linspace(0.0, 2.0, 8, dtype=np.float32)
    batch = {**tokens, "weight": jax.device_put(w, ss.abstract_batch["weight"].sharding)}
    state = ss.init_fn(0)()
    init = jax.device_get(state.params)
    metrics = None
    if params is None:  # the compiled train step takes the field: its state and batch carry it
        metrics = jax.device_get(compile_step(cfg, ss)(state, batch)[1])
    with sharding.use(m, rules):
        at = jax.device_put(init if params is None else params, ss.shardings.params)
        out = jax.jit(lambda p, b: step_lib.grads(p, b, ss.recipe))(at, batch)
    metrics = metrics or {"loss": out.loss, **out.metrics}
    return jax.device_get(metrics), jax.device_get(out.grads), init, jax.device_get(tokens), w, ss.recipe


def test_a_new_objective_with_a_float_field_needs_no_other_change():
    """A fourth objective and a per-sequence float field, both declared in this file: the state lays the
    field out, the compiled step takes it, microbatches split it, and another mesh gives the same loss and
    gradients."""
    one, g_one, init, tokens, w, r = weighted_run(["mesh.fsdp=1"], 1)
    # the loss is the objective's: the cross-entropy weighted per sequence, over the kept tokens
    tok = np.asarray(jax.jit(r.forward.token_losses)(init, tokens).tok_BL, np.float64)
    mask = np.asarray(tokens["loss_mask"], np.float64)
    assert float(one["loss"]) == pytest.approx((w[:, None] * tok).sum() / mask.sum(), rel=1e-5)
    assert float(one["token_weight"]) == pytest.approx((w[:, None] * mask).sum() / mask.sum(), rel=1e-6)
    four, g_four, *_ = weighted_run(["mesh.fsdp=2", "mesh.tensor=2", "microbatches=2"], 4, init)
    assert float(four["loss"]) == pytest.approx(float(one["loss"]), rel=1e-5)
    assert float(four["token_weight"]) == pytest.approx(float(one["token_weight"]), rel=1e-6)
    for a, b in zip(jax.tree.leaves(g_four), jax.tree.leaves(g_one)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


@pytest.mark.malformed
def test_an_objective_that_needs_a_field_the_data_lacks_is_one_line():
    r = recipe_lib.build(load("configs/tiny.yml", SMALL))
    with pytest.raises(ConfigError, match=r"^the weighted objective reads the batch fields weight, which this data "
                                          r"does not have \(it has inputs, targets, positions, segment_ids, loss_mask\)$"):
        r.batch.check(Weighted.fields, "the weighted objective")


# ---- a weight node of its own: nodes nest without knowing each other ----

@functools.partial(jax.tree_util.register_dataclass, data_fields=["w"], meta_fields=["s"])
@dataclasses.dataclass
class Scaled(WeightNode):
    w: Any
    s: float = 2.0

    def matmul(self, eq, x, out_dtype=None):
        return self.s * dense(eq, x, self.w, out_dtype=out_dtype)


def test_weight_nodes_compose_through_dense():
    """`dense` hands a node its own matmul; a node multiplies its inner weight through `dense` again, so LoRA
    over a node LoRA has never heard of (as over FP8), and that node over LoRA, both compute what they say."""
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=(4, 5)).astype(np.float32)
    a, b = rng.normal(size=(4, 2)).astype(np.float32), rng.normal(size=(2, 5)).astype(np.float32)
    lora = Lora(w, a, b, scale=0.5)
    inner = wrap_innermost(lora, lambda v: Scaled(v, 3.0))  # Lora(w=Scaled(w)): the base scaled, the adapters not
    assert isinstance(inner, Lora) and isinstance(inner.w, Scaled) and innermost(inner) is w
    np.testing.assert_allclose(dense("bd,df->bf", x, inner), 3 * x @ w + 0.5 * x @ a @ b, rtol=1e-5)
    np.testing.assert_allclose(dense("bd,df->bf", x, Scaled(lora, 3.0)), 3 * (x @ w + 0.5 * x @ a @ b), rtol=1e-5)
    np.testing.assert_allclose(dense("bd,df->bf", x, w), x @ w, rtol=1e-6)


# ---- the house rules ----

def _source(rel: str) -> ast.Module:
    return ast.parse((SRC / rel).read_text())


@pytest.mark.parametrize("rel", ["step.py", "state.py", "loop.py"])
def test_step_state_and_loop_read_no_config(rel):
    """Everything they use is built before (maxlm.recipe, maxlm.train): no `cfg` name, no config import."""
    tree = _source(rel)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {a.arg for n in ast.walk(tree)
                                                                         if isinstance(n, ast.arguments) for a in n.args}
    assert "cfg" not in names
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names} | \
               {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"config", "maxlm.config"}


def test_only_the_schedules_import_the_pipeline_and_only_a_node_s_module_recognises_it():
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        text = path.read_text()
        if not rel.startswith("schedules/"):
            assert "schedules.pipeline" not in text and "schedules import pipeline" not in text, rel
        for node, home in (("Lora", "lora.py"), ("Fp8", "fp8.py")):
            if rel != home:
                assert f"isinstance(w, {node})" not in text and f", {node})" not in text, (rel, node)

