#!/usr/bin/env bash
# Checks the example Prometheus alert rules: syntax (promtool check rules) and
# behaviour (promtool test rules). Exits non-zero on any failure; exits 0 with a
# message only when promtool is not installed (apt-get install prometheus).
set -euo pipefail
cd "$(dirname "$0")/../deploy/prometheus"

if ! command -v promtool >/dev/null 2>&1; then
  echo "promtool not installed: skipping the alert rule checks (apt-get install prometheus)"
  exit 0
fi

promtool check rules alerts.yml
promtool test rules alerts_test.yml
