"""Multi-process start-up: join the job's other processes before anything touches a device.

One process per host (TPU VM, GPU node) or per GPU. maxlm calls `jax.distributed.initialize` when:
  - JAX_COORDINATOR_ADDRESS is set (host:port of process 0), with JAX_NUM_PROCESSES and JAX_PROCESS_ID
    (any launcher, and localhost tests); or
  - the environment is a multi-process job JAX detects by itself: Slurm with more than one task, or a
    multi-host TPU slice.
Otherwise the run is single-process. A job that looks multi-process but cannot join fails loudly,
rather than training N independent copies of the model.
"""

import os

import jax

from maxlm.config import ConfigError


def _cluster() -> str | None:
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS"
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return "Slurm"
    if "," in os.environ.get("TPU_WORKER_HOSTNAMES", ""):
        return "multi-host TPU"
    return None


def initialize() -> str:
    """Join the job if there is one; return a line for the log."""
    how = _cluster()
    if how is None:
        return "single process"
    kwargs = {}
    if how == "JAX_COORDINATOR_ADDRESS":
        try:
            kwargs = dict(num_processes=int(os.environ["JAX_NUM_PROCESSES"]), process_id=int(os.environ["JAX_PROCESS_ID"]))
        except (KeyError, ValueError):
            raise ConfigError("JAX_COORDINATOR_ADDRESS is set: also set JAX_NUM_PROCESSES and JAX_PROCESS_ID "
                              "(integers)") from None
    try:
        jax.distributed.initialize(**kwargs)
    except Exception as e:  # noqa: BLE001 - the job must not silently run as N single processes
        raise ConfigError(f"{how} says this is a multi-process job, but jax.distributed.initialize failed: "
                          f"{str(e).strip().splitlines()[0]}") from None
    return (f"process {jax.process_index()} of {jax.process_count()} ({how}); "
            f"{jax.local_device_count()} local of {jax.device_count()} devices")
