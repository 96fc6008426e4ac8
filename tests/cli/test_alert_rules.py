"""The example Prometheus alert rules load in promtool and pass their unit tests."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tools" / "check_alerts.sh"
RULES_DIR = ROOT / "deploy" / "prometheus"


def test_alert_rules_pass_promtool_check_and_unit_tests() -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (apt-get install prometheus); CI installs it")
    result = subprocess.run(
        ["bash", str(CHECK)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_severity_annotations_and_a_unit_test() -> None:
    rules = (RULES_DIR / "alerts.yml").read_text()
    tests = (RULES_DIR / "alerts_test.yml").read_text()
    names = re.findall(r"^\s*- alert: (\w+)$", rules, flags=re.MULTILINE)

    assert len(names) >= 6
    for field in ("severity: ", "summary: ", "description: "):
        assert rules.count(field) == len(names), field
    untested = [n for n in names if f"alertname: {n}\n" not in tests]
    assert not untested
