"""maxlm trainer CLI:  python train.py CONFIG.yml [key=value ...]

Exit codes: 0 done (or stopped by SIGINT after saving), 2 bad config/data/checkpoint, 3 stopped by
nan_policy (last good checkpoint kept), 143 stopped by SIGTERM after saving (re-run to resume).

Examples:
  python train.py configs/tiny.yml steps=50 mesh.tensor=2
  python train.py configs/models/llama3-8b.yml dry_run=true compile_topology=v5p-8
"""

import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    from maxlm.config import ConfigError, load  # no jax import: bad configs fail in milliseconds

    try:
        cfg = load(argv[0], argv[1:])
    except ConfigError as e:
        print(f"maxlm: error: {e}", file=sys.stderr)
        return 2
    from maxlm import train

    try:
        return train.run(cfg)
    except ConfigError as e:  # bad config, data or checkpoint: nothing was trained
        print(f"maxlm: error: {e}", file=sys.stderr)
        return 2
    except train.TrainingStopped as e:  # nan_policy stopped the run; checkpoints intact
        print(f"maxlm: error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("maxlm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
