#!/usr/bin/env bash
# Router benchmark tools (benchmarks/router.py): wrk from Debian, and the `bench` extra (vllm-router 0.1.17,
# the Rust anchor, and py-spy) into .venv. Idempotent: does nothing when all three are already there.
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! command -v wrk >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get install -y -q wrk >/dev/null || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q wrk >/dev/null; }
fi
if [ ! -x .venv/bin/vllm-router ] || [ ! -x .venv/bin/py-spy ]; then
  .venv/bin/python -m pip install -q "vllm-router==0.1.17" "py-spy>=0.3.14"
fi
echo "bench.sh: $(wrk -v 2>&1 | head -1 | cut -c1-40); $(.venv/bin/pip show vllm-router 2>/dev/null | grep ^Version)"
