"""Every notebook in notebooks/ runs top to bottom without an error, as CI's build step.

Each `notebooks/*.ipynb` is one test (a notebook added later is picked up by the glob). It is executed
by nbclient in a fresh ipykernel kernel started with this interpreter (the venv's python: the kernelspec
is written into a temporary JUPYTER_PATH, so a fresh clone needs no `ipykernel install`), with the
repository root as its working directory. A failure names the notebook, the failing cell and its error.

The kernel inherits this process's environment (tests/conftest.py: 8 fake CPU devices, JAX_PLATFORMS=cpu),
shares the tests' compile cache, and gets its own TMPDIR, so what a notebook writes to a temporary
directory is removed with the test's.
"""

import json
import re
import sys
import time
from pathlib import Path

import nbclient
import nbformat
import pytest
from nbclient.exceptions import CellTimeoutError

from conftest import ROOT, cli_env

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "maxlm-test-python"
# Seconds each notebook may take, kernel start to last cell (quickstart: 20 s on 2 cores with a cold
# compile cache, 9 s warm; the margin is for a machine busy with other tests);
# one not named here gets DEFAULT_LIMIT_S. pytest-timeout gets a minute more, for the kernel's shutdown.
LIMIT_S = {"quickstart.ipynb": 240, "grpo.ipynb": 720}
DEFAULT_LIMIT_S = 480
# Notebooks that train for hundreds of steps (grpo: 900 steps, 3.5 min optimized on 2 cores): in the slow
# suite, with optimized code, as a user's kernel has it.
LONG = {"grpo.ipynb"}


def limit(path: Path) -> int:
    return LIMIT_S.get(path.name, DEFAULT_LIMIT_S)


@pytest.fixture
def kernel_env(tmp_path, monkeypatch, request):
    """A kernelspec running `sys.executable -m ipykernel_launcher`, found through JUPYTER_PATH."""
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"maxlm tests ({sys.executable})", "language": "python",
        "metadata": {"debugger": False},
    }))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    # the compile cache and the patient collective timeout of the CLI tests
    env = cli_env(optimized=request.node.callspec.params["path"].name in LONG)
    env.pop("PYTHONUNBUFFERED", None)
    return {**env, "TMPDIR": str(tmp)}


def cell_error(nb, exc) -> str:
    """The first cell whose output is an error: its index, first source line and traceback's last lines."""
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                first = next((line for line in cell.source.splitlines() if line.strip()), "")
                return (f"cell {i} ({first!r}): {out['ename']}: {out['evalue']}\n"
                        + "\n".join(_strip_ansi(line) for line in out.get("traceback", [])[-8:]))
    return f"{type(exc).__name__}: {exc}"  # a timeout or a dead kernel: no error output to point at


def _strip_ansi(s: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", s)


@pytest.mark.parametrize("path", [pytest.param(p, id=p.name, marks=[pytest.mark.timeout(limit(p) + 60),
                                                                    *[pytest.mark.slow] * (p.name in LONG)])
                                  for p in NOTEBOOKS])
def test_notebook_runs(path: Path, kernel_env):
    nb = nbformat.read(path, as_version=4)
    deadline = time.monotonic() + limit(path)
    # nbclient's timeout is per cell: each cell gets what is left of the notebook's `limit`.
    client = nbclient.NotebookClient(nb, kernel_name=KERNEL, startup_timeout=120,
                                     timeout_func=lambda cell: max(1, int(deadline - time.monotonic())),
                                     resources={"metadata": {"path": str(ROOT)}})  # the kernel's cwd
    try:
        client.execute(env=kernel_env)
    except Exception as e:  # CellExecutionError, CellTimeoutError, DeadKernelError
        how = (f"ran past its limit of {limit(path)} s" if isinstance(e, CellTimeoutError)
               else "failed")
        pytest.fail(f"notebooks/{path.name} {how} at {cell_error(nb, e)}", pytrace=False)
