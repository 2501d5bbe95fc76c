"""Keep the log to what maxlm says, and what the libraries say of their own failures, in few lines.

Orbax logs a failed write from each of its threads, with tracebacks (a full disk gave 700 lines), and
gcsfs logs each retry of a GCS request the same way; then the error reaches maxlm, which reports it in
one `maxlm: error:` line. Their warnings and errors still say why a write is slow or failing (a retry, a
throttled bucket, a permission), so they reach the log: once per distinct message a minute, with the
traceback cut to its last line, and the number of repeats said with the next one or at exit. Orbax's
informational records (every save's progress) are dropped.
"""

import atexit
import logging
import sys
import time

WINDOW_S = 60.0


class _Digest(logging.Filter):
    """Warnings and errors of one library, each distinct message at most once per WINDOW_S."""

    def __init__(self, name: str, only=lambda record: True):
        super().__init__()
        self.name, self.only = name, only
        self.seen: dict[tuple, list] = {}  # (level, message) -> [last shown, repeats since]
        atexit.register(self.summary)

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.only(record):
            return True
        if record.levelno < logging.WARNING:
            return False
        if record.exc_info and record.exc_info[1] is not None:  # the traceback's last line, not 30 more
            e = record.exc_info[1]
            record.msg, record.args = f"{record.getMessage()} ({type(e).__name__}: {str(e).strip()[:300]})", None
            record.exc_info = record.exc_text = None
        key = (record.levelno, record.getMessage().splitlines()[0][:200] if record.getMessage() else "")
        now, entry = time.monotonic(), self.seen.get(key)
        if entry and now - entry[0] < WINDOW_S:
            entry[1] += 1
            return False
        if entry and entry[1]:
            record.msg, record.args = f"{record.getMessage()} [and {entry[1]} more like it since]", None
        self.seen[key] = [now, 0]
        return True

    def summary(self) -> None:
        for (_, message), entry in self.seen.items():
            if entry[1]:
                print(f"{self.name}: {entry[1]} more like this were not shown: {message}", file=sys.stderr)
                entry[1] = 0


def libraries() -> None:
    """Digest Orbax's records (absl logs them through the `absl` logger; the rest of absl stays) and gcsfs's.
    Drop tokamax's "Autotuning cache miss" (a 600-character repr for each grouped matmul traced): its
    shipped tiles are keyed by exact shapes, none of them maxlm's, and the log says the built-in tiles run."""
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _Digest) for f in absl.filters):
        absl.addFilter(_Digest("orbax", lambda r: "/orbax/" in r.pathname))
        absl.addFilter(lambda r: not ("/tokamax/" in r.pathname and str(r.msg).startswith("Autotuning cache miss")))
    for name in ("gcsfs", "fsspec"):
        lg = logging.getLogger(name)
        if not any(isinstance(f, _Digest) for f in lg.filters):
            lg.addFilter(_Digest(name))


def after_failure() -> None:
    """After a failed save, writes still queued in Orbax's event loops die with the interpreter and
    print "Exception ignored in <coroutine>" tracebacks at exit, and asyncio logs each failed write that
    nobody awaited ("Task exception was never retrieved") when it is collected; the failure has been
    reported. (Seen once in a full suite run: the second write's traceback after our line.)"""
    sys.unraisablehook = lambda unraisable: None
    logging.getLogger("asyncio").disabled = True
