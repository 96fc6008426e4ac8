"""`shardledger demo`: every injected failure form is found with its reason, and the rerun completes.

The demo runs once, small (40 shards, 2 workers, 3 steps), as a subprocess
with --json and --keep, so its forkserver, signals and server restart stay out
of the test process; the tests then read its report and the files it kept. A
second, smaller run against an external ledger goes at the same time: both
spend most of their time waiting for silent attempts to go stale.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ledger_server.config import ServerConfig
from ledger_server.server import create_server
from shardledger_cli.cli import main as cli
from shardledger_cli.commands.plan_entries import entries_from_manifest
from shardledger_cli.demo.faults import EXPECTED_REASON, FORMS, MIN_SHARDS, FaultPlan
from shardledger_cli.demo.report import render
from tests.cli.test_piped_output import BOXES, plain_problems

DEMO_ARGS = ["--shards", "40", "--workers", "2", "--steps", "3", "--seed", "7"]
EXTERNAL_ARGS = ["--shards", "20", "--workers", "2", "--steps", "2", "--seed", "3"]
PIPES: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}


@dataclass(frozen=True, slots=True)
class Runs:
    """The two demo runs: the embedded one (JSON report, kept dir) and the external one."""

    code: int
    report: dict[str, Any]
    work: Path
    external: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """Runs both demos concurrently, once for the module."""
    base = tmp_path_factory.mktemp("demo")
    work = base / "kept"
    server = create_server(ServerConfig(database=str(base / "external.db"), listen="127.0.0.1:0"))
    embedded = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardledger_cli",
            "demo",
            *DEMO_ARGS,
            "--json",
            "--keep",
            str(work),
        ],
        **PIPES,
    )
    external_argv = [sys.executable, "-m", "shardledger_cli", "demo", *EXTERNAL_ARGS]
    external = subprocess.Popen([*external_argv, "--server", f"127.0.0.1:{server.port}"], **PIPES)
    try:
        out, err = embedded.communicate(timeout=240)
        ext_out, ext_err = external.communicate(timeout=240)
    finally:
        for proc in (embedded, external):
            if proc.poll() is None:
                proc.kill()
        server.stop(0.5)
    assert out, err
    done = subprocess.CompletedProcess(external_argv, external.returncode, ext_out, ext_err)
    yield Runs(embedded.returncode, json.loads(out), work, done)


@pytest.fixture
def demo(runs: Runs) -> tuple[int, dict[str, Any], Path]:
    """Returns the embedded run: (exit code, JSON report, kept work dir)."""
    return runs.code, runs.report, runs.work


def test_demo_exits_zero_when_the_ledger_matches_the_injected_faults(
    demo: tuple[int, dict[str, Any], Path],
) -> None:
    code, report, _ = demo
    failed = [c for c in report["ground_truth"]["checks"] if not c["ok"]]
    assert failed == []
    assert report["ground_truth"]["matched"]
    assert code == 0


def test_resume_list_is_exactly_the_injected_failures_with_their_reasons(
    demo: tuple[int, dict[str, Any], Path],
) -> None:
    _, report, _ = demo
    truth = report["ground_truth"]
    assert truth["found"] == truth["expected"]
    assert sorted(Counter(truth["found"].values()).items()) == [
        ("failed:incomplete", 1),
        ("failed:timeout", 2),
        ("verify_failed:empty", 1),
        ("verify_failed:nan_or_inf", 1),
    ]
    for form in FORMS:
        for row in report["faults"][form]:
            assert row["found"] == EXPECTED_REASON.get(form, "verified"), (form, row)


def test_resume_file_holds_the_original_plan_lines_of_the_failed_shards(
    demo: tuple[int, dict[str, Any], Path],
) -> None:
    _, report, work = demo
    planned = {
        e.shard_id: e.plan_line for e in entries_from_manifest(str(work / "plan.jsonl"), workers=2)
    }
    lines = (work / "resume.jsonl").read_text().splitlines()
    expected = report["ground_truth"]["expected"]
    assert sorted(lines) == sorted(planned[shard_id] for shard_id in expected)


def test_duplicate_retry_counts_as_wasted_and_drift_makes_two_fingerprint_groups(
    demo: tuple[int, dict[str, Any], Path],
) -> None:
    _, report, _ = demo
    before = report["summary_before"]
    assert before["duplicates"] == {"nondeterministic": 0, "wasted": 1, "zombie": 0}
    assert sorted(before["fingerprint_groups"].values()) == [2, 38]
    assert before["silent_errors"] == 3
    assert before["submitted"] == before["verified"] + before["failed"] == 40


def test_ledger_server_was_killed_mid_run_and_no_spooled_event_was_lost_or_doubled(
    demo: tuple[int, dict[str, Any], Path],
) -> None:
    _, report, _ = demo
    kill = report["server_kill"]
    assert kill["happened"]
    assert kill["spooled_events"] > 0 and kill["attempts"] > 0
    assert kill["stored_after"] == kill["spooled_events"]
    checks = {c["name"]: c for c in report["ground_truth"]["checks"]}
    assert checks["no event lost or doubled"]["ok"]


def test_watchdog_dumped_the_hung_jobs_stack_before_killing_it(
    demo: tuple[int, dict[str, Any], Path],
) -> None:
    _, report, _ = demo
    steps = sorted(tuple(a["steps"]) for a in report["watchdog"])
    assert steps == [("diagnostics", "SIGTERM", "SIGKILL"), ("process already gone",)]
    # faulthandler writes "line N in _hang", py-spy (when installed) "_hang (worker.py:N)".
    assert any("_hang" in line for line in report["hang_stack"])


def test_rerun_of_the_resume_list_reaches_full_completion(
    demo: tuple[int, dict[str, Any], Path],
) -> None:
    _, report, work = demo
    resume, after = report["resume"], report["summary_after"]
    assert (resume["recomputed"], resume["total"]) == (5, 40)
    assert after["completion_rate"] == 1.0
    assert after["verified"] == after["submitted"] == 40
    assert report["after"]["resume_list"] == 0
    assert (work / "resume-after-rerun.jsonl").read_text() == ""
    assert report["verify_after"]["failed"] == 0


def test_text_report_explains_how_each_failure_form_was_caught(
    demo: tuple[int, dict[str, Any], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, report, _ = demo
    render(report)
    out = capsys.readouterr().out
    assert "what just happened" in out
    for phrase in ("failed(incomplete)", "as empty", "nan_or_inf", "wasted", "fingerprint groups"):
        assert phrase in out
    assert "every injected fault was found" in out
    assert "completion rate 100.0 %" in out


def test_the_report_tells_one_recomputed_figure_and_checks_in_the_equations_terms(
    demo: tuple[int, dict[str, Any], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, report, _ = demo
    render(report)
    out = capsys.readouterr().out
    before, after = report["summary_before"], report["summary_after"]
    reran = report["resume"]["recomputed"]
    # The night's own retries, the resume, and the two together: named apart, adding up.
    assert after["recomputed"] == before["recomputed"] + reran
    assert f"resume reran {reran} of 40 shards" in out
    row = next(line for line in out.splitlines() if line.startswith("recomputed (ran more"))
    assert row.split("\t")[1:] == [
        f"{before['recomputed']} ({100 * before['recomputed_rate']:.1f} %)",
        f"{after['recomputed']} ({100 * after['recomputed_rate']:.1f} %)",
    ]
    check = next(line for line in out.splitlines() if line.startswith("reconciliation and"))
    failed = before["by_state"]["failed"]
    assert f"+ failed {failed} + verify_failed {before['verify_failed']} of 40" in check


def test_piped_report_is_plain_blocks_and_on_a_terminal_draws_tables(
    demo: tuple[int, dict[str, Any], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, report, _ = demo
    render(report)  # stdout captured: not a terminal, as in a CI log
    out = capsys.readouterr().out
    assert plain_problems(out, table=True) == [], out
    assert "# injected failures" in out and "# the ledger vs what was injected" in out
    render(report, plain=False)
    assert BOXES.search(capsys.readouterr().out)


def test_fault_plan_is_seeded_disjoint_and_small() -> None:
    plan = FaultPlan.choose(200, 7)
    assert plan == FaultPlan.choose(200, 7)
    assert plan != FaultPlan.choose(200, 8)
    assert sorted(Counter(plan.by_index.values()).values()) == [1, 1, 1, 1, 1, 1, 2]
    assert 0.02 <= len(plan.by_index) / 200 <= 0.04


def test_demo_refuses_too_few_shards_and_a_non_empty_keep_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli(["demo", "--shards", str(MIN_SHARDS - 1)])
    assert exc.value.code == 2
    (tmp_path / "something").write_text("x")
    assert cli(["demo", "--keep", str(tmp_path)]) == 2
    assert "must be a new or empty directory" in capsys.readouterr().err


def test_demo_against_an_external_ledger_skips_the_server_kill_and_says_so(runs: Runs) -> None:
    proc = runs.external
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ledger server kill skipped: the ledger is external (--server)" in proc.stdout
    assert "every injected fault was found" in proc.stdout
