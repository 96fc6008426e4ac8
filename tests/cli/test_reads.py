"""`shardledger status|shards|resume|events|runs` against a real server on a real SQLite file."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
from google.protobuf.duration_pb2 import Duration

from ledger_server import interceptor
from ledger_server.config import ServerConfig
from ledger_server.server import RunningServer, create_server
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.canonical import canonical_json
from shard_client.client import LedgerClient
from shardledger_cli.cli import main
from shardledger_cli.commands.resume import slurm_ranges
from shardledger_cli.output import with_resume_reason

RUN = "night-01"
ISO_SECOND = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")
REPO = Path(__file__).resolve().parents[2]
DIGEST = "d" * 64
# shard -> (plan_index, fate); resume order is plan order.
FATES = {
    "s00": (0, "verified"),
    "s01": (1, "failed"),
    "s02": (2, "planned"),
    "s03": (3, "running"),
    "s04": (4, "stale"),
    "s05": (5, "committed"),
    "s06": (6, "verify_failed"),
    "s07": (7, "planned"),
    "s08": (9, "verified"),
    "s09": (10, "planned"),
    "s10": (11, "planned"),
}


def plan_line(shard: str) -> str:
    """Returns the plan line of a shard, canonical as the server stores it."""
    return canonical_json({"cmd": ["train", "--shard", shard], "shard_id": shard, "x": "ünï"})


_IDS = itertools.count()


def ev(shard: str, attempt: str = "", run: str = RUN, **payload: Any) -> pb.ShardEvent:
    """Returns an event with a fresh, readable id."""
    event_id = f"{run}-{next(_IDS)}"
    return pb.ShardEvent(
        event_id=event_id, run_id=run, shard_id=shard, attempt_id=attempt, **payload
    )


def life(shard: str, index: int, fate: str, run: str = RUN) -> list[pb.ShardEvent]:
    """Returns the events that bring one shard to its fate."""
    plan = pb.ShardPlanned(
        input_ref=f"/in/{shard}",
        expected_outputs=["out"],
        plan_line=plan_line(shard),
        plan_index=index,
    )
    events = [ev(shard, run=run, planned=plan)]
    if fate == "planned":
        return events
    timeout = Duration(nanos=1000) if fate == "stale" else Duration(seconds=3600)
    started = pb.AttemptStarted(
        host="gpu-1", pid=7, heartbeat_timeout=timeout, fingerprint_digest="f" * 64
    )
    events.append(ev(shard, "a1", run, started=started))
    if fate == "failed":
        events.append(
            ev(shard, "a1", run, failed=pb.AttemptFailed(tag=pb.FAILURE_TAG_OOM, message="OOM"))
        )
    if fate in ("verified", "committed", "verify_failed"):
        path = f"/out/{shard}.bin"
        commit = pb.ArtifactCommitted(name="out", path=path, size_bytes=3, blake3_hex=DIGEST)
        events.append(ev(shard, "a1", run, artifact_committed=commit))
        if fate != "committed":
            ok = fate == "verified"
            verdict = pb.ArtifactVerified(
                name="out",
                path=path,
                blake3_hex=DIGEST,
                result=pb.VERIFICATION_RESULT_PASSED if ok else pb.VERIFICATION_RESULT_FAILED,
                reason="" if ok else "digest_mismatch",
            )
            events.append(ev(shard, run=run, verified=verdict))
    return events


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A real server with run night-01 (every fate) and run all-good (one verified shard)."""
    db = tmp_path_factory.mktemp("report") / "ledger.db"
    server = create_server(ServerConfig(database=str(db), listen="127.0.0.1:0"))
    client = LedgerClient(f"127.0.0.1:{server.port}")
    client.append([e for shard, (i, fate) in FATES.items() for e in life(shard, i, fate)])
    client.append(life("g0", 0, "verified", run="all-good"))
    client.close()
    time.sleep(0.01)  # the stale shard's 1 µs timeout has passed
    yield server
    server.stop(0.5)


@pytest.fixture
def cli(running: RunningServer, capsys: pytest.CaptureFixture[str]) -> Any:
    """Returns run(*argv) -> (exit code, stdout, stderr) against the fixture server."""

    def run(*argv: str) -> tuple[int, str, str]:
        code = main([argv[0], "--server", f"127.0.0.1:{running.port}", *argv[1:]])
        out, err = capsys.readouterr()
        return code, out, err

    return run


