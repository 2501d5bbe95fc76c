"""What every `python -m maxlm.*` command line shares: argparse mistakes as one line, and argument types
that refuse what would otherwise be read as something else (an empty path is the current directory to
pathlib and the filesystem's root to a string join; nan passes every comparison)."""

import argparse
import math
import os
import sys

from maxlm.errors import ConfigError


class Parser(argparse.ArgumentParser):
    """argparse whose usage mistakes are one ConfigError line naming --help, not a usage block."""

    def error(self, message):
        raise ConfigError(f"{message} (see {self.prog} --help)")


def path(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; give a path")
    return text


def whole(least: int):
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {least}, got {text!r}") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {least}, got {n}")
        return n
    return parse


def fraction(text: str) -> float:
    """A probability: a finite number in [0, 1]."""
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}")
    return x


def run(main) -> int:
    """A script's command line (the benchmarks'): a mistake in its flags or its config is one line naming the
    script, and exit 2, as train.py's; what the script returns is its exit code."""
    prog = os.path.basename(sys.argv[0])
    try:
        return main() or 0
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 2
