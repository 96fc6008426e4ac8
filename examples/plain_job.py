"""A plain Python job wired with shard_client: one plan line in, one committed output out.

Run one shard by hand (from the repository root):

    shardledger plan night-01 --manifest examples/jobs.jsonl
    LINE=$(shardledger plan night-01 --manifest examples/jobs.jsonl --dry-run | head -1)
    python examples/plain_job.py --run night-01 --line "$LINE" --out out/

or let examples/launch_pool.py run every line. The job counts the words of its
input and writes them as JSON with ``shard.atomic_write``: the file appears
complete or not at all, and the ledger records its size and blake3 digest. If
the block raises, or ends without committing "counts", the SDK records the
attempt as failed instead of letting it pass as a success.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shard_client import Ledger


def run_line(ledger: Ledger, run_id: str, line: dict[str, Any], *, out_dir: str) -> None:
    """Runs one shard: counts the words of its input and commits the counts as "counts"."""
    shard_id = line["shard_id"]
    target = Path(out_dir) / f"{shard_id}.counts.json"
    with ledger.shard(run_id, shard_id, expected_outputs=["counts"], input=line) as shard:
        text = Path(line["input"]).read_text(encoding="utf-8")
        if line.get("params", {}).get("lowercase"):
            text = text.lower()
        counts = Counter(word.strip(".,:;!?") for word in text.split())
        with shard.atomic_write(target, name="counts", media_type="application/json") as f:
            f.write(json.dumps(dict(counts), sort_keys=True).encode())


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the shard of one plan line; a failure propagates, so the exit code is non-zero."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="run id")
    parser.add_argument("--line", required=True, help="one plan line (JSON) with its shard_id")
    parser.add_argument("--out", default="out", help="output directory (default: out)")
    parser.add_argument("--server", default=None, help="ledger HOST:PORT ($SHARDLEDGER_SERVER)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    with Ledger(args.server) as ledger:
        run_line(ledger, args.run, json.loads(args.line), out_dir=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
