# Two commands set everything up on a fresh machine: `make train` and `make test`.
# torch is installed first, pinned to the CPU wheel on this machine's disk, unless already present;
# override with e.g. `make test TORCH=torch` (a CUDA build) or `make test TORCH='torch==2.11.0'`.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The versions the suite was last proven on (see its header); `make lock` rewrites it on purpose.
LOCK   ?= constraints.txt

.PHONY: train test install install-dev lint bench clean lock

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# torch first, so that no later requirement pulls a multi-GB CUDA build.
$(VENV)/.torch: | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet "$(TORCH)"
	touch $@

$(VENV)/.installed: pyproject.toml $(LOCK) $(VENV)/.torch
	$(PIP) install --quiet -c $(LOCK) -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(LOCK) $(VENV)/.torch
	$(PIP) install --quiet -c $(LOCK) -e ".[dev]"
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

# After `make test` passed with newer releases (e.g. `make test LOCK=/dev/null` on a fresh .venv): record them.
lock: install-dev
	{ sed -n '/^#/p' $(LOCK); $(PIP) freeze --exclude-editable | grep -viE \
	  '^(torch|memtrain|filelock|fsspec|jinja2|networkx|setuptools|sympy|typing.extensions|mpmath|markupsafe)(==| @)'; \
	} > $(LOCK).new && mv $(LOCK).new $(LOCK)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
