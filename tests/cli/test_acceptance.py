"""`shardledger accept` and the consistency rate of `trend`, on ruler rounds played through the SDK."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from shardledger_cli.cli import EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE
from tests.builders import run_cli
from tests.nights import play_night

pytestmark = pytest.mark.usefixtures("spool_in_tmp")
FIVE_OK = ["ok"] * 5


@pytest.fixture(autouse=True)
def quiet_server_logs() -> Iterator[None]:
    """Keeps the in-process server's log lines out of the CLI's captured stdout."""
    with structlog.testing.capture_logs():
        yield


def accept(
    capsys: pytest.CaptureFixture[str], target: str, *argv: str
) -> tuple[int, dict[str, Any]]:
    """Runs `shardledger accept --json`; returns (exit code, parsed report)."""
    code, out, err = run_cli(capsys, "accept", *argv, "--server", target, "--json")
    assert code in (EXIT_OK, EXIT_PROBLEMS), err
    report: dict[str, Any] = json.loads(out)
    return code, report


def test_three_clean_rounds_an_interruption_and_the_reference_environment_are_accepted(
    capsys: pytest.CaptureFixture[str], target: str, tmp_path: Path
) -> None:
    root = tmp_path / "out"
    for run in ("baseline", "ruler-1", "ruler-2", "ruler-3"):
        play_night(capsys, target, root, run, FIVE_OK)
    play_night(capsys, target, root, "kill-test", ["ok", "preempted", "ok", "preempted", "ok"])

    code, report = accept(
        capsys,
        target,
        "--runs",
        "ruler-1,ruler-2,ruler-3",
        "--interruption",
        "kill-test",
        "--reference",
        "baseline",
    )

    assert code == EXIT_OK and report["verdict"] == "accept"
    steps = {s["step"]: s for s in report["steps"]}
    assert [steps[n]["status"] for n in range(1, 6)] == ["pass", "pass", "pass", "pass", "skipped"]
    assert [r["consistency_rate"] for r in steps[2]["rounds"]] == [None, 1.0, 1.0]
    assert (steps[3]["duplicates"], steps[3]["gaps"]) == (0, 0)
    assert steps[5]["reasons"] == ["no --multi-gpu run"]


def test_a_round_below_the_reports_thresholds_is_rejected_with_the_reason(
    capsys: pytest.CaptureFixture[str], target: str, tmp_path: Path
) -> None:
    root = tmp_path / "out"
    play_night(capsys, target, root, "ruler-1", FIVE_OK)
    play_night(capsys, target, root, "ruler-2", FIVE_OK, values=[0, 1, 2, 30, 40])  # drifted
    play_night(capsys, target, root, "ruler-3", ["ok", "ok", "ok", "ok", "empty"])
    play_night(capsys, target, root, "baseline", FIVE_OK, driver="560")

    code, report = accept(
        capsys, target, "--runs", "ruler-1,ruler-2,ruler-3", "--reference", "baseline"
    )

    assert code == EXIT_PROBLEMS and report["verdict"] == "reject"
    metrics = report["steps"][1]
    assert metrics["status"] == "fail"
    assert "ruler-2: consistency 60.00 % < 95.00 %" in metrics["reasons"]
    assert "ruler-3: completion 80.00 % < 99.00 %" in metrics["reasons"]
    assert "ruler-3: silent errors 20.00 % > 1.00 %" in metrics["reasons"]
    assert report["steps"][3]["status"] == "fail"  # every round ran on driver 550, not 560

    code, text, _ = run_cli(
        capsys,
        "accept",
        "--runs",
        "ruler-1,ruler-2,ruler-3",
        "--min-completion",
        "0.8",
        "--max-silent",
        "0.2",
        "--min-consistency",
        "0.6",
        "--min-rounds",
        "3",
        "--format",
        "table",
        "--server",
        target,
    )
    assert code == EXIT_OK and "verdict: ACCEPT" in text  # thresholds are configurable


def test_too_few_rounds_and_bad_thresholds(
    capsys: pytest.CaptureFixture[str], target: str, tmp_path: Path
) -> None:
    play_night(capsys, target, tmp_path / "out", "ruler-1", FIVE_OK)

    code, report = accept(capsys, target, "--runs", "ruler-1")

    assert code == EXIT_PROBLEMS
    assert report["steps"][0]["reasons"] == ["1 rounds, fewer than 3"]
    code, _, err = run_cli(capsys, "accept", "--runs", "ruler-1", "--max-silent", "5")
    assert code == EXIT_USAGE and "between 0 and 1" in err


def test_trend_reports_consistency_between_runs_sharing_shards_and_ruler_digests(
    capsys: pytest.CaptureFixture[str], target: str, tmp_path: Path
) -> None:
    root = tmp_path / "out"
    play_night(capsys, target, root, "ruler-1", FIVE_OK)
    play_night(capsys, target, root, "ruler-2", FIVE_OK, values=[0, 1, 2, 3, 99])
    play_night(capsys, target, root, "ruler-3", FIVE_OK, values=[0, 1, 2, 3, 99])

    code, out, _ = run_cli(capsys, "trend", "--json", "--server", target)

    report = json.loads(out)
    assert code == EXIT_PROBLEMS  # ruler-2's s4 changed inside one fingerprint group
    pairs = {(c["run_id"], c["previous_run_id"]): c for c in report["consistency"]}
    assert pairs[("ruler-2", "ruler-1")]["consistency_rate"] == 0.8
    assert pairs[("ruler-3", "ruler-2")]["consistency_rate"] == 1.0
    digests = [r["digest"] for r in report["ruler_digests"]]
    assert len(digests) == 3 and digests[0] != digests[1] == digests[2]
