"""The example Prometheus alert rules load in promtool and pass their unit tests."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tools.alerts.windows import format_duration, parse_duration, scale_rules

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tools" / "alerts" / "check.sh"
RULES_DIR = ROOT / "deploy" / "prometheus"


@pytest.mark.prometheus
def test_alert_rules_pass_promtool_check_and_unit_tests() -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (apt-get install prometheus); CI installs it")
    result = subprocess.run(
        ["bash", str(CHECK)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_severity_annotations_a_runbook_section_and_a_unit_test() -> None:
    rules = (RULES_DIR / "alerts.yml").read_text()
    tests = (RULES_DIR / "alerts_test.yml").read_text()
    runbook = (ROOT / "docs" / "alerts.md").read_text()
    names = re.findall(r"^\s*- alert: (\w+)$", rules, flags=re.MULTILINE)

    assert len(names) >= 14
    for field in ("severity", "summary", "description", "runbook"):
        assert len(re.findall(rf"^ +{field}: ", rules, flags=re.MULTILINE)) == len(names), field
    links = re.findall(r"runbook: docs/alerts\.md#(\w+)$", rules, flags=re.MULTILINE)
    assert links == [n.lower() for n in names]
    # Each anchor is a heading of the runbook, so the link lands on the alert's section.
    assert [n for n in names if f"\n## {n}\n" not in runbook] == []
    untested = [n for n in names if f"alertname: {n}\n" not in tests]
    assert not untested


def test_scaled_windows_shorten_every_duration_and_time_threshold_only() -> None:
    rules = (RULES_DIR / "alerts.yml").read_text()

    fast = scale_rules(rules, 0.01)

    assert "keep_firing_for: 9s" in fast and "keep_firing_for: 15m" not in fast
    assert "for: 6s" in fast  # for: 10m
    assert "rate(shardledger_events_rejected_total[3s])" in fast  # [5m]
    assert "time() - shardledger_run_settled_timestamp_seconds > 6\n" in fast  # > 600
    assert "shardledger_run_completion_ratio < 0.99" in fast  # a ratio is not a window
    assert 'up{job="shardledger"} == 0\n        for: 1s' in fast  # 2m, never below 1 s
    assert scale_rules(rules, 1.0).count("\n") == rules.count("\n")
    with pytest.raises(ValueError, match="positive"):
        scale_rules(rules, 0)


@pytest.mark.parametrize(
    ("text", "seconds", "back"),
    [("90s", 90, "90s"), ("1h30m", 5400, "90m"), ("500ms", 0.5, "1s"), ("2h", 7200, "2h")],
)
def test_durations_parse_and_format_as_prometheus_writes_them(
    text: str, seconds: float, back: str
) -> None:
    assert parse_duration(text) == seconds
    assert format_duration(seconds) == back
