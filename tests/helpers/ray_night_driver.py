"""The Ray night's driver: examples/ray/ray_tasks.py's submit, with faults by shard and attempt.

    python tests/helpers/ray_night_driver.py RUN LINES --out DIR --truth DIR --faults JSON

$RAY_ADDRESS names the cluster. ``--faults`` maps a shard id to its action per Ray
attempt number (``{"t2": {"0": "raise"}}``; unnamed: "ok"):

- ``raise``: raise RuntimeError (retried: retry_exceptions);
- ``kill_mid_commit``: write half the output into the atomic temp file, flush it,
  then SIGKILL this worker (retried: max_retries);
- ``gate``: wait until the file ``<truth>/open-gate`` exists (a task still running
  when the test kills this driver);
- ``hang``: deadlock on a lock it holds, the process alive (with ``--progress-timeout``
  its heartbeats stop: only a watchdog outside can end it);
- ``ok``: count the words and commit.

Every step is first written to ``<truth>/<shard>.<attempt>.<step>.json`` (the shard
context's attempt id, Ray's ids, the pid): the truth the test holds the ledger to.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "ray"))

import ray_tasks  # after the path above
from ray_tasks import count_words, init, submit

from shard_client import Shard

# Workers cannot import the example by name: its functions travel by value.
ray.cloudpickle.register_pickle_by_value(ray_tasks)  # type: ignore[no-untyped-call, unused-ignore]


def faulty(
    shard: Shard, line: dict[str, Any], out_dir: str, truth: str, faults: dict[str, Any]
) -> str:
    """Runs one attempt as the faults say, recording each step before taking it."""
    context = ray.get_runtime_context()
    # Read here from Ray's core worker, not through shard_client: this is the truth.
    attempt = int(context.worker.core_worker.get_current_task_attempt_number())
    shard_id = line["shard_id"]
    action = faults.get(shard_id, {}).get(str(attempt), "ok")

    def record(step: str) -> None:
        fact = {
            "shard_id": shard_id,
            "ray_attempt": attempt,
            "attempt_id": shard.attempt_id,
            "step": step,
            "pid": os.getpid(),
            "job_id": context.get_job_id(),
            "task_id": context.get_task_id(),
            "node_id": context.get_node_id(),
        }
        path = Path(truth) / f"{shard_id}.{attempt}.{step}.json"
        # Whole or absent when the test reads it: written beside, then renamed.
        path.with_suffix(".tmp").write_text(json.dumps(fact))
        os.replace(path.with_suffix(".tmp"), path)

    record("started")
    if action == "raise":
        record("raised")
        raise RuntimeError(f"{shard_id}: a raise on attempt {attempt}")
    if action == "kill_mid_commit":
        target = Path(out_dir) / f"{shard_id}.counts.json"
        with shard.atomic_write(target, name="counts") as f:
            f.write(b'{"half": ')
            f.flush()  # into the temp file beside the target: what a kill leaves behind
            record("killed")
            os.kill(os.getpid(), signal.SIGKILL)
    if action == "gate":
        record("waiting")
        while not (Path(truth) / "open-gate").exists():
            time.sleep(0.1)
    if action == "hang":
        record("hung")
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # never returns
    result = str(count_words(shard, line, out_dir))
    record("committed")
    return result


def main() -> int:
    """Submits every line and waits; prints shard id -> outcome as JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("run")
    parser.add_argument("lines")
    parser.add_argument("--out", required=True)
    parser.add_argument("--truth", required=True)
    parser.add_argument("--faults", default="{}")
    parser.add_argument("--max-retries", type=int, default=1)
    parser.add_argument("--progress-timeout", type=float, default=None)
    args = parser.parse_args()
    lines = [line for line in Path(args.lines).read_text().splitlines() if line.strip()]
    init(None)
    print(json.dumps({"job_id": ray.get_runtime_context().get_job_id()}), flush=True)
    outcome = submit(
        args.run,
        lines,
        lambda shard, line, out: faulty(shard, line, out, args.truth, json.loads(args.faults)),
        out_dir=args.out,
        max_retries=args.max_retries,
        heartbeat_timeout=2.0,
        progress_timeout=args.progress_timeout,
    )
    print(json.dumps(outcome, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
