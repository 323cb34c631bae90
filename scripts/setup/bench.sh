#!/usr/bin/env bash
# Router benchmark tools (benchmarks/router.py): wrk from Debian, and the `bench` extra (vllm-router 0.1.17,
# the Rust anchor, and py-spy) into .venv. Idempotent: does nothing when all three are there. The test suite
# does not need them, so a failure here warns and lets the rest of the setup go on.
set -uo pipefail
cd "$(dirname "$0")/../.."

if ! command -v wrk >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get install -y -q wrk >/dev/null 2>&1 \
    || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q wrk >/dev/null 2>&1; } \
    || echo "bench.sh: warning: could not install wrk (apt-get install wrk); benchmarks/router.py needs it" >&2
fi
if [ ! -x .venv/bin/vllm-router ] || [ ! -x .venv/bin/py-spy ]; then
  .venv/bin/python -m pip install -q "vllm-router==0.1.17" "py-spy>=0.3.14" \
    || echo "bench.sh: warning: could not install vllm-router/py-spy (pip install -e '.[bench]')" >&2
fi
echo "bench.sh: $(command -v wrk >/dev/null && wrk -v 2>&1 | head -1 | cut -c1-24); vllm-router" \
     "$(.venv/bin/pip show vllm-router 2>/dev/null | sed -n 's/^Version: //p')"
exit 0