# --- status -------------------------------------------------------------------


def test_status_prints_the_reconciliation_equation_and_exits_1_when_shards_are_unverified(
    cli: Any,
) -> None:
    code, out, _ = cli("status", RUN, "--format", "table")  # the layout for a person
    assert code == 1
    assert (
        "submitted 11 = verified 2 + failed 1 + missing 4 + running 1 + stale 1 + unverified 1"
        " + verify_failed 1" in out
    )
    assert "completion rate    18.18 %" in out
    assert "silent error rate  9.09 %" in out  # the verify-failed shard reported success
    assert "oom" in out and "digest_mismatch" in out
    assert "f" * 16 in out  # the fingerprint group


def test_status_json_carries_the_server_summary(cli: Any) -> None:
    code, out, _ = cli("status", RUN, "--json")
    summary = json.loads(out)
    assert code == 1
    assert {
        k: summary[k] for k in ("submitted", "verified", "failed", "missing", "running", "stale")
    } == {
        "submitted": 11,
        "verified": 2,
        "failed": 2,
        "missing": 4,
        "running": 1,
        "stale": 1,
    }
    assert summary["unverified"] == 1
    assert summary["failure_tags"] == {"oom": 1}
    assert summary["verify_failures"] == {"digest_mismatch": 1}
    assert summary["fingerprint_groups"] == {"f" * 64: 7}


def test_each_count_status_shows_is_the_set_shards_state_lists_under_that_name(
    cli: Any,
) -> None:
    _, out, _ = cli("status", RUN, "--json")
    summary = json.loads(out)
    _, plain, _ = cli("status", RUN)
    shown = {row[0].split(" (")[0]: int(row[1]) for row in plain_block(plain, "shards")[1:]}
    assert sum(summary["by_state"].values()) == summary["submitted"] == 11
    for state, n in summary["by_state"].items():
        _, listed, _ = cli("shards", RUN, "--state", state, "--json")
        assert len(json_lines(listed)) == n == shown[state], state
    # failed is the job's own failure (s01, oom); verify_failed (s06) is apart; the old
    # --json key keeps its meaning (both) for the scripts that read it.
    assert (shown["failed"], shown["verify_failed"]) == (1, 1)
    assert (summary["failed"], summary["verify_failed"]) == (2, 1)
    fields = dict(plain_block(plain, "summary")[1:])
    assert fields["unconfirmed"].startswith("9 shards")
    _, unconfirmed, _ = cli("shards", RUN, "--state", "unconfirmed", "--json")
    assert len(json_lines(unconfirmed)) == summary["unconfirmed"] == 9


def test_status_tables_say_whether_they_count_shards_or_attempts(cli: Any) -> None:
    _, plain, _ = cli("status", RUN)
    assert plain_block(plain, "failure tags (failed shards, by their latest attempt)") == [
        ["TAG", "SHARDS"],
        ["oom", "1"],
    ]
    assert plain_block(plain, "failure tags (every failed attempt)") == [
        ["TAG", "ATTEMPTS"],
        ["oom", "1"],
    ]
    assert plain_block(plain, "verification failures (verify_failed shards)")[0] == [
        "REASON",
        "SHARDS",
    ]
    assert "incl. verify_failed" not in plain


def test_status_exits_0_when_every_planned_shard_is_verified(cli: Any) -> None:
    code, out, _ = cli("status", "all-good")
    assert code == 0
    assert "submitted 1 = verified 1 + failed 0" in out


def test_status_of_an_unknown_run_is_refused_with_exit_4(cli: Any) -> None:
    code, _, err = cli("status", "no-such-run")
    assert code == 4
    assert "RUN_NOT_FOUND" in err


def test_status_without_a_server_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["status", RUN, "--server", "127.0.0.1:1", "--timeout", "0.2"])
    assert code == 3
    assert "unreachable" in capsys.readouterr().err


