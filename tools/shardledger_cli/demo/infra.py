"""The demo's moving parts around the pool: the ledger as a killable subprocess, and the watchdog."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any, Final

from shard_client.client import LedgerClient
from shard_client.errors import LedgerClientError
from shardledger_cli.commands.watch import Action, StartedIndex, handle_stale, stale_checker
from shardledger_cli.demo.faults import Check

START_TIMEOUT_S: Final = 30.0
COUNTED_KINDS: Final = ("started", "checkpoint", "artifact_committed", "failed")


class LedgerProcess:
    """`shardledger serve` on a SQLite file, as a subprocess the demo can SIGKILL and restart."""

    def __init__(self, work: Path) -> None:
        self.db = work / "ledger.db"
        self.port_file = work / "ledger.port"
        self.log_path = work / "ledger.log"
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def target(self) -> str:
        """Returns HOST:PORT of the server."""
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Starts the server (on the port it had before, if any) and waits until it listens."""
        with contextlib.suppress(FileNotFoundError):
            self.port_file.unlink()
        if self._log is None:
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the server
        command = [sys.executable, "-m", "shardledger_cli", "serve", "--db", str(self.db)]
        command += ["--listen", f"127.0.0.1:{self.port}", "--port-file", str(self.port_file)]
        command += ["--log-level", "warning", "--grace", "1"]
        self._proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.port_file.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the ledger server did not start; see {self.log_path}")
            time.sleep(0.05)
        port = int(self.port_file.read_text())
        if self.port and port != self.port:
            raise RuntimeError(f"the ledger came back on port {port}, not {self.port}")
        self.port = port

    def kill(self) -> None:
        """SIGKILLs the server: no drain, no clean close of the database."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait()

    def stop(self) -> None:
        """Stops the server cleanly (SIGTERM), or kills it after a few seconds."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10.0)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._log is not None:
            self._log.close()
            self._log = None


class Watchdog:
    """`shardledger watch --kill-stale` as a thread of the demo: one pass every interval."""

    def __init__(
        self,
        target: str,
        *,
        run_id: str,
        namespace: str,
        grace_s: float,
        diag_dir: Path,
        interval_s: float = 1.0,
    ) -> None:
        self.client = LedgerClient(target, timeout_s=5.0, retry_deadline_s=1.0)
        self.run_id, self.namespace = run_id, namespace
        self.grace_s, self.diag_dir, self.interval_s = grace_s, diag_dir, interval_s
        self.actions: list[Action] = []
        self.unrecorded: dict[str, Action] = {}  # stopped, failed(timeout) not yet taken
        self.started = StartedIndex(run_id, namespace)
        self._hold_until = 0.0
        # After an outage: shard id -> attempt id of the attempts that ran through it, until
        # each is heard from again (received after _since_us) or has ended; then _settle_s.
        self._awaiting: dict[str, str] = {}
        self._since_us = 0
        self._settle_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="demo-watchdog", daemon=True)

    def start(self) -> None:
        """Starts watching."""
        self._thread.start()

    def hold(self, seconds: float) -> None:
        """Pauses the watchdog for some seconds (inf: until the next hold)."""
        self._hold_until = time.monotonic() + seconds

    def running_attempts(self) -> dict[str, str]:
        """Returns shard id -> latest attempt id of the run's running shards (the ledger's view)."""
        shards = self.client.shards(self.run_id, namespace=self.namespace, state="running")
        return {s.shard_id: s.view.latest_attempt for s in shards}

    def hold_until_heard(
        self, attempts: Mapping[str, str], *, since_us: int, settle_s: float, deadline_s: float
    ) -> None:
        """Pauses until each attempt was heard from after ``since_us`` (or ended), then settle_s.

        After an outage a job's events come back only once its sender's backoff lets it
        retry and its spool drains, which on a busy machine takes longer than any fixed
        pause: until then an attempt that ran through the outage only looks silent. A
        job that never speaks again (it hung meanwhile) is watched after ``deadline_s``.
        """
        self._awaiting, self._since_us, self._settle_s = dict(attempts), since_us, settle_s
        self._hold_until = time.monotonic() + (deadline_s if attempts else settle_s)

    def _heard_all(self) -> bool:
        """Drops the awaited attempts the ledger heard from (or that ended); True once none is left."""
        for shard in self.client.shards(self.run_id, namespace=self.namespace):
            attempt = self._awaiting.get(shard.shard_id)
            if attempt is None:
                continue
            view = shard.view
            ended = view.latest_attempt != attempt or shard.state not in ("running", "stale")
            if ended or (view.HasField("last_seen_us") and view.last_seen_us >= self._since_us):
                del self._awaiting[shard.shard_id]
        return not self._awaiting

    def stop(self) -> None:
        """Stops watching and waits for a pass in progress."""
        self._stop.set()
        self._thread.join(30.0)
        self.client.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self._awaiting:
                with contextlib.suppress(LedgerClientError):
                    if self._heard_all():
                        self._hold_until = min(self._hold_until, time.monotonic() + self._settle_s)
            if time.monotonic() < self._hold_until:
                continue
            with contextlib.suppress(LedgerClientError):
                self.sweep()

    def sweep(self) -> None:
        """Handles every stale attempt once: stack dump, SIGTERM, grace, SIGKILL, failed(timeout)."""
        stale = list(self.client.shards(self.run_id, namespace=self.namespace, state="stale"))
        for shard in stale:
            view = json.loads(shard.view_json)
            action = handle_stale(
                view,
                # The started event's pid start time: a pid is signalled only when it matches.
                target=self.started.target(view, self.client),
                append=self.client.append,
                run_id=self.run_id,
                namespace=self.namespace,
                grace_s=self.grace_s,
                diag_dir=self.diag_dir,
                recheck=stale_checker(self.client, self.run_id, namespace=self.namespace),
                unrecorded=self.unrecorded,
            )
            self.actions.append(action)


