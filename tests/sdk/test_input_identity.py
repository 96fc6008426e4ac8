"""Input identity through a real server: plan records it, a job re-reads it, the ledger judges.

Each case plans real files with the CLI, replaces or touches one as another
pipeline would, and runs the job as a user writes it: its resume line handed to
``ledger.shard(..., input=line)``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from ledger_server.server import RunningServer
from shard_client import InputChanged, Ledger, LedgerClient, LifecycleError
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from tests.builders import run_cli

RUN = "inputs-01"

pytestmark = pytest.mark.usefixtures("spool_in_tmp")


@pytest.fixture
def planned(
    server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> dict[str, Path]:
    """Plans three local inputs; returns shard id -> input path."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    for i in range(3):
        (inputs / f"part-{i}.bin").write_bytes(f"input {i}\n".encode() * 50)
    code, _, err = run_cli(
        capsys,
        "plan",
        RUN,
        "--server",
        f"127.0.0.1:{server.port}",
        "--inputs",
        str(inputs),
        "--glob",
        "*.bin",
        "--expected-outputs",
        "out",
        "--json",
    )
    assert code == 0, err
    client = LedgerClient(f"127.0.0.1:{server.port}")
    try:
        lines = [json.loads(e.plan_line) for e in client.resume(RUN)]
    finally:
        client.close()
    return {line["shard_id"]: Path(line["input"]) for line in lines}


def lines(client: LedgerClient) -> dict[str, dict[str, Any]]:
    """Returns the resume list's plan lines by shard id."""
    return {
        json.loads(e.plan_line)["shard_id"]: json.loads(e.plan_line) for e in client.resume(RUN)
    }


def reasons(client: LedgerClient) -> dict[str, str]:
    return {json.loads(e.plan_line)["shard_id"]: e.reason for e in client.resume(RUN)}


def run_job(ledger: Ledger, line: dict[str, Any], tmp_path: Path, **options: Any) -> None:
    """The job a user writes: reads its input, writes its output through the SDK."""
    with ledger.shard(RUN, line["shard_id"], input=line, **options) as shard:
        data = Path(line["input"]).read_bytes()
        with shard.atomic_write(tmp_path / f"{line['shard_id']}.out", name="out") as out:
            out.write(data[::-1])


def test_the_plan_line_carries_the_inputs_identity_as_plan_read_it(
    planned: dict[str, Path], client: LedgerClient
) -> None:
    for shard_id, line in lines(client).items():
        st = os.stat(planned[shard_id])
        identity = line["input_identity"]
        assert identity["bytes"] == st.st_size
        assert identity["mtime_ns"] == str(st.st_mtime_ns)
        assert identity["inode"] == str(st.st_ino)
        assert identity["device"] == str(st.st_dev)
        assert len(identity["blake3"]) == 64
    events = [e for e in client.list_events(RUN) if e.HasField("planned")]
    assert {e.planned.input_inode for e in events} == {os.stat(p).st_ino for p in planned.values()}


def test_an_input_replaced_before_its_job_fails_the_attempt_at_once_and_stays_in_resume(
    planned: dict[str, Path], client: LedgerClient, ledger: Ledger, tmp_path: Path
) -> None:
    shard_id, path = sorted(planned.items())[0]
    line = lines(client)[shard_id]
    # Another pipeline rewrites the input (same name, other bytes) after plan.
    fresh = path.with_suffix(".tmp")
    fresh.write_bytes(b"rewritten by another pipeline\n" * 80)
    os.replace(fresh, path)
    computed = []
    with pytest.raises(InputChanged) as caught, ledger.shard(RUN, shard_id, input=line) as shard:
        computed.append(shard)  # never reached: the job computes nothing
    assert computed == []
    assert "size" in caught.value.difference
    failed = [e.failed for e in client.list_events(RUN) if e.HasField("failed")]
    assert [f.tag for f in failed] == [pb.FAILURE_TAG_INPUT_CHANGED]
    assert str(path) in failed[0].message
    assert reasons(client)[shard_id] == "failed:input_changed"
    # The others still run and verify as planned.
    for other, other_line in lines(client).items():
        if other != shard_id:
            run_job(ledger, other_line, tmp_path)
    assert reasons(client) == {
        shard_id: "failed:input_changed",
        **{other: "unverified" for other in planned if other != shard_id},
    }


def test_a_touched_or_copied_input_with_the_same_bytes_is_still_the_planned_input(
    planned: dict[str, Path], client: LedgerClient, ledger: Ledger, tmp_path: Path
) -> None:
    shard_id, path = sorted(planned.items())[1]
    line = lines(client)[shard_id]
    copy = path.with_suffix(".copy")
    copy.write_bytes(path.read_bytes())  # a new inode, a new mtime, the same bytes
    os.replace(copy, path)
    run_job(ledger, line, tmp_path)
    started = next(e.started for e in client.list_events(RUN) if e.HasField("started"))
    # The cheap identity differed, so the SDK re-hashed and the content decided.
    assert started.input.blake3_hex == line["input_identity"]["blake3"]
    assert started.input.inode == os.stat(path).st_ino != int(line["input_identity"]["inode"])
    assert shard_id not in {s for s, r in reasons(client).items() if r.startswith("failed")}


def test_the_ledger_judges_a_job_handed_only_a_path_and_refuses_its_commits(
    planned: dict[str, Path], client: LedgerClient, ledger: Ledger, tmp_path: Path
) -> None:
    shard_id, path = sorted(planned.items())[2]
    path.write_bytes(path.read_bytes() + b"appended later\n")  # grows in place
    with pytest.raises(InputChanged) as caught, ledger.shard(RUN, shard_id, input=str(path)):
        pass
    assert "size" in caught.value.difference
    assert reasons(client)[shard_id] == "failed:input_changed"


def test_a_job_that_ignores_the_verdict_cannot_commit(
    planned: dict[str, Path], client: LedgerClient, tmp_path: Path
) -> None:
    # A client in another language that sends started with the input it saw and
    # carries on: the ack says why, and the ledger refuses its commit.
    shard_id, path = sorted(planned.items())[0]
    path.write_bytes(b"other bytes")
    st = os.stat(path)
    started = pb.ShardEvent(
        event_id="start-1",
        run_id=RUN,
        shard_id=shard_id,
        attempt_id="att-go",
        started=pb.AttemptStarted(
            host="h",
            pid=1,
            heartbeat_timeout={"seconds": 60},
            input=pb.InputSeen(input_ref=str(path), size_bytes=st.st_size, mtime_ns=st.st_mtime_ns),
        ),
    )
    [result] = client.append([started])
    assert "size" in result.input_changed
    commit = pb.ShardEvent(
        event_id="commit-1",
        run_id=RUN,
        shard_id=shard_id,
        attempt_id="att-go",
        artifact_committed=pb.ArtifactCommitted(
            name="out", path=str(tmp_path / "o"), size_bytes=1, blake3_hex="a" * 64
        ),
    )
    with pytest.raises(LifecycleError) as refused:
        client.append([commit])
    assert refused.value.reason == "INPUT_CHANGED"
    assert reasons(client)[shard_id] == "failed:input_changed"
