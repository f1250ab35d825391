# Two commands on a fresh machine: `make demo` and `make test`.
# The pinned CPU build of torch is installed first so that `torch>=2.4` in
# pyproject.toml never pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,hf]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/driftless demo

test: $(STAMP)
	$(PY) -m pytest tests

lint: $(STAMP)
	$(VENV)/bin/ruff check driftless tests bench
	$(VENV)/bin/lint-imports

bench: $(STAMP)
	$(PY) bench/objectives.py
	$(PY) bench/train_step.py
	$(PY) bench/rollout.py

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
