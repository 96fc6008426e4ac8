"""`shardledger plan`: register shards from a manifest or a directory, idempotently, all or nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import blake3
import pytest

from ledger_server.server import RunningServer
from shard_client import LedgerClient, shard_id_for
from shardledger_cli.cli import main as cli
from tests.builders import without_root_bypass

RUN = "night-03"


@pytest.fixture
def inputs(tmp_path: Path) -> list[Path]:
    """Returns three small input files."""
    paths = []
    for i in range(3):
        path = tmp_path / "in" / f"part-{i}.bin"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(f"input {i}".encode() * 100)
        paths.append(path)
    return paths


def write_manifest(path: Path, lines: Sequence[Any]) -> Path:
    """Writes a JSON-lines manifest (str items are written verbatim)."""
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def manifest_of(inputs: list[Path], tmp_path: Path, *, lr: float = 0.1) -> Path:
    """Returns a manifest with one line per input."""
    lines = [{"input": str(p), "params": {"lr": lr}, "expected_outputs": ["out"]} for p in inputs]
    return write_manifest(tmp_path / f"jobs-{lr}.jsonl", lines)


def plan(server: RunningServer, *args: str) -> int:
    """Runs `shardledger plan RUN ...` against the server."""
    return cli(["plan", RUN, "--server", f"127.0.0.1:{server.port}", *args])


def test_manifest_registers_every_shard_with_derived_ids(
    server: RunningServer,
    client: LedgerClient,
    inputs: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert plan(server, "--manifest", str(manifest_of(inputs, tmp_path)), "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["shards"], report["new"], report["already_planned"], report["conflicting"]) == (
        3,
        3,
        0,
        [],
    )
    digest = blake3.blake3(inputs[0].read_bytes()).hexdigest()
    expected_id = shard_id_for(input_blake3=digest, params={"lr": 0.1})
    events = list(client.list_events(RUN))
    first = events[0]
    assert first.shard_id == expected_id
    assert (first.planned.input_blake3, first.planned.input_bytes) == (digest, 700)
    assert json.loads(first.planned.plan_line)["shard_id"] == expected_id
    assert [e.planned.plan_index for e in events] == [0, 1, 2]
    resume = [e.plan_line for e in client.resume(RUN)]
    assert [json.loads(line)["input"] for line in resume] == [str(p) for p in inputs]


def test_planning_again_counts_shards_as_already_planned(
    server: RunningServer,
    client: LedgerClient,
    inputs: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    manifest = str(manifest_of(inputs, tmp_path))
    assert plan(server, "--manifest", manifest) == 0
    capsys.readouterr()
    assert plan(server, "--manifest", manifest) == 0
    assert "0 new, 3 already planned identically, 0 conflicting" in capsys.readouterr().out
    assert len(list(client.list_events(RUN))) == 3


def test_a_changed_definition_is_a_conflict_listed_on_stderr(
    server: RunningServer,
    client: LedgerClient,
    inputs: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    first = [
        {"input": str(p), "shard_id": f"shard-{i}", "params": {"lr": 0.1}}
        for i, p in enumerate(inputs)
    ]
    assert plan(server, "--manifest", str(write_manifest(tmp_path / "a.jsonl", list(first)))) == 0
    changed: list[dict[str, Any]] = [dict(line) for line in first]
    changed.append({"input": str(inputs[0]), "shard_id": "shard-new"})
    changed[1]["params"] = {"lr": 0.2}
    capsys.readouterr()
    manifest = str(write_manifest(tmp_path / "b.jsonl", list(changed)))
    # shard-new has params ({}) that no stored shard has: it needs --add.
    assert plan(server, "--manifest", manifest, "--add") == 1
    out, err = capsys.readouterr()
    assert "1 new, 2 already planned identically, 1 conflicting" in out
    assert "shard-1" in err and "PLAN_CONFLICT" in err
    assert 'params: stored {"lr":0.1}, sent {"lr":0.2}' in err
    assert len(list(client.list_events(RUN))) == 4


def test_dry_run_prints_the_plan_lines_and_sends_nothing(
    server: RunningServer,
    client: LedgerClient,
    inputs: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert plan(server, "--manifest", str(manifest_of(inputs, tmp_path)), "--dry-run") == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["input"] for x in lines] == [str(p) for p in inputs]
    assert all(x["shard_id"].startswith("s-") for x in lines)
    assert client.list_runs() == []


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "line 2: not valid JSON"),
        ('["a list"]', "line 2: must be a JSON object"),
        ('{"params": {}}', 'line 2: needs "input"'),
        # An object input without input_blake3 is read through the store; here no
        # credentials reach it (the test points botocore at none), so it cannot be.
        ('{"input": "s3://bucket/key"}', "line 2: input s3://bucket/key: cannot be read"),
        ('{"input": "/"}', "line 2: input '/' is a directory"),
        (
            '{"input": "s3://b/k", "input_blake3": "XYZ"}',
            "line 2: input_blake3 must be 64 lowercase hex",
        ),
        (
            '{"input": "s3://b/k", "input_blake3": "'
            + "a" * 64
            + '", "expected_outputs": ["bad name"]}',
            "line 2: expected output",
        ),
        (
            '{"input": "s3://b/k", "input_blake3": "' + "a" * 64 + '", "shard_id": "ok-0"}',
            "lines 1, 2: shard id ok-0",
        ),
        # Rules only the server knew: the line used to be sent, and refused alone.
        (
            '{"input": "s3://b/' + "k" * 5000 + '", "input_blake3": "' + "a" * 64 + '"}',
            "line 2: planned.input_ref: longer than 4096 characters",
        ),
        (
            '{"input": "s3://b/\\u0000k", "input_blake3": "' + "a" * 64 + '"}',
            "line 2: planned.input_ref: must not contain NUL characters",
        ),
    ],
)
def test_a_bad_manifest_line_exits_5_naming_it_and_sends_nothing(
    server: RunningServer,
    client: LedgerClient,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    bad_line: str,
    message: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    for key in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(key, str(tmp_path / "no-such-aws-file"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    good = {"input": "s3://b/k0", "input_blake3": "a" * 64, "shard_id": "ok-0"}
    manifest = write_manifest(
        tmp_path / "jobs.jsonl", [good, bad_line, {**good, "shard_id": "ok-2"}]
    )
    assert plan(server, "--manifest", str(manifest)) == 5
    err = capsys.readouterr().err
    assert message in err and "nothing was sent" in err
    assert client.list_runs() == []


def test_a_digest_that_does_not_match_the_input_file_is_refused(
    server: RunningServer,
    client: LedgerClient,
    inputs: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    manifest = write_manifest(
        tmp_path / "jobs.jsonl", [{"input": str(inputs[0]), "input_blake3": "b" * 64}]
    )
    assert plan(server, "--manifest", str(manifest)) == 5
    assert "does not match the file" in capsys.readouterr().err
    assert client.list_runs() == []


def test_inputs_directory_plans_one_shard_per_matching_file(
    server: RunningServer,
    client: LedgerClient,
    inputs: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "in" / "notes.txt").write_text("not an input")
    args = ["--inputs", str(tmp_path / "in"), "--glob", "*.bin", "--params", '{"seed": 7}']
    assert plan(server, *args, "--expected-outputs", "image,stats", "--json") == 0
    assert json.loads(capsys.readouterr().out)["new"] == 3
    events = list(client.list_events(RUN))
    assert [e.planned.input_ref for e in events] == [str(p.resolve()) for p in inputs]
    assert all(list(e.planned.expected_outputs) == ["image", "stats"] for e in events)
    assert json.loads(events[0].planned.params_json) == {"seed": 7}


def test_a_re_plan_of_a_grown_directory_numbers_new_shards_after_the_stored_ones(
    server: RunningServer,
    client: LedgerClient,
    inputs: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder = tmp_path / "in"
    inputs[1].unlink()  # planned first: part-0 (index 0) and part-2 (index 1)
    args = ["--inputs", str(folder), "--glob", "*.bin", "--expected-outputs", "out"]
    assert plan(server, *args) == 0
    inputs[1].write_bytes(b"input 1" * 100)  # a file that sorts between them appears
    capsys.readouterr()
    assert plan(server, *args) == 0
    captured = capsys.readouterr()
    assert "1 new, 2 already planned identically, 0 conflicting" in captured.out
    assert "new shards are numbered from 2" in captured.err
    resume = list(client.resume(RUN))  # nothing started: every shard, in plan order
    names = [(Path(json.loads(e.plan_line)["input"]).name, e.plan_index) for e in resume]
    assert names == [("part-0.bin", 0), ("part-2.bin", 1), ("part-1.bin", 2)]


def test_an_unreachable_ledger_exits_3(
    inputs: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = str(manifest_of(inputs, tmp_path))
    assert (
        cli(["plan", RUN, "--manifest", manifest, "--server", "127.0.0.1:1", "--timeout", "0.2"])
        == 3
    )
    assert "unreachable" in capsys.readouterr().err


@pytest.mark.parametrize("pattern", ["", "/tmp/*", "../*", "sub/../../*"])
def test_a_glob_outside_the_inputs_directory_is_a_usage_error(
    server: RunningServer,
    client: LedgerClient,
    inputs: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    pattern: str,
) -> None:
    assert plan(server, "--inputs", str(tmp_path / "in"), "--glob", pattern) == 2
    err = capsys.readouterr().err
    assert "--glob" in err and "relative to --inputs" in err and "Traceback" not in err
    assert client.list_runs() == []


def test_per_rank_outputs_plan_through_the_manifest_and_the_inputs_directory(
    server: RunningServer,
    client: LedgerClient,
    inputs: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # docs/multirank.md: weights.rank{rank} is each rank's own output; rank 0 commits the rest.
    line = {"input": str(inputs[0]), "params": {}, "expected_outputs": ["weights.rank{rank}", "m"]}
    assert plan(server, "--manifest", str(write_manifest(tmp_path / "r.jsonl", [line]))) == 0
    directory = ["--inputs", str(inputs[0].parent), "--params", '{"lr": 1}']
    assert plan(server, *directory, "--expected-outputs", "ckpt.rank{rank},metrics", "--add") == 0
    capsys.readouterr()
    outputs = [tuple(e.planned.expected_outputs) for e in client.list_events(RUN)]
    assert outputs == [("weights.rank{rank}", "m")] + [("ckpt.rank{rank}", "metrics")] * 3
    # A name that is bad for every rank is still refused before anything is sent.
    assert plan(server, *directory, "--expected-outputs", "bad name.rank{rank}") == 5
    assert "must start with a letter or digit" in capsys.readouterr().err
    assert len(list(client.list_events(RUN))) == 4


def test_a_re_plan_with_other_params_is_refused_without_add_and_sends_nothing(
    server: RunningServer,
    client: LedgerClient,
    inputs: list[Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    directory = ["--inputs", str(inputs[0].parent)]
    assert plan(server, *directory, "--params", '{"seed": 3}') == 0
    capsys.readouterr()
    # The same params again: idempotent; other params: refused, exit 1, nothing sent.
    assert plan(server, *directory, "--params", '{"seed": 3}') == 0
    assert plan(server, *directory, "--params", '{"seed": 4}') == 1
    err = capsys.readouterr().err
    assert (
        f'run {RUN} already has 3 shards, planned with params {{"seed":3}}; this plan would'
        ' add 3 shards with params {"seed":4}, which none of them has. Nothing was sent:'
        " pass --add" in err
    )
    assert len(list(client.list_events(RUN))) == 3
    # A grown directory with the run's own params adds its new input without --add.
    (inputs[0].parent / "part-9.bin").write_bytes(b"more")
    assert plan(server, *directory, "--params", '{"seed": 3}', "--json") == 0
    assert json.loads(capsys.readouterr().out)["new"] == 1
    assert plan(server, *directory, "--params", '{"seed": 4}', "--add", "--json") == 0
    assert json.loads(capsys.readouterr().out)["new"] == 4
    assert len(list(client.list_events(RUN))) == 8


def test_a_re_plan_with_other_labels_names_the_field_with_both_values(
    server: RunningServer,
    client: LedgerClient,
    inputs: list[Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    directory = ["--inputs", str(inputs[0].parent)]
    assert plan(server, *directory, "--label", "provider=a") == 0
    capsys.readouterr()
    assert plan(server, *directory, "--label", "provider=b", "--json") == 1
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("shardledger: shard")]
    assert len(lines) == 1  # the first shard in full, the others counted
    assert "is planned otherwise (EVENT_ID_REUSED)" in lines[0]
    assert 'labels: stored {"provider": "a"}, sent {"provider": "b"}' in lines[0]
    assert "2 more shards differ from their stored plan" in lines[0]
    report = json.loads(captured.out)
    assert len(report["conflicting"]) == 3 and report["refused"] == []
    first = report["differences"][report["conflicting"][0]]
    assert first == {"labels": {"stored": {"provider": "a"}, "sent": {"provider": "b"}}}
    assert len(list(client.list_events(RUN))) == 3


def test_matching_links_that_lead_nowhere_are_listed_and_nothing_is_sent_unless_skipped(
    server: RunningServer,
    client: LedgerClient,
    inputs: list[Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder = inputs[0].parent
    (folder / "dangling.bin").symlink_to(folder / "was-deleted.bin")
    (folder / "loop-a.bin").symlink_to(folder / "loop-b.bin")
    (folder / "loop-b.bin").symlink_to(folder / "loop-a.bin")
    capsys.readouterr()
    assert plan(server, "--inputs", str(folder)) == 1
    err = capsys.readouterr().err
    assert "3 matching link(s) lead nowhere, nothing was sent" in err
    assert f"{folder / 'dangling.bin'}: a dangling link (to {folder / 'was-deleted.bin'})" in err
    assert f"{folder / 'loop-a.bin'}: Too many levels of symbolic links" in err
    assert client.list_runs() == []
    assert plan(server, "--inputs", str(folder), "--skip-broken-links", "--json") == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["new"] == 3  # the three real inputs
    assert "skipped 3 broken link(s)" in captured.err


def test_an_input_or_directory_the_planner_may_not_read_is_named_with_exit_5(
    tmp_path: Path,
) -> None:
    # Inputs and a folder their owner may not read, planned in a process that file modes
    # bind (as root too: tests.builders.without_root_bypass); nothing reaches a ledger.
    base = tmp_path
    folder = base / "in"
    folder.mkdir()
    (folder / "open.bin").write_bytes(b"anyone may read this")
    secret = folder / "secret.bin"
    secret.write_bytes(b"owner only")
    locked = folder / "locked"
    locked.mkdir()
    (locked / "inner.bin").write_bytes(b"hidden")
    manifest = base / "jobs.jsonl"
    manifest.write_text(json.dumps({"input": str(secret)}) + "\n")
    secret.chmod(0o000)
    locked.chmod(0o000)
    try:
        cli_args = [
            sys.executable,
            "-m",
            "shardledger_cli",
            "plan",
            "r1",
            "--server",
            "127.0.0.1:1",
        ]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(sys.path),
            "PYTHONDONTWRITEBYTECODE": "1",
        }

        def run(*extra: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                without_root_bypass([*cli_args, *extra]),
                capture_output=True,
                text=True,
                env=env,
                cwd=base,
            )

        by_manifest = run("--manifest", str(manifest))
        assert by_manifest.returncode == 5, by_manifest.stderr
        assert f"line 1: cannot read {secret}: Permission denied" in by_manifest.stderr
        assert "Traceback" not in by_manifest.stderr
        flat = run("--inputs", str(folder))
        assert flat.returncode == 5, flat.stderr
        assert f"cannot read {secret}: Permission denied" in flat.stderr
        deep = run("--inputs", str(folder), "--glob", "**/*.bin")
        assert deep.returncode == 5, deep.stderr
        assert f"cannot be read, nothing was sent:\n  {locked}: Permission denied" in deep.stderr
        closed = run("--inputs", str(locked))
        assert closed.returncode == 5, closed.stderr
        assert f"{locked}: Permission denied" in closed.stderr
    finally:
        for path in (locked, secret):
            path.chmod(0o700)


# --- a closed run, and --reopen ------------------------------------------------------


def _closed_run(server: RunningServer, inputs: list[Path], capsys: Any) -> list[str]:
    """Plans the inputs with seed 1 and closes the run; returns the directory arguments."""
    directory = ["--inputs", str(inputs[0].parent)]
    assert plan(server, *directory, "--params", '{"seed": 1}') == 0
    assert plan(server, "--close", "--expected", "3") == 0
    capsys.readouterr()
    return directory


def test_new_shards_of_a_closed_run_are_refused_in_one_line_and_nothing_is_stored(
    server: RunningServer,
    client: LedgerClient,
    inputs: list[Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    directory = _closed_run(server, inputs, capsys)
    before = list(client.list_events(RUN))
    close = before[-1]

    code = plan(server, *directory, "--params", '{"seed": 2}', "--add")

    assert code == 4
    captured = capsys.readouterr()
    when = close.receive_time.ToDatetime().strftime("%Y-%m-%dT%H:%M:%SZ")
    assert captured.err.splitlines() == [
        f"shardledger: refused (RUN_CLOSED): run {RUN} was closed at sequence"
        f" {close.sequence} ({when}): plan --reopen to add shards; nothing of this plan"
        " was stored"
    ]
    assert captured.out == ""
    assert list(client.list_events(RUN)) == before
    status = json.loads(client.summary(RUN))
    assert (status["submitted"], status["lifecycle"]["state"]) == (3, "settled")


def test_a_closed_run_refuses_a_plan_that_spans_batches_before_storing_any_of_it(
    server: RunningServer,
    client: LedgerClient,
    inputs: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from shardledger_cli.commands import plan as plan_command

    stored = [{"input": str(p), "params": {"seed": 1}, "expected_outputs": ["out"]} for p in inputs]
    assert plan(server, "--manifest", str(write_manifest(tmp_path / "a.jsonl", stored))) == 0
    assert plan(server, "--close") == 0
    capsys.readouterr()
    before = list(client.list_events(RUN))
    new = [dict(line, params={"seed": 2}) for line in stored]
    manifest = write_manifest(tmp_path / "mixed.jsonl", [stored[0], *new, *stored[1:]])
    monkeypatch.setattr(plan_command, "BATCH", 2)  # [stored, new] [new, new] [stored, stored]

    assert plan(server, "--manifest", str(manifest), "--add", "--json") == 4

    captured = capsys.readouterr()
    assert len(captured.err.splitlines()) == 1
    assert (
        "refused (RUN_CLOSED)" in captured.err and "nothing of this plan was stored" in captured.err
    )
    report = json.loads(captured.out)
    assert (report["new"], report["already_planned"]) == (0, 0)
    assert "plan --reopen to add shards" in report["run_closed"]
    assert list(client.list_events(RUN)) == before


def test_an_identical_replan_of_a_closed_run_still_exits_0(
    server: RunningServer,
    client: LedgerClient,
    inputs: list[Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    directory = _closed_run(server, inputs, capsys)
    assert plan(server, *directory, "--params", '{"seed": 1}') == 0
    assert "0 new, 3 already planned identically, 0 conflicting" in capsys.readouterr().out
    assert len(list(client.list_events(RUN))) == 4  # three plans and the close


def test_reopen_then_new_shards_are_accepted_and_status_says_reopened(
    server: RunningServer,
    client: LedgerClient,
    inputs: list[Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    directory = _closed_run(server, inputs, capsys)

    assert plan(server, "--reopen", "--reason", "a late wave") == 0

    out = capsys.readouterr().out
    reopen = list(client.list_events(RUN))[-1]
    assert reopen.WhichOneof("payload") == "run_reopened"
    assert reopen.run_reopened.reason == "a late wave"
    assert out == (
        f"run {RUN}: reopened at sequence {reopen.sequence}: new shards are accepted until"
        f" `shardledger plan {RUN} --close`\n"
    )
    cli(["status", RUN, "--server", f"127.0.0.1:{server.port}"])  # exit 1: shards missing
    status = capsys.readouterr().out
    assert f"\nlifecycle\topen (reopened at event {reopen.run_sequence}, " in status
    assert "settled" not in status
    assert plan(server, *directory, "--params", '{"seed": 2}', "--add", "--json") == 0
    assert json.loads(capsys.readouterr().out)["new"] == 3
    summary = json.loads(client.summary(RUN))
    assert (summary["submitted"], summary["lifecycle"]["state"]) == (6, "open")


def test_reopen_plan_and_close_again_in_one_command(
    server: RunningServer,
    client: LedgerClient,
    inputs: list[Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    directory = _closed_run(server, inputs, capsys)

    code = plan(server, *directory, "--params", '{"seed": 2}', "--add", "--reopen", "--close")

    assert code == 0
    out = capsys.readouterr().out
    kinds = [e.WhichOneof("payload") for e in client.list_events(RUN)]
    assert kinds[3:] == ["submission_closed", "run_reopened", *["planned"] * 3, "submission_closed"]
    assert out.startswith(f"run {RUN}: reopened at sequence ")
    assert "3 new, 0 already planned identically, 0 conflicting; submission closed at" in out
    life = json.loads(client.summary(RUN))["lifecycle"]
    assert life["state"] == "settled" and life["reopened_at_sequence"] is not None


def test_reopening_a_run_that_is_not_closed_exits_4_and_sends_no_plan(
    server: RunningServer,
    client: LedgerClient,
    inputs: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    manifest = str(manifest_of(inputs, tmp_path))
    assert plan(server, "--manifest", manifest) == 0
    capsys.readouterr()

    assert plan(server, "--reopen") == 4
    assert capsys.readouterr().err == (
        f"shardledger: cannot reopen run {RUN}: RUN_NOT_CLOSED: run {RUN} is not closed"
        " (it was never closed): there is nothing to reopen\n"
    )
    other = str(manifest_of(inputs, tmp_path, lr=0.5))
    assert plan(server, "--manifest", other, "--add", "--reopen") == 4
    assert len(list(client.list_events(RUN))) == 3
