"""Writes tests/data/ledger-v1-rows.db: a small ledger whose event rows are of row format 1.

Row format 1 is what every release before contract version 2 wrote: the canonical JSON
of Python's `json` module (sorted keys, no spaces, UTF-8 kept, Python's float repr).
It was made with commit 4cbfae0 (main before RFC 8785 was adopted), e.g.:

    git worktree add /tmp/v1rows 4cbfae0
    PYTHONPATH=/tmp/v1rows python tools/gen/v1_rows_ledger.py tests/data/ledger-v1-rows.db

Its events hold what format 1 and RFC 8785 encode differently: floats (1.0, 1e-07,
1e+22, 0.1), non-ASCII and astral text, keys that sort differently by UTF-16 code
units, nested params, and a fingerprint with non-ASCII values. The upgrade tests
(tests/server/test_contract_upgrade.py) read it; regenerating it changes its bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from google.protobuf.duration_pb2 import Duration

from ledger_server.config import ServerConfig
from ledger_server.server import create_server
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from shard_client.environment import Fingerprint

RUN = "night-v1-rows"
D = {c: c * 64 for c in "abcdef"}
PARAMS = (
    '{"lr": 1.0, "eps": 1e-07, "big": 1e+22, "tenth": 0.1, "name": "Äpfel 🍎",'
    ' "nested": {"z": [1, 2.5, {"deep": -0.0}], "\ufb01": true, "\U0001f600": null}}'
)


def ev(eid: str, shard: str, attempt: str = "", **payload: Any) -> pb.ShardEvent:
    msg = pb.ShardEvent(event_id=eid, run_id=RUN, shard_id=shard, attempt_id=attempt, **payload)
    if attempt:
        msg.client_time.FromMicroseconds(1_764_000_000_123_456)
    return msg


def main(out: str) -> None:
    path = Path(out)
    path.unlink(missing_ok=True)
    running = create_server(ServerConfig(database=str(path), listen="127.0.0.1:0"))
    client = LedgerClient(f"127.0.0.1:{running.port}")
    client.append(
        [
            ev(
                f"plan-{i}",
                f"s{i}",
                planned=pb.ShardPlanned(
                    input_ref=f"/in/{i}-ünïcode",
                    input_bytes=10 + i,
                    input_blake3=D["f"],
                    params_json=PARAMS if i < 2 else f'{{"i": {i}}}',
                    expected_outputs=["weights"],
                    plan_line=f'{{"frame": {i}, "scale": 2.0, "title": "Ω"}}',
                    plan_index=i,
                ),
            )
            for i in range(4)
        ]
    )
    fields = {"schema": "2", "gpu.0.name": "NVIDIA H100 80GB HBM3", "host.label": "Zürich-α"}
    fp = Fingerprint.from_fields(fields)

    def start(shard: str, attempt: str) -> pb.ShardEvent:
        return ev(
            f"start-{shard}-{attempt}",
            shard,
            attempt,
            started=pb.AttemptStarted(
                host="node-1",
                pid=7,
                heartbeat_timeout=Duration(seconds=60),
                fingerprint=fp.fields,
                fingerprint_digest=fp.digest,
            ),
        )

    def beat(shard: str, attempt: str, step: int, progress: float) -> pb.ShardEvent:
        return ev(
            f"beat-{shard}-{attempt}-{step}",
            shard,
            attempt,
            heartbeat=pb.Heartbeat(
                step=step, progress=progress, metrics={"loss": 1e-07 * step, "lr": 1.0}
            ),
        )

    def commit(shard: str, attempt: str, digest: str) -> pb.ShardEvent:
        return ev(
            f"commit-{shard}-{attempt}",
            shard,
            attempt,
            artifact_committed=pb.ArtifactCommitted(
                name="weights", path=f"/out/{shard}/wëights.npy", size_bytes=128, blake3_hex=digest
            ),
        )

    client.append(
        [
            start("s0", "a0"),
            beat("s0", "a0", 1, 0.5),
            beat("s0", "a0", 2, 1.0),
            commit("s0", "a0", D["a"]),
            start("s1", "a0"),
            beat("s1", "a0", 3, 0.1),
            ev("fail-s1", "s1", "a0", failed=pb.AttemptFailed(tag=pb.FAILURE_TAG_OOM, message="ü")),
            start("s2", "a0"),
            commit("s2", "a0", D["b"]),
        ]
    )
    client.append(
        [
            ev(
                "v-s0",
                "s0",
                verified=pb.ArtifactVerified(
                    name="weights",
                    path="/out/s0/wëights.npy",
                    blake3_hex=D["a"],
                    result=pb.VERIFICATION_RESULT_PASSED,
                ),
            )
        ]
    )
    running.stop(0)
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1])
