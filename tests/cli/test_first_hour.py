"""The small things a newcomer's first hour tripped on, each as they saw it.

Sizes in bytes that are bytes, counts with their plural, no table header over
nothing, a spool that says how it is cleared, and an error table in the README
that holds every reason the ledger answers with.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
import structlog

from shard_client import LedgerClient
from shard_client.spool import Spool
from shard_client.spooldir import drain_spool_dirs
from tests.builders import committed, planned, run_cli, started
from tests.nights import play_night

pytestmark = pytest.mark.usefixtures("spool_in_tmp")
REPO: Final = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def quiet_server_logs() -> Iterator[None]:
    with structlog.testing.capture_logs():
        yield


def test_the_html_report_says_its_size_in_bytes(
    capsys: pytest.CaptureFixture[str], target: str, tmp_path: Path
) -> None:
    play_night(capsys, target, tmp_path / "out", "night-1", ["ok", "empty"])
    page = tmp_path / "night.html"
    code, out, err = run_cli(capsys, "report", "night-1", "--html", str(page), "--server", target)
    assert code == 0, err
    text = page.read_text(encoding="utf-8")
    assert len(text) != page.stat().st_size  # the page holds non-ASCII ("·")
    assert f"({page.stat().st_size} bytes, no external resources)" in out


def test_one_duplicate_and_one_shard_to_rerun_are_singular(
    capsys: pytest.CaptureFixture[str], target: str, tmp_path: Path
) -> None:
    root = tmp_path / "out"
    play_night(capsys, target, root, "night-1", ["ok", "empty"])
    play_night(capsys, target, root, "night-1", ["ok"], shard_ids=["s0"])  # a second result
    code, out, err = run_cli(capsys, "status", "night-1", "--server", target, "--format", "table")
    assert code == 1, err
    assert re.search(r"^duplicates\s+1 shard: ", out, re.MULTILINE), out
    code, _, err = run_cli(capsys, "resume", "night-1", "--server", target)
    assert code == 1
    assert err.startswith("1 shard to re-run")


def test_a_piped_verify_with_nothing_to_list_prints_no_empty_table(
    capsys: pytest.CaptureFixture[str], target: str, tmp_path: Path
) -> None:
    root = tmp_path / "out"
    play_night(capsys, target, root, "night-1", ["ok", "ok"])
    code, out, err = run_cli(capsys, "verify", "night-1", "--root", str(root), "--server", target)
    assert code == 0, err
    assert out.splitlines() and all(line.startswith("# ") for line in out.splitlines()), out


def test_spool_status_says_where_refused_events_are_and_how_to_clear_the_spool(
    capsys: pytest.CaptureFixture[str], client: LedgerClient, target: str, tmp_path: Path
) -> None:
    client.append([planned("a", "s1")])
    directory = tmp_path / "spools" / "host-1-abc"
    with Spool(directory) as spool:
        spool.append([started("a", "never-planned", "att").SerializeToString()])
    (directory / "target").write_text(target + "\n")
    [drained] = drain_spool_dirs(str(tmp_path / "spools"))
    assert (drained.rejected, drained.remaining) == (1, 0)
    code, out, err = run_cli(capsys, "spool", "status", "--dir", str(tmp_path / "spools"))
    assert code == 0, err
    rejected = directory / "rejected.jsonl"
    assert f"1 event(s) the ledger refused are in {rejected}, each with its reason" in out
    assert f"once read, `rm -r {directory}` clears it" in out


def test_the_readmes_error_table_names_every_reason_the_ledger_answers_with() -> None:
    source = "\n".join(
        p.read_text(encoding="utf-8") for p in (REPO / "ledger_server").rglob("*.py")
    )
    reasons = set(re.findall(r'\breason(?:: Final)? ?= ?"([A-Z_]+)"', source))
    # An import is the CLI's own (`shardledger import`), never a gRPC answer.
    reasons -= {"RUN_EXISTS", "IMPORT_REJECTED"}
    assert {"INPUT_CHANGED", "RUN_NOT_FOUND", "TOKEN_EXPIRED"} <= reasons
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    table = readme.split("## Error model", 1)[1]
    assert sorted(r for r in reasons if f"`{r}`" not in table) == []


def test_shards_attempts_shows_the_jobs_start_the_receive_time_and_late(
    capsys: pytest.CaptureFixture[str], client: LedgerClient, target: str
) -> None:
    from tests.server.test_late_events import made_ago

    client.append([planned("night", "s0")])
    client.append([made_ago(started("night", "s0", "a0"), 27)])
    client.append([made_ago(committed("night", "s0", "a0"), 0)])
    code, out, err = run_cli(capsys, "shards", "night", "--attempts", "--server", target)
    assert code == 0, err
    header, row = (line.split("\t") for line in out.splitlines())
    cells = dict(zip(header, row, strict=True))
    assert cells["STARTED"] < cells["RECEIVED"]  # the job's clock, 27 s before the drain
    # 27 s, give or take each call's own time in transit on a loaded machine.
    assert re.fullmatch(r"late \(its start waited 2[5-9] s\)", cells["LATE"]), cells["LATE"]
    code, out, err = run_cli(capsys, "status", "night", "--server", target, "--format", "plain")
    assert "late events\t1 attempt(s) whose events reached the ledger late" in out


def test_events_show_the_jobs_clock_beside_the_receive_time(
    capsys: pytest.CaptureFixture[str], client: LedgerClient, target: str
) -> None:
    from tests.server.test_late_events import made_ago

    client.append([planned("night", "s0")])
    client.append([made_ago(started("night", "s0", "a0"), 27)])
    code, out, err = run_cli(capsys, "events", "night", "--server", target)
    assert code == 0, err
    head, *rows = (line.split("\t") for line in out.splitlines())
    start = dict(zip(head, rows[1], strict=True))  # rows[0] is the plan, made by no job
    assert start["JOB TIME"] < start["TIME"]  # made 27 s before the ledger had it
    code, out, err = run_cli(capsys, "events", "night", "--server", target, "--format", "table")
    assert f"{start['TIME']} (job clock {start['JOB TIME']}) s0 a0 started" in out
