"""A metric that is an integral double past 2**53 survives storage, resends and rebuilds.

RFC 8785 writes such a double without an exponent (2.0**60 as 1152921504606846976), and
the row parser reads it back as an integer. The ledger once gave only `metrics` its
doubles back: a resent coalesced heartbeat whose `metrics_max` held one failed with
UNKNOWN (group_commit_failed), and export/import could not re-encode the row.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ledger_server.server import RunningServer
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from tests.builders import event, planned, run_cli, started

HUGE = 2.0**60  # integral, past 2**53


def test_a_resent_heartbeat_with_a_huge_integral_extreme_is_a_duplicate_and_the_file_checks(
    server: RunningServer,
    client: LedgerClient,
    db_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    beat = event(
        "run-1",
        "shard-0",
        "att-1",
        heartbeat=pb.Heartbeat(
            step=2,
            progress=0.5,
            metrics={"loss": 1e20},
            first_step=1,
            metrics_min={"loss": 1.0},
            metrics_max={"loss": HUGE},
            progress_calls=2,
        ),
    )
    client.append([planned(), started()])
    first, again = client.append([beat])[0], client.append([beat])[0]
    assert first.outcome == pb.APPEND_OUTCOME_APPENDED
    assert (again.outcome, again.sequence) == (pb.APPEND_OUTCOME_DUPLICATE, first.sequence)
    (stored,) = [e for e in client.list_events("run-1") if e.WhichOneof("payload") == "heartbeat"]
    assert stored.heartbeat.metrics_max["loss"] == HUGE
    assert stored.heartbeat.metrics["loss"] == 1e20

    export = db_path.parent / "run-1.jsonl"
    target = f"127.0.0.1:{server.port}"
    code, _, err = run_cli(capsys, "export", "run-1", "--server", target, "-o", str(export))
    assert code == 0, err
    copy = db_path.parent / "copy.db"
    code, _, err = run_cli(capsys, "import", str(export), "--db", str(copy))
    assert code == 0, err
    code, out, err = run_cli(capsys, "audit", "verify", "--db", str(copy))
    assert code == 0, out + err
