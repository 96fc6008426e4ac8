"""The server's retention: settled runs older than a policy are archived in the background.

`serve --archive-after 7d --archive-to s3://bucket/prefix` starts one thread that,
every ``every_s`` seconds, archives at most one run: the one settled longest ago
among those settled more than ``after_s`` before now. One run per step bounds the
work; the write lock is taken only for the tombstone's short transaction and then
for one chunk of the dead rows' purge at a time, resting between chunks (archiver.purge),
so an append waits for one chunk at most. A backlog drains at one run per step; a purge
a crash cut short is finished at the next step. Every outcome is logged
and counted in /metrics; a failed run stays hot and is tried again at a later
step, after the runs that have not failed.
"""

from __future__ import annotations

import multiprocessing
import re
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Final

import structlog

from ledger_server.archiver import Outcome, archive_run, commit, finish_purges, prepare_in_child
from ledger_server.service import LedgerService, summary_at
from ledger_server.signing import SigningKey

log = structlog.get_logger("shardledger.retention")

_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION: Final = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


def parse_duration(text: str) -> float:
    """Returns the seconds in "90s", "15m", "12h", "7d", "2w" (or a bare number of seconds)."""
    try:
        seconds = float(text)
    except ValueError:
        match = _DURATION.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"{text!r} is not a duration (e.g. 7d, 12h, 30m, 90s)") from None
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if seconds < 0:
        raise ValueError(f"{text!r} is negative")
    return seconds


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """Archive runs settled more than after_s ago to the base URL, one per every_s.

    per_namespace overrides after_s for a namespace: (namespace, seconds), or
    (namespace, None) to keep that namespace's runs hot.
    """

    after_s: float
    to: str
    every_s: float = 60.0
    per_namespace: tuple[tuple[str, float | None], ...] = ()

    def after_for(self, namespace: str) -> float | None:
        """Returns how long the namespace's runs stay hot once settled (None: always)."""
        for name, after_s in self.per_namespace:
            if name == namespace:
                return after_s
        return self.after_s


def parse_namespace_policy(text: str) -> tuple[str, float | None]:
    """Returns (namespace, seconds or None) of "NAMESPACE=DURATION" or "NAMESPACE=never"."""
    namespace, sep, duration = text.partition("=")
    if not sep or not namespace:
        raise ValueError(
            f"{text!r} is not NAMESPACE=DURATION (e.g. audit=90d, scratch=1d, keep=never)"
        )
    return namespace, None if duration == "never" else parse_duration(duration)


class Retention:
    """The background thread that applies a RetentionPolicy to a ledger."""

    def __init__(
        self,
        ledger: LedgerService,
        key: SigningKey,
        policy: RetentionPolicy,
        *,
        on_outcome: Callable[[Outcome], None] = lambda outcome: None,
        child: tuple[str, str] | None = None,
    ) -> None:
        """child: (database URL, signing key path) to build bundles in a child process.

        A bundle is CPU work (JSON, blake3, the Merkle tree) that in this process
        would hold the GIL the appends need; in a child process the server keeps only
        the final transaction.
        """
        self.ledger = ledger
        self.key = key
        self.policy = policy
        self.on_outcome = on_outcome
        self.child = child
        self._pool: ProcessPoolExecutor | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="retention", daemon=True)
        # Runs whose last try failed, tried again only when nothing else is due.
        self._failed: set[tuple[str, str]] = set()

    def start(self) -> None:
        """Starts the thread."""
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stops the thread after the step in progress, or between two chunks of its purge.

        An archive is never cut short before its tombstone commits; a purge stopped
        half-way is finished at the next start's first step.
        """
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.policy.every_s):
            try:
                self.step()
            except Exception as exc:  # the thread must outlive a bad step; it is counted
                log.exception("archive_step_failed", error=str(exc))
                self.on_outcome(Outcome("", "", "failed", reason=str(exc)))

    def due(self, now_us: int) -> list[tuple[str, str]]:
        """Returns the runs past the policy, longest settled first; failed ones last."""
        view = self.ledger.store.read()
        found = []
        for run in view.list_runs(None, 1 << 30):
            after_s = self.policy.after_for(run.namespace)
            if after_s is None:
                continue  # this namespace's runs stay hot
            limit_us = now_us - int(after_s * 1_000_000)
            if run.archived or run.updated_us > limit_us:
                continue  # a run's settled time is never later than its last event
            life = summary_at(view, run, now_us)["lifecycle"]
            if life["settled"] and life["settled_at_us"] <= limit_us:
                key = (run.namespace, run.run_id)
                found.append((key in self._failed, life["settled_at_us"], key))
        return [key for _, _, key in sorted(found)]

    def step(self) -> Outcome | None:
        """Archives at most one due run; returns what happened (None when nothing was due)."""
        purged = finish_purges(self.ledger.store, paced=True, stop=self._stop)
        if purged:
            log.info("archive_purge_finished", rows=purged)
        now_us = self.ledger.clock()
        due = self.due(now_us)
        if not due:
            return None
        namespace, run_id = due[0]
        outcome = self._archive(namespace, run_id, now_us)
        if outcome.ok:
            self._failed.discard((namespace, run_id))
            log.info(
                "run_archived",
                namespace=namespace,
                run_id=run_id,
                events=outcome.events,
                size_bytes=outcome.size_bytes,
                location=outcome.location,
            )
        else:
            self._failed.add((namespace, run_id))
            log.warning(
                "run_archive_failed",
                namespace=namespace,
                run_id=run_id,
                action=outcome.action,
                reason=outcome.reason,
            )
        self.on_outcome(outcome)
        return outcome

    def _archive(self, namespace: str, run_id: str, now_us: int) -> Outcome:
        if self.child is None:
            return archive_run(
                self.ledger.store,
                self.key,
                namespace,
                run_id,
                self.policy.to,
                now_us=now_us,
                paced=True,
                stop=self._stop,
            )
        if self._pool is None:
            # spawn, not fork: the server's threads (gRPC's, the committer) must not be
            # copied mid-flight into the child.
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        database, key_path = self.child
        job = (database, key_path, namespace, run_id, self.policy.to, now_us)
        try:
            prepared = self._pool.submit(prepare_in_child, *job).result()
        except BrokenProcessPool as exc:
            self._pool = None  # a new child at the next step
            return Outcome(namespace, run_id, "failed", reason=f"the archive's child died: {exc}")
        if isinstance(prepared, Outcome):
            return prepared
        return commit(self.ledger.store, namespace, run_id, prepared, paced=True, stop=self._stop)