# --- shards -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ("missing", ["s02", "s07", "s09", "s10"]),
        ("stale", ["s04"]),
        ("running", ["s03"]),
        ("verified", ["s00", "s08"]),
        ("failed", ["s01"]),
        ("verify_failed", ["s06"]),
        ("unverified", ["s05"]),
        # The old names, accepted for one release.
        ("planned", ["s02", "s07", "s09", "s10"]),
        ("committed", ["s05"]),
        ("unconfirmed", ["s01", "s02", "s03", "s04", "s05", "s06", "s07", "s09", "s10"]),
    ],
)
def test_shards_state_filter_lists_exactly_that_state(
    cli: Any, state: str, expected: list[str]
) -> None:
    code, out, _ = cli("shards", RUN, "--state", state, "--json")
    assert code == 0
    assert [v["shard_id"] for v in json_lines(out)] == expected


def test_shards_text_lists_one_row_per_shard_in_plan_order(cli: Any) -> None:
    code, out, _ = cli("shards", RUN)
    lines = out.splitlines()
    assert code == 0
    assert lines[0].split()[:3] == ["INDEX", "SHARD", "STATE"]
    assert [line.split()[1] for line in lines[1:]] == list(FATES)
    assert lines[2].split()[2:4] == ["failed", "oom"]


def _rerun_night(running: RunningServer, run: str) -> None:
    """Plans r0 and r1; r0 runs as Slurm job 100, is preempted, and job 200 reruns it."""

    def start(attempt: str, job: str, node: str) -> pb.ShardEvent:
        slurm = pb.SchedulerIdentity(
            kind="slurm", job_id=f"{job}9", array_job_id=job, array_task_id="0", node=node
        )
        begun = pb.AttemptStarted(
            host=node,
            pid=7,
            heartbeat_timeout=Duration(seconds=3600),
            fingerprint_digest="f" * 64,
            scheduler=slurm,
        )
        return ev("r0", attempt, run, started=begun)

    preempted = pb.AttemptFailed(tag=pb.FAILURE_TAG_PREEMPTED, message="reclaimed")
    rerun = life("r0", 0, "verified", run=run)  # planned, started a1, committed, verified
    client = LedgerClient(f"127.0.0.1:{running.port}")
    client.append(
        [
            rerun[0],
            start("a0", "100", "gpu-1"),
            ev("r0", "a0", run, failed=preempted),
            start("a1", "200", "gpu-2"),
            *rerun[2:],
            *life("r1", 1, "planned", run=run),
        ]
    )
    client.close()


def test_shards_attempts_lists_every_attempt_with_its_own_job(
    cli: Any, running: RunningServer
) -> None:
    _rerun_night(running, "rerun-night")
    _, shards, _ = cli("shards", "rerun-night")
    assert "slurm:100_0@gpu-1" not in shards  # the view shows the latest attempt's job only
    code, out, _ = cli("shards", "rerun-night", "--attempts")
    header, *rows = [line.split("\t") for line in out.splitlines()]
    assert code == 0
    assert header == [
        "INDEX",
        "SHARD",
        "ATTEMPT",
        "ATTEMPT ID",
        "OUTCOME",
        "DETAIL",
        "HOST",
        "JOB",
        "STARTED",
        "ENDED",
    ]
    assert [r[:8] for r in rows] == [
        ["0", "r0", "1", "a0", "failed", "preempted", "gpu-1", "slurm:100_0@gpu-1"],
        ["0", "r0", "2", "a1", "verified", "-", "gpu-2", "slurm:200_0@gpu-2"],
    ]  # r1 never started: no attempt, no row
    assert all(ISO_SECOND.fullmatch(c) for r in rows for c in r[8:])
    _, lines, _ = cli("shards", "rerun-night", "--attempts", "--json")
    objects = json_lines(lines)
    assert [(o["attempt"], o["attempt_id"], o["latest"]) for o in objects] == [
        (1, "a0", False),
        (2, "a1", True),
    ]
    assert objects[0]["scheduler"]["array_job_id"] == "100" and objects[0]["ended_us"]
    _, table, _ = cli(
        "shards", "rerun-night", "--attempts", "--state", "verified", "--format", "table"
    )
    assert [line.split()[:5] for line in table.splitlines()[1:]] == [
        ["0", "r0", "1", "a0", "failed"],
        ["0", "r0", "2", "a1", "verified"],
    ]


