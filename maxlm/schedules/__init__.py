"""How a train step runs the model over its batch: the schedule owns the forward over microbatches and
value-and-grad, and the order the layer stacks are held in.

A schedule implements:
  layout                     the order its layer stacks are held in (maxlm.schedules.layout.Layout)
  value_and_grad(terms, params, diff, merges, batch) -> (terms, grads, diff's next values)
                             `terms(params, diff, mb, stack) -> objectives.Terms` is one run of the step's
                             function over a microbatch (its loss, side loss, the model's aux loss, MoE
                             statistics and metrics); the schedule differentiates loss + side_loss + aux
                             with respect to (params, diff), where `diff` are the transforms' extras whose
                             gradient is their next value, combined across microbatches by `merges` (by
                             name), and returns the terms summed over the batch (aux as their mean)
  forward(fn, batch)         `fn(mb, stack) -> a tree of sums` over the whole batch, forward only (eval)
  describe(n_layers, whole)  its start-up line, or None (`n_layers` the stack it runs, `whole` the parts of
                             the model beside it)
and hands the model its `stack`: what the family runs its pipelined layer stack with
(models.decoder.run_layers), or None for the plain scan. It reaches the model only through that
argument, as the attention kernel and the remat wrapper do.

`Accumulate` (microbatches one after another, in a scan) and `Pipeline` (GPipe, or circular with
repeats, over mesh.stage) are the two; a new one (1F1B, which owns its backward) is a module beside them
and a line in `build`.
"""

from maxlm.schedules.accumulate import Accumulate, split  # noqa: F401 - the package's API
from maxlm.schedules.layout import Layout  # noqa: F401
from maxlm.schedules.pipeline import Pipeline, stages


def build(microbatches: int, stages: int = 1, repeats: int = 1, axes: dict | None = None):
    """The schedule of a train step: `microbatches` through `stages` pipeline stages (mesh.stage) with
    `repeats` chunks per stage, or accumulated one after another without stages. `axes`: the batch
    fields' logical axes by name, which every microbatch keeps."""
    if stages > 1:
        return Pipeline(stages, microbatches, repeats)
    return Accumulate(microbatches, axes)


def inference_stack():
    """The `stack` for a forward outside training, traced under a mesh (the notebook API, the benchmarks):
    the layers run through the mesh's pipeline stages, if it has any, in natural order (GPipe)."""
    S = stages()
    return Pipeline(S).stack if S > 1 else None
