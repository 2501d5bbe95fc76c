"""Everything a run computes with, built once from the config and the mesh: the model as the step runs it,
the transforms, the objective, the schedule, the optimizer with its learning-rate schedule, and the batch.
The train step, the state (StateSpec) and the compiled eval step take the built `Recipe`, and read no
config; the notebook API and the lm-eval bridge take it for the model they run.
"""

from typing import Any, NamedTuple

import jax.numpy as jnp
import optax

from maxlm import data, models, objectives, optim, remat, schedules, transforms
from maxlm.objectives import grpo
from maxlm.batch import Schema
from maxlm.forward import Forward


class Recipe(NamedTuple):
    forward: Forward          # the model as the step runs it: family, model config, dtype, kernel, remat, loss
    base_specs: dict          # the model's parameter spec tree (models.params)
    transforms: tuple         # LoRA, FP8, the router bias, the reference model (maxlm.transforms)
    specs: dict               # the trained parameters' spec tree (under LoRA, the adapters')
    objective: Any            # what the step minimises (maxlm.objectives)
    schedule: Any             # how it runs over microbatches and stages (maxlm.schedules)
    tx: optax.GradientTransformation
    lr: optax.Schedule        # the learning rate at each optimizer step, for the metrics
    batch: Schema             # the batch the step takes (maxlm.batch)
    skip_nonfinite: bool      # nan_policy=skip: a step whose loss or gradient is not finite changes nothing

    @property
    def model(self):
        """The model's config section (what every family function takes)."""
        return self.forward.m


def build(cfg, mesh=None) -> Recipe:
    """The run's recipe: `mesh` sets the pipeline stages (its `stage` axis); without one, none."""
    family = models.get(cfg.model.family)
    base_specs = family.param_specs(cfg.model)
    stages = 1 if mesh is None else mesh.shape.get("stage", 1)
    batch = data.schema(cfg)
    if cfg.objective == "grpo":  # rollouts: the packed rows plus each completion's advantage and old log-probabilities
        batch = Schema((*batch.fields, *grpo.fields(cfg.seq_len)), batch.rows)
    schedule = schedules.build(cfg.microbatches, stages, cfg.pipeline_repeats, batch.axes)
    objective = objectives.build(cfg)
    batch.check(objective.fields, f"objective={cfg.objective}")
    ts = transforms.build(cfg, base_specs, schedule.layout, objective.reference)
    specs = transforms.trained_specs(ts, base_specs)
    forward = Forward(family, cfg.model, jnp.dtype(cfg.dtype), cfg.attention, remat.wrap(cfg.remat), cfg.chunked_loss)
    return Recipe(forward, base_specs, ts, specs, objective, schedule, optim.optimizer(cfg, specs), optim.schedule(cfg),
                  batch, cfg.nan_policy == "skip")


def saved_transforms(saved_cfg, base_specs) -> tuple:
    """The transforms of the run that wrote a checkpoint (`saved_cfg`, its config): what extras it holds.
    FP8 or the router bias may have been switched on or off since."""
    layout = schedules.Layout(saved_cfg.mesh.stage, saved_cfg.pipeline_repeats)
    return transforms.build(saved_cfg, base_specs, layout, objectives.build(saved_cfg).reference)

