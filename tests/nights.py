"""Real nights played through the SDK for the analysis tests: plan, shard contexts, verify.

Every shard runs in a real `Ledger.shard(...)` context against the fixture server
and writes real files atomically; `shardledger verify` then re-reads them. What
a shard does is one outcome word:

    ok          writes {"id": ..., "value": ...} (one checkpoint first); verify passes
    empty       writes an empty file and exits cleanly; verify fails it (empty)
    truncated   writes a file that loses its tail on disk afterwards (size_mismatch)
    preempted   raises Preempted (what the SDK's SIGTERM grace raises), then a rerun is ok
    hang        a job process that is SIGKILLed mid-shard: silent past its timeout (stale)
    missing     never starts
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from shard_client import Fingerprint, Ledger, LedgerClient, Preempted, plan_events
from tests.builders import plan_entries, run_cli

REPO = Path(__file__).resolve().parents[1]


def fingerprint(driver: str = "550") -> Fingerprint:
    """Returns the environment fingerprint of a node with this driver (the group key)."""
    return Fingerprint.from_fields({"driver": driver, "cuda": "12.4", "gpu": "H100"})


def output(shard_id: str, value: float) -> bytes:
    """Returns the keyed result one shard writes."""
    return json.dumps({"id": shard_id, "value": value}).encode() + b"\n"


def plan(
    client: LedgerClient,
    run_id: str,
    shard_ids: Sequence[str],
    *,
    labels: Mapping[str, str] | None = None,
) -> None:
    """Registers the run's shards (each expects one output, "out") with the run's labels."""
    client.append(plan_events(run_id, plan_entries(shard_ids, output="out"), labels=labels))


def _attempt(
    ledger: Ledger,
    run_id: str,
    shard_id: str,
    root: Path,
    data: bytes,
    *,
    labels: Mapping[str, str],
    driver: str,
) -> None:
    out_dir = root / run_id / shard_id
    with ledger.shard(
        run_id,
        shard_id,
        labels=labels,
        fingerprint=fingerprint(driver),
        output_dir=out_dir,
        watchdog=False,
        sigterm_grace=None,
    ) as shard:
        shard.progress(1, 0.5)
        with shard.checkpoint_write(1) as f:
            f.write(b"checkpoint " + shard_id.encode())
        with shard.atomic_write(out_dir / "out.jsonl", name="out") as f:
            f.write(data)


def _preempted(
    ledger: Ledger, run_id: str, shard_id: str, root: Path, *, labels: Mapping[str, str]
) -> None:
    try:
        with ledger.shard(
            run_id, shard_id, labels=labels, fingerprint=fingerprint(), watchdog=False
        ) as shard:
            shard.progress(1, 0.1)
            raise Preempted("the platform reclaimed the node")
    except Preempted:
        pass


def _hang(target: str, run_id: str, shard_id: str, tmp: Path, labels: Mapping[str, str]) -> None:
    """Starts a real job process that reaches its shard, then SIGKILLs it (no goodbye)."""
    code = textwrap.dedent(
        f"""
        import sys, time
        from shard_client import Fingerprint, Ledger
        fp = Fingerprint.from_fields({{"driver": "550", "cuda": "12.4", "gpu": "H100"}})
        with Ledger({target!r}, spool_dir={str(tmp / "hang-spool")!r}) as ledger:
            with ledger.shard({run_id!r}, {shard_id!r}, labels={dict(labels)!r}, fingerprint=fp,
                              heartbeat_timeout=0.5, heartbeat_interval=0.1, watchdog=False):
                print("started", flush=True)
                time.sleep(600)
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env, cwd=tmp
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)


def play_night(
    capsys: pytest.CaptureFixture[str],
    target: str,
    root: Path,
    run_id: str,
    outcomes: Sequence[str],
    *,
    labels: Mapping[str, str] | None = None,
    run_labels: Mapping[str, str] | None = None,
    driver: str = "550",
    values: Sequence[float] | None = None,
    drivers: Sequence[str] | None = None,
    shard_ids: Sequence[str] | None = None,
) -> list[str]:
    """Plans one shard per outcome (ids s0, s1, ...), plays them, verifies; returns the ids.

    With ``shard_ids`` the run is already planned (a sample run): only those shards
    are played. ``drivers`` gives each shard its own fingerprint group.
    """
    labels = dict(labels or {})
    ids = list(shard_ids) if shard_ids is not None else [f"s{i}" for i in range(len(outcomes))]
    client = LedgerClient(target)
    try:
        if shard_ids is None:
            plan(client, run_id, ids, labels=run_labels if run_labels is not None else labels)
        with Ledger(target, spool_dir=str(root / ".spool")) as ledger:
            for i, (sid, outcome) in enumerate(zip(ids, outcomes, strict=True)):
                number = sid.lstrip("s")
                value = float(
                    values[i] if values is not None else number if number.isdigit() else i
                )
                data = output(sid, value)
                env = drivers[i] if drivers is not None else driver
                if outcome in ("ok", "truncated"):
                    _attempt(ledger, run_id, sid, root, data, labels=labels, driver=env)
                elif outcome == "empty":
                    _attempt(ledger, run_id, sid, root, b"", labels=labels, driver=env)
                elif outcome == "preempted":
                    _preempted(ledger, run_id, sid, root, labels=labels)
                    _attempt(ledger, run_id, sid, root, data, labels=labels, driver=env)
                elif outcome == "hang":
                    _hang(target, run_id, sid, root, labels)
                else:
                    assert outcome == "missing", outcome
                if outcome == "truncated":
                    path = root / run_id / sid / "out.jsonl"
                    os.truncate(path, len(data) // 2)
        if "hang" in outcomes:
            time.sleep(0.6)  # past the killed job's 0.5 s heartbeat timeout: it is stale now
        code, _, err = run_cli(capsys, "verify", run_id, "--root", str(root), "--server", target)
        assert code in (0, 1), err
    finally:
        client.close()
    return ids