def count_events(events: Iterable[Any]) -> dict[str, Counter[str]]:
    """Returns attempt id -> counts of the life-cycle events the ledger holds for it."""
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    for event in events:
        kind = event.WhichOneof("payload")
        if event.attempt_id and kind in COUNTED_KINDS:
            counts[event.attempt_id][kind] += 1
    return counts


def late_arrivals(events: Iterable[Any], *, down: float, up: float) -> tuple[int, int, int]:
    """Returns (events written during the outage, those stored after it, their attempts)."""
    written = stored_after = 0
    attempts: set[str] = set()
    for event in events:
        client_s = event.client_time.seconds + event.client_time.nanos / 1e9
        if event.HasField("client_time") and down <= client_s <= up:
            written += 1
            received = event.receive_time.seconds + event.receive_time.nanos / 1e9
            stored_after += received >= up
            attempts.add(event.attempt_id)
    return written, stored_after, len(attempts)


def check_accounting(
    results: Iterable[Mapping[str, Any]], counts: Mapping[str, Counter[str]]
) -> Check:
    """Checks every surviving attempt's events arrived exactly once: none lost, none doubled."""
    problems, checked = [], 0
    for result in results:
        if result["outcome"] == "died":
            continue  # a SIGKILLed worker cannot say what it emitted
        checked += 1
        have = counts.get(result["attempt_id"], Counter())
        for kind in COUNTED_KINDS:
            if have[kind] != result["emitted"][kind]:
                problems.append(
                    f"{result['shard_id']} attempt {result['attempt_id']}: {kind} "
                    f"emitted {result['emitted'][kind]}, ledger holds {have[kind]}"
                )
    detail = f"{checked} attempts, every started/checkpoint/commit/failed event counted"
    return Check("no event lost or doubled", not problems, detail, problems)


def overlapping(results: Iterable[Mapping[str, Any]], *, down: float, up: float) -> list[str]:
    """Returns the attempts that ran, at least partly, while the ledger was down."""
    return [
        r["attempt_id"]
        for r in results
        if r["outcome"] != "died" and r["begin"] <= up and r["end"] >= down
    ]
