"""Library log records: Orbax's and gcsfs's warnings and errors reach the log, each distinct one at most once
a minute with its traceback cut to one line, repeats counted; their informational records do not."""

import logging

from maxlm import quiet


def test_library_warnings_reach_the_log_once_a_minute_with_repeats_counted(capsys, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(quiet.time, "monotonic", lambda: now[0])
    digest = quiet._Digest("gcsfs")
    logger = logging.getLogger("maxlm-test-digest")
    logger.propagate = False
    seen = []
    handler = logging.Handler()
    handler.emit = lambda r: seen.append(r.getMessage())
    logger.addHandler(handler)
    logger.addFilter(digest)
    logger.info("saving step 4")  # progress: dropped
    for _ in range(3):
        try:
            raise ConnectionError("503 Service Unavailable\nbody...")
        except ConnectionError:
            logger.exception("retrying GCS request")
    logger.warning("slow write")
    now[0] += quiet.WINDOW_S + 1
    logger.error("retrying GCS request (ConnectionError: 503 Service Unavailable\nbody...)")
    assert seen == ["retrying GCS request (ConnectionError: 503 Service Unavailable\nbody...)", "slow write",
                    "retrying GCS request (ConnectionError: 503 Service Unavailable\nbody...) [and 2 more like it since]"]
    logger.warning("slow write")  # a minute since it was last shown: shown
    logger.warning("slow write")  # within a minute of that: counted, and said at exit
    assert seen[-1] == "slow write" and len(seen) == 4
    digest.summary()
    assert "gcsfs: 1 more like this were not shown: slow write" in capsys.readouterr().err


def test_orbax_records_are_digested_and_the_rest_of_absl_untouched():
    quiet.libraries()
    absl = logging.getLogger("absl")
    (digest,) = [f for f in absl.filters if isinstance(f, quiet._Digest)]
    orbax = logging.LogRecord("absl", logging.INFO, "/x/orbax/checkpoint/y.py", 1, "Finished saving", None, None)
    other = logging.LogRecord("absl", logging.INFO, "/x/jax/y.py", 1, "hello", None, None)
    assert not digest.filter(orbax) and digest.filter(other)
    orbax.levelno = logging.WARNING
    assert digest.filter(orbax)
