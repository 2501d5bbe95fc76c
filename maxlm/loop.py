"""The training loop: data -> step -> metrics -> checkpoint, with evaluation, profiling and signals at step
boundaries. Everything it uses is built before it starts (maxlm.train); it logs through the `log` it is
given."""

import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax

from maxlm import checkpoint as ckpt, metrics, storage
from maxlm.preemption import Boundary, Interrupted, StopRequest


class TrainingStopped(Exception):
    """The run stopped itself (nan_policy); exit code 3, one line, checkpoints intact."""


class NonFinite(Exception):
    def __init__(self, msg: str, step: int, metrics: dict):
        super().__init__(msg)
        self.msg, self.step, self.metrics = msg, step, metrics


class NanPolicy:
    """nan_policy on one step's metrics: `stop` raises at the first non-finite loss or gradient norm;
    `skip` counts the steps the jitted step discarded and raises after `limit` (max_consecutive_skips) in a
    row. `skips_total`: the skips before this attempt (a resume's)."""

    def __init__(self, policy: str, limit: int, skips_total: int, log: Callable[[str], None]):
        self.policy, self.limit, self.log = policy, limit, log
        self.in_row, self.total = 0, skips_total

    def check(self, step: int, m: dict) -> None:
        bad = f"non-finite loss or gradient at step {step} (loss {m['loss']}, grad_norm {m['grad_norm']})"
        if self.policy == "stop":
            if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
                raise NonFinite(f"{bad} (nan_policy=stop)", step, m)
            return
        self.in_row = self.in_row + 1 if m["skipped"] else 0
        self.total += bool(m["skipped"])
        m["skips_total"] = self.total
        if m["skipped"]:
            self.log(f"{bad}: update skipped ({self.in_row} in a row, max_consecutive_skips={self.limit})")
        if self.in_row >= self.limit:
            raise NonFinite(f"{bad}: {self.in_row} steps skipped in a row (max_consecutive_skips={self.limit})", step, m)


def metrics_row(m_dev: dict, dt: float, *, tokens: int, flops_per_token: float, n_dev: int, peak: float | None,
                data_wait: float, host_s: float | None, skips: dict, source: dict | None = None) -> dict:
    """One step's metrics: the device's scalars plus throughput, TFLOP/s, MFU and host timings; the data's
    skips, and what the batch source reports of the step's batch (`source`: a mixture's shares, a rollout's
    rewards)."""
    m = {k: float(v) for k, v in m_dev.items()}
    tflops = flops_per_token * tokens / dt / n_dev / 1e12
    m.update(step_time_s=dt, tokens_per_sec=tokens / dt, tokens_per_sec_per_device=tokens / dt / n_dev,
             tflops_per_device=tflops, mfu=tflops * 1e12 / peak if peak else None, data_wait_s=data_wait,
             host_time_s=host_s, **{f"data_skipped_{k}": v for k, v in skips.items() if v}, **(source or {}))
    return m


class Profiler:
    """A jax.profiler trace of steps first..last (`profile_steps`), for TensorBoard or Perfetto. The
    trace starts before step `first` is dispatched and stops once step `last` has finished on device.
    For a gs:// run_dir it is traced into a local directory and its files uploaded whole at the end."""

    def __init__(self, steps, out: str, log: Callable[[str], None]):
        self.first, self.last = (steps[0], steps[1]) if steps else (None, None)
        self.out, self.on, self.log = out, False, log
        self.local = tempfile.mkdtemp(prefix="maxlm-profile-") if steps and storage.is_gcs(out) else out

    def before(self, step: int) -> None:
        if step == self.first:
            jax.profiler.start_trace(self.local)
            self.on = True

    def after(self, step: int, m_dev) -> None:
        if self.on and step >= self.last:
            jax.block_until_ready(m_dev)
            jax.profiler.stop_trace()
            self.on = False
            if self.local != self.out:
                storage.upload(self.local, self.out)
            self.log(f"profile of steps {self.first}-{min(step, self.last)} written to {self.out} (tensorboard --logdir "
                f"{self.out}, or open the .xplane.pb / .trace.json.gz in Perfetto)")


