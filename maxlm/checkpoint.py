"""Checkpoints on Orbax: async saves with atomic commits, their cadence, the choice of what to resume,
resharding restore, and refusals that name what is wrong instead of silently starting over.

One checkpoint is one step directory with three items:
  state/  the train state as a tree of arrays (maxlm.state.StateSpec.on_disk), each saved with its sharding
  data/   each process's data-iterator position (process_<i>-of-<n>.json)
  meta/   the resolved config, versions, mesh and counters (JSON)
Locally a save writes `<step>.orbax-checkpoint-tmp/` and renames it to `<step>/` only when every item is
complete, so a directory without the tmp suffix is a committed checkpoint. On gs://, which cannot rename,
Orbax writes `<step>/` in place and commits it by writing `<step>/commit_success.txt` last. Restore reads
onto whatever mesh the current run has: Orbax reshards each array to the target's sharding. Arrays come
back as they were saved; the layout their layer stacks are in (maxlm.schedules.layout) is the caller's.

The Checkpointer decides when to save: every `checkpoint.every` steps and every `checkpoint.minutes`
(`due`, `time_due`); a job of several processes agrees on a time save through preemption.Boundary.
`opened` chooses what a run resumes, and moves old checkpoints aside for resume=never.
"""

import contextlib
import functools
import json
import logging
import os
import re
import sys
import time

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

import maxlm
from maxlm import runlock, storage
from maxlm.errors import ConfigError

TMP_SUFFIX = ".orbax-checkpoint-tmp"
COMMIT_FILE = "commit_success.txt"  # what commits a step on gs://
# The layout of a checkpoint (items, tree structure, metadata fields), recorded in its metadata. A change
# of layout bumps it, and a checkpoint written under a layout this maxlm does not read is refused by name.
# Checkpoints from before the field existed have layout 1.
SCHEMA = 1


class CheckpointError(ConfigError):
    """A checkpoint that exists but cannot be used; one line naming the step, the path and the reason."""


class _DataState:
    """A frozen snapshot of a data-iterator position, in the shape grain's Orbax handler expects.

    The snapshot is taken when `save` is called: the handler may run after the loop has moved on."""

    def __init__(self, state: dict | None = None):
        self.blob = json.dumps(state).encode() if state is not None else b""

    def get_state(self) -> bytes:
        return self.blob

    def set_state(self, blob: bytes) -> None:
        self.blob = blob

    def start_prefetch(self) -> None:
        pass


