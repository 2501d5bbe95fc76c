"""Which platforms jax starts, chosen before it starts them: a GPU jax cannot use is refused in one line
naming the fix, and a TPU runtime installed where there is no TPU (libtpu, which compile-only runs need)
is kept from starting or, when it compiles for a topology, from looking for a TPU VM it is not on."""

def skip_absent_tpu() -> str | None:
    """Before jax picks its platforms (JAX_PLATFORMS unset):
      - an NVIDIA GPU that jax cannot use (no CUDA plugin) is a ConfigError naming the fix, not jax's
        "Backend 'cuda' is not in the list of known backends" traceback, nor a quiet CPU run;
      - with libtpu installed (as `compile_topology` needs) on a machine without TPU chips, jax still
        starts the TPU runtime, which prints five lines of host-bounds warnings before falling back: name
        the platforms that can be here instead, the way jax itself decides a TPU is absent.
    Returns a line for the log, or None if nothing changed."""
    import importlib.util
    import os

    import jax
    from jax._src import cloud_tpu_init, hardware_utils, xla_bridge

    if os.environ.get("JAX_PLATFORMS") or xla_bridge.backends_are_initialized():  # chosen already
        return None

    gpu = hardware_utils.has_visible_nvidia_gpu()
    if gpu and not any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (13, 12)):
        from maxlm.errors import ConfigError

        raise ConfigError(f"this machine has an NVIDIA GPU, but jax has no CUDA backend to use it: pip install "
                          f"'jax[cuda13]=={jax.__version__}' to train on the GPU, or set JAX_PLATFORMS=cpu to run on the CPU")
    if cloud_tpu_init.get_tpu_library_path() is None or hardware_utils.num_available_tpu_chips_and_device_id()[0]:
        return None
    platforms = "cuda,cpu" if gpu else "cpu"
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
