"""A shard context against a real server: started, heartbeats, commits, and never a bare success."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from shard_client import (
    DataError,
    IncompleteShard,
    Ledger,
    LedgerClient,
    LifecycleError,
    PlanEntry,
    plan_events,
)
from shard_client.api.shardledger.v1 import ledger_pb2 as pb

REPO = Path(__file__).resolve().parents[2]
RUN = "night-01"


pytestmark = pytest.mark.usefixtures("spool_in_tmp")


def plan(
    client: LedgerClient, *shard_ids: str, outputs: tuple[str, ...] = (), run: str = RUN
) -> None:
    """Registers shards in a run (RUN unless given)."""
    entries = [
        PlanEntry(
            shard_id=s,
            input_ref=f"/in/{s}",
            input_bytes=1,
            input_blake3="ab" * 32,
            expected_outputs=outputs,
            plan_index=i,
        )
        for i, s in enumerate(shard_ids)
    ]
    client.append(plan_events(run, entries))


def kinds(client: LedgerClient, shard_id: str) -> list[str]:
    """Returns the kinds of a shard's events, heartbeats collapsed into one."""
    out: list[str] = []
    for e in client.list_events(RUN):
        kind = e.WhichOneof("payload")
        if e.shard_id == shard_id and kind is not None and not (kind == out[-1:] == ["heartbeat"]):
            out.append(kind)
    return out


def failures(client: LedgerClient, shard_id: str) -> list[pb.AttemptFailed]:
    """Returns the shard's failed events."""
    return [
        e.failed for e in client.list_events(RUN) if e.shard_id == shard_id and e.HasField("failed")
    ]


def state(client: LedgerClient, shard_id: str) -> str:
    """Returns the shard's state as the server projects it."""
    return next(s.state for s in client.shards(RUN) if s.shard_id == shard_id)


