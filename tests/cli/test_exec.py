"""`shardledger exec` runs examples/shell_job.sh through every failure form against a real ledger.

Each test runs the wrapper as a real subprocess (real signals, real fsync and
rename, a real bash child), then asks the ledger through the CLI what it holds
(`shards --json`, `resume --json`, `events --json`) and looks at the disk: an
output is at its final path only after a clean commit, never half-written.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shard_client import atomic
from shardledger_cli.exec.guard import GUARD_BOUND_S
from tests.builders import run_cli

REPO = Path(__file__).resolve().parents[2]
SHELL_JOB = REPO / "examples" / "shell_job.sh"
RUN = "exec-night"
WORDS = "the render of frame seventeen reported success and the file was empty\n"


@dataclass
class Night:
    """A planned run of one shard with the two outputs shell_job.sh writes."""

    target: str
    tmp: Path
    line: str
    shard_id: str

    @property
    def out(self) -> Path:
        return self.tmp / "out"

    def final(self, name: str) -> Path:
        suffix = {"counts": "counts.txt", "summary": "summary.json"}[name]
        return self.out / f"{self.shard_id}.{suffix}"

    def argv(self, *extra: str) -> list[str]:
        """Returns the exec command line for shell_job.sh on this night's shard."""
        return [
            sys.executable,
            "-m",
            "shardledger_cli",
            "exec",
            RUN,
            "--plan-line",
            self.line,
            "--server",
            self.target,
            "--output",
            f"counts={self.out}/{{shard}}.counts.txt",
            "--output",
            f"summary={self.out}/{{shard}}.summary.json",
            "--heartbeat-timeout",
            "0.5",
            "--heartbeat-interval",
            "0.2",
            "--json",
            *extra,
            "--",
            "bash",
            str(SHELL_JOB),
        ]

    def env(self, fault: str = "") -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            SHELL_JOB_FAULT=fault,
            SHARDLEDGER_SPOOL_DIR=str(self.tmp / "spool"),
            SHARDLEDGER_DIAG_DIR=str(self.tmp / "diag"),
            SHARDLEDGER_EXIT_WAIT="5",
        )
        return env

    def exec(self, fault: str = "", *extra: str) -> tuple[int, dict[str, Any], str]:
        """Runs exec to its end; returns (exit code, its --json report, stderr)."""
        proc = subprocess.run(
            self.argv(*extra),
            env=self.env(fault),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        report = json.loads(proc.stdout.splitlines()[-1])
        return proc.returncode, report, proc.stderr

    def view(self, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
        code, out, err = run_cli(capsys, "shards", RUN, "--server", self.target, "--json")
        assert code == 0, err
        (view,) = [json.loads(line) for line in out.splitlines()]
        return dict(view)

    def resume(self, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
        code, out, err = run_cli(capsys, "resume", RUN, "--server", self.target, "--json")
        assert code in (0, 1), err
        return [json.loads(line) for line in out.splitlines()]

    def events(self, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
        code, out, err = run_cli(capsys, "events", RUN, "--server", self.target, "--json")
        assert code == 0, err
        return [json.loads(line) for line in out.splitlines()]

    def leftovers(self) -> list[str]:
        """Returns the temp files left in the output directory."""
        if not self.out.exists():
            return []
        return sorted(p.name for p in self.out.iterdir() if p.name.startswith(atomic.TEMP_PREFIX))


@pytest.fixture
def night(target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Night:
    source = tmp_path / "frame17.txt"
    source.write_text(WORDS)
    manifest = tmp_path / "jobs.jsonl"
    entry = {
        "input": str(source),
        "params": {"frame": 17},
        "expected_outputs": ["counts", "summary"],
    }
    manifest.write_text(json.dumps(entry) + "\n")
    code, _, err = run_cli(capsys, "plan", RUN, "--manifest", str(manifest), "--server", target)
    assert code == 0, err
    code, out, err = run_cli(capsys, "plan", RUN, "--manifest", str(manifest), "--dry-run")
    assert code == 0, err
    line = out.splitlines()[0]
    return Night(target=target, tmp=tmp_path, line=line, shard_id=json.loads(line)["shard_id"])


def assert_nothing_committed(night: Night) -> None:
    """No final path holds a file and no temp file is left behind."""
    assert not night.final("counts").exists()
    assert not night.final("summary").exists()
    assert night.leftovers() == []


def assert_failed(night: Night, capsys: pytest.CaptureFixture[str], tag: str) -> None:
    view = night.view(capsys)
    assert (view["state"], view["detail"]) == ("failed", tag)
    assert [(e["shard_id"], e["reason"]) for e in night.resume(capsys)] == [
        (night.shard_id, f"failed:{tag}")
    ]


def test_clean_exit_commits_both_outputs_and_verify_confirms_them(
    night: Night, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report, _ = night.exec()
    assert code == 0
    assert report["outcome"] == "committed"
    summary = json.loads(night.final("summary").read_text())
    assert summary["words"] == len(WORDS.split())
    assert "2 the" in night.final("counts").read_text()
    assert night.leftovers() == []
    assert night.view(capsys)["state"] == "unverified"
    events = night.events(capsys)
    started = next(e["started"] for e in events if "started" in e)
    assert started["fingerprint"]["torch"] == "not-read"
    beats = [e["heartbeat"] for e in events if "heartbeat" in e]
    # The job's progress lines reach the ledger as heartbeats with their metrics.
    assert beats and beats[-1]["metrics"] == {"words": float(len(WORDS.split()))}
    commits = {
        e["artifact_committed"]["name"]: e["artifact_committed"]
        for e in events
        if "artifact_committed" in e
    }
    assert commits["summary"]["path"] == str(night.final("summary"))
    assert int(commits["summary"]["size_bytes"]) == night.final("summary").stat().st_size
    code, _, err = run_cli(
        capsys, "verify", RUN, "--root", str(night.out), "--server", night.target
    )
    assert code == 0, err
    assert night.view(capsys)["state"] == "verified"
    assert night.resume(capsys) == []


def test_exit_zero_without_outputs_is_incomplete_and_nothing_is_committed(
    night: Night, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report, _ = night.exec("swallow")
    assert code == 65
    assert {p["name"]: p["reason"] for p in report["problems"]} == {
        "counts": "missing",
        "summary": "missing",
    }
    assert_failed(night, capsys, "incomplete")
    assert_nothing_committed(night)


def test_sigkill_mid_write_is_killed_and_the_old_final_file_survives(
    night: Night, capsys: pytest.CaptureFixture[str]
) -> None:
    night.out.mkdir()
    night.final("counts").write_text("yesterday's counts\n")
    code, report, _ = night.exec("kill9")
    assert code == 137
    assert report["signal"] == "SIGKILL"
    assert_failed(night, capsys, "killed")
    # The child's half-written temp file is gone; the final path still holds the old file.
    assert night.final("counts").read_text() == "yesterday's counts\n"
    assert not night.final("summary").exists()
    assert night.leftovers() == []


def test_an_empty_output_refuses_the_whole_commit(
    night: Night, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report, _ = night.exec("empty")
    assert code == 65
    assert [(p["name"], p["reason"]) for p in report["problems"]] == [("summary", "empty")]
    assert_failed(night, capsys, "incomplete")
    # "counts" was fine, but an attempt commits all of its outputs or none.
    assert_nothing_committed(night)


def test_hang_without_progress_is_diagnosed_stopped_and_recorded_as_timeout(
    night: Night, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report, _ = night.exec("hang", "--hang-timeout", "1", "--kill-grace", "0.5")
    assert code == 124
    assert report["tag"] == "timeout"
    assert_failed(night, capsys, "timeout")
    assert_nothing_committed(night)
    failed = next(e["failed"] for e in night.events(capsys) if "failed" in e)
    bundle = Path(failed["diagnostics_path"])
    assert bundle.parent == night.tmp / "diag"
    text = bundle.read_text()
    # The group's state when it hung: the shell waiting on its sleep, and the last progress.
    assert "sleep 3600" in text
    assert "SHARDLEDGER_PROGRESS step=2" in text


@pytest.mark.parametrize(("fault", "exit_code", "tag"), [("fail", 3, "unknown"), ("oom", 1, "oom")])
def test_non_zero_exit_is_failed_with_the_tag_its_last_words_give(
    night: Night, capsys: pytest.CaptureFixture[str], fault: str, exit_code: int, tag: str
) -> None:
    code, report, _ = night.exec(fault)
    assert code == exit_code
    assert_failed(night, capsys, tag)
    assert_nothing_committed(night)
    failed = next(e["failed"] for e in night.events(capsys) if "failed" in e)
    expected = "fatal: renderer crashed" if fault == "fail" else "CUDA out of memory"
    assert expected in failed["message"]
    assert expected in Path(report["diagnostics_path"]).read_text()


def _wait_for_line(stream: Any, text: str, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        line = stream.readline()
        if not line:
            raise AssertionError(f"the stream ended before {text!r}")
        if text in line:
            return
    raise AssertionError(f"no {text!r} within {deadline_s}s")


def test_sigterm_to_exec_is_forwarded_and_recorded_as_preempted(
    night: Night, capsys: pytest.CaptureFixture[str]
) -> None:
    proc = subprocess.Popen(
        night.argv("--term-grace", "2", "--attempt-id", "a-preempted"),
        env=night.env("term"),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_line(proc.stderr, "waiting for SIGTERM")
        # What `shardledger watch` sends first: a dump of the child's group, not its death.
        proc.send_signal(signal.SIGUSR1)
        stack = night.tmp / "diag" / "a-preempted.stack"
        deadline = time.monotonic() + 30
        while "sleep 3600" not in (stack.read_text() if stack.exists() else ""):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert json.loads(out.splitlines()[-1])["tag"] == "preempted"
    assert_failed(night, capsys, "preempted")
    assert_nothing_committed(night)


def _stat(pid: str) -> tuple[str, int] | None:
    """Returns a process's state letter and process group, or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
    return state, int(pgrp)


def _attempt_processes(attempt_id: str) -> dict[int, str]:
    """Returns the live processes of an attempt (each carries its id), pid to command line."""
    marker = f"SHARDLEDGER_ATTEMPT={attempt_id}".encode()
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        stat = _stat(pid)
        # A zombie is dead; whether it is reaped is its new parent's business (PID 1 here).
        if marker in environ.split(b"\0") and stat is not None and stat[0] != "Z":
            found[int(pid)] = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
    return found


def _group_members(pgid: int) -> list[int]:
    """Returns the live processes of a process group."""
    members = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        stat = _stat(pid)
        if stat is not None and stat[0] != "Z" and stat[1] == pgid:
            members.append(int(pid))
    return members


def _kill_attempt_processes(attempt_id: str) -> None:
    """Kills what is left of an attempt after a failed test, so none outlives the suite."""
    for pid in _attempt_processes(attempt_id):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def orphan_cleanup() -> Iterator[list[str]]:
    attempts: list[str] = []
    yield attempts
    for attempt_id in attempts:
        _kill_attempt_processes(attempt_id)


# The guard's documented bound (docs/exec.md), plus what a loaded 2-core machine may take
# to schedule the guard and deliver the kills.
ORPHAN_BOUND_S = GUARD_BOUND_S + 5.0


def test_sigkill_of_exec_itself_kills_its_child_and_grandchild_and_a_rerun_commits(
    night: Night, capsys: pytest.CaptureFixture[str], orphan_cleanup: list[str]
) -> None:
    orphan_cleanup.append("a-killed-wrapper")
    # A quiet child mid-write, with a grandchild (a background job) it waits for.
    script = (
        'printf "half of the counts" > "$SHARDLEDGER_OUTPUT_COUNTS"; sleep 3600 &'
        ' echo "SHARDLEDGER_PROGRESS step=2"; wait'
    )
    argv = _with_command(
        night.argv("--attempt-id", "a-killed-wrapper", "--no-watchdog"), "bash", "-c", script
    )
    proc = subprocess.Popen(argv, env=night.env(), cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    _wait_for_line(proc.stdout, "SHARDLEDGER_PROGRESS step=2")
    deadline = time.monotonic() + 30
    while "sleep 3600" not in _attempt_processes("a-killed-wrapper").values():
        assert time.monotonic() < deadline, _attempt_processes("a-killed-wrapper")
        time.sleep(0.05)
    (child,) = [p for p, cmd in _attempt_processes("a-killed-wrapper").items() if "bash" in cmd]
    child_stat = _stat(str(child))
    assert child_stat is not None
    pgid = child_stat[1]
    assert len(night.leftovers()) == 1  # the half-written temp file of "counts"
    proc.kill()
    proc.wait(10)
    # Nothing of the attempt survives: not the child, not its grandchild, not the guard,
    # and not the temp file (the guard removes it; no rerun has come yet).
    deadline = time.monotonic() + ORPHAN_BOUND_S
    while _attempt_processes("a-killed-wrapper") or _group_members(pgid) or night.leftovers():
        assert time.monotonic() < deadline, (
            _attempt_processes("a-killed-wrapper"),
            _group_members(pgid),
            night.leftovers(),
        )
        time.sleep(0.05)
    deadline = time.monotonic() + 30
    while night.view(capsys)["state"] != "stale":
        assert time.monotonic() < deadline, night.view(capsys)
        time.sleep(0.2)
    assert [e["reason"] for e in night.resume(capsys)] == ["stale"]
    assert not night.final("counts").exists()
    code, report, _ = night.exec()
    assert (code, report["outcome"]) == (0, "committed")
    assert night.view(capsys)["state"] == "unverified"
    assert night.leftovers() == []


def test_a_shard_the_ledger_does_not_know_never_runs_the_command(
    night: Night, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = night.tmp / "ran"
    proc = subprocess.run(
        [
            *night.argv()[: night.argv().index("--plan-line")],
            "s-not-planned",
            *("--server", night.target, "--output", f"x={night.out}/x.txt"),
            *("--", "touch", str(marker)),
        ],
        env=night.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 4, proc.stderr
    assert "refused" in proc.stderr
    assert not marker.exists()


def test_a_placeholder_naming_no_output_is_a_usage_error(night: Night) -> None:
    argv = night.argv()
    argv[argv.index("--") + 1 :] = ["cp", str(night.tmp / "frame17.txt"), "{tmp:weights}"]
    proc = subprocess.run(argv, env=night.env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "{tmp:weights} names no --output" in proc.stderr
    assert night.leftovers() == []


def test_plan_file_and_slurm_array_task_id_pick_the_shard(
    night: Night, capsys: pytest.CaptureFixture[str]
) -> None:
    plan_file = night.tmp / "plan-lines.jsonl"
    plan_file.write_text(night.line + "\n")
    argv = night.argv()
    at = argv.index("--plan-line")
    argv[at : at + 2] = ["--plan-file", str(plan_file)]
    # {tmp:NAME} in the arguments: the child writes where exec says, here with cp.
    argv[argv.index("--") + 1 :] = [
        "bash",
        "-c",
        'printf "1 frame\\n" > {tmp:counts} && printf \'{"frame": %s}\' {param:frame} > "$SHARDLEDGER_OUTPUT_SUMMARY"',
    ]
    env = night.env() | {"SLURM_ARRAY_TASK_ID": "0", "SLURM_JOB_ID": "4242"}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(night.final("summary").read_text()) == {"frame": 17}
    view = night.view(capsys)
    assert view["state"] == "unverified"
    assert view["scheduler"]["job_id"] == "4242"


def _with_command(argv: list[str], *command: str) -> list[str]:
    return [*argv[: argv.index("--") + 1], *command]


def test_with_liveness_progress_chatter_without_progress_counts_as_a_hang(
    night: Night, capsys: pytest.CaptureFixture[str]
) -> None:
    # An NCCL-style watchdog that keeps printing while the job is stuck.
    chatter = "while :; do echo 'still waiting for rank 3'; sleep 0.1; done"
    argv = _with_command(
        night.argv("--liveness", "progress", "--hang-timeout", "1", "--kill-grace", "0.5"),
        *("bash", "-c", chatter),
    )
    proc = subprocess.run(argv, env=night.env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 124, proc.stderr
    assert "no progress report for" in json.loads(proc.stdout.splitlines()[-1])["message"]
    assert_failed(night, capsys, "timeout")


def test_a_progress_file_feeds_heartbeats_and_keeps_the_watchdog_quiet(
    night: Night, capsys: pytest.CaptureFixture[str]
) -> None:
    # Silent on stdout and stderr; progress only through $SHARDLEDGER_PROGRESS_FILE.
    script = (
        'for step in 1 2 3 4 5 6; do sleep 0.3; echo "step=$step progress=0.$step loss=0.25"'
        ' > "$SHARDLEDGER_PROGRESS_FILE.tmp"; mv "$SHARDLEDGER_PROGRESS_FILE.tmp"'
        ' "$SHARDLEDGER_PROGRESS_FILE"; done;'
        ' echo counted > "$SHARDLEDGER_OUTPUT_COUNTS"; echo \'{"ok": true}\' > {tmp:summary}'
    )
    argv = _with_command(
        night.argv("--liveness", "progress", "--hang-timeout", "1"), "bash", "-c", script
    )
    proc = subprocess.run(argv, env=night.env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    beats = [e["heartbeat"] for e in night.events(capsys) if "heartbeat" in e]
    assert {"step": "6", "progress": 0.6, "metrics": {"loss": 0.25}} in beats
    assert night.view(capsys)["state"] == "unverified"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_with_the_ledger_away_exec_spools_and_the_drained_spool_commits(
    night: Night, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = night.argv("--unavailable-after", "0.2")
    argv[argv.index("--server") + 1] = f"127.0.0.1:{_free_port()}"
    env = night.env() | {"SHARDLEDGER_EXIT_WAIT": "0.5"}
    proc = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    # The job ran and committed its outputs; the ledger has not heard of it yet.
    assert proc.returncode == 0, proc.stderr
    assert night.final("summary").exists()
    assert night.view(capsys)["state"] == "missing"
    spool = str(night.tmp / "spool")
    code, _, err = run_cli(capsys, "spool", "drain", "--dir", spool, "--server", night.target)
    assert code == 0, err
    assert night.view(capsys)["state"] == "unverified"


def test_a_progress_bar_redrawn_with_carriage_returns_is_alive(
    night: Night, capsys: pytest.CaptureFixture[str]
) -> None:
    # tqdm's way: one line redrawn with \r for the whole run, never a newline.
    script = (
        'for i in $(seq 1 12); do printf "\\r%3d%%|###" $((i * 8)) >&2; sleep 0.2; done;'
        " echo counted > {tmp:counts}; echo '{\"ok\": true}' > {tmp:summary}"
    )
    argv = _with_command(night.argv("--hang-timeout", "1"), "bash", "-c", script)
    proc = subprocess.run(argv, env=night.env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "96%|###" in proc.stderr  # passed through as the child wrote it
    assert night.view(capsys)["state"] == "unverified"


def test_temp_files_of_long_dead_attempts_are_removed_and_young_ones_left(
    night: Night, capsys: pytest.CaptureFixture[str]
) -> None:
    night.out.mkdir()
    old = night.out / f"{atomic.TEMP_PREFIX}deadbeef0000.{night.shard_id}.counts.txt"
    young = night.out / f"{atomic.TEMP_PREFIX}cafe00000000.{night.shard_id}.counts.txt"
    for path in (old, young):
        path.write_text("half of a file")
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    code, _, _ = night.exec()
    assert code == 0
    # The young one may be a live attempt's on another node sharing the directory.
    assert night.leftovers() == [young.name]
    assert night.view(capsys)["state"] == "unverified"


def test_a_command_that_does_not_exist_exits_127_and_is_recorded_failed(
    night: Night, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _with_command(night.argv(), "./no-such-renderer", "--frame", "17")
    proc = subprocess.run(argv, env=night.env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 127
    assert "cannot run './no-such-renderer'" in json.loads(proc.stdout.splitlines()[-1])["message"]
    assert_failed(night, capsys, "unknown")
    assert_nothing_committed(night)


def test_an_input_rewritten_after_plan_never_reaches_the_child_and_is_input_changed(
    night: Night, capsys: pytest.CaptureFixture[str]
) -> None:
    source = night.tmp / "frame17.txt"
    source.write_text(WORDS.replace("empty", "full!"))  # same size, other bytes, new mtime
    code, report, err = night.exec()
    assert code == 66, err
    assert (report["outcome"], report["tag"]) == ("failed", "input_changed")
    assert "content blake3" in report["message"]
    assert_nothing_committed(night)
    assert_failed(night, capsys, "input_changed")
    started = next(e["started"] for e in night.events(capsys) if "started" in e)
    assert started["input"]["input_ref"] == str(source)


def test_an_input_copied_over_itself_is_the_same_input_and_the_child_runs(
    night: Night, capsys: pytest.CaptureFixture[str]
) -> None:
    source = night.tmp / "frame17.txt"
    copy = night.tmp / "frame17.copy"
    copy.write_text(source.read_text())
    os.replace(copy, source)  # a new inode and mtime, the bytes of the plan
    code, report, err = night.exec()
    assert code == 0, err
    assert report["outcome"] == "committed"


def test_a_shard_id_cut_as_the_cli_prints_it_names_the_whole_shard(
    night: Night, capsys: pytest.CaptureFixture[str]
) -> None:
    cut = night.shard_id[:14] + "…"  # as status, demo and watch print ids

    def exec_shard(shard: str, server: str) -> subprocess.CompletedProcess[str]:
        argv = night.argv()
        at = argv.index("--plan-line")
        argv[at : at + 2] = [shard]
        argv[argv.index("--server") + 1] = server
        argv[argv.index("--") + 1 :] = [
            "bash",
            "-c",
            "printf '1 frame\\n' > {tmp:counts} && printf '{\"frame\": 17}' > {tmp:summary}",
        ]
        return subprocess.run(argv, env=night.env(), capture_output=True, text=True, timeout=60)

    done = exec_shard(cut, night.target)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["shard_id"] == night.shard_id
    assert night.final("counts").exists() and night.view(capsys)["state"] == "unverified"

    unknown = exec_shard("s-ffffffff…", night.target)
    assert unknown.returncode == 4 and "has no shard s-ffffffff…" in unknown.stderr
    away = exec_shard(cut, f"127.0.0.1:{_free_port()}")
    assert away.returncode == 3, away.stderr
    assert "give the whole shard id" in away.stderr
