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


@pytest.mark.malformed
def test_sighup_saves_and_exits_143_like_sigterm(tmp_path):
    """A closed terminal or SSH session (SIGHUP) ended a run with exit 129 and no save: it is a SIGTERM now."""
    import json
    import time

    from conftest import start_cli

    run_dir = tmp_path / "run"
    with open(tmp_path / "log.txt", "w") as log:
        proc = start_cli("configs/tiny.yml", "model.n_layers=1", "seq_len=32", "sample_tokens=0", "steps=1000",
                         "log_every=1", "checkpoint.every=0", f"run_dir={run_dir}", devices=1, log=log)
    metrics, t = run_dir / "metrics.jsonl", time.time()
    while proc.poll() is None and time.time() - t < 120 and not (
            metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.05)
    proc.send_signal(signal.SIGHUP)
    code = proc.wait(timeout=120)
    out = (tmp_path / "log.txt").read_text()
    assert code == 143, out[-3000:]
    assert "maxlm: SIGHUP received: saving at the end of this step, then exiting" in out
    stopped = int(out.split("SIGHUP: stopped after step ")[1].split()[0])
    assert 2 <= stopped < 1000 and f"exiting with code 143" in out
    assert (run_dir / "checkpoints" / str(stopped)).is_dir()
    assert json.loads(metrics.read_text().splitlines()[-1])["step"] == stopped


def test_nohup_keeps_sighup_ignored():
    """A run started under nohup (SIGHUP ignored) goes on when its terminal closes."""
    code = ("import signal\nsignal.signal(signal.SIGHUP, signal.SIG_IGN)\nfrom maxlm import preemption\n"
            "with preemption.owned():\n    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN\n"
            "    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)\n"
            "assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL\nprint('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.stdout == "ok\n", r.stderr


@pytest.mark.parametrize("sig, code", [("SIGTERM", 143), ("SIGHUP", 143), ("SIGINT", 0)])
def test_before_the_loop_a_signal_ends_the_process_at_once_even_in_a_blocked_call(sig, code):
    """Before the loop, the signal is acted on by a thread: a main thread blocked in a C call (here a lock that
    nobody writes to, standing in for a join or a compile) does not delay it."""
    src = (f"import threading\nfrom maxlm import preemption\nwith preemption.owned():\n"
           f"    threading.Timer(0.3, lambda: __import__('os').kill(__import__('os').getpid(), "
           f"__import__('signal').{sig})).start()\n"
           f"    import os; os.read(os.pipe()[0], 1)\nprint('survived')\n")
    r = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == code and "survived" not in r.stdout, r.stderr
    assert r.stderr.splitlines() == [f"maxlm: {sig} received before the first step: exiting now with code {code}; "
                                     f"nothing new to save (re-run the same command to resume)"]


@pytest.mark.malformed
def test_a_signal_while_the_command_imports_jax_is_one_line_and_143(tmp_path):
    """Before train.run owns the signals, `python train.py` spends seconds importing jax and maxlm: a SIGTERM
    then still ends it with one line and 143 (not a bare kill, nor a traceback), and nothing is written."""
    import time

    from conftest import ROOT, cli_env

    p = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "configs/tiny.yml", f"run_dir={tmp_path / 'run'}"],
                         cwd=ROOT, env=cli_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # in the imports: the run's own handlers come seconds later
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 143, err
    assert err.strip().splitlines() == ["maxlm: SIGTERM received while the run starts or ends: exiting now with code "
                                        "143; nothing is lost (re-run the same command to resume)"], err
    assert not (tmp_path / "run" / "checkpoints").exists()
