#!/usr/bin/env bash
# prometheus and promtool from Debian (tests start their own prometheus on a free port with a temp
# config; the Debian service is not started). Idempotent; runs as root in CI.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "prometheus.sh: prometheus/promtool missing and not root; run: sudo apt-get install -y prometheus" >&2
  exit 1
fi
# Keep the package's service from starting: a policy-rc.d that denies every start, removed afterwards
# (only if none was there before).
policy=/usr/sbin/policy-rc.d
own_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy"
  chmod +x "$policy"
  own_policy=1
fi
cleanup() { if [ "$own_policy" = 1 ]; then rm -f "$policy"; fi; }
trap cleanup EXIT
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends prometheus >/dev/null
prometheus --version 2>&1 | head -1
