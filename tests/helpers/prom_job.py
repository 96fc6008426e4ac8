"""A job on the SDK for the live Prometheus test: it commits its output, or runs until killed.

Usage: prom_job.py TARGET RUN SHARD OUT_DIR MODE

MODE "ok": a few steps, then commits OUT_DIR/SHARD/out.txt and exits 0.
MODE "run": heartbeats (every 0.5 s, timeout 2 s) and prints "running" until it is killed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from shard_client import Ledger


def main() -> None:
    target, run_id, shard_id, out_dir, mode = sys.argv[1:6]
    out = Path(out_dir) / shard_id
    ledger = Ledger(target, spool_dir=str(Path(out_dir) / "spool" / shard_id))
    with ledger.shard(
        run_id, shard_id, output_dir=str(out), fingerprint=False, heartbeat_timeout=2.0
    ) as shard:
        for step in range(3):
            shard.progress(step)
        if mode == "run":
            print("running", flush=True)
            while True:
                time.sleep(0.1)
        with shard.atomic_write(out / "out.txt", name="out") as f:
            f.write(f"{shard_id} done\n".encode())
    ledger.close()


if __name__ == "__main__":
    main()
