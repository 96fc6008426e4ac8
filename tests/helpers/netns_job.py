"""A job host's worker for the network-namespace fault suite (tests/contract/test_netns_faults.py).

    python tests/helpers/netns_job.py --target A[,B] --run RUN --shards s0,s1 --out DIR
        --truth FILE [--hold s0 --gate-dir DIR] [--timeout 2 --interval 0.5]

Runs each shard through the SDK in turn (`Ledger.shard`: started, heartbeats, progress,
one atomic commit of "out" whose bytes depend on the shard id alone, so every night
commits the same digests) and records the truth the test compares the ledger with:
every event the SDK emitted, its fate (acknowledged, its sequence, when the job saw it
acknowledged on its own wall clock) and the digest committed per shard. With --hold S
the job stops inside shard S once it is running: it writes GATE/S.reached and waits for
GATE/S.go, so the test can fault the network at a known point of the attempt.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from shard_client import Ledger
from shard_client.ack import Ack
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient

GATE_WAIT_S = 300.0

if os.environ.get("FAKETIME"):
    # libfaketime 0.9.10 (Debian 12) with FAKETIME_DONT_FAKE_MONOTONIC=1 answers Python's
    # time.sleep (clock_nanosleep on an absolute monotonic deadline) with EINVAL, while
    # timed waits on a lock work: under it, a sleep is such a wait. Set before anything runs.
    _never = threading.Event()
    time.sleep = _never.wait  # type: ignore[assignment]


class Truth:
    """Every event this job emitted and when each was first seen acknowledged."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[pb.ShardEvent, Ack]] = []
        self.acked_at: dict[str, float] = {}
        self.done = threading.Event()
        threading.Thread(target=self._stamp, daemon=True).start()

    def wrap(self, ledger: Ledger) -> None:
        """Records every event the ledger's sender is handed (heartbeats from its thread too)."""
        emit = ledger.sender.emit

        def recording(event: pb.ShardEvent, *, ack: Ack | None = None) -> Ack:
            sent = emit(event, ack=ack)
            with self.lock:
                self.events.append((pb.ShardEvent.FromString(event.SerializeToString()), sent))
            return sent

        ledger.sender.emit = recording  # type: ignore[method-assign]

    def _stamp(self) -> None:
        while not self.done.is_set():
            self.stamp()
            time.sleep(0.02)

    def stamp(self) -> None:
        """Notes the first time each event is seen acknowledged."""
        now = time.time()
        with self.lock:
            for event, ack in self.events:
                if ack.acknowledged and event.event_id not in self.acked_at:
                    self.acked_at[event.event_id] = now

    def rows(self) -> list[dict[str, Any]]:
        """Returns one row per event: its identity, kind and fate."""
        self.stamp()
        with self.lock:
            return [
                {
                    "event_id": e.event_id,
                    "kind": e.WhichOneof("payload"),
                    "shard_id": e.shard_id,
                    "attempt_id": e.attempt_id,
                    "outcome": a.outcome,
                    "acknowledged": a.acknowledged,
                    "sequence": a.sequence,
                    "acked_at": self.acked_at.get(e.event_id),
                }
                for e, a in self.events
            ]


def content(shard_id: str) -> bytes:
    """Returns the shard's output: the same bytes in every night."""
    return (f"output of shard {shard_id}\n" * 64).encode()


def hold(gate: Path, shard_id: str) -> None:
    """Says the shard is running, then waits for the test's go."""
    reached = gate / f"{shard_id}.reached"
    reached.with_suffix(".tmp").write_text(str(time.time()))
    os.replace(reached.with_suffix(".tmp"), reached)
    deadline = time.monotonic() + GATE_WAIT_S
    while not (gate / f"{shard_id}.go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go for {shard_id} within {GATE_WAIT_S} s")
        time.sleep(0.02)


def main() -> int:
    """Runs the shards; writes the truth file (also after a failure); exit 1 on a failure."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--shards", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--truth", required=True)
    parser.add_argument("--spool", required=True)
    parser.add_argument("--hold", action="append", default=[])
    parser.add_argument("--gate-dir", default="")
    parser.add_argument("--timeout", type=float, default=2.0, help="heartbeat timeout (s)")
    parser.add_argument("--interval", type=float, default=0.5, help="heartbeat interval (s)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--step-s", type=float, default=0.1)
    parser.add_argument("--deadline", type=float, default=3.0, help="per-call deadline (s)")
    parser.add_argument("--unavailable-after", type=float, default=1.0)
    parser.add_argument("--exit-wait", type=float, default=120.0)
    parser.add_argument("--progress-timeout", type=float, default=None)
    args = parser.parse_args()
    out, gate = Path(args.out), Path(args.gate_dir)
    out.mkdir(parents=True, exist_ok=True)
    truth = Truth()
    committed: dict[str, str] = {}
    report: dict[str, Any] = {"pid": os.getpid(), "host": os.uname().nodename, "error": ""}
    client = LedgerClient(args.target, timeout_s=args.deadline)
    ledger = Ledger(
        client=client,
        spool_dir=args.spool,
        unavailable_after_s=args.unavailable_after,
        exit_wait_s=args.exit_wait,
    )
    truth.wrap(ledger)
    try:
        for shard_id in args.shards.split(","):
            with ledger.shard(
                args.run,
                shard_id,
                heartbeat_timeout=args.timeout,
                heartbeat_interval=args.interval,
                expected_outputs=["out"],
                fingerprint=False,
                watchdog=False,
                sigterm_grace=None,
                progress_timeout=args.progress_timeout,
            ) as shard:
                for step in range(args.steps):
                    shard.progress(step, (step + 1) / args.steps)
                    if step == 0 and shard_id in args.hold:
                        hold(gate, shard_id)
                    time.sleep(args.step_s)
                target = out / f"{args.run}-{shard_id}.out"
                with shard.atomic_write(target, name="out") as f:
                    f.write(content(shard_id))
                committed[shard_id] = str(target)
    except BaseException as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        ledger.close()
        truth.done.set()
        report |= {"events": truth.rows(), "committed": committed, "closed_at": time.time()}
        tmp = Path(args.truth + ".tmp")
        tmp.write_text(json.dumps(report))
        os.replace(tmp, args.truth)
    return 1 if report["error"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
