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
# tests/topologies.py gives them, sharing the topologies it starts once per run. The vLLM pair's users run in a
# pytest of their own beside the fast tier (most of their time waits on two vLLM servers, which cost nothing while
# idle since cluster/vllm_site gives their NIXL progress threads a delay); their output follows the fast tier's.
# Then the rest on two workers: the shared topologies' users on one in order (xdist group `topologies`), the e2e
# tests with clusters of their own on the other (group `own_clusters`), then the light tests a module at a time on
# whichever worker is free.
PARALLEL := -n 2 --dist worksteal
PROCESS_PARALLEL := -n 2 --dist loadgroup

test: setup
	@export PATH="$(CURDIR)/.tools/bin:$$PATH"; vllm_log=$$(mktemp); \
	$(PYTEST) -m "not gpu and process and vllm_pair" $(PYTEST_ARGS) > $$vllm_log 2>&1 & vllm_pid=$$!; \
	$(PYTEST) -m "not gpu and not process" $(PARALLEL) $(PYTEST_ARGS); fast=$$?; \
	wait $$vllm_pid; vllm=$$?; cat $$vllm_log; rm -f $$vllm_log; \
	$(PYTEST) -m "not gpu and process and not vllm_pair" $(PROCESS_PARALLEL) $(PYTEST_ARGS); slow=$$?; \
	for rc in $$fast $$vllm $$slow; do test $$rc -eq 0 -o $$rc -eq 5 || exit 1; done

# The fast tier: every test that starts no process or server (pytest marker `process`, tests/conftest.py).
test-fast: setup-python
	$(PYTEST) -m "not gpu and not process" $(PARALLEL) $(PYTEST_ARGS)
