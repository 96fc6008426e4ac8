#!/usr/bin/env bash
# Checks the Prometheus alert rules: syntax (promtool check rules), behaviour (promtool test
# rules, a case for every situation docs/alerts.md lists), and that the shortened-window
# copy the live Prometheus test loads (python -m tools.alerts.windows) is valid too.
# Exits non-zero on any failure; exits 0 with a message only when promtool is not
# installed (apt-get install prometheus).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root/deploy/prometheus"

if ! command -v promtool >/dev/null 2>&1; then
  echo "promtool not installed: skipping the alert rule checks (apt-get install prometheus)"
  exit 0
fi

promtool check rules alerts.yml
promtool test rules alerts_test.yml

scaled="$(mktemp --suffix=.yml)"
trap 'rm -f "$scaled"' EXIT
(cd "$root" && python3 -m tools.alerts.windows --scale 0.01 deploy/prometheus/alerts.yml -o "$scaled")
promtool check rules "$scaled"
