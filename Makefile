# kv-slot-tracker: everything runs from a local virtualenv in .venv.
#
# The stamp files inside .venv record that an install finished; they depend on
# pyproject.toml (and the dev one on the Python client's, clients/python/pyproject.toml), so
# editing the dependencies triggers a reinstall and nothing else does. Deleting .venv
# (make clean) starts over from scratch.

PYTHON ?= python3
VENV := .venv
VENV_PY := $(VENV)/bin/python
VENV_STAMP := $(VENV)/.stamp-venv
DEV_STAMP := $(VENV)/.stamp-dev
LOADTEST_STAMP := $(VENV)/.stamp-loadtest
CLIENT := clients/python

ARGS ?=
PYTEST_ARGS ?=
LINT_PATHS := $(wildcard kv_slot_tracker tests bench scripts loadtest clients docs)

.DEFAULT_GOAL := help
.PHONY: help venv dev run test lint fmt openapi clean chromium docker-lint loadtest engines

help:
	@echo "make run      start the service (ARGS='--port 8091 --config FILE')"
	@echo "make test     run the test suite (PYTEST_ARGS='-k name -x')"
	@echo "make lint     ruff check + format check + mypy (pyproject.toml [tool.mypy])"
	@echo "make fmt      ruff format + autofix"
	@echo "make openapi  write openapi.yaml from the app"
	@echo "make loadtest run Locust against a local instance (LOADTEST_TIME=60s LOADTEST_USERS=50)"
	@echo "make docker-lint  lint the Dockerfile with hadolint"
	@echo "make engines  vLLM's and SGLang's own KV-event publishers vs the reference (ARGS='--json -')"
	@echo "make venv     runtime virtualenv in $(VENV); make dev adds test/lint tools"
	@echo "make clean    remove $(VENV) and caches"

$(VENV_PY):
	$(PYTHON) -m venv $(VENV)

$(VENV_STAMP): pyproject.toml | $(VENV_PY)
	$(VENV_PY) -m pip install --upgrade pip
	$(VENV_PY) -m pip install -e .
	touch $@

# The dev install is a superset of the runtime one, so it refreshes both stamps. It adds the
# Python client (its own distribution in $(CLIENT)), which the tests drive the service with.
$(DEV_STAMP): pyproject.toml $(CLIENT)/pyproject.toml | $(VENV_PY)
	$(VENV_PY) -m pip install --upgrade pip
	$(VENV_PY) -m pip install -e '.[dev]'
	$(VENV_PY) -m pip install -e $(CLIENT)
	touch $(VENV_STAMP) $@

venv: $(VENV_STAMP)

# The load test needs the runtime install and Locust only (the loadtest extra).
$(LOADTEST_STAMP): pyproject.toml | $(VENV_PY)
	$(VENV_PY) -m pip install --upgrade pip
	$(VENV_PY) -m pip install -e '.[loadtest]'
	touch $(VENV_STAMP) $@

dev: $(DEV_STAMP)

run: venv
	$(VENV_PY) -m kv_slot_tracker $(ARGS)

# The suite runs in one process per core plus one (pytest-xdist): much of it waits on servers,
# Redis and sockets, and a third process on two cores took the suite from 578 s to 517 s.
# PYTEST_PARALLEL= runs it in one process.
PYTEST_WORKERS ?= $(shell python3 -c "import os; print(len(os.sched_getaffinity(0)) + 1)")
PYTEST_PARALLEL ?= -n $(PYTEST_WORKERS) --dist loadgroup
test: dev chromium
	scripts/with_redis.sh $(VENV_PY) -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

# Headless Chromium for tests/browser/; installed with apt-get when missing. A failed install
# does not stop the other tests: the browser tests then fail and say why.
chromium:
	-scripts/ensure_chromium.sh

# Prometheus's promtool for tests/deploy/test_alerts.py (promtool check/test rules on
# deploy/prometheus/); installed with apt-get when missing. As above, a failed install does not
# stop the other tests: the alert tests then fail and say why.
.PHONY: promtool
test: promtool
promtool:
	-scripts/ensure_promtool.sh

docker-lint: dev
	$(VENV)/bin/hadolint Dockerfile

lint: dev
	$(VENV_PY) -m ruff check $(LINT_PATHS)
	$(VENV_PY) -m ruff format --check $(LINT_PATHS)
	$(VENV_PY) -m mypy

fmt: dev
	$(VENV_PY) -m ruff check --fix $(LINT_PATHS)
	$(VENV_PY) -m ruff format $(LINT_PATHS)

openapi: venv
	$(VENV_PY) -m kv_slot_tracker.openapi_export > openapi.yaml.tmp
	mv openapi.yaml.tmp openapi.yaml

# Starts a local instance, runs Locust headless, writes CSVs to loadtest/out/.
loadtest: $(LOADTEST_STAMP)
	bash loadtest/run.sh

# The engines' own KV-event publishers (wheels in $$KV_ENGINE_WHEELS, downloaded when missing)
# against the reference selection service and this one; prints agreement per scenario.
engines: dev
	$(VENV_PY) bench/engine_conformance.py $(ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .mypy_cache .hypothesis
	rm -rf $(CLIENT)/build $(CLIENT)/dist $(CLIENT)/src/*.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
