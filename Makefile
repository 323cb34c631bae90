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

# Bytecode caches are written even where the environment sets PYTHONDONTWRITEBYTECODE: without them every pytest
# process (each xdist worker) recompiles our modules and re-rewrites the asserts of ~170 test modules, about 3 s
# of CPU per process per run (the __pycache__ folders are git-ignored).
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/python -m pytest
# Tests that start no process run on both cores (pytest-xdist), alone (beside them, the vLLM servers' start-up
# slowed the fast tests 2-5x). Those that start processes then run on three workers, sharing the topologies
# tests/topologies.py starts once per run: the vLLM pair's users on one (xdist group `vllm_pair`), the shared
# reference topologies' users on another in order (group `topologies`), the e2e tests with clusters of their own on
# the third (group `own_clusters`), then the light tests a module at a time on whichever worker is free. Those tests
# wait on processes (starts, drains, restarts, timeouts) for about a quarter of their time on two workers; a third
# fills that time, and the vLLM pair's users no longer run alone (62 s of a quiet `make test` before).
PARALLEL := -n 2 --dist worksteal
PROCESS_PARALLEL := -n 3 --dist loadgroup

test: setup
	@export PATH="$(CURDIR)/.tools/bin:$$PATH"; \
	$(PYTEST) -m "not gpu and not process" $(PARALLEL) $(PYTEST_ARGS); fast=$$?; \
	$(PYTEST) -m "not gpu and process" $(PROCESS_PARALLEL) $(PYTEST_ARGS); slow=$$?; \
	for rc in $$fast $$slow; do test $$rc -eq 0 -o $$rc -eq 5 || exit 1; done

# The fast tier: every test that starts no process or server (pytest marker `process`, tests/conftest.py).
test-fast: setup-python
	$(PYTEST) -m "not gpu and not process" $(PARALLEL) $(PYTEST_ARGS)
