"""Held-out evaluation: eval_loss (mean next-token cross-entropy, nats/token) and eval_ppl = exp(eval_loss)
over the same `eval.steps` batches of held-out data every time, so evaluations compare across steps and
across a resume."""

import functools
import math
import time

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from maxlm import sharding
from maxlm.errors import ConfigError
from maxlm.data import make_eval_loader, say
from maxlm.objectives import lm
from maxlm.state import StateSpec


def eval_step(params, batch: dict, recipe) -> tuple[jax.Array, jax.Array]:
    """`lm.loss_sum` of a batch (summed token cross-entropy, token count), forward only, over the batch as the
    train step's schedule runs it (its microbatches, its stages), so it needs no more activation memory
    than training."""
    return recipe.schedule.forward(lambda mb, stack: lm.loss_sum(recipe.forward, params, mb, stack), batch)


def compile_eval(ss: StateSpec):
    """AOT-compile the eval step with the train step's param and batch shardings (nothing donated)."""
    replicated = NamedSharding(ss.mesh, P())
    batch_sh = {k: a.sharding for k, a in ss.abstract_batch.items()}
    fn = jax.jit(functools.partial(eval_step, recipe=ss.recipe), in_shardings=(ss.model_params(ss.shardings), batch_sh),
                 out_shardings=(replicated, replicated))
    with sharding.use(ss.mesh, ss.rule_table):
        return fn.lower(ss.model_params(ss.abstract), ss.abstract_batch).compile()


class Evaluator:
    """`evaluator(params)` -> {eval_loss, eval_ppl, eval_tokens, eval_time_s}. The eval iterator is put back
    at its start before each evaluation, so every evaluation reads the same batches."""

    def __init__(self, cfg, compiled, batch: dict, log=None):
        self.compiled, self.steps, self.every = compiled, cfg.eval.steps, cfg.eval.every
        self.messages: list[str] = []  # what it has said, each line also given to `log` as it happens
        self._log = log or say
        self.loader = make_eval_loader(cfg, batch, log=lambda m: self._say(f"eval {m}"))
        self.start = self.loader.get_state()
        self._short_said = False
        per_pass = self.loader.steps_per_epoch  # None for streaming sources: known after the first pass
        self.batches = per_pass if not self.steps else min(self.steps, per_pass) if per_pass else self.steps
        if per_pass is not None and self.steps > per_pass:
            self._short(per_pass)

    def due(self, step: int) -> bool:
        """Whether an evaluation follows `step` (every `eval.every` steps; the run's end is the loop's call)."""
        return step % self.every == 0

    def _say(self, msg: str) -> None:
        self.messages.append(msg)
        self._log(msg)

    def describe(self) -> str:
        n = f"{self.batches}" if self.batches else "all"
        return f"{self.loader.describe()}; {n} batch(es) per evaluation"

    def _short(self, n: int) -> None:
        self._say(f"eval: the held-out data makes only {n} batch(es) of this size, fewer than eval.steps="
                             f"{self.steps}; each evaluation reads those {n}")
        self._short_said = True

    def __call__(self, params) -> dict:
        t = time.perf_counter()
        self.loader.set_state(self.start)
        total, tokens, n = 0.0, 0.0, 0  # Python floats: the sum over batches is float64 on the host
        while not self.steps or n < self.steps:
            try:
                batch = next(self.loader)
            except StopIteration:
                break
            except ConfigError as e:  # the bad-input budget of the held-out data
                raise ConfigError(f"eval: {e}") from None
            # One batch in flight at a time: fetching each result keeps the host from queueing many
            # executions (deep queues deadlock CPU collectives).
            s, c = jax.device_get(self.compiled(params, batch))
            total, tokens, n = total + float(s), tokens + float(c), n + 1
        if not n:
            raise ConfigError("eval: the held-out data makes no full batch of global_batch_size x seq_len; add "
                              "held-out data, or lower global_batch_size or seq_len")
        if self.steps and n < self.steps and not self._short_said:
            self._short(n)
        self.batches = n
        loss = total / tokens if tokens else math.nan
        return {"eval_loss": loss, "eval_ppl": math.inf if loss > 700 else math.exp(loss), "eval_tokens": tokens,
                "eval_time_s": time.perf_counter() - t}

    def close(self) -> None:
        self.loader.close()