def test_shards_limit_stops_after_n(cli: Any) -> None:
    _, out, _ = cli("shards", RUN, "--limit", "3", "--json")
    assert [v["shard_id"] for v in json_lines(out)] == ["s00", "s01", "s02"]


def test_shards_json_of_no_match_prints_nothing(cli: Any) -> None:
    _, out, _ = cli("shards", "all-good", "--state", "failed", "--json")
    assert out == ""


def test_shards_rejects_an_unknown_state_as_usage_error(cli: Any) -> None:
    with pytest.raises(SystemExit) as exc:
        cli("shards", RUN, "--state", "bogus")
    assert exc.value.code == 2


# --- resume -------------------------------------------------------------------

UNCONFIRMED = [s for s, (_, fate) in FATES.items() if fate != "verified"]


def test_resume_jsonl_is_the_original_plan_lines_byte_for_byte(cli: Any) -> None:
    code, out, err = cli("resume", RUN)
    assert code == 1
    assert out.encode() == "".join(plan_line(s) + "\n" for s in UNCONFIRMED).encode()
    assert err.startswith("9 shards to re-run")
    assert "missing 4" in err and "failed:oom 1" in err and "stale 1" in err


def test_resume_reasons_adds_a_key_and_keeps_the_rest_of_the_line(cli: Any) -> None:
    _, out, _ = cli("resume", RUN, "--reasons")
    lines = out.splitlines()
    reasons = [json.loads(line)["_resume_reason"] for line in lines]
    assert reasons == [
        "failed:oom",
        "missing",
        "running",
        "stale",
        "unverified",
        "verify_failed:digest_mismatch",
        "missing",
        "missing",
        "missing",
    ]
    for shard, line in zip(UNCONFIRMED, lines, strict=True):
        assert line.startswith(plan_line(shard)[:-1] + ',"_resume_reason":')


def test_resume_json_is_one_object_per_shard_with_the_plan_line_parsed(cli: Any) -> None:
    code, out, _ = cli("resume", RUN, "--json")
    assert code == 1
    entries = [json.loads(line) for line in out.splitlines()]
    assert [e["shard_id"] for e in entries] == UNCONFIRMED
    assert entries[0]["reason"] == "failed:oom"
    assert entries[0]["plan_line"] == json.loads(plan_line(UNCONFIRMED[0]))
    assert all(isinstance(e["plan_index"], int) for e in entries)


def test_resume_json_with_a_format_that_is_not_json_is_a_usage_error(cli: Any) -> None:
    code, out, err = cli("resume", RUN, "--json", "--format", "slurm-array")
    assert (code, out) == (2, "")
    assert "--json writes JSON lines" in err


def test_shards_of_an_unknown_run_print_nothing_to_stdout(cli: Any) -> None:
    for extra in ([], ["--json"]):
        code, out, err = cli("shards", "no-such-run", *extra)
        assert (code, out) == (4, "")
        assert "no-such-run" in err


def test_resume_ids_prints_shard_ids(cli: Any) -> None:
    _, out, _ = cli("resume", RUN, "--format", "ids")
    assert out.split() == UNCONFIRMED


def test_resume_slurm_array_compacts_plan_indexes_into_ranges(cli: Any) -> None:
    _, out, _ = cli("resume", RUN, "--format", "slurm-array")
    assert out == "1-7,10-11\n"


def test_the_documented_slurm_idiom_survives_set_e_with_exit_zero(
    running: RunningServer, tmp_path: Path
) -> None:
    # docs/cluster.md and examples/slurm_array.sbatch: the list under `set -euo pipefail`,
    # where a plain resume (exit 1: shards must rerun) would stop the script.
    script = tmp_path / "morning.sh"
    script.write_text(
        "set -euo pipefail\n"
        f"ARRAY=$({sys.executable} -m shardledger_cli resume {RUN} --format slurm-array"
        f" --exit-zero --server 127.0.0.1:{running.port})\n"
        'echo "submit ${ARRAY}%64"\n'
        f"ARRAY=$({sys.executable} -m shardledger_cli resume {RUN} --format slurm-array"
        f" --server 127.0.0.1:{running.port})\n"
        'echo "never reached"\n'
    )
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=REPO)
    assert done.stdout == "submit 1-7,10-11%64\n"  # the first list went out, the second stopped it
    assert done.returncode == 1


