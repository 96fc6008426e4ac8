"""A job that starts an attempt, then hangs without heartbeating (for watchdog tests)."""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import time
import uuid
from pathlib import Path

from google.protobuf.duration_pb2 import Duration

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from shard_client.scheduler import process_start_ticks


def stuck_in_data_loader() -> None:
    """Stands in for a deadlocked data loader."""
    while True:
        time.sleep(0.1)


def main() -> None:
    target, run_id, shard_id, attempt_id, diag_dir = sys.argv[1:6]
    Path(diag_dir).mkdir(parents=True, exist_ok=True)
    stack = open(Path(diag_dir) / f"{attempt_id}.stack", "a")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(10, file=stack, all_threads=True)  # SIGUSR1
    LedgerClient(target).append(
        [
            pb.ShardEvent(
                event_id=uuid.uuid4().hex,
                run_id=run_id,
                shard_id=shard_id,
                attempt_id=attempt_id,
                started=pb.AttemptStarted(
                    host=socket.gethostname(),
                    pid=os.getpid(),
                    heartbeat_timeout=Duration(seconds=1),
                    process_start_ticks=process_start_ticks(),
                ),
            )
        ]
    )
    print("started", flush=True)
    stuck_in_data_loader()


if __name__ == "__main__":
    main()
