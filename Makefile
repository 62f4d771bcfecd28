# Quick start: `make demo` runs the demo, `make test` runs lint, types and the test suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck pytest bench schemas clean chaos chaos-short soak

$(PY):
	$(PYTHON) -c 'import sys; sys.exit("Python >= 3.11 is required") if sys.version_info < (3, 11) else None'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[dev,fast,edge]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/reach demo

lint: $(STAMP)
	$(VENV)/bin/ruff check reach services sdk tests bench chaos
	$(VENV)/bin/ruff format --check reach services sdk tests bench chaos

typecheck: $(STAMP)
	$(VENV)/bin/mypy reach

pytest: $(STAMP)
	$(VENV)/bin/pytest -q

test: lint typecheck pytest

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,fast,edge,bench]'
	$(PY) bench/request_reply.py
	$(PY) bench/registry_scale.py
	$(PY) bench/routing.py all
	$(PY) bench/tasks.py
	$(PY) bench/gateway.py

chaos: $(STAMP)
	$(PY) -m chaos.run

chaos-short: $(STAMP)
	$(PY) -m chaos.run --short

soak: $(STAMP)
	$(PY) -m chaos.soak --minutes $(or $(MINUTES),10)

schemas: $(STAMP)
	$(PY) -m sdk.gen_schemas

clean:
	rm -rf $(VENV) .reach-data *.egg-info
