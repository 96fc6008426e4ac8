"""The ledger side of an exec'd attempt: started, heartbeats with the child's progress, commits, failed.

Everything goes through the SDK's `Ledger` and its sender, so an unreachable
ledger spools exactly as it does for an SDK job (docs/spools.md) and the child
keeps running. The wrapper's own pid and start time are recorded in ``started``:
`shardledger watch` signals that process, which forwards to the child.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from shard_client import Ledger
from shard_client.ack import Ack
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.atomic import CommitInfo
from shard_client.classify import describe
from shard_client.environment import Fingerprint, fingerprint
from shard_client.errors import LedgerClientError
from shard_client.metrics import TelemetryCoercer
from shard_client.scheduler import detect, process_start_ticks
from shard_client.sender import new_event_id
from shard_client.vocabulary import FailureTag
from shardledger_cli.exec.progress import Progress

__all__ = ["ExecAttempt", "read_fingerprint"]

log = logging.getLogger("shard_client")


def read_fingerprint(extra: Mapping[str, str], *, enabled: bool) -> Fingerprint:
    """Returns the node's fingerprint (GPUs, driver, image) plus ``extra`` fields; never raises.

    torch is not read: it would describe the wrapper's interpreter, not the child's
    runtime; ``--fingerprint-field`` records what the child runs on instead.
    """
    if not enabled:
        return Fingerprint(fields={}, digest="")
    try:
        fields = dict(fingerprint(with_torch=False).fields)
    except Exception as exc:  # evidence, never a reason not to run the job
        fields = {"error": describe(exc)}
    fields.update(extra)
    return Fingerprint.from_fields(fields)


def _now() -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(time.time_ns())
    return stamp


class ExecAttempt:
    """One attempt run by `shardledger exec`; heartbeats from a daemon thread while the child lives."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        run_id: str,
        shard_id: str,
        attempt_id: str,
        heartbeat_timeout_s: float,
        heartbeat_interval_s: float,
    ) -> None:
        self.ledger = ledger
        self.run_id, self.shard_id, self.attempt_id = run_id, shard_id, attempt_id
        self._timeout_s = heartbeat_timeout_s
        self._interval_s = heartbeat_interval_s
        # Progress reports go out at most this often; the latest one wins.
        self._min_gap_s = min(1.0, heartbeat_interval_s)
        self._coercer = TelemetryCoercer(shard_id=shard_id, attempt_id=attempt_id)
        self._lock = threading.Lock()
        self._latest: Progress | None = None
        self._pending = False
        self._step, self._progress = 0, 0.0
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def _emit(self, **payload: object) -> Ack:
        event = pb.ShardEvent(
            event_id=new_event_id(),
            namespace=self.ledger.namespace,
            run_id=self.run_id,
            shard_id=self.shard_id,
            attempt_id=self.attempt_id,
            client_time=_now(),
            **payload,  # type: ignore[arg-type]
        )
        return self.ledger.emit(event)

    def start(self, fp: Fingerprint, seen: pb.InputSeen | None = None) -> Ack:
        """Records started and waits until the ledger (or the spool) holds it; raises a refusal.

        ``seen`` is what exec read of the input; the ack says whether the ledger finds it
        other than the plan's (Ack.input_changed).
        """
        timeout = Duration()
        timeout.FromNanoseconds(int(self._timeout_s * 1e9))
        try:
            found = detect()
        except Exception as exc:  # identity is evidence, never a reason to fail the job
            log.warning("scheduler_identity_unreadable error=%s", describe(exc))
            found = None
        started = pb.AttemptStarted(
            host=socket.gethostname(),
            pid=os.getpid(),
            heartbeat_timeout=timeout,
            fingerprint={k[:256]: v[:1024] for k, v in fp.fields.items()},
            fingerprint_digest=fp.digest,
            scheduler=None if found is None else pb.SchedulerIdentity(**found.fields()),
            process_start_ticks=process_start_ticks(),
            input=seen,
        )
        # Waiting turns a wrong run or shard id into an error before the child runs.
        return self._emit(started=started).result(self.ledger.ack_timeout_s)

    def start_beats(self) -> None:
        """Starts the heartbeat thread."""
        self._thread = threading.Thread(
            target=self._run, name=f"shardledger-exec-beats-{self.shard_id}", daemon=True
        )
        self._thread.start()

    def stop_beats(self) -> None:
        """Stops the heartbeat thread and sends the last progress report still pending, once."""
        with self._lock:
            stopped, self._stopped = self._stopped, True
            latest, pending, self._pending = self._latest, self._pending, False
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5.0)
        if stopped or not pending:
            return
        # The child's last report (often its final step) comes before the attempt's end.
        try:
            self._emit(heartbeat=self._beat(latest))
        except (LedgerClientError, RuntimeError) as exc:  # telemetry never stops the job
            log.warning("heartbeat_not_sent shard=%s error=%s", self.shard_id, exc)

    def report(self, progress: Progress) -> None:
        """Notes the child's progress; the beat thread sends it within a second."""
        with self._lock:
            self._latest, self._pending = progress, True
        self._wake.set()

    def _run(self) -> None:
        last_sent = time.monotonic()
        while True:
            with self._lock:
                pending = self._pending
            due = last_sent + (self._min_gap_s if pending else self._interval_s)
            self._wake.wait(max(due - time.monotonic(), 0.0))
            self._wake.clear()
            now = time.monotonic()
            with self._lock:
                if self._stopped:
                    return
                latest, pending = self._latest, self._pending
                if now < last_sent + (self._min_gap_s if pending else self._interval_s):
                    continue
                self._pending = False
            last_sent = now
            try:
                self._emit(heartbeat=self._beat(latest if pending else None))
            except (LedgerClientError, RuntimeError) as exc:  # telemetry never stops the job
                log.warning("heartbeat_not_sent shard=%s error=%s", self.shard_id, exc)

    def _beat(self, latest: Progress | None) -> pb.Heartbeat:
        if latest is None:
            return pb.Heartbeat(step=self._step, progress=self._progress)
        values = self._coercer.coerce(latest.step, latest.progress, latest.metrics)
        self._step, self._progress = values.step, values.progress
        return pb.Heartbeat(
            step=values.step,
            progress=values.progress,
            metrics=values.metrics,
            nonfinite_metrics=values.nonfinite,
        )

    def record_commit(self, name: str, info: CommitInfo) -> None:
        """Records artifact_committed and waits until the ledger or the spool holds it."""
        event = pb.ArtifactCommitted(
            name=name, path=info.path, size_bytes=info.size_bytes, blake3_hex=info.blake3_hex
        )
        # A commit not recorded durably anywhere must not be reported as done.
        self._emit(artifact_committed=event).result(self.ledger.ack_timeout_s)

    def fail(self, tag: FailureTag, message: str, *, diagnostics: CommitInfo | None = None) -> bool:
        """Records failed(tag); returns False (and logs) when the ledger refused or never held it."""
        failed = pb.AttemptFailed(
            tag=f"FAILURE_TAG_{tag.value.upper()}",
            message=message,
            diagnostics_path=diagnostics.path if diagnostics else "",
            diagnostics_blake3_hex=diagnostics.blake3_hex if diagnostics else "",
        )
        try:
            self._emit(failed=failed).result(self.ledger.ack_timeout_s)
        except LedgerClientError as error:
            log.error("failure_not_recorded shard=%s tag=%s error=%s", self.shard_id, tag, error)
            return False
        return True
