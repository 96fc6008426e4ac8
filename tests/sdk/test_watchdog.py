"""The SDK's own hang watchdog: a job alive but stuck is diagnosed, recorded failed(timeout), stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import blake3
import pytest

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from shard_client.diagnostics import BundleContext, write_bundle
from shard_client.options import ShardOptions
from shard_client.watchdog import HangPolicy, ProgressClock
from tests.builders import planned

REPO = Path(__file__).resolve().parents[2]


def run_job(
    client: LedgerClient,
    tmp_path: Path,
    mode: str,
    *,
    hang_grace: float,
    kill_grace: float = 2.0,
    sigterm_grace: float = 30.0,
    timeout: float = 60.0,
) -> tuple[int, float, str]:
    """Runs the helper job to its end; returns (exit status, seconds after its steps, stdout)."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "SHARDLEDGER_HANG_GRACE": str(hang_grace),
        "SHARDLEDGER_KILL_GRACE": str(kill_grace),
        "SHARDLEDGER_DIAG_DIR": str(tmp_path / "diag"),
    }
    argv = [sys.executable, str(REPO / "tests/helpers/sdk_hung_job.py"), client.target]
    argv += ["run-1", "shard-0", str(tmp_path / "out"), mode, str(sigterm_grace)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "stepping"
        began = time.monotonic()
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, time.monotonic() - began, out


def endings(client: LedgerClient) -> list[tuple[str, str]]:
    """Returns (kind, tag) of every attempt-ending event of the run, in order."""
    found = []
    for e in client.list_events("run-1"):
        if e.WhichOneof("payload") == "failed":
            found.append(("failed", pb.FailureTag.Name(e.failed.tag)))
    return found


def test_a_deadlocked_job_with_default_settings_is_recorded_timeout_with_its_stack_and_killed(
    client: LedgerClient, tmp_path: Path
) -> None:
    client.append([planned()])
    # Steps take 0.05 s: the documented bound is 10 x 0.05 s + hang_grace 1 s, then kill_grace.
    code, seconds, _ = run_job(client, tmp_path, "deadlock", hang_grace=1.0, kill_grace=2.0)
    # Its main thread never runs the SIGTERM handler's Preempted: only SIGKILL ends it.
    assert code == -signal.SIGKILL
    assert 1.5 <= seconds < 1.5 + 2.0 + 10.0
    [failed] = [
        e.failed for e in client.list_events("run-1") if e.WhichOneof("payload") == "failed"
    ]
    assert failed.tag == pb.FAILURE_TAG_TIMEOUT
    assert "no progress() call, checkpoint or commit for" in failed.message
    assert "10 x median step" in failed.message
    bundle = Path(failed.diagnostics_path)
    assert bundle.parent == tmp_path / "diag"
    assert blake3.blake3(bundle.read_bytes()).hexdigest() == failed.diagnostics_blake3_hex
    report = bundle.read_text()
    assert "deadlocked_in_collective" in report and "lock.acquire()" in report
    assert "== nvml ==" in report and "== open file descriptors ==" in report
    [view] = client.shards("run-1")
    assert view.state == "failed"
    assert [(e.shard_id, e.reason) for e in client.resume("run-1")] == [
        ("shard-0", "failed:timeout")
    ]
    # SIGKILL ran no cleanup, yet its never-used SIGUSR1 stack file is gone: only evidence stays.
    assert list((tmp_path / "diag").glob("*.stack")) == []


def test_a_hung_job_that_handles_sigterm_stops_within_its_grace_and_is_recorded_once(
    client: LedgerClient, tmp_path: Path
) -> None:
    client.append([planned()])
    code, seconds, _ = run_job(
        client, tmp_path, "sleep", hang_grace=0.5, kill_grace=30.0, sigterm_grace=0.5
    )
    # Preempted after the 0.5 s SIGTERM grace ends the job long before the 30 s SIGKILL.
    assert code == 1
    assert seconds < 20
    assert endings(client) == [("failed", pb.FailureTag.Name(pb.FAILURE_TAG_TIMEOUT))]


def test_a_slow_but_progressing_job_is_never_stopped(client: LedgerClient, tmp_path: Path) -> None:
    client.append([planned()])
    # Every step (0.3 s) outlasts hang_grace (0.2 s); 10 x the step time keeps it watched, not killed.
    code, _, out = run_job(client, tmp_path, "slow", hang_grace=0.2)
    assert (code, out.strip()) == (0, "done")
    assert endings(client) == []
    assert not (tmp_path / "diag").exists() or not list((tmp_path / "diag").glob("*.hang.txt"))
    [view] = client.shards("run-1")
    assert view.state == "unverified"


def test_a_checkpoint_save_longer_than_the_threshold_is_not_a_hang(
    client: LedgerClient, tmp_path: Path
) -> None:
    client.append([planned()])
    # The save takes 3 s; the threshold is 10 x 0.05 s + 0.3 s = 0.8 s.
    code, _, out = run_job(client, tmp_path, "slow_save", hang_grace=0.3)
    assert (code, out.strip()) == (0, "done")
    assert endings(client) == []
    [view] = client.shards("run-1")
    assert view.state == "unverified"


def test_a_job_that_never_calls_progress_is_unwatched_unless_it_sets_hang_timeout() -> None:
    assert HangPolicy(hang_timeout=None).threshold(None) is None
    assert HangPolicy(hang_timeout=90.0).threshold(None) == (90.0, "hang_timeout 90s")
    assert HangPolicy(hang_timeout=None, hang_grace=300.0).threshold(2.0) == (
        320.0,
        "10 x median step 2s + hang_grace 300s",
    )


def test_the_clock_pauses_during_a_save_and_follows_the_median_step() -> None:
    now = [0.0]
    clock = ProgressClock(now=lambda: now[0])
    for t in (1.0, 2.0, 3.0, 13.0):  # one 10 s outlier among 1 s steps
        now[0] = t
        clock.stepped()
    assert clock.median_step() == 1.0
    with clock.paused():
        now[0] = 500.0
        assert clock.quiet_since() is None
    assert clock.quiet_since() == 500.0
    now[0] = 501.0
    clock.stepped()
    assert clock.median_step() == 1.0  # the save's 487 s is not a step


def test_the_bundle_degrades_section_by_section_and_keeps_the_log_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHARDLEDGER_DIAG_DIR", str(tmp_path / "diag"))
    log = tmp_path / "job.log"
    log.write_text("".join(f"line {i}\n" for i in range(1000)))

    class BrokenNvml:
        def init(self) -> None:
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    info = write_bundle(
        BundleContext("run-1", "shard-0", "att-1"),
        message="hung",
        log_file=str(log),
        nvml=BrokenNvml(),  # type: ignore[arg-type]
    )
    report = Path(info.path).read_text()
    assert info.path == str(tmp_path / "diag" / "att-1.hang.txt")
    assert "nvml unavailable: OSError: libnvidia-ml.so.1" in report
    assert "line 999" in report and "line 799\n" not in report and "line 800" in report
    assert "test_the_bundle_degrades_section_by_section" in report  # this thread's stack


def test_watchdog_settings_come_from_options_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SHARDLEDGER_HANG_GRACE", "12")
    policy = ShardOptions().hang_policy()
    assert policy is not None and (policy.hang_grace, policy.kill_grace) == (12.0, 30.0)
    assert ShardOptions(hang_grace=5.0).hang_policy() == HangPolicy(
        hang_timeout=None, hang_grace=5.0
    )
    assert ShardOptions(watchdog=False).hang_policy() is None
    monkeypatch.setenv("SHARDLEDGER_WATCHDOG", "off")
    assert ShardOptions().hang_policy() is None
    monkeypatch.setenv("SHARDLEDGER_KILL_GRACE", "soon")
    monkeypatch.delenv("SHARDLEDGER_WATCHDOG")
    with pytest.raises(ValueError, match=r"\$SHARDLEDGER_KILL_GRACE='soon' is not a number"):
        ShardOptions().hang_policy()