def process_age() -> float | None:
    """Seconds since this process started (Linux), or None: imports and the config count as start-up too."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return time.clock_gettime(time.CLOCK_BOOTTIME) - int(after_name[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def startup_report(t: dict) -> tuple[str, dict]:
    """The cost of a (re)start, which preemptible jobs pay again and again (their "goodput" is what is
    left): a line for the log and fields for the first metrics row. `t` holds seconds: join, compile,
    restore or init, first_step (loop start to its metrics), total (process start to then, or None)."""
    state = t.get("restore", t.get("init"))
    fields = {"startup_join_s": t["join"], "startup_compile_s": t["compile"], "startup_restore_s": state,
              "startup_first_step_s": t["first_step"], "startup_total_s": t["total"]}
    total = f"; {t['total']:.1f}s from process start to the first step" if t["total"] is not None else ""
    line = (f"start-up: joined in {t['join']:.1f}s, compiled in {t['compile']:.1f}s, state "
            f"{'restored' if 'restore' in t else 'initialised'} in {state:.1f}s, first step in {t['first_step']:.1f}s{total}")
    return line, fields


# What to check when the watchdog finds the loop waiting too long (maxlm/watchdog.py), by what it waited for.
FIX_COORDINATOR = ("the job's coordinator (process 0) did not answer: check that process 0 is alive and reachable "
                   "(its log's last lines say what it waits for)")
FIX_DATA = ("the data pipeline produced no batch: check that the storage behind data.path answers (a stalled "
            "network file system or bucket) and that data workers are alive; raise watchdog_s if a batch "
            "legitimately takes this long")
FIX_STEP = ("the step did not finish on the device: in a multi-process job another process is usually stuck or gone "
            "(the last lines of its log say what it waits for); otherwise the device or its driver hangs. Raise "
            "watchdog_s only if one step legitimately takes this long")
FIX_SAVE = ("the checkpoint storage did not take the save: check that the storage behind checkpoint.dir answers; "
            "raise watchdog_s if a save legitimately takes this long")
FIX_HARNESS = ("one batch of the benchmarks (eval.harness) did not finish on the device: see the step advice; raise "
               "watchdog_s if one batch legitimately takes this long")
FIX_EVAL = ("the evaluation did not finish (it is one wait, however many batches): check the held-out data's "
            "storage, or lower eval.steps; raise watchdog_s if an evaluation legitimately takes this long")


class Plan(NamedTuple):
    """What the loop is told of the run, worked out from the config before it starts (maxlm.train)."""
    steps: int                # the run's last step
    log_every: int            # a metrics line every so many steps (and at saves, evals and the end)
    tokens: int               # per step: global_batch_size x seq_len
    flops_per_token: float    # metrics.flops_per_token
    peak: float | None        # the device's peak FLOP/s, for MFU (None: not known)
    devices: int
    mesh: Any
    meta: dict                # the config as each checkpoint's metadata records it (config.to_dict)


class Trainer:
    """The loop: data -> step -> metrics -> checkpoint, with evaluation and signals at step boundaries.

    Step s's metrics are read right after step s+1 is dispatched: the device never idles on the host,
    and the host never queues more than one step ahead (deep queues deadlock CPU collectives). Before
    each wait the loop tells its watchdog what it waits for. Saves and evaluations come at the cadence
    their own components keep (the Checkpointer's, the Evaluator's, the Harness's)."""

    def __init__(self, plan: Plan, ss, step_fn, ck, loader, start: int, *, nan: NanPolicy, logger, profiler,
                 watchdog, log: Callable[[str], None], evaluator=None, harness=None, startup: dict | None = None):
        self.plan, self.step_fn, self.ck, self.loader, self.evaluator = plan, step_fn, ck, loader, evaluator
        self.harness = harness  # lm-evaluation-harness benchmarks (maxlm.eval_harness), on their own cadence
        self.log, self.nan, self.logger, self.profiler, self.watchdog = log, nan, logger, profiler, watchdog
        self.ss = ss  # the state's spec: what the model runs with, what a checkpoint holds
        self.start = self.done = start
        self.timer = metrics.StepTimer()
        self.summaries = metrics.summaries()  # a step's array metrics, each made fields and log lines on the host
        self.host_s = None  # the host's own time in the previous loop iteration
        self.saved = {start} if start else set()
        self.state = None
        self.data_state = None  # the data position before a wait for a batch that a signal cut short
        self.startup = startup  # start-up seconds, reported with the first step

    def run(self, state):
        """Train from `start` to `steps` (or a signal, or the end of the data); return (state, stop)."""
        self.state, self.t0 = state, time.perf_counter()
        try:
            # Armed only now: compiling, restoring and starting the data take as long as they take.
            with self.watchdog:
                with StopRequest() as stop:
                    self._loop(stop)
                self.watchdog.mark(f"the checkpoint save of step {self.done} to finish", FIX_SAVE)
                self._committed(self.ck.wait())
            self.log(f"checkpoints in {self.ck.dir} (the last save finished {time.perf_counter() - self._t_end:.1f}s "
                f"after the loop)")
        except NonFinite as e:
            self._committed(self.ck.wait())  # saves already in flight are good: let them commit
            self.logger.step(e.step, e.metrics, log=True)
            last = self.ck.steps()
            keep = (f"the last good checkpoint is step {last[-1]} ({self.ck.step_path(last[-1])})" if last
                    else "no checkpoint was saved")
            raise TrainingStopped(f"{e.msg}; stopped; {keep}") from None
        finally:
            self.logger.close()
        self.loop_s = self._t_end - self.t0
        return self.state, stop

    def _loop(self, stop) -> None:
        steps, pending = self.plan.steps, None
        self.boundary = Boundary(stop)
        self.ck.start_clock()
        self.timer.lap()
        for step in range(self.start, steps):
            if jax.process_count() > 1:
                self.watchdog.mark(f"the coordinator to answer at step {step + 1} (the step-boundary check)",
                                   FIX_COORDINATOR)
            halt, timed_save = self.boundary.at(self.done, self.ck.time_due())
            if timed_save and pending:  # the checkpointer's time cadence: save the state after step `done`
                m = self._collect(*pending, time.perf_counter())
                pending = None
                m["checkpoint_block_s"] = self._save(self.done)
                self._emit(self.done, m, force=True)
            if halt:
                break
            self.watchdog.mark(f"data for step {step + 1}", FIX_DATA)
            t_iter, wait0 = time.perf_counter(), self.loader.wait_s
            self.data_state = self.loader.get_state()  # what a save after step `done` records
            try:
                with stop.interruptible():
                    batch = next(self.loader)
            except StopIteration:
                self.data_state = None  # the position at the end of the data, as before
                self.log(f"the data ran out: data.epochs={self.loader.epochs} ended after step {self.done}; saving it "
                         f"and finishing early")
                break
            except Interrupted:  # the loader may be mid-batch: the save takes the position from before the wait
                self.log(f"{stop.name} while waiting for data for step {step + 1}: stopping after step {self.done}")
                break
            self.data_state = None
            self.profiler.before(step + 1)
            self.watchdog.mark(f"step {step + 1} on device", FIX_STEP)
            t_dispatch = time.perf_counter()
            self.state, m_dev = self.step_fn(self.state, batch)
            dispatch_s = time.perf_counter() - t_dispatch
            self.done = step + 1
            self.profiler.after(self.done, m_dev)
            self._committed(self.ck.committed())
            if pending:
                self._emit(pending[0], self._collect(*pending, t_iter, dispatch_s))
            pending = (self.done, m_dev, self.loader.wait_s - wait0)
            # Each component keeps its own cadence; the run's last step is saved and evaluated below.
            save_now = self.ck.due(self.done) and self.done < steps
            evals = [e for e in (self.evaluator, self.harness) if e is not None]
            eval_now = self.done < steps and any(e.due(self.done) for e in evals)
            if save_now or eval_now:
                # The step must be checked before it is saved (nan_policy) or evaluated, and both wait for
                # it anyway: collect it now. The eval reads the state before the next step donates it.
                m = self._collect(*pending, time.perf_counter())
                pending = None
                if save_now:
                    m["checkpoint_block_s"] = self._save(self.done)
                if eval_now:
                    m.update(self._evaluate(self.done))
                self._emit(self.done, m, force=True)
        if pending:  # the final step, or the one a signal stopped us after: always saved
            m = self._collect(*pending, time.perf_counter())
            if self.done not in self.saved:
                m["checkpoint_block_s"] = self._save(self.done)
            evaluating = self.evaluator is not None or self.harness is not None
            if evaluating and not stop.requested():  # a signal asks for a quick exit
                m.update(self._evaluate(self.done, last=True))
            self._emit(self.done, m, force=True)
        self.profiler.after(steps, None)  # a run that ended early closes its trace
        self._t_end = time.perf_counter()

    def _collect(self, step: int, m_dev: dict, data_wait: float, t_iter: float, dispatch_s: float = 0.0) -> dict:
        """Wait for step `step`, apply the NaN policy, and return its metrics row. `dispatch_s`: how long
        this iteration's call of the next step took to return."""
        self.watchdog.mark(f"step {step} on device", FIX_STEP)
        t_block = time.perf_counter()
        m_host = jax.device_get(m_dev)  # waits for the step to finish
        arrays = {k: m_host.pop(k) for k in self.summaries if k in m_host}  # summarised below, not one number each
        t_ready = time.perf_counter()
        if self.startup is not None and "first_step" not in self.startup:
            self.startup.update(first_step=t_ready - self.t0, total=process_age())
        p = self.plan
        m = metrics_row(m_host, self.timer.lap(), tokens=p.tokens, flops_per_token=p.flops_per_token, n_dev=p.devices,
                        peak=p.peak, data_wait=data_wait, host_s=self.host_s, skips=self.loader.skips,
                        source=self.loader.metrics())
        # The host's own time in this loop iteration (data, bookkeeping, logging), reported with the next
        # step, since logging is part of it; near step_time_s = host-bound. Neither the wait nor the
        # dispatch counts: on a GPU the call of step N+1 returns only once step N has finished (measured
        # on an H100, docs/metrics.md), so its time there is the device's, not the host's.
        self.host_s = (t_block - t_iter - dispatch_s) + (time.perf_counter() - t_ready)
        for k, a in arrays.items():
            fields, lines = self.summaries[k](a)
            m.update(fields)
            for line in lines:
                self.log(line)
        self.nan.check(step, m)
        return m

    def _emit(self, step: int, m: dict, force: bool = False) -> None:
        every = step % self.plan.log_every == 0 or step == self.plan.steps or step == self.start + 1
        report = None
        if self.startup is not None:  # the first step is always written: its row carries the start-up cost
            report, fields = startup_report(self.startup)
            m.update(fields)
            self.startup = None
        # a forced row comes with a save, an eval or the end: make the rows so far durable with it
        self.logger.step(step, m, log=force or every, flush=force)
        if report:
            self.log(report)

    def _committed(self, step: int | None) -> None:
        if step is not None:
            self.log(f"checkpoint step {step} committed")

    def _save(self, step: int) -> float:
        self.watchdog.mark(f"the checkpoint save of step {step}", FIX_SAVE)
        self._committed(self.ck.wait())  # Orbax would wait for the previous save anyway: report it as it commits
        meta = ckpt.metadata(self.plan.meta, self.plan.mesh, step, self.nan.total)
        data = self.data_state if self.data_state is not None else self.loader.get_state()
        block = self.ss.save(self.ck, step, self.state, data, meta)
        self.saved.add(step)
        self.log(f"saving step {step} to {self.ck.step_path(step)} (async; the loop was blocked {block:.2f}s)")
        return block

    def _evaluate(self, step: int, last: bool = False) -> dict:
        """eval_loss and eval_ppl, and the benchmarks, of the parameters after `step` (the state the loop holds
        now): each when due, or both after the `last` step."""
        e = {}
        if self.evaluator is not None and (last or self.evaluator.due(step)):
            self.watchdog.mark(f"the evaluation after step {step}", FIX_EVAL)
            e = self.evaluator(self.ss.model_params(self.state))
            self.log(f"eval at step {step}: loss {e['eval_loss']:.4f}, ppl {e['eval_ppl']:.3f} ({e['eval_tokens']:,.0f} tokens, "
                f"{e['eval_time_s']:.2f}s)")
        if self.harness is not None and (last or self.harness.due(step)):
            what = f"the benchmarks after step {step} (eval.harness)"  # marked at each batch: a long suite is progress
            h = self.harness(self.ss.natural_params(self.state), beat=lambda: self.watchdog.mark(what, FIX_HARNESS))
            self.log(f"benchmarks at step {step}: {self.harness.summary(h)}")
            e = {**e, **h}
        self.timer.lap()  # the next step's time starts after the eval: step_time_s stays the training's
        return e



