# The two commands a newcomer needs: `make up` (the main job) and `make test` (the whole suite).
# Both install what they need first (idempotent; see scripts/setup.sh).
PY ?= python3
VENV := .venv
ARGS ?=
PYTEST_ARGS ?=

.PHONY: up test test-fast setup setup-python

setup-python:
	@PY=$(PY) ./scripts/setup.sh python

setup:
	@PY=$(PY) ./scripts/setup.sh all

up: setup-python
	$(VENV)/bin/pdcluster up $(ARGS)

test: setup
	PATH="$(CURDIR)/.tools/bin:$$PATH" $(VENV)/bin/python -m pytest -m "not gpu" $(PYTEST_ARGS)

# The fast tier: every test that starts no process or server (pytest marker `process`, tests/conftest.py).
test-fast: setup-python
	$(VENV)/bin/python -m pytest -m "not gpu and not process" $(PYTEST_ARGS)
