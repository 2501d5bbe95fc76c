"""maxlm trainer CLI:  python train.py CONFIG.yml [key=value ...]

Exit codes: 0 done (or stopped by SIGINT after saving), 2 bad config/data/checkpoint (or run_dir in use
by another job), 3 stopped by nan_policy (last good checkpoint kept), 4 an I/O failure (disk full,
permissions, storage) stopped the run (every checkpoint reported committed is intact), 5 the job stopped
making progress (a stall past watchdog_s, a lost process, an unreachable coordinator; re-run to resume),
143 stopped by SIGTERM after saving (re-run to resume).

Examples:
  python train.py configs/tiny.yml steps=50 mesh.tensor=2
  python train.py configs/models/llama3-8b.yml dry_run=true compile_topology=v5p-8
"""

import sys

EXIT_IO = 4


def error(msg: str) -> None:
    print(f"maxlm: error: {msg}", file=sys.stderr, flush=True)


def early_signals() -> None:
    """Outside the run (importing jax and maxlm takes seconds; maxlm.preemption.owned takes the signals over in
    train.run and hands these back after it): SIGTERM or SIGHUP ends the process at once with 143, SIGINT
    with 0, in one line. The command line only: a caller of main() in-process keeps its own handlers."""
    import os
    import signal

    def leave(signum, _frame):
        code = 0 if signum == signal.SIGINT else 143
        print(f"maxlm: {signal.Signals(signum).name} received while the run starts or ends: exiting now with code "
              f"{code}; nothing is lost (re-run the same command to resume)", file=sys.stderr, flush=True)
        os._exit(code)

    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        if signal.getsignal(s) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
            signal.signal(s, leave)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    from maxlm.config import ConfigError, load, repeated  # no jax import: bad configs fail in milliseconds

    notes = repeated(argv[1:])
    try:
        cfg = load(argv[0], argv[1:], notes)
    except ConfigError as e:
        error(e)
        return 2
    import jax

    from maxlm import distributed, quiet, storage, train
    from maxlm.loop import TrainingStopped

    quiet.libraries()
    try:
        return train.run(cfg, notes, explicit=[arg.partition("=")[0] for arg in argv[1:]])
    except ConfigError as e:  # bad config, data or checkpoint: nothing was trained
        error(e)
        return 2
    except TrainingStopped as e:  # nan_policy stopped the run; checkpoints intact
        error(e)
        return 3
    except storage.StorageError as e:
        error(e)
        quiet.after_failure()
        return EXIT_IO
    except OSError as e:  # writing metrics, logs or outputs: the storage failed, not the code
        error(f"I/O failure: {e.strerror or e}" + (f": {e.filename}" if e.filename else ""))
        quiet.after_failure()
        return EXIT_IO
    except jax.errors.JaxRuntimeError as e:
        if not distributed.joined():
            raise
        distributed.collective_failed(e)  # a lost peer, most likely: one line, exit 5
    except KeyboardInterrupt:
        print("maxlm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    early_signals()
    sys.exit(main(sys.argv[1:]))
