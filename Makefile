# Two commands set everything up on a fresh machine: `make train` and `make test`.
# torch is installed first, pinned to the CPU wheel on this machine's disk, unless already present;
# override with e.g. `make test TORCH=torch` (a CUDA build) or `make test TORCH='torch==2.11.0'`.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: train test install install-dev lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# torch first, so that no later requirement pulls a multi-GB CUDA build.
$(VENV)/.torch: | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet "$(TORCH)"
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(PIP) install --quiet -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(VENV)/.torch
	$(PIP) install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

train: install
	$(VENV)/bin/memtrain train

test: install-dev
	$(PY) -m pytest

lint: install-dev
	$(PY) -m ruff check memtrain tests benchmarks

bench: install
	$(VENV)/bin/memtrain bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
