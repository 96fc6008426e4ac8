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
- ``big``: count the words, commit, and return a result of over 100 KiB, which Ray keeps
  in the object store of the node that ran the task (not inline in the reply);
- ``ok``: count the words and commit.

``--pin RESOURCE`` places every task on the node that holds the custom resource
(soft: a retry goes elsewhere once that node is dead); ``--hold FILE`` submits,
then waits for FILE before it fetches any result (a lost result then needs Ray's
lineage reconstruction); ``--linger FILE`` waits for FILE before the driver
exits (its job's workers live on); ``--actor`` runs every line, in order, as a
call of one actor (one process, many shards; no restarts). A re-execution of a
verified shard returns the committed result (``committed_result``), recorded as
the step ``reused``.

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

import blake3
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "ray"))

import ray_tasks  # after the path above
from ray_tasks import count_words, init, submit

from shard_client import Shard
from shard_client.ray import shard_task

# Over Ray's inline limit (100 KiB): such a result lives in the object store of its node.
BIG_RESULT_BYTES = 200_000
OUTCOME = "outcome:"

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
    if action == "big":
        count_words(shard, line, out_dir)
        record("committed")
        return _big_result(shard_id, Path(out_dir) / f"{shard_id}.counts.json", "ran")
    if action == "hang":
        record("hung")
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # never returns
    result = str(count_words(shard, line, out_dir))
    record("committed")
    return result


def _big_result(shard_id: str, committed: Path, how: str) -> str:
    """Returns a result of over 100 KiB that names the shard, how it came, and its output's digest."""
    digest = blake3.blake3(committed.read_bytes()).hexdigest()
    return f"{shard_id} {how} {digest} " + "x" * BIG_RESULT_BYTES


def reused(truth: str, line: dict[str, Any], artifacts: dict[str, str]) -> str:
    """The committed result of a verified shard Ray ran again: recorded, then read back."""
    context = ray.get_runtime_context()
    attempt = int(context.worker.core_worker.get_current_task_attempt_number())
    fact = {
        "shard_id": line["shard_id"],
        "ray_attempt": attempt,
        "attempt_id": "",
        "step": "reused",
        "pid": os.getpid(),
        "job_id": context.get_job_id(),
        "task_id": context.get_task_id(),
        "node_id": context.get_node_id(),
        "artifacts": artifacts,
    }
    path = Path(truth) / f"{line['shard_id']}.{attempt}.reused.json"
    path.with_suffix(".tmp").write_text(json.dumps(fact))
    os.replace(path.with_suffix(".tmp"), path)
    return _big_result(line["shard_id"], Path(artifacts["counts"]), "reused")


def _wait_for(path: str) -> None:
    while not Path(path).exists():
        time.sleep(0.1)


def _collect(refs: dict[Any, str]) -> dict[str, str]:
    """Returns shard id -> "ok" (or, for a big result, its first three words) or the error."""
    outcome: dict[str, str] = {}
    for ref, shard_id in refs.items():
        try:
            result = str(ray.get(ref))
            outcome[shard_id] = (
                " ".join(result.split()[:3]) if len(result) > BIG_RESULT_BYTES else "ok"
            )
        except ray.exceptions.RayError as exc:
            outcome[shard_id] = type(exc).__name__
    return outcome


def _run_placed(args: argparse.Namespace, lines: list[str], work: Any) -> dict[str, str]:
    """Runs the lines as tasks pinned (softly) to a node, or as calls of one actor."""
    options: dict[str, Any] = {
        "heartbeat_timeout": 2.0,
        "progress_timeout": args.progress_timeout,
        "committed_result": lambda line, artifacts: reused(args.truth, line, artifacts),
    }
    wrapped = shard_task(args.run, **options)(work)
    if args.actor:

        @ray.remote(max_restarts=0, max_task_retries=0)
        class Worker:
            def run(self, line: str, out_dir: str) -> str:
                return str(wrapped(line, out_dir))

        actor = Worker.remote()  # type: ignore[attr-defined]
        refs = {actor.run.remote(line, args.out): json.loads(line)["shard_id"] for line in lines}
    else:
        strategy: Any = "DEFAULT"
        if args.pin:
            nodes = ray.nodes()  # type: ignore[no-untyped-call, unused-ignore]
            node = next(n["NodeID"] for n in nodes if n["Alive"] and args.pin in n["Resources"])
            strategy = NodeAffinitySchedulingStrategy(node, soft=True)
        task = ray.remote(max_retries=args.max_retries, retry_exceptions=True)(wrapped)
        refs = {
            task.options(scheduling_strategy=strategy).remote(line, args.out): json.loads(line)[
                "shard_id"
            ]
            for line in lines
        }
    if args.hold:
        _wait_for(args.hold)
    return _collect(refs)


def main() -> int:
    """Submits every line and waits; prints "outcome:" and shard id -> outcome as JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("run")
    parser.add_argument("lines")
    parser.add_argument("--out", required=True)
    parser.add_argument("--truth", required=True)
    parser.add_argument("--faults", default="{}")
    parser.add_argument("--max-retries", type=int, default=1)
    parser.add_argument("--progress-timeout", type=float, default=None)
    parser.add_argument("--pin", default="")
    parser.add_argument("--hold", default="")
    parser.add_argument("--linger", default="")
    parser.add_argument("--actor", action="store_true")
    args = parser.parse_args()
    lines = [line for line in Path(args.lines).read_text().splitlines() if line.strip()]
    init(None)
    print(json.dumps({"job_id": ray.get_runtime_context().get_job_id()}), flush=True)
    faults = json.loads(args.faults)

    def work(shard: Shard, line: dict[str, Any], out: str) -> str:
        return faulty(shard, line, out, args.truth, faults)

    if args.pin or args.hold or args.actor:
        outcome = _run_placed(args, lines, work)
    else:
        outcome = submit(
            args.run,
            lines,
            work,
            out_dir=args.out,
            max_retries=args.max_retries,
            heartbeat_timeout=2.0,
            progress_timeout=args.progress_timeout,
        )
    # Prefixed: Ray prints on the driver's stdout too (a node's death, its raylet's log).
    print(OUTCOME, json.dumps(outcome, sort_keys=True), flush=True)
    if args.linger:
        _wait_for(args.linger)
    return 0


if __name__ == "__main__":
    sys.exit(main())