def _key(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def flat_shapes(tree) -> dict[str, tuple]:
    """`params.layers.wq` -> shape, for any tree of arrays, ShapeDtypeStructs or Orbax metadata."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(_key(k) for k in path): tuple(leaf.shape) for path, leaf in leaves}


def compare(saved: dict[str, tuple], wanted: dict[str, tuple]) -> str | None:
    """The first difference between two flat shape tables, in words; None if they agree."""
    for name, shape in sorted(wanted.items(), key=lambda kv: kv[0].startswith("opt_state")):  # params first
        if name not in saved:
            problem = name, f"`{name}` {shape} is missing from the checkpoint"
            break
        if saved[name] != shape:
            problem = name, f"`{name}` has shape {saved[name]} in the checkpoint but {shape} in this config"
            break
    else:
        surplus = sorted(set(saved) - set(wanted), key=lambda n: (n.startswith("opt_state"), n))  # params first
        if not surplus:
            return None
        problem = surplus[0], f"the checkpoint has `{surplus[0]}` {saved[surplus[0]]}, which this config does not"
    if problem[0].startswith("opt_state"):
        # Parameters agree but the optimizer's state tree does not: its chain changed (e.g. grad_clip on/off).
        return problem[1] + " (the optimizer's structure changed; init_from keeps only the parameters)"
    return problem[1]


def _first_line(e: BaseException) -> str:
    """The root cause's first line: Orbax wraps tensorstore's precise error (which file, which array,
    what is wrong with it) in exceptions whose own text is a dump of the store's spec."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    text = (str(e).strip() or type(e).__name__).splitlines()[0].split(" [tensorstore_spec=")[0]
    text = re.sub(r' in OCDBT database at local file "[^"]*"', "", text)  # the file named next says more
    return f"{type(e).__name__}: {text[:400]}"


def _quiet_stray_reads() -> None:
    """After a failed read, tensorstore may finish reads that were still in flight once Orbax's event
    loop has closed; their callbacks then print "Event loop is closed" tracebacks, even in the middle of
    the one-line refusal. The failure itself is reported by the refusal; drop only that echo of it.
    Installed before any read, since the echo can come before the refusal is raised."""
    hook = sys.unraisablehook
    if getattr(hook, "maxlm_quiet", False):
        return

    def quiet(u):
        if not (isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"):
            hook(u)
    quiet.maxlm_quiet = True
    sys.unraisablehook = quiet


class _ReadOnlyNotice(logging.Filter):
    """Orbax warns, twice, that a checkpoint opened read-only is read-only; reading is all an export, a
    notebook or init_from does, so those two lines are dropped and every other warning kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("CheckpointManagerOptions.read_only=True", "Given directory is read only"))


logging.getLogger("absl").addFilter(_ReadOnlyNotice())


REPLICA_SLICE_BYTES = 16 << 20


@functools.cache  # once a process: the registry is orbax's, global
def _whole_small_replicas() -> None:
    """Orbax splits a replicated array's write among its replicas, each slicing its part out with an eager
    jax op: one compile per shape per device at the first save (16 for two norm scales on 8 devices).
    Below 16 MiB one replica writes it whole; larger replicated arrays keep the parallel write."""
    absl = logging.getLogger("absl")  # orbax warns of any override, its own default handler's included
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        ocp.type_handlers.register_type_handler(
            jax.Array, ocp.type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=REPLICA_SLICE_BYTES),
            override=True)
    finally:
        absl.setLevel(level)


class Checkpointer:
    """The run's checkpoint directory: what is committed, what is partial, and save/restore."""

    def __init__(self, directory: str, keep: int = 3, keep_every: int = 0, read_only: bool = False, every: int = 0,
                 minutes: float = 0.0):
        _quiet_stray_reads()
        _whole_small_replicas()
        self.every = every  # save every N steps (checkpoint.every; 0: only when the loop asks)
        self.minutes = minutes  # and every so many minutes (checkpoint.minutes; 0: never for the time)
        self._last_save = time.monotonic()
        # Orbax refuses relative paths, and only at its first write: make any local path absolute here.
        self.dir = epath.Path(directory if "://" in directory else os.path.abspath(directory))
        self.in_flight: int | None = None  # the step whose async save is not yet known to have committed
        policies = [ocp.checkpoint_managers.LatestN(n=keep)]
        if keep_every:
            policies.append(ocp.checkpoint_managers.EveryNSteps(interval_steps=keep_every))
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=True, create=not read_only, read_only=read_only,
            preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies))
        self.mgr = ocp.CheckpointManager(self.dir, options=options, item_handlers={
            "state": ocp.StandardCheckpointHandler(), "data": grain.checkpoint.CheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler()})

    def due(self, step: int) -> bool:
        """Whether `step` is one the run saves on its cadence (the last step and a signal's are the loop's call)."""
        return bool(self.every) and step % self.every == 0

    def time_due(self) -> bool:
        """Whether `minutes` have passed since the last save (or `start_clock`): this process's view; a job of
        several processes saves on process 0's (preemption.Boundary)."""
        return bool(self.minutes) and time.monotonic() - self._last_save >= self.minutes * 60

    def start_clock(self) -> None:
        """The time cadence counts from now (the loop's start: compiling and restoring are not training)."""
        self._last_save = time.monotonic()

    # ---- What is on disk ------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        self.mgr.reload()
        return sorted(self.mgr.all_steps())

    def partials(self) -> list[epath.Path]:
        """Step directories an interrupted save left behind (never committed, never restored): locally the
        tmp-suffixed ones, on gs:// those without commit_success.txt."""
        names = storage.listdir(self.dir)
        if storage.is_gcs(self.dir):
            steps = [n for n in names if n.isdigit()]
            return [self.dir / n for n in steps if not (self.dir / n / COMMIT_FILE).exists()]
        return [self.dir / n for n in names if n.endswith(TMP_SUFFIX)]

    def remove_partials(self) -> tuple[list[str], float]:
        """Delete the partial steps: (their names, 0), or, where this job took the run_dir's lease over from
        a holder that may still be finishing a save (runlock.previous_holder_may_write), (their names, for
        how many seconds more it may write) with nothing deleted: never a step another live job may be
        writing. Orbax replaces a partial step when it saves that step itself."""
        partials, busy = self.partials(), runlock.previous_holder_may_write()
        if not busy and jax.process_index() == 0:
            for p in partials:
                p.rmtree()
        return [p.name for p in partials], busy

    def step_path(self, step: int) -> epath.Path:
        return self.dir / str(step)

    # ---- Save -----------------------------------------------------------------------------------------
    def save(self, step: int, tree: dict, data_state: dict, meta: dict) -> float:
        """Start an async save of `step` (`tree`: the state's arrays); return the seconds the caller was
        blocked (device-to-host copy, plus waiting for the previous save if it is still being written). The
        step is committed only once `committed()` or `wait()` says so."""
        t = time.perf_counter()
        self._last_save = time.monotonic()
        try:
            self.mgr.save(step, force=True, args=ocp.args.Composite(
                state=ocp.args.StandardSave(tree),
                data=grain.checkpoint.CheckpointSave(_DataState(data_state)),
                meta=ocp.args.JsonSave(meta)))
        except Exception as e:  # noqa: BLE001 - this or the previous save failed to write: stop, loudly
            raise self._failed(step, e) from None
        self.in_flight = step
        return time.perf_counter() - t

    def committed(self) -> int | None:
        """The step whose save has committed since the last call, if it has (without waiting)."""
        if self.in_flight is None or self.mgr.is_saving_in_progress():
            return None
        return self.wait()

    def wait(self) -> int | None:
        """Wait for the save in flight; return its step once committed (None if none was in flight)."""
        step, self.in_flight = self.in_flight, None
        try:
            self.mgr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._failed(step, e) from None
        return step

    def _failed(self, step: int | None, e: BaseException) -> storage.StorageError:
        self.in_flight = None
        try:
            self.mgr.reload()  # what is on disk now, not what this manager last saw
            last = max(self.mgr.all_steps(), default=None)
        except Exception:  # noqa: BLE001 - the storage may be what failed
            last = None
        kept = f"the last committed checkpoint is {self.step_path(last)}" if last is not None else "no checkpoint was committed"
        which = f"step {step} " if step is not None else ""
        return storage.StorageError(f"saving checkpoint {which}to {self.dir} failed: {_first_line(e)}; {kept}")

    def close(self) -> None:
        try:
            self.mgr.close()
        except Exception:  # noqa: BLE001 - a failed save was already raised as a StorageError by wait()/save()
            if self.in_flight is not None:
                raise

    # ---- Restore --------------------------------------------------------------------------------------
    def meta(self, step: int) -> dict:
        try:
            meta = self.mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception as e:  # noqa: BLE001 - any failure to read is reported, never skipped
            raise self._refuse(step, f"its metadata cannot be read, the checkpoint is damaged ({_first_line(e)})") from None
        schema = meta.get("schema", 1)
        if schema != SCHEMA:
            raise self._refuse(step, f"it has checkpoint layout {schema} (written by maxlm {meta.get('maxlm_version', '?')}) "
                                     f"and this maxlm reads layout {SCHEMA}; use the maxlm version that wrote it")
        return meta

    def check(self, step: int, abstract_tree: dict) -> dict:
        """Refuse a committed step this run cannot resume (layout, process count, array shapes) without
        reading its arrays; return its metadata."""
        meta = self.meta(step)
        if meta["processes"] != jax.process_count():
            raise self._refuse(step, f"it was written by {meta['processes']} process(es) and this run has "
                                     f"{jax.process_count()}; data positions are per process, so resume with "
                                     f"{meta['processes']}, or start a new run from its parameters with init_from")
        self._check_shapes(step, abstract_tree)
        return meta

    def restore(self, step: int, abstract_tree: dict) -> tuple:
        """(tree, data_state, meta) of a committed step, placed onto `abstract_tree`'s shardings, as saved."""
        meta = self.check(step, abstract_tree)
        try:
            restored = self.mgr.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_tree),
                data=grain.checkpoint.CheckpointRestore(_DataState())))
        except Exception as e:  # noqa: BLE001
            raise self._refuse(step, f"its arrays cannot be read, the checkpoint is damaged ({_first_line(e)})") from None
        return restored.state, json.loads(restored.data.get_state()), meta

    def _check_shapes(self, step: int, abstract_tree, only: str = "") -> None:
        """Refuse, naming the first differing array, before Orbax reads a byte."""
        missing = [f for f in ("state/_METADATA", "state/_sharding") if not (self.step_path(step) / f).exists()]
        if missing:
            raise self._refuse(step, f"its {missing[0]} file is missing, so the checkpoint is damaged")
        try:
            saved = flat_shapes(self.mgr.item_metadata(step).state)
        except Exception as e:  # noqa: BLE001
            raise self._refuse(step, f"its array metadata cannot be read, the checkpoint is damaged ({_first_line(e)})") from None
        wanted = flat_shapes({only: abstract_tree} if only else abstract_tree)
        if only:
            saved = {k: v for k, v in saved.items() if k.startswith(only + ".")}
        problem = compare(saved, wanted)
        if problem:
            raise self._refuse(step, f"it does not match the model: {problem}")

    def check_params(self, step: int, abstract_params) -> None:
        """Refuse a step whose parameters do not have `abstract_params`' shapes (metadata only)."""
        self._check_shapes(step, abstract_params, only="params")

    def restore_params(self, step: int, abstract_params):
        """Only the parameters of a committed step (for `init_from`), onto the current shardings, as saved
        (convert.peft.params_of puts their stacks in layer order)."""
        self._check_shapes(step, abstract_params, only="params")
        path = self.step_path(step) / "state"
        restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape,
                                                                   dtype=a.dtype), abstract_params)
        try:
            with ocp.PyTreeCheckpointer() as ckptr:
                out = ckptr.restore(path, args=ocp.args.PyTreeRestore(
                    item={"params": abstract_params}, restore_args={"params": restore_args}, partial_restore=True))
        except Exception as e:  # noqa: BLE001
            raise self._refuse(step, f"its parameters cannot be read ({_first_line(e)})") from None
        return out["params"]

    def _refuse(self, step: int, why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint step {step} at {self.step_path(step)}: {why}. Fix or move it away, "
                               f"or start over with resume=never or a new run_dir")


