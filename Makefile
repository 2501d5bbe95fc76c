# `make train` and `make test` work on a fresh machine: the venv is built on first use.
# PYTHON=/path/to/python3.12 overrides the interpreter search.
PYTHON ?= $(shell for p in python3.13 python3.12 "$$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python3.12" python3; do \
	  command -v "$$p" >/dev/null 2>&1 && "$$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { echo "$$p"; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: test-malformed train test test-slow test-all test-ci clean
train: $(VENV)/.installed
	$(PY) train.py configs/tiny.yml $(ARGS)

# libtpu lets the tests compile for real TPU topologies on this CPU machine. It lives outside the venv's
# site-packages and is named only for the tests, so ordinary runs never try (noisily) to start a TPU.
LIBTPU := $(CURDIR)/$(VENV)/tpu/libtpu/libtpu.so
# jax's CUDA plugin compiles for H100/H200 targets with no GPU (compile_topology=h100-8); kept out of the
# venv's site-packages for the same reason, and found through MAXLM_CUDA_PLUGIN (maxlm/aot.py).
CUDA_PLUGIN := $(CURDIR)/$(VENV)/cuda
TEST_ENV := JAX_PLATFORMS=cpu TPU_LIBRARY_PATH=$(LIBTPU) MAXLM_CUDA_PLUGIN=$(CUDA_PLUGIN)
# Two pytest workers (pytest-xdist), one file each at a time, so that a file's module fixtures run once.
# One worker leaves a core idle whenever a test waits on a subprocess, a save or Slurm's scheduler. Each
# worker holds ~3 GB; TEST_JOBS=1 runs the suite in one process.
TEST_JOBS ?= 2
PYTEST := $(TEST_ENV) $(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile

test: $(VENV)/.installed-dev
	$(PYTEST) tests $(PYTEST_ARGS)

test-slow: $(VENV)/.installed-dev
	$(PYTEST) -m slow tests $(PYTEST_ARGS)

# Every mistake and outside fault the tests make (docs/errors.md): both suites, less the full-size compiles.
test-malformed: $(VENV)/.installed-dev
	$(PYTEST) -m "malformed and not full_size" -rs tests $(PYTEST_ARGS)

# Both suites in one run: neither worker idles while the other finishes the last file of a suite.
test-all: $(VENV)/.installed-dev
	$(PYTEST) -m "" tests $(PYTEST_ARGS)

# CI's run: both suites less the `full_size` compiles (docs/testing.md names them and what they check), which
# alone would take CI's 2 cores past its time limit.
test-ci: $(VENV)/.installed-dev
	$(PYTEST) -m "not full_size" tests $(PYTEST_ARGS)

$(VENV)/.installed: requirements.txt
	@test -n "$(PYTHON)" || { echo "maxlm: error: no Python >= 3.12 found; install one or pass PYTHON=/path/to/python3.12" >&2; exit 2; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed requirements-dev.txt
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps --target $(VENV)/tpu libtpu==0.0.48.1
	$(PY) -m pip install -q --no-deps --target $(VENV)/cuda jax-cuda13-plugin==0.11.2 jax-cuda13-pjrt==0.11.2
	touch $@

clean:
	rm -rf $(VENV) runs .pytest_cache
