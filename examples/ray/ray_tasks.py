"""Ray tasks as shards: one remote task per plan line; Ray retries, the ledger keeps the truth.

From the repository root, with a ledger running and SHARDLEDGER_SERVER pointing at it:

    shardledger plan night-ray --manifest examples/jobs.jsonl
    shardledger plan night-ray --manifest examples/jobs.jsonl --dry-run > plan-lines.jsonl
    python examples/ray/ray_tasks.py night-ray plan-lines.jsonl --out out/
    shardledger verify night-ray --root out/
    shardledger resume night-ray -o rerun.jsonl     # exactly what must run again
    python examples/ray/ray_tasks.py night-ray rerun.jsonl --out out/

``--address`` joins a running cluster (``ray start --head``; also $RAY_ADDRESS);
without either the script starts a local one. The only line of Ray code that
knows about the ledger is ``shard_task``: the task takes a plan line, runs
inside ``ledger.shard(run, shard_id, input=line)`` and commits its output
atomically. Ray's retries (``max_retries`` for a dead worker, ``retry_exceptions``
for a raise) are new attempts; the ledger records each with its Ray job, task,
attempt number and node (``shardledger shards RUN --attempts``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray

from shard_client import Shard
from shard_client.ray import shard_task

# The ledger settings a job's workers need: Ray starts them from the raylet's environment,
# not the driver's, so the driver hands these over in the job's runtime_env.
FORWARDED = (
    "SHARDLEDGER_SERVER",
    "SHARDLEDGER_SPOOL_DIR",
    "SHARDLEDGER_TOKEN_FILE",
    "SHARDLEDGER_DIAG_DIR",
)


def count_words(shard: Shard, line: dict[str, Any], out_dir: str) -> str:
    """Counts the words of the line's input and commits them as "counts"; returns the shard id."""
    text = Path(line["input"]).read_text(encoding="utf-8")
    counts = Counter(word.strip(".,:;!?") for word in text.split())
    target = Path(out_dir) / f"{line['shard_id']}.counts.json"
    with shard.atomic_write(target, name="counts", media_type="application/json") as f:
        f.write(json.dumps(dict(counts), sort_keys=True).encode())
    return str(line["shard_id"])


def submit(
    run_id: str,
    lines: Sequence[str],
    work: Callable[..., str],
    *,
    out_dir: str,
    max_retries: int = 3,
    retry_exceptions: bool = True,
    **options: Any,
) -> dict[str, str]:
    """Runs one task per plan line and waits; returns shard id -> "ok" or the task's error."""
    task = ray.remote(max_retries=max_retries, retry_exceptions=retry_exceptions)(
        shard_task(run_id, **options)(work)
    )
    refs = {task.remote(line, out_dir): json.loads(line)["shard_id"] for line in lines}
    outcome: dict[str, str] = {}
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done[0])
            outcome[refs[done[0]]] = "ok"
        except (ray.exceptions.RayTaskError, ray.exceptions.RayError) as exc:
            outcome[refs[done[0]]] = type(exc).__name__
    return outcome


def init(address: str | None) -> None:
    """Joins the cluster at ``address`` ($RAY_ADDRESS), or starts a local one."""
    env = {name: os.environ[name] for name in FORWARDED if os.environ.get(name)}
    ray.init(
        address=address,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": env},
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs every line of a plan or resume list; exits 1 when a task still failed after retries."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="run id")
    parser.add_argument("lines", help="plan lines or a resume list (JSON lines)")
    parser.add_argument("--out", default="out", help="output directory (default: out)")
    parser.add_argument("--address", default=None, help="Ray cluster address ($RAY_ADDRESS)")
    parser.add_argument("--max-retries", type=int, default=3, help="Ray retries per task")
    args = parser.parse_args(argv)
    lines = [line for line in Path(args.lines).read_text().splitlines() if line.strip()]
    os.makedirs(args.out, exist_ok=True)
    init(args.address)
    outcome = submit(
        args.run,
        lines,
        count_words,
        out_dir=os.path.abspath(args.out),
        max_retries=args.max_retries,
    )
    failed = sorted(k for k, v in outcome.items() if v != "ok")
    print(f"{len(outcome) - len(failed)} of {len(outcome)} tasks returned", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
