"""`python -m tools.campaign` at a tiny size: it kills, fuzzes, counts, and saves its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_tiny_campaign_reports_kills_checked_events_and_fuzz_codes(tmp_path: Path) -> None:
    out = tmp_path / "campaign.json"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "tools.campaign", "--suites", "crash,fuzz", "--kills", "2"),
            *("--fuzz-seconds", "0", "--fuzz-scale", "0.02", "--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    totals = result["totals"]
    assert result["ok"] is True
    assert result["suites"]["sqlite_sigkill"]["kills"] == totals["kills"] == 2
    assert totals["acknowledged"] > 50
    assert totals["lost"] == totals["duplicated"] == totals["moved"] == 0
    assert totals["fuzz_requests"] == sum(result["fuzz_codes"].values()) > 200
    assert "UNKNOWN" not in result["fuzz_codes"] and "INTERNAL" not in result["fuzz_codes"]
    assert f"total: 2 kills, {totals['acknowledged']} acknowledged events, 0 lost" in done.stdout
    assert "campaign: clean" in done.stdout


def test_unknown_suite_is_a_usage_error_naming_the_choices(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tools.campaign", "--suites", "crash,nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "unknown suite nope; choose from crash, replicas, failover, fuzz" in done.stderr