def test_resume_to_a_file_replaces_it_atomically(cli: Any, tmp_path: Path) -> None:
    target = tmp_path / "rerun.jsonl"
    target.write_text("stale content\n")
    code, out, err = cli("resume", RUN, "-o", str(target))
    assert code == 1 and out == ""
    assert target.read_text() == "".join(plan_line(s) + "\n" for s in UNCONFIRMED)
    assert os.listdir(tmp_path) == ["rerun.jsonl"]  # no temp file left behind
    assert f"written to {target}" in err


def test_resume_to_a_device_writes_through_it_instead_of_replacing_it(cli: Any) -> None:
    code, _, _ = cli("resume", RUN, "-o", os.devnull)
    assert code == 1
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_resume_of_a_fully_verified_run_is_empty_and_exits_0(cli: Any, tmp_path: Path) -> None:
    code, _, err = cli("resume", "all-good", "-o", str(tmp_path / "none.jsonl"))
    assert code == 0
    assert (tmp_path / "none.jsonl").read_text() == ""
    assert err.startswith("0 shards to re-run")


def test_resume_reasons_with_another_format_is_a_usage_error(cli: Any) -> None:
    code, _, err = cli("resume", RUN, "--format", "ids", "--reasons")
    assert code == 2 and "--reasons" in err


@pytest.mark.parametrize(
    ("indexes", "ranges"),
    [([], []), ([3, 4, 5, 9, 12, 13, 14], ["3-5", "9", "12-14"]), ([0, 0, 1, 3], ["0-1", "3"])],
)
def test_slurm_ranges_merge_runs_and_repeats(indexes: list[int], ranges: list[str]) -> None:
    assert list(slurm_ranges(indexes)) == ranges


def test_with_resume_reason_handles_empty_objects_and_an_existing_key() -> None:
    assert with_resume_reason("{}", "stale") == '{"_resume_reason":"stale"}'
    assert json.loads(with_resume_reason('{"_resume_reason":"x","a":1}', "stale")) == {
        "_resume_reason": "stale",
        "a": 1,
    }


# --- events and runs ------------------------------------------------------------


def test_events_prints_one_line_per_event_with_kind_and_payload(cli: Any) -> None:
    code, out, _ = cli("events", RUN, "--format", "table")
    lines = out.splitlines()
    assert code == 0
    assert len(lines) == sum(len(life(s, i, f)) for s, (i, f) in FATES.items())
    assert "s01 a1 failed tag=oom" in out
    assert "verified FAILED out /out/s06.bin reason=digest_mismatch" in out


def test_events_number_each_run_from_1_and_json_has_both_sequences(cli: Any) -> None:
    # all-good's events were stored after night-01's: ledger-wide they come after its.
    code, out, _ = cli("events", "all-good")
    header, *rows = [line.split("\t") for line in out.splitlines()]
    assert code == 0
    assert header == ["SEQ", "TIME", "SHARD", "ATTEMPT", "KIND", "DETAIL"]
    assert [(r[0], r[4]) for r in rows] == [
        ("1", "planned"),
        ("2", "started"),
        ("3", "artifact_committed"),
        ("4", "verified"),
    ]
    _, table, _ = cli("events", "all-good", "--format", "table")
    assert [line.split()[0] for line in table.splitlines()] == ["1", "2", "3", "4"]
    _, lines, _ = cli("events", "all-good", "--json")
    first = json.loads(lines.splitlines()[0])
    night = sum(len(life(s, i, f)) for s, (i, f) in FATES.items())
    assert (first["run_sequence"], first["sequence"]) == ("1", str(night + 1))
    # --after counts in the run's own sequence, as shown.
    _, after, _ = cli("events", "all-good", "--after", "2")
    assert [line.split("\t")[0] for line in after.splitlines()[1:]] == ["3", "4"]


def test_events_json_lines_and_after_filter(cli: Any) -> None:
    _, out, _ = cli("events", RUN, "--json")
    events = [json.loads(line) for line in out.splitlines()]
    assert events[0]["planned"]["plan_line"] == plan_line("s00")
    plan = next(e for e in events if e["shard_id"] == "s01" and "planned" in e)
    assert plan["planned"]["plan_index"] == "1"  # int64 is a string in the JSON mapping
    after = int(events[-3]["run_sequence"])
    _, tail, _ = cli("events", RUN, "--json", "--after", str(after))
    assert [json.loads(line)["event_id"] for line in tail.splitlines()] == [
        e["event_id"] for e in events[-2:]
    ]


