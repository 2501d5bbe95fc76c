"""StopRequest: a signal becomes a flag the loop reads; the exit code says which signal it was."""

import os
import signal

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
