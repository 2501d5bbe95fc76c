"""StopRequest: a signal becomes a flag the loop reads; the exit code says which signal it was."""

import os
import signal
import subprocess
import sys

import pytest

from maxlm.preemption import StopRequest


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 0), (signal.SIGTERM, 143)])
def test_signal_sets_flag_and_exit_code(sig, code, capsys):
    before = signal.getsignal(sig)
    with StopRequest() as stop:
        assert not stop.requested()
        os.kill(os.getpid(), sig)
        assert stop.requested() and stop.exit_code == code and stop.name == sig.name
    assert signal.getsignal(sig) is before  # handlers are restored on exit
    assert f"{sig.name} received: saving at the end of this step" in capsys.readouterr().err


def test_a_second_sigterm_at_once_is_the_same_request(capsys):
    """Slurm sends SIGTERM twice, milliseconds apart, when it ends a job: the second must not cost the save."""
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal that exited would end this test here
        assert stop.requested() and stop.exit_code == 143
    assert "maxlm: SIGTERM again 0.0" in capsys.readouterr().err


@pytest.mark.parametrize("first, pause", [("SIGTERM", 1.2), ("SIGINT", 0.0)])
def test_a_later_second_signal_exits_at_once(first, pause):
    """A second signal after DUPLICATE_S, or any second SIGINT (a person), exits without saving."""
    code = (f"import os, signal, time\nfrom maxlm.preemption import StopRequest\nwith StopRequest():\n"
            f"    os.kill(os.getpid(), signal.{first}); time.sleep({pause})\n"
            f"    os.kill(os.getpid(), signal.{first}); time.sleep(5)\nprint('survived')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 128 + getattr(signal, first) and "survived" not in r.stdout, r.stderr
    assert f"maxlm: second {first}: exiting now without saving" in r.stderr


def test_a_signal_ends_a_wait_for_data_only_inside_interruptible(capsys):
    import threading

    from maxlm.preemption import Interrupted

    with StopRequest() as stop:
        with pytest.raises(Interrupted), stop.interruptible():
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
            threading.Event().wait(30)  # a read that never returns
        assert stop.requested()
        with stop.interruptible():  # asked before this wait: the step boundary acts on it, not the wait
            pass
    with StopRequest() as stop:  # outside a wait for data the signal only sets the flag
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested()