def run_job(
    code: str, target: str, tmp_path: Path, *, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Runs a job script in a fresh interpreter against the server."""
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        SHARDLEDGER_SERVER=target,
        SHARDLEDGER_SPOOL_DIR=str(tmp_path / "job-spool"),
    )
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
    )


def test_shard_records_started_heartbeats_and_artifact_then_run_is_committed(
    ledger: Ledger, client: LedgerClient, tmp_path: Path
) -> None:
    plan(client, "a", outputs=("out",))
    with ledger.shard(RUN, "a", heartbeat_timeout=0.4, output_dir=tmp_path) as shard:
        shard.progress(1, 0.5, loss=0.25)
        time.sleep(0.3)  # long enough for a background heartbeat (interval = timeout / 4)
        with shard.atomic_write(tmp_path / "a.out", name="out", media_type="text/plain") as f:
            f.write(b"result")
        assert shard.committed == ("out",)
    events = [e for e in client.list_events(RUN) if e.shard_id == "a"]
    heartbeats = [e.heartbeat for e in events if e.HasField("heartbeat")]
    assert kinds(client, "a")[:3] == ["planned", "started", "heartbeat"]
    assert [k for k in kinds(client, "a") if k != "heartbeat"][-1] == "artifact_committed"
    assert len(heartbeats) >= 2 and heartbeats[0].metrics["loss"] == 0.25
    started = events[1].started
    assert started.pid == os.getpid() and started.heartbeat_timeout.ToMilliseconds() == 400
    assert started.fingerprint and len(started.fingerprint_digest) == 64
    [artifact] = [e.artifact_committed for e in events if e.HasField("artifact_committed")]
    assert (artifact.path, artifact.size_bytes) == (str(tmp_path / "a.out"), 6)
    assert state(client, "a") == "unverified"
    summary = json.loads(client.summary(RUN))
    assert summary["unverified"] == 1 and summary["failed"] == 0


def test_commit_records_a_file_that_another_library_wrote(
    ledger: Ledger, client: LedgerClient, tmp_path: Path
) -> None:
    plan(client, "b")
    out = tmp_path / "table.csv"
    with ledger.shard(RUN, "b", fingerprint=False) as shard:
        out.write_text("a,b\n1,2\n")
        info = shard.commit(out)
    assert shard.committed == ("table.csv",)
    assert [
        e.artifact_committed.blake3_hex
        for e in client.list_events(RUN)
        if e.HasField("artifact_committed")
    ] == [info.blake3_hex]
    assert state(client, "b") == "unverified"


@pytest.mark.parametrize(
    ("error", "tag"),
    [
        (MemoryError("host"), pb.FAILURE_TAG_OOM),
        (DataError("row 7 has no label"), pb.FAILURE_TAG_DATA),
        (RuntimeError("NCCL error: remote process exited"), pb.FAILURE_TAG_NCCL),
        (ValueError("anything else"), pb.FAILURE_TAG_UNKNOWN),
        (KeyboardInterrupt(), pb.FAILURE_TAG_KILLED),
    ],
)
def test_exception_in_block_records_failed_with_its_tag_and_propagates(
    ledger: Ledger, client: LedgerClient, error: BaseException, tag: int
) -> None:
    plan(client, "c")
    with pytest.raises(type(error)), ledger.shard(RUN, "c", fingerprint=False):
        raise error
    [failed] = failures(client, "c")
    assert failed.tag == tag and type(error).__name__ in failed.message
    assert state(client, "c") == "failed"


def test_clean_exit_without_any_commit_records_incomplete_and_raises(
    ledger: Ledger, client: LedgerClient
) -> None:
    plan(client, "d")
    with (
        pytest.raises(IncompleteShard, match="without committing"),
        ledger.shard(RUN, "d", fingerprint=False),
    ):
        pass
    [failed] = failures(client, "d")
    assert failed.tag == pb.FAILURE_TAG_INCOMPLETE


def test_clean_exit_missing_a_declared_output_names_it(
    ledger: Ledger, client: LedgerClient, tmp_path: Path
) -> None:
    plan(client, "e", outputs=("model", "metrics"))
    shard = ledger.shard(RUN, "e", expected_outputs=["model", "metrics"], fingerprint=False)
    with (
        pytest.raises(IncompleteShard) as raised,
        shard,
        shard.atomic_write(tmp_path / "m.json", name="metrics", mode="w") as f,
    ):
        f.write("{}")
    assert raised.value.missing == ("model",)
    [failed] = failures(client, "e")
    assert failed.tag == pb.FAILURE_TAG_INCOMPLETE and "model" in failed.message


def test_entering_an_unplanned_shard_fails_before_the_block_runs(
    ledger: Ledger, client: LedgerClient
) -> None:
    plan(client, "f")
    ran = False
    with pytest.raises(LifecycleError), ledger.shard(RUN, "never-planned", fingerprint=False):
        ran = True
    assert not ran


def test_output_dir_orphans_of_killed_writers_are_removed_on_enter(
    ledger: Ledger, client: LedgerClient, tmp_path: Path
) -> None:
    plan(client, "g")
    orphan = tmp_path / ".shardledger-tmp-out.bin.abc123"
    orphan.write_bytes(b"half")
    with ledger.shard(RUN, "g", output_dir=tmp_path, orphan_age_s=0, fingerprint=False) as shard:
        assert not orphan.exists()
        with shard.atomic_write(tmp_path / "out.bin") as f:
            f.write(b"whole")


@pytest.mark.parametrize("where", ["output_dir", "checkpoint_dir"])
def test_checkpoint_orphans_of_a_preempted_save_are_removed_on_enter(
    ledger: Ledger, client: LedgerClient, tmp_path: Path, where: str
) -> None:
    plan(client, "go")
    checkpoints = tmp_path / "checkpoints" if where == "output_dir" else tmp_path / "ck"
    checkpoints.mkdir()
    orphan = checkpoints / ".shardledger-tmp-ckpt-00000100.pt.2w6ikr"
    orphan.write_bytes(b"half a checkpoint")
    kept = checkpoints / "ckpt-00000050.pt"
    kept.write_bytes(b"a committed checkpoint")
    place: dict[str, Any] = {where: checkpoints if where == "checkpoint_dir" else tmp_path}
    with ledger.shard(
        RUN,
        "go",
        **place,
        orphan_age_s=0,
        fingerprint=False,
    ) as shard:
        assert not orphan.exists() and kept.exists()
        shard.commit(_touch(tmp_path / "go.bin"))


def test_checkpoints_are_recorded_and_the_latest_one_loads(
    ledger: Ledger, client: LedgerClient, tmp_path: Path
) -> None:
    plan(client, "h")
    with ledger.shard(RUN, "h", output_dir=tmp_path, fingerprint=False) as shard:
        assert shard.load_latest_checkpoint() is None
        shard.save_checkpoint(3, extra={"epoch": 0})
        shard.save_checkpoint(7, extra={"epoch": 1})
        loaded = shard.load_latest_checkpoint()
        assert loaded is not None and (loaded.step, loaded.extra) == (7, {"epoch": 1})
        with shard.atomic_write(tmp_path / "final.bin") as f:
            f.write(b"w")
    steps = [e.checkpoint.step for e in client.list_events(RUN) if e.HasField("checkpoint")]
    assert steps == [3, 7]


def test_a_checkpoint_replaced_on_disk_is_skipped_for_the_older_recorded_one(
    ledger: Ledger, client: LedgerClient, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plan(client, "hd")
    with ledger.shard(RUN, "hd", output_dir=tmp_path, fingerprint=False) as shard:
        shard.save_checkpoint(100, extra={"epoch": 1})
        newest = shard.save_checkpoint(200, extra={"epoch": 2})
        data = Path(newest.path).read_bytes()
        Path(newest.path).write_bytes(data[: len(data) // 2])  # replaced after its commit
        loaded = shard.load_latest_checkpoint()
        assert loaded is not None and (loaded.step, loaded.extra) == (100, {"epoch": 1})
        assert "checkpoint_digest_mismatch" in caplog.text and newest.path in caplog.text
        Path(loaded.path).write_bytes(b"also replaced")
        assert shard.load_latest_checkpoint() is None  # nothing on record matches: fresh
        assert "checkpoint_fresh_start" in caplog.text
        shard.commit(_touch(tmp_path / "hd.bin"))


def test_a_recorded_checkpoint_that_does_not_load_is_raised_when_no_older_one_loads(
    ledger: Ledger, client: LedgerClient, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch = pytest.importorskip("torch")
    plan(client, "hm")
    with ledger.shard(RUN, "hm", output_dir=tmp_path, fingerprint=False) as shard:
        shard.save_checkpoint(5)  # no model state: the job's model cannot be restored from it
        with pytest.raises(ValueError, match="checkpoint has no model state"):
            shard.load_latest_checkpoint(model=torch.nn.Linear(2, 2))
        assert "checkpoint_unloadable" in caplog.text
        shard.commit(_touch(tmp_path / "hm.bin"))


def test_a_new_run_over_the_same_output_dir_starts_at_step_zero(
    ledger: Ledger, client: LedgerClient, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shard_client")
    plan(client, "s")
    with ledger.shard(RUN, "s", output_dir=tmp_path, fingerprint=False) as shard:
        final = shard.save_checkpoint(200)
        shard.commit(_touch(tmp_path / "s.bin"))
    plan(client, "s", run="night-02")
    with ledger.shard("night-02", "s", output_dir=tmp_path, fingerprint=False) as shard:
        assert shard.load_latest_checkpoint() is None  # night-01's checkpoint is not this run's
        shard.commit(_touch(tmp_path / "s.bin"))
    assert f"checkpoint_not_recorded run=night-02 shard=s path={final.path}" in caplog.text


def test_a_rerun_of_the_same_run_and_shard_resumes_from_its_recorded_checkpoint(
    ledger: Ledger, client: LedgerClient, tmp_path: Path
) -> None:
    plan(client, "r", "other")
    with (
        pytest.raises(RuntimeError),
        ledger.shard(RUN, "r", output_dir=tmp_path, fingerprint=False) as shard,
    ):
        shard.save_checkpoint(40, extra={"epoch": 4})
        raise RuntimeError("preempted mid-training")
    # Another shard sharing the directory saves a later step: not this shard's.
    with ledger.shard(RUN, "other", output_dir=tmp_path, fingerprint=False) as shard:
        shard.save_checkpoint(90)
        shard.commit(_touch(tmp_path / "other.bin"))
    with ledger.shard(RUN, "r", output_dir=tmp_path, fingerprint=False) as shard:
        loaded = shard.load_latest_checkpoint()
        assert loaded is not None and (loaded.step, loaded.extra) == (40, {"epoch": 4})
        shard.commit(_touch(tmp_path / "r.bin"))


def test_with_the_ledger_unreachable_no_checkpoint_on_disk_is_trusted(
    client: LedgerClient, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plan(client, "u")
    led = Ledger(target=client.target, unavailable_after_s=0.5)
    with led.shard(RUN, "u", output_dir=tmp_path, fingerprint=False) as shard:
        shard.save_checkpoint(10)
        led.client = LedgerClient("127.0.0.1:1", timeout_s=0.5, retry_deadline_s=0.5)
        assert shard.load_latest_checkpoint() is None
        led.client = client
        shard.commit(_touch(tmp_path / "u.bin"))
    led.close()
    assert "checkpoint_resume_skipped run=night-01 shard=u reason=ledger_unreachable" in caplog.text


def test_with_progress_timeout_a_job_hung_with_its_process_alive_goes_stale_then_recovers(
    ledger: Ledger, client: LedgerClient, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plan(client, "hang")

    def state_becomes(wanted: str) -> bool:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if state(client, "hang") == wanted:
                return True
            time.sleep(0.05)
        return False

    with ledger.shard(
        RUN, "hang", heartbeat_timeout=0.4, progress_timeout=0.3, fingerprint=False
    ) as shard:
        shard.progress(1)
        # A deadlock with the GIL released: the heartbeat thread lives on, progress stops.
        assert state_becomes("stale"), "the hung attempt never went stale"
        assert "no_progress shard=hang" in caplog.text
        shard.progress(2)  # it moves again: beats resume
        assert state_becomes("running")
        shard.commit(_touch(tmp_path / "hang.bin"))
    assert state(client, "hang") == "unverified"


def test_heartbeat_thread_uses_almost_no_cpu(
    ledger: Ledger, client: LedgerClient, tmp_path: Path
) -> None:
    plan(client, "i")
    with ledger.shard(RUN, "i", heartbeat_timeout=0.2, fingerprint=False) as shard:
        before = time.process_time()
        time.sleep(1.0)
        used = time.process_time() - before
        shard.commit(_touch(tmp_path / "i.bin"))
    beats = [e for e in client.list_events(RUN) if e.shard_id == "i" and e.HasField("heartbeat")]
    assert len(beats) >= 10  # every 50 ms
    assert used < 0.25


def _touch(path: Path) -> Path:
    path.write_bytes(b"x")
    return path


def test_job_that_exits_cleanly_without_committing_exits_nonzero(
    client: LedgerClient, target: str, tmp_path: Path
) -> None:
    plan(client, "j")
    done = run_job(
        f"""
        from shard_client import Ledger
        with Ledger().shard({RUN!r}, "j", fingerprint=False):
            print("work done, forgot to write the result")
        """,
        target,
        tmp_path,
    )
    assert done.returncode != 0
    assert "IncompleteShard" in done.stderr
    assert failures(client, "j")[0].tag == pb.FAILURE_TAG_INCOMPLETE


def test_sigterm_sets_stopping_then_grace_end_records_preempted(
    client: LedgerClient, target: str, tmp_path: Path
) -> None:
    plan(client, "k")
    job = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                from shard_client import Ledger
                with Ledger().shard({RUN!r}, "k", sigterm_grace=3.0, output_dir="out",
                                    fingerprint=False) as shard:
                    print("ready", flush=True)
                    while not shard.stopping:
                        time.sleep(0.01)
                    with shard.checkpoint_write(5) as f:
                        f.write(b"state at step 5")
                    print("checkpointed", flush=True)
                    time.sleep(60)  # the end of the grace period interrupts this
                """
            ),
        ],
        env=dict(os.environ, PYTHONPATH=str(REPO), SHARDLEDGER_SERVER=target),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert job.stdout is not None
    assert job.stdout.readline().strip() == "ready"
    start = time.monotonic()
    job.terminate()
    out, err = job.communicate(timeout=60)
    assert "checkpointed" in out
    assert job.returncode != 0 and "Preempted" in err
    # The grace leaves room for the checkpoint's fsyncs and commit on a slow disk.
    assert 2.9 < time.monotonic() - start < 60
    assert kinds(client, "k") == ["planned", "started", "checkpoint", "failed"]
    assert failures(client, "k")[0].tag == pb.FAILURE_TAG_PREEMPTED


