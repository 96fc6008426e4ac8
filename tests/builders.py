"""Event builders and helpers the tests import: ShardEvents of each kind, digests, the in-process CLI."""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import pytest
from google.protobuf.duration_pb2 import Duration

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.canonical import fingerprint_digest
from shard_client.ids import PlanEntry


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Runs the CLI in process; returns (exit code, stdout, stderr), usage errors included."""
    from shardledger_cli.cli import main

    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse exits 2 on a usage error
        assert isinstance(exc.code, int), exc.code
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# The capabilities that let root ignore a file's mode (capabilities(7)), by their bit:
# write any file, read and search any directory, chmod a file it does not own.
ROOT_BYPASS_CAPS: Final = {"dac_override": 1, "dac_read_search": 2, "fowner": 3}


def without_root_bypass(argv: Sequence[str]) -> list[str]:
    """Returns argv to run without the capabilities that let root ignore a file's mode.

    CI runs as root, which reads a 0o000 file and writes a 0o444 one: a test of a
    permission error starts its child through this. The child keeps root's uid, so it
    reads the checkout and its virtual environment wherever the clone is (a 0700 home
    directory too; another uid could not), while a mode binds it as it binds any owner.
    As a user, argv runs as it is.
    """
    if not holds_root_bypass():
        return list(argv)
    drop = ",".join(f"-{cap}" for cap in ROOT_BYPASS_CAPS)
    # Root's exec refills its capabilities from both sets, so both lose them.
    return ["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}", *argv]


def holds_root_bypass() -> bool:
    """Whether this process may ignore a file's mode (any of ROOT_BYPASS_CAPS is effective)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:  # not Linux: root is what bypasses
        return os.geteuid() == 0
    effective = int(status.split("CapEff:", 1)[1].split()[0], 16)
    return any(effective >> bit & 1 for bit in ROOT_BYPASS_CAPS.values())


DIGEST_A = "a" * 64
DIGEST_B = "b" * 64
# The fingerprint started() records, and its digest (the ledger refuses any other).
FINGERPRINT = {"driver": "550.54"}
FINGERPRINT_DIGEST = fingerprint_digest(FINGERPRINT)


def event(
    run_id: str = "run-1",
    shard_id: str = "shard-0",
    attempt_id: str = "",
    *,
    event_id: str | None = None,
    **payload: Any,
) -> pb.ShardEvent:
    """Returns a ShardEvent with a fresh event id."""
    return pb.ShardEvent(
        event_id=uuid.uuid4().hex if event_id is None else event_id,
        run_id=run_id,
        shard_id=shard_id,
        attempt_id=attempt_id,
        **payload,
    )


def planned(
    run_id: str = "run-1",
    shard_id: str = "shard-0",
    index: int = 0,
    outputs: tuple[str, ...] = ("out",),
) -> pb.ShardEvent:
    """Returns a planned event."""
    return event(
        run_id,
        shard_id,
        planned=pb.ShardPlanned(
            input_ref=f"/data/{shard_id}.bin",
            input_bytes=10,
            input_blake3=DIGEST_A,
            params_json='{"lr":0.1}',
            expected_outputs=list(outputs),
            plan_index=index,
        ),
    )


def started(
    run_id: str = "run-1", shard_id: str = "shard-0", attempt_id: str = "att-1", timeout_s: int = 60
) -> pb.ShardEvent:
    """Returns a started event."""
    return event(
        run_id,
        shard_id,
        attempt_id,
        started=pb.AttemptStarted(
            host="node-1",
            pid=123,
            heartbeat_timeout=Duration(seconds=timeout_s),
            fingerprint=FINGERPRINT,
            fingerprint_digest=FINGERPRINT_DIGEST,
        ),
    )


def committed(
    run_id: str = "run-1",
    shard_id: str = "shard-0",
    attempt_id: str = "att-1",
    name: str = "out",
    digest: str = DIGEST_A,
    path: str = "/out/x",
) -> pb.ShardEvent:
    """Returns an artifact_committed event."""
    return event(
        run_id,
        shard_id,
        attempt_id,
        artifact_committed=pb.ArtifactCommitted(
            name=name,
            path=path,
            size_bytes=5,
            blake3_hex=digest,
            media_type="application/octet-stream",
        ),
    )


def plan_entries(shard_ids: Sequence[str], *, output: str) -> list[PlanEntry]:
    """Returns plan entries for shards that each must commit one output named `output`."""
    return [
        PlanEntry(
            shard_id=s,
            input_ref=f"/in/{s}",
            input_bytes=1,
            input_blake3="ab" * 32,
            expected_outputs=(output,),
            plan_index=i,
        )
        for i, s in enumerate(shard_ids)
    ]