def metadata(cfg_dict: dict, mesh, step: int, skips_total: int) -> dict:
    return {"schema": SCHEMA, "step": step, "maxlm_version": maxlm.__version__, "jax_version": jax.__version__,
            # a size-1 stage axis is left out, as in checkpoints written before the axis existed
            "mesh": {k: int(v) for k, v in mesh.shape.items() if k != "stage" or v > 1}, "devices": int(mesh.size),
            "processes": jax.process_count(), "skips_total": skips_total, "config": cfg_dict}


def resolve_init_from(path: str, key: str = "`init_from`") -> tuple[Checkpointer, int]:
    """(read-only Checkpointer, step) of a run directory or its checkpoints directory (the newest step), or
    one step's directory; errors name `key`, the argument the caller was given (`init_from`, --checkpoint, ...)."""
    p = epath.Path(path)
    if not p.exists():
        raise ConfigError(f"{key}: {path} does not exist")
    if p.name.isdigit() and (p / "state").exists():  # one step's directory
        return Checkpointer(str(p.parent), read_only=True), int(p.name)
    if (p / "checkpoints").is_dir():  # a run directory
        p = p / "checkpoints"
    ck = Checkpointer(str(p), read_only=True)
    steps = ck.steps()
    if not steps:
        ck.close()
        raise ConfigError(f"{key}: {path} holds no committed checkpoint (expected a run directory, its checkpoints "
                          f"directory, or one step directory)")
    return ck, steps[-1]


