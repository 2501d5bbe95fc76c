"""Keep the log to what maxlm says: libraries that report what maxlm already reports, in one line.

Orbax logs every failed write from each of its threads, with tracebacks (a full disk gave 700 lines),
and then raises the same error to the caller, where maxlm turns it into one `maxlm: error:` line. Its
warnings ("waiting for the previous save") describe what maxlm's own log says with numbers.
"""

import logging
import sys


class _DropOrbax(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "/orbax/" not in record.pathname


def libraries() -> None:
    """Drop Orbax's log records (absl logs through the `absl` logger); the rest of absl stays."""
    logger = logging.getLogger("absl")
    if not any(isinstance(f, _DropOrbax) for f in logger.filters):
        logger.addFilter(_DropOrbax())


def after_failure() -> None:
    """After a failed save, writes still queued in Orbax's event loops die with the interpreter and
    print "Exception ignored in <coroutine>" tracebacks at exit, and asyncio logs each failed write that
    nobody awaited ("Task exception was never retrieved") when it is collected; the failure has been
    reported. (Seen once in a full suite run: the second write's traceback after our line.)"""
    sys.unraisablehook = lambda unraisable: None
    logging.getLogger("asyncio").disabled = True


def skip_absent_tpu() -> str | None:
    """With libtpu installed (as `compile_topology` needs) on a machine without TPU chips, jax still
    starts the TPU runtime, which prints five lines of host-bounds warnings before falling back. When the
    PCI bus shows no TPU and JAX_PLATFORMS is unset, name the platforms that can be here instead, the
    way jax itself decides a TPU is absent. Returns a line for the log, or None if nothing changed."""
    import os

    if os.environ.get("JAX_PLATFORMS"):
        return None
    import jax
    from jax._src import cloud_tpu_init, hardware_utils

    if cloud_tpu_init.get_tpu_library_path() is None or hardware_utils.num_available_tpu_chips_and_device_id()[0]:
        return None
    platforms = "cuda,cpu" if hardware_utils.has_visible_nvidia_gpu() else "cpu"
    jax.config.update("jax_platforms", platforms)
    return f"libtpu is installed but this machine has no TPU: platforms {platforms}"


def compile_only_tpu(accelerator: str) -> None:
    """Before libtpu loads to compile for a topology on a machine without TPU chips: it would look for a
    TPU VM's metadata and print eight lines of warnings about the worker hostnames and host bounds it
    cannot find. Tell it the one thing it asks for (a lone worker of this accelerator type). And with no chip
    to guard, its one-process-per-machine lock only makes a second compile (a test, a launcher) fail;
    on a TPU VM nothing changes."""
    import os

    from jax._src import hardware_utils

    if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
        return
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
