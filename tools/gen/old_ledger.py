# mypy: ignore-errors
# (it runs against release 0.1.0's modules, ledger_server.server.ServerConfig, not these)
"""Writes tests/data/ledger-0.1.0.db: a small ledger as release 0.1.0 (commit eaca5b1) wrote it.

Run it with that release on the path, not this checkout's code, e.g.:

    git worktree add /tmp/v010 eaca5b1
    PYTHONPATH=/tmp/v010 python tools/gen/old_ledger.py tests/data/ledger-0.1.0.db

The night it records exercises what the upgrade must carry over: a verified shard,
a shard whose commit failed verification and was rerun with identical bytes (0.1.0
handed the rerun the old verdict), a verdict recorded with the wrong --root
(outside_root), a swallowed error, and a shard never started. The upgrade tests
(tests/server/test_upgrade.py) read it; regenerating it changes its bytes, so do it only
to add a case.
"""

from __future__ import annotations

import sys
from pathlib import Path

from google.protobuf.duration_pb2 import Duration

from ledger_server.server import ServerConfig, create_server  # 0.1.0's module layout
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient

RUN = "night-0.1.0"
D = {c: c * 64 for c in "abcdef"}


def ev(eid: str, shard: str, attempt: str = "", **payload: object) -> pb.ShardEvent:
    return pb.ShardEvent(event_id=eid, run_id=RUN, shard_id=shard, attempt_id=attempt, **payload)


def main(out: str) -> None:
    path = Path(out)
    path.unlink(missing_ok=True)
    running = create_server(ServerConfig(database=str(path), listen="127.0.0.1:0"))
    client = LedgerClient(f"127.0.0.1:{running.port}")
    plans = [
        ev(
            f"plan-{i}",
            f"s{i}",
            planned=pb.ShardPlanned(
                input_ref=f"/in/{i}",
                input_bytes=1,
                params_json="{}",
                expected_outputs=["weights"],
                plan_index=i,
            ),
        )
        for i in range(5)
    ]
    client.append(plans)

    def start(shard: str, attempt: str) -> pb.ShardEvent:
        return ev(
            f"start-{shard}-{attempt}",
            shard,
            attempt,
            started=pb.AttemptStarted(host="node-1", pid=7, heartbeat_timeout=Duration(seconds=60)),
        )

    def commit(shard: str, attempt: str, digest: str) -> pb.ShardEvent:
        return ev(
            f"commit-{shard}-{attempt}",
            shard,
            attempt,
            artifact_committed=pb.ArtifactCommitted(
                name="weights", path=f"/out/{shard}/weights.npy", size_bytes=128, blake3_hex=digest
            ),
        )

    def verdict(eid: str, shard: str, digest: str, reason: str = "") -> pb.ShardEvent:
        result = pb.VERIFICATION_RESULT_FAILED if reason else pb.VERIFICATION_RESULT_PASSED
        return ev(
            eid,
            shard,
            verified=pb.ArtifactVerified(
                name="weights",
                path=f"/out/{shard}/weights.npy",
                blake3_hex=digest,
                result=result,
                reason=reason,
            ),
        )

    client.append(
        [
            start("s0", "a0"),
            commit("s0", "a0", D["a"]),
            start("s1", "a0"),
            commit("s1", "a0", D["b"]),
            start("s2", "a0"),
            ev("fail-s2", "s2", "a0", failed=pb.AttemptFailed(tag=pb.FAILURE_TAG_INCOMPLETE)),
            start("s4", "a0"),
            commit("s4", "a0", D["c"]),
        ]
    )
    client.append(
        [
            verdict("v-s0", "s0", D["a"]),
            verdict("v-s1", "s1", D["b"], "digest_mismatch"),
            verdict("v-s4", "s4", D["c"], "outside_root"),
        ]
    )
    # The resume pass: s1 rerun writes the identical bytes again.
    client.append([start("s1", "a1"), commit("s1", "a1", D["b"])])
    running.stop(None)
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1])