def test_events_shard_takes_the_cut_id_the_cli_prints_and_refuses_one_it_cannot_place(
    cli: Any,
) -> None:
    # The CLI prints ids cut ("s-3c52ba9ca020…"): that form names its shard.
    code, out, _ = cli("events", RUN, "--shard", "s1…")
    assert code == 0
    assert {line.split("\t")[2] for line in out.splitlines()[1:]} == {"s10"}
    code, out, _ = cli("events", RUN, "--shard", "s01")
    assert code == 0 and "s01\ta1\tfailed\ttag=oom" in out
    code, _, err = cli("events", RUN, "--shard", "s0")
    assert code == 2
    assert "--shard s0 matches 10 shards of run night-01: s00, s01, s02, s03, s04 and 5 more" in err
    code, out, err = cli("events", RUN, "--shard", "zz")
    assert (code, out) == (4, "")
    assert "run night-01 has no shard zz" in err


def test_a_cancelled_tail_ends_quietly_and_the_server_logs_it_cancelled(
    running: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with structlog.testing.capture_logs() as logs:
        # A logger made now, so an earlier test's cached configuration does not apply.
        monkeypatch.setattr(interceptor, "log", structlog.get_logger("shardledger.server"))
        _cancel_a_tail(running)
        # The server notices the cancel at its next look (within its 1 s poll).
        deadline = time.monotonic() + 10
        while not any(e.get("method", "").endswith("/TailEvents") for e in logs):
            assert time.monotonic() < deadline, logs
            time.sleep(0.05)
    [handled] = [e for e in logs if e.get("method", "").endswith("/TailEvents")]
    assert handled["code"] == "CANCELLED"


def _cancel_a_tail(running: RunningServer) -> None:
    client = LedgerClient(f"127.0.0.1:{running.port}")
    client.append(life("c0", 0, "planned", run="cancel-run"))
    tail = client.tail("cancel-run")
    seen: list[str] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            seen.extend(event.shard_id for event in tail)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        tail.cancel()
        reader.join(10)
    finally:
        client.close()
    assert not reader.is_alive() and not errors
    assert seen == ["c0"]


def test_events_follow_streams_new_events_until_ctrl_c(running: RunningServer) -> None:
    client = LedgerClient(f"127.0.0.1:{running.port}")
    first = life("t0", 0, "planned", run="tail-run")
    client.append(first)
    argv = [sys.executable, "-m", "shardledger_cli", "events", "tail-run", "--follow", "--json"]
    argv += ["--server", f"127.0.0.1:{running.port}"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())["event_id"] == first[0].event_id
        late = life("t1", 1, "planned", run="tail-run")
        client.append(late)
        assert json.loads(proc.stdout.readline())["event_id"] == late[0].event_id
    finally:
        client.close()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0


def test_runs_lists_both_runs(cli: Any) -> None:
    code, out, _ = cli("runs", "--json")
    assert code == 0
    counts = {r["run_id"]: r["event_count"] for r in json_lines(out)}
    assert counts[RUN] == sum(len(life(s, i, f)) for s, (i, f) in FATES.items())
    assert counts["all-good"] == 4
    _, text, _ = cli("runs")
    assert RUN in text and "all-good" in text


@pytest.mark.parametrize("command", ["status", "shards", "resume", "events", "runs"])
def test_every_report_command_documents_itself(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    assert "--server" in out
    if command in ("status", "shards", "resume"):
        assert "exit codes:" in out


def plain_block(out: str, name: str) -> list[list[str]]:
    """Returns the header and rows of the block a "# name" line opens in plain output."""
    lines = out.splitlines()
    start = lines.index(f"# {name}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("#")), len(lines))
    return [line.split("\t") for line in lines[start:end]]


def json_lines(out: str) -> list[Any]:
    """Returns the objects of a JSON Lines output, checking each line is one object."""
    objects = [json.loads(line) for line in out.splitlines()]
    assert all(isinstance(o, dict) for o in objects), out
    return objects
