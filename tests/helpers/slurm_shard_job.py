"""The Slurm flow's job: examples/plain_job.py, except that shards named in $HANG_SHARDS deadlock.

A hung shard enters its shard context, then blocks forever on a lock it already holds (a
deadlocked data loader) without calling progress(). The in-job ``progress_timeout`` test
hook stops its background heartbeats, so it goes stale on the ledger while its process
lives: only an external watchdog can stop it. A rerun of the same shard (HANG_SHARDS
unset) runs the plain job.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from plain_job import run_line  # after the path above

from shard_client import Ledger


def deadlock(ledger: Ledger, run_id: str, shard_id: str) -> None:
    """Starts the attempt, then hangs with its process alive and its heartbeats stopped."""
    with ledger.shard(run_id, shard_id, heartbeat_timeout=2.0, progress_timeout=1.0):
        lock = threading.Lock()
        lock.acquire()
        print(f"{shard_id}: deadlocked", flush=True)
        lock.acquire()  # never returns


def main() -> int:
    """Runs one plan line like plain_job.py, or hangs when its shard is in $HANG_SHARDS."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--run", required=True)
    parser.add_argument("--line", required=True)
    parser.add_argument("--out", default="out")
    args = parser.parse_args()
    line = json.loads(args.line)
    os.makedirs(args.out, exist_ok=True)
    with Ledger() as ledger:
        if line["shard_id"] in os.environ.get("HANG_SHARDS", "").split(","):
            deadlock(ledger, args.run, line["shard_id"])
        run_line(ledger, args.run, line, out_dir=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
