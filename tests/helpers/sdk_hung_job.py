"""A job on the SDK with its default settings that hangs, slows down or saves slowly (watchdog tests).

Usage: sdk_hung_job.py TARGET RUN SHARD OUT_DIR MODE [SIGTERM_GRACE]

MODE "deadlock": a few quick steps, then blocks forever on a lock it holds.
MODE "sleep": a few quick steps, then sleeps forever (a SIGTERM handler can run).
MODE "slow": every step takes 0.3 s, longer than the grace the test sets, then commits.
MODE "slow_save": quick steps, a checkpoint that takes far longer than the threshold, then commits.
The watchdog's thresholds come from the environment the test sets.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from shard_client import Ledger


def deadlocked_in_collective(lock: threading.Lock) -> None:
    """Stands in for a stuck all-reduce: waits for a lock this thread already holds."""
    lock.acquire()


def asleep_in_data_loader() -> None:
    """Stands in for a data loader waiting on a worker that died."""
    while True:
        time.sleep(0.1)


def main() -> None:
    target, run_id, shard_id, out_dir, mode = sys.argv[1:6]
    grace = float(sys.argv[6]) if len(sys.argv) > 6 else 30.0
    ledger = Ledger(target, spool_dir=f"{out_dir}/spool")
    with ledger.shard(
        run_id, shard_id, output_dir=out_dir, fingerprint=False, sigterm_grace=grace
    ) as shard:
        pause = 0.3 if mode == "slow" else 0.05
        for step in range(8):
            shard.progress(step)
            time.sleep(pause)
        print("stepping", flush=True)
        if mode == "deadlock":
            lock = threading.Lock()
            lock.acquire()
            deadlocked_in_collective(lock)
        elif mode == "sleep":
            asleep_in_data_loader()
        elif mode == "slow_save":
            with shard.checkpoint_write(8) as f:
                for _ in range(30):
                    f.write(b"x" * 1024)
                    time.sleep(0.1)
            shard.progress(9)
        with shard.atomic_write(Path(out_dir) / "out.txt", name="out") as f:
            f.write(b"done\n")
    ledger.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
