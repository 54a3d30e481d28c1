# The few commands people run. `make demo` and `make test` set up .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
export SGLANG_PLATFORM ?= unicache_cpu

.PHONY: setup demo test lint format bench

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

demo: setup
	$(PY) -m sglang_unicache.demo

test: setup
	$(PY) -m pytest -q -p no:warnings

lint: setup
	$(VENV)/bin/ruff check sglang_unicache tests benchmarks examples

format: setup
	$(VENV)/bin/ruff format sglang_unicache tests benchmarks examples