def archive_name(path: epath.Path) -> epath.Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return path.parent / f"{path.stem}-replaced-{stamp}{path.suffix}"


@contextlib.contextmanager
def opened(directory: str, resume: str, steps: int, log, **cadence):
    """(the run's Checkpointer, the step to resume from or None), closed on the way out. Never starts fresh
    over existing checkpoints unless told to (resume=never), and then moves them aside. `steps`: the run's
    last step; `cadence`: the Checkpointer's keep, keep_every, every and minutes."""
    ck = Checkpointer(directory, **cadence)
    partials, busy = ck.remove_partials()
    if partials and busy:
        log(f"ignoring {len(partials)} partial checkpoint(s) without removing them: {', '.join(partials)}; the job "
            f"this run_dir's lease was taken over from may still be writing them for {busy:.0f}s (a save of such a "
            f"step replaces it)")
    elif partials:
        log(f"ignoring and removing {len(partials)} partial checkpoint(s) left by an interrupted save: {', '.join(partials)}")
    found = ck.steps()
    if found and resume == "never":
        if storage.is_gcs(directory):  # moving them aside would copy every object
            ck.close()
            raise ConfigError(f"resume=never: {directory} holds {len(found)} checkpoint(s) (steps {found[0]}.."
                              f"{found[-1]}), and object storage cannot move them aside; delete them "
                              f"(gcloud storage rm -r {directory}) or choose a new run_dir")
        ck.close()
        moved = archive_name(ck.dir)
        if jax.process_index() == 0:
            ck.dir.rename(moved)
        if jax.process_count() > 1:  # nobody recreates the directory before it has moved
            multihost_utils.sync_global_devices("maxlm: checkpoints moved aside")
        log(f"resume=never: moved {len(found)} existing checkpoint(s) (steps {found[0]}..{found[-1]}) to {moved}")
        ck, found = Checkpointer(directory, **cadence), []
    try:
        if not found:
            log(f"no checkpoint in {ck.dir}: starting from step 0")
        elif found[-1] > steps:
            raise ConfigError(f"{ck.dir} holds step {found[-1]}, beyond steps={steps}; raise `steps`, "
                              f"or start over with resume=never or a new run_dir")
        yield ck, (found[-1] if found else None)
    finally:
        ck.close()
