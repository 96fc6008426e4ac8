"""Verification failures keep their history: first pass beside now, in `status` and the HTML report.

A rerun that repairs an empty or truncated output empties "now"; the night as
first reconciled still had those failures, and every view says so, as the loud
failures' view does (every failed attempt).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from tests.builders import run_cli
from tests.nights import play_night

pytestmark = pytest.mark.usefixtures("spool_in_tmp")
TITLE = "verification failures (shards, by reason: first pass and now)"


@pytest.fixture(autouse=True)
def quiet_server_logs() -> Iterator[None]:
    with structlog.testing.capture_logs():
        yield


@pytest.fixture
def repaired(capsys: pytest.CaptureFixture[str], target: str, tmp_path: Path) -> str:
    """A night whose empty and truncated (size_mismatch) outputs were rerun and verified; returns its id."""
    root = tmp_path / "out"
    play_night(capsys, target, root, "night-1", ["ok", "empty", "truncated", "empty"])
    play_night(capsys, target, root, "night-1", ["ok", "ok"], shard_ids=["s1", "s2"])
    return "night-1"


def test_the_summary_keeps_the_first_pass_verification_failures_by_reason(
    repaired: str, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "status", repaired, "--server", target, "--json")
    assert code in (0, 1), err
    summary = json.loads(out)
    assert summary["verify_failures"] == {"empty": 1}
    assert summary["first_pass"]["verify_failures"] == {"empty": 2, "size_mismatch": 1}


def test_status_shows_each_reason_first_pass_and_now(
    repaired: str, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "status", repaired, "--server", target, "--format", "plain")
    assert code in (0, 1), err
    block = f"# {TITLE}\nREASON\tFIRST PASS\tNOW\nempty\t2\t1\nsize_mismatch\t1\t0\n"
    assert block in out


def test_the_html_report_shows_repaired_verification_failures(
    repaired: str, target: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    page = tmp_path / "night.html"
    code, _, err = run_cli(capsys, "report", repaired, "--html", str(page), "--server", target)
    assert code == 0, err
    html = page.read_text(encoding="utf-8")
    section = html.split('id="verify-failures"', 1)[1].split("</div>", 1)[0]
    assert "none" not in section
    assert "<tr><td>empty</td><td>2</td><td>1</td></tr>" in section
    assert "<tr><td>size_mismatch</td><td>1</td><td>0</td></tr>" in section
