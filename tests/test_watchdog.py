"""The watchdog: a process that stops making progress prints every thread's stack and one `maxlm: error:` line
saying what it waited for, and exits 5; the start-up cost is reported with the first step."""

import json
import subprocess
import sys
import time

import pytest
from conftest import ROOT, cli_env

from maxlm import config, loop

ERROR = "maxlm: error: "

# A process that marks one wait and then blocks in it, with a second thread asleep elsewhere.
STALL = """
import sys, threading, time
from maxlm.watchdog import Watchdog
def reader():
    time.sleep(60)
threading.Thread(target=reader, daemon=True).start()
with Watchdog(float(sys.argv[1])) as wd:
    for step in range(1, 4):
        wd.mark(f"data for step {step}", "check the data")
        time.sleep(float(sys.argv[2]) if step == 3 else 0.2)
print("finished")
"""


def python(code: str, *args, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=cli_env(), capture_output=True,
                          text=True, timeout=timeout)


def test_watchdog_names_the_wait_dumps_every_stack_and_exits_5():
    t = time.time()
    r = python(STALL, 1, 60)
    assert r.returncode == 5 and time.time() - t < 20, r.stderr
    lines = r.stderr.splitlines()
    assert lines[-1] == (f"{ERROR}no progress for 1s while waiting for data for step 3 (every thread's stack is above); "
                         f"check the data")
    assert sum(line.startswith(ERROR) for line in lines) == 1
    # faulthandler's dump: the main thread in its wait, the other thread in its own function.
    assert r.stderr.count("Thread 0x") >= 2 and 'line 10 in <module>' in r.stderr and "in reader" in r.stderr
    assert "finished" not in r.stdout


def test_marks_keep_the_watchdog_quiet_and_zero_turns_it_off():
    assert python(STALL, 1, 0.2).stdout == "finished\n"  # marks every 0.2 s against a 1 s limit
    assert python(STALL, 0, 1.5).stdout == "finished\n"  # watchdog_s=0: a 1.5 s wait is nobody's business


# The real CLI with one wait made endless: data (the loader's 3rd batch), a checkpoint save (step 2), or the
# device (the 3rd step's dispatch). Each must end the run, naming that wait, in about watchdog_s.
STALLED_RUN = """
import sys, time
import train as cli
from maxlm import checkpoint, train

where = sys.argv[1]
def endless(*a, **k):
    time.sleep(600)

class Stalling:
    def __init__(self, inner):
        self.inner, self.n = inner, 0
    def __getattr__(self, name):
        return getattr(self.inner, name)
    def __next__(self):
        self.n += 1
        return endless() if self.n == 3 else next(self.inner)

if where == "data":
    make = train.make_loader
    train.make_loader = lambda *a, **k: Stalling(make(*a, **k))
elif where == "save":
    save = checkpoint.Checkpointer.save
    checkpoint.Checkpointer.save = lambda self, step, *a: endless() if step == 2 else save(self, step, *a)
else:
    compile_all = train.compile_all
    def stalling_compile(*a):
        step_fn, eval_fn = compile_all(*a)
        calls = []
        def step(state, batch):
            calls.append(1)
            return endless() if len(calls) == 3 else step_fn(state, batch)
        return step, eval_fn
    train.compile_all = stalling_compile
sys.exit(cli.main(sys.argv[2:]))
"""
TINY = ["configs/tiny.yml", "model.n_layers=2", "model.d_model=64", "model.d_ff=128", "model.n_heads=4",
        "model.n_kv_heads=2", "model.head_dim=16", "seq_len=32", "global_batch_size=8", "steps=6", "log_every=1",
        "sample_tokens=0", "checkpoint.every=2", "watchdog_s=3"]


@pytest.mark.parametrize("where, what, fix", [
    ("data", "data for step 3", loop.FIX_DATA),
    pytest.param("save", "the checkpoint save of step 2", loop.FIX_SAVE, marks=pytest.mark.slow),
    pytest.param("step", "step 3 on device", loop.FIX_STEP, marks=pytest.mark.slow),
])
def test_a_stalled_loop_exits_5_naming_its_wait(tmp_path, where, what, fix):
    r = python(STALLED_RUN, where, *TINY, f"run_dir={tmp_path}", timeout=120)
    assert r.returncode == 5, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stderr.splitlines()[-1] == f"{ERROR}no progress for 3s while waiting for {what} (every thread's stack is above); {fix}"
    assert "in endless" in r.stderr  # the stack of the thread that waits
    # The start-up cost rides on the first row this run wrote, before the stall.
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["startup_compile_s"] > 0 and first["startup_total_s"] > first["startup_compile_s"]
    assert {"startup_join_s", "startup_restore_s", "startup_first_step_s"} <= first.keys()
    assert "maxlm: start-up: joined in 0.0s, compiled in" in r.stdout


def test_startup_report():
    line, fields = loop.startup_report({"join": 1.23, "compile": 20.06, "restore": 0.5, "first_step": 3.4, "total": 31.2})
    assert line == ("start-up: joined in 1.2s, compiled in 20.1s, state restored in 0.5s, first step in 3.4s; 31.2s "
                    "from process start to the first step")
    assert fields == {"startup_join_s": 1.23, "startup_compile_s": 20.06, "startup_restore_s": 0.5,
                      "startup_first_step_s": 3.4, "startup_total_s": 31.2}
    line, fields = loop.startup_report({"join": 0.0, "compile": 2.0, "init": 0.25, "first_step": 0.1, "total": None})
    assert line == "start-up: joined in 0.0s, compiled in 2.0s, state initialised in 0.2s, first step in 0.1s"
    assert fields["startup_restore_s"] == 0.25 and fields["startup_total_s"] is None
    # A fresh process's age lies within the time it took to run: a pytest worker's own age is whatever
    # the suite has spent so far (over an hour in CI).
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", "from maxlm import loop; print(loop.process_age())"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert 0 < float(out) < time.monotonic() - t0


def test_watchdog_s_is_one_key_with_a_default_for_big_jobs():
    assert config.load("configs/tiny.yml").watchdog_s == 1800
    assert config.load("configs/tiny.yml", ["watchdog_s=0"]).watchdog_s == 0
    with pytest.raises(config.ConfigError, match=r"^`watchdog_s` must be >= 0, got -1$"):
        config.load("configs/tiny.yml", ["watchdog_s=-1"])