def test_ledger_works_in_parent_and_in_a_forked_child(
    client: LedgerClient, target: str, tmp_path: Path
) -> None:
    plan(client, "parent", "busy-parent", "child")
    done = run_job(
        f"""
        import multiprocessing, sys, threading
        from shard_client import Ledger
        ledger = Ledger()

        def work(shard_id):
            with ledger.shard({RUN!r}, shard_id, fingerprint=False, coalesce_progress=False) as shard:
                for step in range(200):
                    shard.progress(step)
                with shard.atomic_write(shard_id + ".out") as f:
                    f.write(shard_id.encode())

        work("parent")
        # Fork while the parent's sender is busy: the child must not inherit a wedged channel.
        busy = threading.Thread(target=work, args=("busy-parent",))
        busy.start()
        child = multiprocessing.get_context("fork").Process(target=work, args=("child",))
        child.start()
        child.join(30)
        busy.join(30)
        sys.exit(child.exitcode)
        """,
        target,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    for shard_id in ("parent", "busy-parent", "child"):
        assert state(client, shard_id) == "unverified"
        steps = [
            e.heartbeat.step
            for e in client.list_events(RUN)
            if e.shard_id == shard_id and e.HasField("heartbeat")
        ]
        assert steps == list(range(200))


def test_sigusr1_dumps_every_thread_stack_for_the_watchdog(
    ledger: Ledger, client: LedgerClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan(client, "l")
    monkeypatch.setenv("SHARDLEDGER_DIAG_DIR", str(tmp_path / "diag"))
    with ledger.shard(RUN, "l", fingerprint=False) as shard:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)
        shard.commit(_touch(tmp_path / "l.bin"))
    dump = (tmp_path / "diag" / f"{shard.attempt_id}.stack").read_text()
    assert "test_sigusr1_dumps_every_thread_stack_for_the_watchdog" in dump
    assert "shard_client-heartbeat-l" in dump or "Thread 0x" in dump
