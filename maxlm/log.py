"""The run's log: what maxlm says, once for the whole job (process 0), on standard output."""

import jax


def log(msg: str) -> None:
    if jax.process_index() == 0:  # one log for the job, not one per process
        print(f"maxlm: {msg}", flush=True)
