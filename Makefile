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
# Tests that start no process run on both cores (pytest-xdist). Those that start processes run in the order
# tests/topologies.py gives them, sharing the topologies it starts once per run: the vLLM pair's users first and
# alone (beside the fast tier, the vLLM servers' start-up slowed its tests 2-5x: 167 s for both against 90 + 63 s
# one after the other), then the rest on two workers: the shared topologies' users on one in order (xdist group
# `topologies`), the e2e tests with clusters of their own on the other (group `own_clusters`), then the light
# tests a module at a time on whichever worker is free.
PARALLEL := -n 2 --dist worksteal
PROCESS_PARALLEL := -n 2 --dist loadgroup

test: setup
	@export PATH="$(CURDIR)/.tools/bin:$$PATH"; \
	$(PYTEST) -m "not gpu and not process" $(PARALLEL) $(PYTEST_ARGS); fast=$$?; \
	$(PYTEST) -m "not gpu and process and vllm_pair" $(PYTEST_ARGS); vllm=$$?; \
	$(PYTEST) -m "not gpu and process and not vllm_pair" $(PROCESS_PARALLEL) $(PYTEST_ARGS); slow=$$?; \
	for rc in $$fast $$vllm $$slow; do test $$rc -eq 0 -o $$rc -eq 5 || exit 1; done

# The fast tier: every test that starts no process or server (pytest marker `process`, tests/conftest.py).
test-fast: setup-python
	$(PYTEST) -m "not gpu and not process" $(PARALLEL) $(PYTEST_ARGS)
