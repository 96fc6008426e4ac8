"""A NaN loss is evidence on the ledger, never the reason a job dies (issue 17, case 7)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shard_client import Ledger, LedgerClient
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from tests.sdk.test_shard_lifecycle import RUN, plan, run_job, state

pytest_plugins = ["tests.sdk.test_shard_lifecycle"]  # the ledger and target fixtures


def heartbeats(client: LedgerClient, shard_id: str) -> list[pb.Heartbeat]:
    """Returns the shard's stored heartbeats, in ledger order."""
    return [
        e.heartbeat
        for e in client.list_events(RUN)
        if e.shard_id == shard_id and e.HasField("heartbeat")
    ]


NAN_JOB = """
import math
from shard_client import Ledger

ledger = Ledger()
with ledger.shard("night-01", "nan", fingerprint=False) as shard:
    for step in range(6):
        loss = float("nan") if step >= 2 else 1.0 / (step + 1)
        shard.progress(step, step / 6, loss=loss, grad_norm=math.inf, lr=1e-3)
    with shard.atomic_write("nan.out") as f:
        f.write(b"finished despite the NaN")
print("job done")
"""


def test_a_job_whose_loss_turns_nan_mid_run_finishes_and_commits(
    client: LedgerClient, target: str, tmp_path: Path
) -> None:
    plan(client, "nan")
    job = run_job(NAN_JOB, target, tmp_path)
    assert job.returncode == 0, job.stderr
    assert job.stdout.strip() == "job done"
    assert state(client, "nan") == "unverified"
    beats = heartbeats(client, "nan")
    explicit = [b for b in beats if b.metrics.get("lr") == 1e-3]
    # Coalesced: the first call and the step the loss turned NaN go at once (news), the
    # rest with the commit; each names every metric non-finite at any of its steps.
    assert [(b.step, list(b.nonfinite_metrics)) for b in explicit] == [
        (0, ["grad_norm"]),
        (2, ["grad_norm", "loss"]),
        (5, ["grad_norm", "loss"]),
    ]
    assert explicit[0].metrics["loss"] == 1.0 and explicit[1].metrics_max["loss"] == 0.5
    assert all("loss" not in b.metrics for b in explicit[1:])
    # The SDK configures no logging: Python's last-resort handler prints each once.
    assert job.stderr.count("metric_nonfinite") == 2, job.stderr
    assert "metric='loss'" in job.stderr and "step 2" in job.stderr


def test_values_that_are_no_number_never_raise_into_the_job(
    ledger: Ledger, client: LedgerClient, tmp_path: Path
) -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    plan(client, "odd")
    with ledger.shard(RUN, "odd", fingerprint=False) as shard:
        ack = shard.progress(
            np.int64(3),
            float("nan"),
            loss=torch.tensor(float("nan")),
            acc=np.float32(0.75),
            weights=torch.ones(3),
            note="not a number",
            missing=None,
            **{f"m{i}": i for i in range(300)},
        )
        assert ack.wait_acknowledged(10) and ack.error is None
        with shard.atomic_write(tmp_path / "odd.out") as f:
            f.write(b"ok")
    assert state(client, "odd") == "unverified"
    [beat] = [b for b in heartbeats(client, "odd") if b.step == 3]
    assert list(beat.nonfinite_metrics) == ["loss"]
    assert beat.metrics["acc"] == 0.75 and len(beat.metrics) == 256
    assert not {"weights", "note", "missing"} & set(beat.metrics)
