"""progress() every step reaches the ledger as one heartbeat per interval (issue 22, item 1)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Unpack

import pytest

from shard_client import Ledger, LedgerClient
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.metrics import Coerced
from shard_client.options import ShardOptionKwargs
from shard_client.progress import ProgressWindow
from tests.builders import run_cli
from tests.sdk.test_shard_lifecycle import RUN, plan, state

pytest_plugins = ["tests.sdk.test_shard_lifecycle"]  # the ledger and target fixtures

# An interval no test reaches: every beat here is the first call, a flush, or news.
QUIET: ShardOptionKwargs = {"heartbeat_timeout": 3600.0, "fingerprint": False, "watchdog": False}


def quiet(**more: Unpack[ShardOptionKwargs]) -> ShardOptionKwargs:
    options = QUIET.copy()
    options.update(more)
    return options


def touch(path: Path) -> Path:
    path.write_bytes(b"x")
    return path


def events(client: LedgerClient, shard_id: str) -> list[pb.ShardEvent]:
    return [e for e in client.list_events(RUN) if e.shard_id == shard_id]


def beats(client: LedgerClient, shard_id: str) -> list[pb.Heartbeat]:
    return [e.heartbeat for e in events(client, shard_id) if e.HasField("heartbeat")]


def test_a_window_of_one_call_is_exactly_the_heartbeat_that_call_sends_alone() -> None:
    window = ProgressWindow()
    window.add(Coerced(7, 0.25, {"loss": 0.5}, ("grad",)))
    alone = pb.Heartbeat(step=7, progress=0.25, metrics={"loss": 0.5}, nonfinite_metrics=["grad"])
    assert window.heartbeat().SerializeToString(deterministic=True) == alone.SerializeToString(
        deterministic=True
    )


def test_a_window_carries_latest_values_lowest_step_extremes_and_every_nonfinite_name() -> None:
    window = ProgressWindow()
    window.add(Coerced(10, 0.1, {"loss": 3.0, "lr": 1e-3}, ()))
    window.add(Coerced(11, 0.2, {"loss": 1.0}, ("grad",)))
    window.add(Coerced(12, 0.3, {"acc": 0.5}, ("loss",)))
    beat = window.heartbeat()
    assert (beat.first_step, beat.step, beat.progress, beat.progress_calls) == (10, 12, 0.3, 3)
    # loss's latest value was NaN: named non-finite, not in metrics; its finite extremes stay.
    assert dict(beat.metrics) == {"lr": 1e-3, "acc": 0.5}
    assert list(beat.nonfinite_metrics) == ["grad", "loss"]
    assert dict(beat.metrics_min) == {"loss": 1.0, "lr": 1e-3, "acc": 0.5}
    assert dict(beat.metrics_max) == {"loss": 3.0, "lr": 1e-3, "acc": 0.5}


def test_a_window_whose_names_fill_the_budget_keeps_latest_values_and_drops_extremes() -> None:
    window = ProgressWindow()
    many = {f"{i:03d}" + "m" * 180: float(i) for i in range(256)}  # ~53 KiB of names
    window.add(Coerced(1, 0.0, many, ()))
    window.add(Coerced(2, 0.0, many, ()))
    beat = window.heartbeat()
    assert len(beat.metrics) == 256
    assert len(beat.metrics_min) == len(beat.metrics_max) < 256
    # What it carries still fits one event (the server's limit is 64 KiB of JSON).
    assert beat.ByteSize() < 64 * 1024


def test_progress_every_step_reaches_the_ledger_as_the_first_call_then_one_flushed_beat(
    ledger: Ledger, client: LedgerClient, tmp_path: Path
) -> None:
    plan(client, "fast")
    with ledger.shard(RUN, "fast", **QUIET) as shard:
        for step in range(200):
            shard.progress(step, step / 200, loss=1.0 / (step + 1), lr=1e-3)
        last = shard.progress(200, 1.0, loss=0.001, lr=1e-3)
        assert not last.settled  # held for the next beat
        shard.commit(touch(tmp_path / "fast.out"))
        assert last.wait_acknowledged(10)
    first, rest = beats(client, "fast")
    assert (first.step, first.progress_calls, dict(first.metrics)) == (
        0,
        0,
        {"loss": 1.0, "lr": 1e-3},
    )
    assert (rest.first_step, rest.step, rest.progress_calls) == (1, 200, 200)
    assert rest.metrics["loss"] == 0.001
    assert (rest.metrics_min["loss"], rest.metrics_max["loss"]) == (0.001, 0.5)
    kinds = [e.WhichOneof("payload") for e in events(client, "fast")]
    assert kinds == ["planned", "started", "heartbeat", "heartbeat", "artifact_committed"]
    assert state(client, "fast") == "unverified"


def test_a_checkpoint_sends_the_pending_progress_before_itself(
    ledger: Ledger, client: LedgerClient, tmp_path: Path
) -> None:
    plan(client, "ckpt")
    with ledger.shard(RUN, "ckpt", **quiet(checkpoint_dir=str(tmp_path))) as shard:
        for step in range(50):
            shard.progress(step)
        with shard.checkpoint_write(49) as f:
            f.write(b"state")
        ckpt_seen = [e.WhichOneof("payload") for e in events(client, "ckpt")]
        shard.commit(touch(tmp_path / "ckpt.out"))
    assert ckpt_seen == ["planned", "started", "heartbeat", "heartbeat", "checkpoint"]
    assert [b.step for b in beats(client, "ckpt")] == [0, 49]


def test_a_metric_turning_nonfinite_is_sent_at_once_and_later_nans_are_coalesced(
    ledger: Ledger, client: LedgerClient, tmp_path: Path
) -> None:
    plan(client, "nan")
    with ledger.shard(RUN, "nan", **QUIET) as shard:
        shard.progress(0, loss=1.0)
        shard.progress(1, loss=0.5)
        ack = shard.progress(2, loss=math.nan)
        assert ack.wait_acknowledged(10)  # no flush: news goes out by itself
        for step in range(3, 10):
            shard.progress(step, loss=math.nan)
        shard.commit(touch(tmp_path / "nan.out"))
    got = [(b.step, b.progress_calls, list(b.nonfinite_metrics)) for b in beats(client, "nan")]
    assert got == [(0, 0, []), (2, 2, ["loss"]), (9, 7, ["loss"])]
    assert state(client, "nan") == "unverified"


def test_with_coalescing_off_every_call_is_one_heartbeat(
    ledger: Ledger, client: LedgerClient, tmp_path: Path
) -> None:
    plan(client, "each")
    with ledger.shard(RUN, "each", **quiet(coalesce_progress=False)) as shard:
        for step in range(20):
            shard.progress(step)
        shard.commit(touch(tmp_path / "each.out"))
    assert [b.step for b in beats(client, "each")] == list(range(20))


def test_a_failing_block_records_its_last_progress_before_the_failure(
    ledger: Ledger, client: LedgerClient
) -> None:
    plan(client, "boom")
    try:
        with ledger.shard(RUN, "boom", **QUIET) as shard:
            for step in range(30):
                shard.progress(step)
            raise MemoryError("CUDA out of memory")
    except MemoryError:
        pass
    kinds = [e.WhichOneof("payload") for e in events(client, "boom")]
    assert kinds[-3:] == ["heartbeat", "heartbeat", "failed"]
    assert beats(client, "boom")[-1].step == 29


def test_a_night_of_coalesced_heartbeats_rebuilds_to_the_projections_the_server_wrote(
    ledger: Ledger,
    client: LedgerClient,
    db_path: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    plan(client, "r1", "r2")
    for shard_id in ("r1", "r2"):
        with ledger.shard(RUN, shard_id, **QUIET) as shard:
            for step in range(40):
                shard.progress(step, loss=math.nan if step == 30 else 1.0 / (step + 1))
            shard.commit(touch(tmp_path / f"{shard_id}.out"))
    code, out, err = run_cli(
        capsys, "db", "rebuild", "--database-url", f"sqlite:///{db_path}", "--check", "--json"
    )
    assert code == 0, err
    [run] = json.loads(out)["runs"]
    assert (run["run_id"], run["shards"], run["differing_shards"]) == (RUN, 2, 0)
    assert run["counters_differ"] is False
