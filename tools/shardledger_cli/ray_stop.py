"""How `watch --kill-stale` stops a hung Ray task: through Ray, on the node that runs it.

Ray cancels a task only for the driver that owns its result (``ray.cancel(ref)``
needs the ref), and a watchdog is another process. What it can do is what
``ray.cancel(ref, force=True)`` does: end the worker process. It joins the
cluster ($RAY_ADDRESS, else the local one) as a short-lived driver and runs a
task pinned to the attempt's node (``NodeAffinitySchedulingStrategy``, no CPU,
so a node whose CPUs the hung tasks hold still runs it). That task signals the
worker pid only if its start time is the one the attempt recorded: TERM, the
grace period, then KILL. Ray then treats the worker as dead and retries the task
if it has retries left (a new attempt on the ledger).

This module runs as its own process (``python -m shardledger_cli.ray_stop``), so
the watch process never imports ray and never stays a driver of the cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from shard_client.scheduler import process_start_ticks

__all__ = ["main", "stop_pid"]


def stop_pid(pid: int, start_ticks: int, grace_s: float) -> list[str]:
    """Sends TERM, waits up to the grace, sends KILL; returns the steps taken (on the node)."""
    if process_start_ticks(pid) == 0:
        return ["process already gone"]
    if start_ticks and process_start_ticks(pid) != start_ticks:
        return [f"pid {pid} is now another process (its start time differs): not signalled"]
    steps: list[str] = []
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return [*steps, "process already gone"]
        steps.append(f"kill -{sig.name.removeprefix('SIG')} {pid}")
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if process_start_ticks(pid) != start_ticks or not _alive(pid):
                return [*steps, "process ended"]
            time.sleep(0.1)
    raise RuntimeError(f"pid {pid} still runs 10 s after SIGKILL")


def _alive(pid: int) -> bool:
    """Returns whether pid runs (a zombie, dead but not yet reaped, does not)."""
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rpartition(")")[2].split()[0] != "Z"
    return False


def main(argv: Sequence[str] | None = None) -> int:
    """Stops one worker through Ray; prints the steps as a JSON list, exit 1 with the reason."""
    parser = argparse.ArgumentParser(prog="python -m shardledger_cli.ray_stop")
    parser.add_argument("--node", required=True, help="the Ray node id the attempt recorded")
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--start-ticks", type=int, default=0)
    parser.add_argument("--grace", type=float, default=30.0)
    args = parser.parse_args(argv)
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=False)
    try:
        nodes = ray.nodes()  # type: ignore[no-untyped-call, unused-ignore]
        if args.node not in {n["NodeID"] for n in nodes if n.get("Alive")}:
            print(f"Ray node {args.node} is not alive in this cluster", file=sys.stderr)
            return 1
        remote = ray.remote(num_cpus=0, max_retries=0)(stop_pid).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(args.node, soft=False)
        )
        steps = ray.get(remote.remote(args.pid, args.start_ticks, args.grace))
    finally:
        ray.shutdown()
    print(json.dumps([f"on Ray node {args.node[:12]}: {step}" for step in steps]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
