"""The conventions every command keeps: usage errors, Examples, --json shapes, --db, --format.

Each test runs the real CLI in process against a real server on loopback (or a real
SQLite file) and asserts what a user would read.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from typing import Any

import pytest

from ledger_server.server import RunningServer
from shard_client import LedgerClient
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.errors import LedgerRejected
from shardledger_cli.cli import build_parser
from shardledger_cli.parsing import EXAMPLES_HEADING, subcommand_parsers
from tests.builders import DIGEST_A, committed, event, planned, run_cli, started

RUN = "night-01"
LONG_ID = "s-" + "0123456789abcdef" * 4  # longer than any column a table would give it
ISO_SECOND = re.compile(r"\b\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\b")


@pytest.fixture
def night(server: RunningServer, client: LedgerClient, quiet_logs: None) -> str:
    """A run with a long-id shard never started, one committed (unverified), one running."""
    client.append(
        [
            planned(RUN, LONG_ID, 0),
            planned(RUN, "s1", 1),
            planned(RUN, "s2", 2),
            started(RUN, "s1", "a1"),
            committed(RUN, "s1", "a1"),
            started(RUN, "s2", "a2"),
        ]
    )
    return f"127.0.0.1:{server.port}"


# --- usage errors -------------------------------------------------------------


def test_a_misspelt_flag_prints_the_subcommands_usage_and_the_closest_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_cli(capsys, "status", "night-01", "--jsn")
    assert code == 2 and out == ""
    assert err.startswith("usage: shardledger status ")
    assert "unrecognized arguments: --jsn (did you mean --json?)" in err


def test_a_misspelt_flag_of_a_nested_subcommand_names_that_subcommand(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run_cli(capsys, "db", "rebuild", "--chek")
    assert code == 2
    assert err.startswith("usage: shardledger db rebuild ")
    assert "did you mean --check?" in err


def test_a_misspelt_command_suggests_the_closest_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run_cli(capsys, "stauts", "night-01")
    assert code == 2
    assert "invalid choice: 'stauts'; did you mean 'status'?" in err


def test_a_misspelt_state_suggests_the_closest_state(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "shards", "night-01", "--state", "stael")
    assert code == 2
    assert err.startswith("usage: shardledger shards ")
    assert "did you mean 'stale'?" in err


# --- help ---------------------------------------------------------------------


def test_every_command_and_subcommand_has_an_examples_block() -> None:
    # Any new command, by anyone, must teach by example: this walks the whole parser.
    missing = []
    for path, parser in subcommand_parsers(build_parser()):
        text = parser.format_help()
        block = text.partition(EXAMPLES_HEADING)[2]
        commands = [line for line in block.splitlines() if line.strip().startswith("shardledger")]
        if not commands:
            missing.append(" ".join(path))
    assert not missing, f"no Examples block with a shardledger command in: {missing}"


def test_every_help_ends_with_its_one_examples_block() -> None:
    # Examples are where --help ends, once: not above the options, not twice.
    wrong = []
    for path, parser in subcommand_parsers(build_parser()):
        text = parser.format_help()
        head, _, block = text.rpartition(EXAMPLES_HEADING)
        tail_lines = [line for line in block.splitlines()[1:] if line.strip()]
        if (
            text.count(EXAMPLES_HEADING) != 1
            or not all(line.startswith("  ") for line in tail_lines)
            or "options:" not in head
        ):
            wrong.append(" ".join(path))
    assert not wrong, f"--help does not end with one Examples block: {wrong}"


def test_every_json_option_says_whether_it_prints_one_object_or_json_lines() -> None:
    vague = []
    for path, parser in subcommand_parsers(build_parser()):
        for action in parser._actions:
            if "--json" in action.option_strings:
                text = action.help or ""
                if not text.startswith(("print JSON Lines: ", "print one JSON object: ")):
                    vague.append(f"{' '.join(path)}: {text}")
    assert not vague, vague


def test_serve_help_states_each_default_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text
    assert text.count("(default: DB.signing-key.pem)") == 1
    assert "(default: 127.0.0.1:50551)" in text


# --- reaching the server ------------------------------------------------------


def test_a_refused_connection_is_reported_at_once_not_after_the_timeout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Nothing listens now; a 600 s --timeout would be waited out by a retry loop.
    code, out, err = run_cli(
        capsys, "status", "night-01", "--server", f"127.0.0.1:{port}", "--timeout", "600"
    )
    assert code == 3 and out == ""
    assert f"ledger unreachable at 127.0.0.1:{port}" in err
    assert f"nothing listens on port {port}" in err


# --- one name per concept -----------------------------------------------------


def test_shards_resume_and_status_use_the_same_state_names(
    night: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out, _ = run_cli(capsys, "shards", RUN, "--server", night, "--json")
    states = {v["shard_id"]: v["state"] for v in map(json.loads, out.splitlines())}
    assert states == {LONG_ID: "missing", "s1": "unverified", "s2": "running"}
    _, out, _ = run_cli(capsys, "resume", RUN, "--server", night, "--json")
    reasons = {e["shard_id"]: e["reason"] for e in map(json.loads, out.splitlines())}
    assert reasons == states
    _, out, _ = run_cli(capsys, "status", RUN, "--server", night, "--json")
    summary = json.loads(out)
    assert (summary["missing"], summary["unverified"], summary["running"]) == (1, 1, 1)


# --- shards -------------------------------------------------------------------


def test_shards_piped_prints_tab_separated_columns_with_the_input_and_whole_ids(
    night: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(capsys, "shards", RUN, "--server", night)
    rows = [line.split("\t") for line in out.splitlines()]
    assert code == 0
    assert rows[0][:5] == ["INDEX", "SHARD", "STATE", "DETAIL", "INPUT"]
    assert rows[1][:5] == ["0", LONG_ID, "missing", "-", f"/data/{LONG_ID}.bin"]
    assert [r[1] for r in rows[1:]] == [LONG_ID, "s1", "s2"]


def test_shards_as_a_table_aligns_columns_without_cutting_ids(
    night: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(capsys, "shards", RUN, "--server", night, "--format", "table")
    lines = out.splitlines()
    assert code == 0 and "\t" not in out
    assert lines[1].split()[1] == LONG_ID
    # Aligned: every row's state starts in the header's STATE column.
    column = lines[0].index("STATE")
    assert [line[column:].split()[0] for line in lines[1:]] == ["missing", "unverified", "running"]


def test_shards_json_is_one_view_per_line_with_its_input(
    night: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out, _ = run_cli(capsys, "shards", RUN, "--server", night, "--format", "json")
    views = [json.loads(line) for line in out.splitlines()]
    assert [v["input"] for v in views] == [f"/data/{LONG_ID}.bin", "/data/s1.bin", "/data/s2.bin"]


# --- status and runs ----------------------------------------------------------


def test_status_piped_prints_no_box_tables_and_a_terminal_format_does(
    night: str, capsys: pytest.CaptureFixture[str]
) -> None:
    boxes = re.compile("[\u2500-\u257f]")
    _, plain, _ = run_cli(capsys, "status", RUN, "--server", night)
    assert not boxes.search(plain)
    assert "missing (planned, never started)\t1\t33.3 %" in plain
    assert "unverified (committed, not yet verified)\t1\t33.3 %" in plain
    _, table, _ = run_cli(capsys, "status", RUN, "--server", night, "--format", "table")
    assert boxes.search(table)


def test_runs_print_whole_timestamps_piped_and_as_a_table(
    night: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _, plain, _ = run_cli(capsys, "runs", "--server", night)
    header, row = (line.split("\t") for line in plain.splitlines())
    assert header == ["RUN", "NAMESPACE", "EVENTS", "CREATED", "UPDATED", "HEAD", "STORED"]
    assert row[6] == "hot"
    assert row[0] == RUN and ISO_SECOND.fullmatch(row[3]) and ISO_SECOND.fullmatch(row[4])
    _, table, _ = run_cli(capsys, "runs", "--server", night, "--format", "table")
    assert len(ISO_SECOND.findall(table)) == 2, table
    _, lines, _ = run_cli(capsys, "runs", "--server", night, "--json")
    [run] = map(json.loads, lines.splitlines())
    assert run["run_id"] == RUN and run["event_count"] == 6


# --- events and resume --------------------------------------------------------


def test_events_shard_prints_only_that_shards_events(
    night: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(capsys, "events", RUN, "--server", night, "--shard", "s1", "--json")
    kinds = [
        next(k for k in ("planned", "started", "artifact_committed") if k in e)
        for e in map(json.loads, out.splitlines())
    ]
    assert code == 0 and kinds == ["planned", "started", "artifact_committed"]
    assert {json.loads(line)["shard_id"] for line in out.splitlines()} == {"s1"}


def test_resume_before_any_verify_hints_that_nothing_is_verified_yet(
    night: str, client: LedgerClient, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(capsys, "resume", RUN, "--server", night, "--format", "ids")
    assert code == 1
    assert "hint: nothing in night-01 is verified yet: the 1 shard committed" in err
    verdict = pb.ArtifactVerified(
        name="out", path="/out/x", blake3_hex=DIGEST_A, result=pb.VERIFICATION_RESULT_PASSED
    )
    client.append([event(RUN, "s1", verified=verdict)])
    code, out, err = run_cli(capsys, "resume", RUN, "--server", night, "--format", "ids")
    assert code == 1 and out.split() == [LONG_ID, "s2"]
    assert "hint" not in err


# --- one --db option ----------------------------------------------------------


def test_db_and_database_url_and_the_environment_name_the_same_database(
    db_path: Path, server: RunningServer, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    server.stop(0.5)  # a rebuild reads the file; the token commands open it directly
    for argv in (("--db", str(db_path)), ("--database-url", f"sqlite:///{db_path}")):
        code, out, err = run_cli(capsys, "token", "list", *argv, "--json")
        assert (code, out) == (0, ""), err
    monkeypatch.setenv("SHARDLEDGER_DATABASE_URL", str(db_path))
    code, _, err = run_cli(capsys, "db", "rebuild", "--check")
    assert code == 0, err


def test_a_db_command_without_a_ledger_here_says_so_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SHARDLEDGER_DATABASE_URL", raising=False)
    for argv in (("db", "rebuild", "--check"), ("db", "migrate"), ("token", "list")):
        code, _, err = run_cli(capsys, *argv)
        assert code == 5 and "no ledger at ledger.db" in err, err
    assert list(tmp_path.iterdir()) == []


# --- plan ---------------------------------------------------------------------


def test_a_re_plan_in_another_order_keeps_indexes_and_says_there_are_no_new_shards(
    night: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = []
    for name in ("a", "b"):
        (tmp_path / name).write_text(name)
        inputs.append({"input": str(tmp_path / name), "expected_outputs": ["out"]})
    manifest = tmp_path / "jobs.jsonl"
    manifest.write_text("".join(json.dumps(i) + "\n" for i in inputs))
    code, _, err = run_cli(capsys, "plan", "p", "--manifest", str(manifest), "--server", night)
    assert code == 0, err
    manifest.write_text("".join(json.dumps(i) + "\n" for i in reversed(inputs)))
    code, out, err = run_cli(capsys, "plan", "p", "--manifest", str(manifest), "--server", night)
    assert code == 0
    assert "already has 2 shards: 2 of this plan's indexes follow the stored ones" in err
    assert "no new shards" in err and "numbered from" not in err
    assert "2 shards: 0 new, 2 already planned identically" in out


def test_the_server_still_answers_the_old_state_names_for_one_release(
    night: str, client: LedgerClient
) -> None:
    # Old clients send ListShards(state="planned"/"committed"): same shards as the new names.
    for old, new in (("planned", "missing"), ("committed", "unverified")):
        assert [v.shard_id for v in client.shards(RUN, state=old)] == [
            v.shard_id for v in client.shards(RUN, state=new)
        ]
        assert {v.state for v in client.shards(RUN, state=old)} == {new}
    with pytest.raises(LedgerRejected, match="missing, running, stale, unverified"):
        list(client.shards(RUN, state="bogus"))
