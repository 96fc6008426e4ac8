"""A local launcher: runs every line of a JSON-lines plan or resume list through a job, W at a time.

    shardledger plan night-01 --manifest examples/jobs.jsonl
    shardledger plan night-01 --manifest examples/jobs.jsonl --dry-run > plan-lines.jsonl
    python examples/launch_pool.py night-01 plan-lines.jsonl --job examples/plain_job.py
    shardledger verify night-01 --root out/
    shardledger resume night-01 -o rerun.jsonl     # exactly what must run again
    python examples/launch_pool.py night-01 rerun.jsonl --job examples/plain_job.py

A job is a Python file defining ``run_line(ledger, run_id, line, *, out_dir)``
(see plain_job.py and torch_train.py). Each worker process loads it once and
keeps one ``Ledger``, as the SDK wants; the "spawn" start method gives every
worker a fresh interpreter, so no gRPC channel or torch state crosses a fork.
The launcher's own verdict is only the exit status of each call: whether a
shard really produced its outputs is the ledger's to say (``verify``, ``status``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import sys
from collections.abc import Sequence
from multiprocessing.util import Finalize
from pathlib import Path
from types import ModuleType
from typing import Any

from shard_client import Ledger, Preempted

# One per worker process, set by _init.
_job: ModuleType | None = None
_ledger: Ledger | None = None
_settings: dict[str, str] = {}


def load_job(path: str) -> ModuleType:
    """Imports a job file by path; it must define run_line()."""
    spec = importlib.util.spec_from_file_location(f"job_{Path(path).stem}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load job {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "run_line", None)):
        raise SystemExit(f"job {path} defines no run_line(ledger, run_id, line, *, out_dir)")
    return module


def _init(job_path: str, server: str | None, run_id: str, out_dir: str) -> None:
    global _job, _ledger
    _job = load_job(job_path)
    _ledger = Ledger(server)
    # Pool workers leave through os._exit, which skips atexit: close the ledger explicitly.
    Finalize(_ledger, _ledger.close, exitpriority=10)
    _settings.update(run_id=run_id, out_dir=out_dir)


def _run(text: str) -> tuple[str, str]:
    """Runs one plan line; returns (shard id, "ok" or why the call failed)."""
    assert _job is not None and _ledger is not None
    line: dict[str, Any] = json.loads(text)
    try:
        _job.run_line(_ledger, _settings["run_id"], line, out_dir=_settings["out_dir"])
    except Preempted:
        return line["shard_id"], "preempted"
    except Exception as exc:  # recorded by the SDK as failed(tag); the launcher just reports it
        return line["shard_id"], f"{type(exc).__name__}: {exc}"
    return line["shard_id"], "ok"


def main(argv: Sequence[str] | None = None) -> int:
    """Runs every line; exits 1 when any call failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="run id")
    parser.add_argument("lines", help="plan lines (plan --dry-run) or a resume list (resume -o)")
    parser.add_argument("--job", required=True, help="job file defining run_line()")
    parser.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument("--out", default="out", help="output directory (default: out)")
    parser.add_argument("--server", default=None, help="ledger HOST:PORT ($SHARDLEDGER_SERVER)")
    args = parser.parse_args(argv)
    lines = [t for t in Path(args.lines).read_text(encoding="utf-8").splitlines() if t.strip()]
    load_job(args.job)  # fail here, once, rather than in every worker
    Path(args.out).mkdir(parents=True, exist_ok=True)
    context = multiprocessing.get_context("spawn")
    init = (str(Path(args.job).resolve()), args.server, args.run, str(Path(args.out).resolve()))
    failed = 0
    pool = context.Pool(max(1, args.workers), initializer=_init, initargs=init)
    try:
        for shard_id, outcome in pool.imap_unordered(_run, lines):
            failed += outcome != "ok"
            print(f"{shard_id} {outcome}", flush=True)
    finally:
        # close+join, not terminate: each worker then runs its finalizer and closes its Ledger.
        pool.close()
        pool.join()
    shards = f"{len(lines)} shard" + ("" if len(lines) == 1 else "s")
    print(f"{shards}: {len(lines) - failed} ok, {failed} failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
