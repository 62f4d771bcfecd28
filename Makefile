# Quick start: `make demo` runs the demo, `make test` runs lint, types, the docs build and the
# test suite (every sample in README.md and docs/ runs in tests/docs).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

REQUEST_PATH_TESTS := tests/integration/test_requests.py tests/integration/test_slow_handlers.py \
	tests/integration/test_deadlines_under_churn.py tests/integration/test_client_hardening.py \
	tests/integration/test_spoofed_replies.py tests/integration/test_request_headers_size.py \
	tests/integration/test_resilience.py tests/integration/test_auth.py tests/integration/test_agent_faults.py \
	tests/integration/test_task_errors.py tests/integration/test_streams.py

.PHONY: test-no-shortcuts demo test lint typecheck docs pytest bench schemas clean chaos chaos-short soak

$(PY):
	$(PYTHON) -c 'import sys; sys.exit("Python >= 3.11 is required") if sys.version_info < (3, 11) else None'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[dev,fast,edge,docs,mcp]'
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

# The documentation site, built strict: a broken link, anchor or API reference fails.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir $(VENV)/site

# The request path with reach's nats-py shortcuts off (CI runs it after make test).
test-no-shortcuts: $(STAMP)
	REACH_NATS_SHORTCUTS=false $(VENV)/bin/pytest -q $(REQUEST_PATH_TESTS)

test: lint typecheck docs pytest

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,fast,edge,bench]'
	$(PY) bench/request_reply.py
	$(PY) bench/streams.py
	$(PY) bench/registry_scale.py
	$(PY) bench/routing.py all
	$(PY) bench/tasks.py
	$(PY) bench/topics.py
	$(PY) bench/schedules.py
	$(PY) bench/gateway.py

# chaos.run bounds each scenario and the suite itself (a FAIL line names what waited);
# timeout(1) is the bound that holds even if Python cannot end (a stuck exit, say).
# The long run of the durable-task model (tests/integration/test_task_model.py) goes first.
chaos: $(STAMP)
	REACH_MODEL_EXAMPLES=200 timeout --kill-after=30 900 $(VENV)/bin/pytest -q -p no:cacheprovider tests/integration/test_task_model.py
	timeout --kill-after=30 5700 $(PY) -m chaos.run

chaos-short: $(STAMP)
	timeout --kill-after=30 2100 $(PY) -m chaos.run --short

soak: $(STAMP)
	$(PY) -m chaos.soak --minutes $(or $(MINUTES),10)

schemas: $(STAMP)
	$(PY) -m sdk.gen_schemas

clean:
	rm -rf $(VENV) .reach-data *.egg-info
