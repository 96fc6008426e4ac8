"""Ray Data batches as shards: plan the batches, map_batches over the plan, resume exactly.

From the repository root, with a ledger running and SHARDLEDGER_SERVER pointing at it:

    python examples/ray/ray_data.py manifest examples/data/items.jsonl --batch-size 4 > batches.jsonl
    shardledger plan night-data --manifest batches.jsonl
    shardledger plan night-data --manifest batches.jsonl --dry-run > plan-lines.jsonl
    python examples/ray/ray_data.py run night-data plan-lines.jsonl --out out/
    shardledger verify night-data --root out/
    shardledger resume night-data --format jsonl -o rerun.jsonl
    python examples/ray/ray_data.py run night-data rerun.jsonl --out out/

A batch of rows is a shard: ``manifest`` groups the items (JSON lines, each with
an ``id``) into batches, and each plan line carries its batch's rows and ids.
``run`` reads the plan lines with ``ray.data.read_json`` and maps
`shard_client.ray.ShardBatches` over them: one actor holds the model and one
Ledger, and for each line runs the model on the batch inside the shard's
context, checks that the results hold exactly the batch's ids and commits them
as ``out/<shard_id>.jsonl``. The resume list is plan lines too, so the morning's
pipeline is the night's, reading another file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray

from shard_client.ray import ShardBatches, batch_manifest

# See ray_tasks.py: the job's workers get the ledger settings through its runtime_env.
FORWARDED = (
    "SHARDLEDGER_SERVER",
    "SHARDLEDGER_SPOOL_DIR",
    "SHARDLEDGER_TOKEN_FILE",
    "SHARDLEDGER_DIAG_DIR",
)


class Model:
    """Stands in for a model loaded once per actor: scores each text by its length."""

    def __init__(self) -> None:
        self.scale = 0.5  # the weights a real model would load here

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        texts = [str(t) for t in batch["text"]]
        return {"id": batch["id"], "score": np.array([len(t) * self.scale for t in texts])}


def write_manifest(items: str, batch_size: int) -> int:
    """Prints one manifest line per batch of the items file (JSON lines with an id)."""
    with open(items, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for line in batch_manifest(rows, batch_size=batch_size):
        print(json.dumps(line, separators=(",", ":")))
    return 0


def run(
    run_id: str,
    lines: str,
    out_dir: str,
    address: str | None,
    model: type = Model,
    **shard_options: Any,
) -> int:
    """Maps the model over every shard of the plan lines; prints how many rows came back.

    ``shard_options`` go to each shard's context (``hang_timeout=``, ``heartbeat_timeout=``).
    """
    env = {name: os.environ[name] for name in FORWARDED if os.environ.get(name)}
    ray.init(address=address, include_dashboard=False, runtime_env={"env_vars": env})
    ds = ray.data.read_json(os.path.abspath(lines))
    results = ds.map_batches(
        ShardBatches,
        fn_constructor_args=(model,),
        fn_constructor_kwargs={
            "run_id": run_id,
            "output_dir": os.path.abspath(out_dir),
            **shard_options,
        },
        batch_size=1,  # one plan line, one shard, per call
        compute=ray.data.ActorPoolStrategy(size=1),  # actors: each loads the model once
    )
    print(f"{results.count()} rows scored", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Writes the batch manifest, or runs the pipeline over plan lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    manifest = sub.add_parser("manifest", help="print the batch manifest of an items file")
    manifest.add_argument("items", help="JSON lines, each with a string id")
    manifest.add_argument("--batch-size", type=int, default=4)
    pipeline = sub.add_parser("run", help="map the model over plan lines or a resume list")
    pipeline.add_argument("run", help="run id")
    pipeline.add_argument("lines", help="plan lines or a resume list (JSON lines)")
    pipeline.add_argument("--out", default="out", help="output directory (default: out)")
    pipeline.add_argument("--address", default=None, help="Ray cluster address ($RAY_ADDRESS)")
    args = parser.parse_args(argv)
    if args.command == "manifest":
        return write_manifest(args.items, args.batch_size)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return run(args.run, args.lines, args.out, args.address)


if __name__ == "__main__":
    sys.exit(main())
