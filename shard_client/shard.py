# Over 400 lines on purpose: one class, the shard context; a split would cut its life cycle in two.
"""One attempt at a shard: the context that ``with ledger.shard(...)`` enters.

A shard context never ends in a bare success. It emits ``started``, heartbeats
from a background thread, an ``artifact_committed`` for every file it commits,
and, when the block raises or ends without the expected artifacts, ``failed``
with a tag; the process then exits non-zero because the exception propagates
(:class:`IncompleteShard` for a clean exit that committed too little).

SIGTERM: used from the main thread, the context sets ``shard.stopping`` on
SIGTERM, so the job can checkpoint and stop within ``sigterm_grace`` seconds;
after that :class:`Preempted` is raised in the main thread and the attempt is
recorded as ``failed(preempted)``. The previous handler is restored on exit and
a SIGTERM received during the block is not passed on to it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from shard_client import atomic, storage
from shard_client.ack import Ack
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.canonical import fingerprint_digest
from shard_client.classify import describe, failure_tag
from shard_client.diagnostics import BundleContext
from shard_client.environment import Fingerprint, gpu_count
from shard_client.environment import fingerprint as read_fingerprint
from shard_client.errors import LedgerClientError, LedgerRejected
from shard_client.failures import IncompleteShard, InputChanged, Preempted
from shard_client.heartbeat import Heartbeats
from shard_client.ids import check_id
from shard_client.inputs import observe
from shard_client.labels import labels_from_env, merged_labels
from shard_client.metrics import TelemetryCoercer
from shard_client.options import ShardOptions
from shard_client.ranks import attempt_id_for, own_outputs
from shard_client.scheduler import detect as detect_scheduler
from shard_client.scheduler import process_start_ticks
from shard_client.sender import new_event_id
from shard_client.signals import SigtermGrace, stack_dumps_on_sigusr1
from shard_client.vocabulary import FailureTag
from shard_client.watchdog import ProgressClock, Watchdog, terminate_self

if TYPE_CHECKING:
    # Loaded when first used (an object-store commit, a checkpoint): a job that does
    # neither never imports them (docs/performance.md, "Job cost").
    from shard_client import checkpoint
    from shard_client.ledger import Ledger
    from shard_client.remote import UploadPolicy

__all__ = ["Shard"]

log = logging.getLogger("shard_client")

# The watchdog's failed(timeout) must be on record before it signals, but a ledger
# that never answers (policy="block", no ack_timeout_s) must not keep a hang alive.
_WATCHDOG_ACK_S = 120.0


def _now() -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(time.time_ns())
    return stamp


def _scheduler_identity() -> pb.SchedulerIdentity | None:
    """Returns the scheduler identity for the started event; None outside a scheduler."""
    try:
        found = detect_scheduler()
    except Exception as exc:  # identity is evidence, never a reason to fail the job
        log.warning("scheduler_identity_unreadable error=%s", describe(exc))
        return None
    return None if found is None else pb.SchedulerIdentity(**found.fields())


class Shard:
    """One attempt at a shard; use it as ``with ledger.shard(run, shard) as shard:``."""

    def __init__(
        self,
        ledger: Ledger,
        run_id: str,
        shard_id: str,
        *,
        options: ShardOptions | None = None,
        attempt_id: str | None = None,
    ) -> None:
        self.options = options or ShardOptions()
        # Every rank of one launch derives the same attempt id: one attempt, N processes.
        self.rank_info = self.options.rank_info()
        if attempt_id is None and self.rank_info is not None:
            attempt_id = attempt_id_for(run_id, shard_id, self.rank_info)
        self.attempt_id = attempt_id or uuid.uuid4().hex
        for what, value in (
            ("run_id", run_id),
            ("shard_id", shard_id),
            ("attempt_id", self.attempt_id),
        ):
            check_id(what, value)
        self.ledger, self.run_id, self.shard_id = ledger, run_id, shard_id
        self._last_beat: Ack | None = None
        self._lock = threading.Lock()
        self._committed: list[str] = []
        # new -> active -> closed, or active -> timed_out | ended -> closed (ended: another
        # rank ended the attempt, and this one stops).
        self._state = "new"
        # Ranks on one host share an attempt id: their bundles and dumps are told apart.
        label = self.attempt_id
        if self.rank_info is not None:
            label = f"{self.attempt_id}.rank{self.rank_info.rank}"
        self._diagnostics = contextlib.ExitStack()
        wake = threading.Event()
        self._sigterm = SigtermGrace(
            grace_s=self.options.sigterm_grace, label=f"shard {shard_id}", on_term=wake.set
        )
        self._clock = ProgressClock()
        policy = self.options.hang_policy()
        self._watchdog = (
            Watchdog(
                policy=policy,
                clock=self._clock,
                context=BundleContext(run_id, shard_id, label),
                claim=self._claim_timeout,
                record_failed=self._record_timeout,
            )
            if policy is not None
            else None
        )
        self._heartbeats = Heartbeats(
            interval_s=self.options.interval,
            progress_timeout_s=self.options.progress_timeout,
            sigterm=self._sigterm,
            wake=wake,
            send=self._send_beat,
            reserve=lambda: Ack(new_event_id(), self.ledger.sender),
            coalesce=self.options.coalesce_progress,
            # After a trip the thread still ends the SIGTERM grace, so it lives on.
            active=lambda: self._state in ("active", "timed_out", "ended"),
            shard_id=shard_id,
            attempt_id=self.attempt_id,
            clock=self._clock,
            watchdog=self._watchdog,
            ended_elsewhere=self._ended_elsewhere if self.rank_info is not None else None,
        )
        self._stack_label = label
        self._telemetry = TelemetryCoercer(shard_id=shard_id, attempt_id=self.attempt_id)

    @property
    def committed(self) -> tuple[str, ...]:
        """Returns the artifact names committed so far, in order."""
        with self._lock:
            return tuple(self._committed)

    @property
    def stopping(self) -> bool:
        """Returns whether a SIGTERM arrived: checkpoint and stop within the grace period."""
        return self._sigterm.term_at > 0

    # --- life cycle -------------------------------------------------------------

    def __enter__(self) -> Shard:
        if self._state != "new":
            raise RuntimeError("a Shard context can be entered once")
        output_dir = self.options.output_dir
        if output_dir is not None:
            atomic.makedirs_durable(output_dir)
            atomic.cleanup_orphans(output_dir, older_than_s=self.options.orphan_age_s)
        checkpoints = self._checkpoint_dir()
        if checkpoints is not None and os.path.isdir(checkpoints):
            # A job preempted mid-checkpoint leaves a whole checkpoint's worth of temp file.
            atomic.cleanup_orphans(checkpoints, older_than_s=self.options.orphan_age_s)
        fp = self._read_fingerprint()
        fields = {k[:256]: v[:1024] for k, v in fp.fields.items()}  # the ledger's limits
        timeout = Duration()
        timeout.FromNanoseconds(int(self.options.heartbeat_timeout * 1e9))
        started = pb.AttemptStarted(
            host=socket.gethostname(),
            pid=os.getpid(),
            heartbeat_timeout=timeout,
            fingerprint=fields,
            # The ledger computes the digest from the map it receives and refuses another
            # (docs/contract.md), so it is the digest of the map as sent, cut or not; a
            # digest without fields is the caller's own group key, sent as it is.
            fingerprint_digest=fingerprint_digest(fields) if fields else fp.digest,
            scheduler=_scheduler_identity(),
            process_start_ticks=process_start_ticks(),
            labels=self._labels(),
            gpu_count=gpu_count(fp.fields, os.environ, one_rank=self.rank_info is not None),
        )
        if self.rank_info is not None:
            started.rank = self.rank_info.rank
            started.world_size = self.rank_info.world_size
            started.local_rank = self.rank_info.local_rank
            started.launch_id = self.rank_info.launch_id
            started.restart_count = self.rank_info.restart_count
        changed, named = "", self.options.input
        if named is not None:
            # Read before the attempt starts: an input that cannot be read stops it here.
            seen, changed = observe(named, check=self.options.input_check)
            started.input.CopyFrom(seen)
        # Waiting here turns a wrong run or shard id into an error before any work.
        ack = self._emit(started=started).result(self.ledger.ack_timeout_s)
        # The ledger holds the plan and judges (a spooled start: the plan the job was handed).
        changed = ack.input_changed or changed
        if changed and named is not None:
            self._state = "closed"
            self._fail(FailureTag.INPUT_CHANGED, f"input {named.ref}: {changed}")
            raise InputChanged(
                f"shard {self.shard_id} of run {self.run_id}: the input is not the one planned"
                f" ({changed}); failed(input_changed) is recorded, nothing was computed",
                run_id=self.run_id,
                shard_id=self.shard_id,
                difference=changed,
            )
        self._state = "active"
        self._sigterm.install()
        self._diagnostics.enter_context(stack_dumps_on_sigusr1(self._stack_label))
        self._heartbeats.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with self._lock:
            ending, self._state = self._state, "closed"
        timed_out = ending in ("timed_out", "ended")
        # From here on a late SIGTERM is ignored, not raised.
        self._sigterm.restore()
        self._diagnostics.close()
        self._heartbeats.stop()
        self._flush_progress()
        clean = exc is None or (isinstance(exc, SystemExit) and exc.code in (None, 0))
        if timed_out:
            # The watchdog recorded failed(timeout), or another rank ended the attempt;
            # the ledger refuses a second ending.
            log.warning("shard_ended_after_hang shard=%s clean=%s", self.shard_id, clean)
            self.ledger.flush(self.ledger.flush_timeout_s)
            if clean:
                why = "the SDK hang watchdog" if ending == "timed_out" else "another rank's failure"
                raise Preempted(f"shard {self.shard_id}: stopped by {why}")
            return
        if not clean:
            assert exc is not None
            tag = failure_tag(exc)
            if self.stopping and tag in (FailureTag.UNKNOWN, FailureTag.KILLED):
                tag = FailureTag.PREEMPTED
            self._fail(tag, describe(exc))
            return
        missing = self._missing()
        if missing is None:
            if self.rank_info is not None:
                self._finish_rank()
            self.ledger.flush(self.ledger.flush_timeout_s)
            return
        message = (
            f"missing expected outputs: {', '.join(missing)}"
            if missing
            else "the block ended without committing any artifact"
        )
        if self.stopping:
            self._fail(FailureTag.PREEMPTED, f"stopped by SIGTERM; {message}")
            raise Preempted(f"shard {self.shard_id}: stopped by SIGTERM; {message}")
        self._fail(FailureTag.INCOMPLETE, message)
        raise IncompleteShard(
            f"shard {self.shard_id} of run {self.run_id}: {message}",
            run_id=self.run_id,
            shard_id=self.shard_id,
            missing=missing,
        )

    def _missing(self) -> list[str] | None:
        """Returns the expected names not committed ([] if none at all was), or None when complete."""
        done = set(self.committed)
        expected = own_outputs(self.options.expected_outputs or (), self.rank_info)
        missing = [n for n in expected if n not in done]
        if self.rank_info is not None and (
            self.options.expected_outputs is not None or self.rank_info.rank != 0
        ):
            # A rank may own none of the names (rank 1 of "model"); without names only
            # rank 0 must commit something. The ledger checks every rank's by the plan.
            return missing or None
        return missing if missing or not done else None

    def _finish_rank(self) -> None:
        """Tells the ledger this rank left its block cleanly: its silence is no hang from now on."""
        beat = pb.Heartbeat(step=self._heartbeats.step, progress=self._heartbeats.progress)
        beat.rank_finished = True
        try:
            self._emit(heartbeat=beat).result(self.ledger.ack_timeout_s)
        except LedgerRejected as error:
            # Another rank ended the attempt meanwhile: this rank's part stands as committed.
            log.warning("rank_finish_refused shard=%s error=%s", self.shard_id, error)
        except LedgerClientError as error:
            log.error("rank_finish_not_recorded shard=%s error=%s", self.shard_id, error)

    def _fail(self, tag: FailureTag, message: str) -> None:
        """Records failed(tag); an error doing so is logged, never raised over the job's own."""
        # The proto enum spells each tag as FAILURE_TAG_<TAG>.
        failed = pb.AttemptFailed(tag=f"FAILURE_TAG_{tag.value.upper()}", message=message)
        try:
            self._emit(failed=failed).result(self.ledger.ack_timeout_s)
        except LedgerClientError as error:
            log.error("failure_not_recorded shard=%s tag=%s error=%s", self.shard_id, tag, error)
        self.ledger.flush(self.ledger.flush_timeout_s)

    def _send_beat(self, beat: pb.Heartbeat, ack: Ack | None = None) -> Ack:
        sent = self._last_beat = self._emit(heartbeat=beat, ack=ack)
        return sent

    def _ended_elsewhere(self) -> bool:
        """Stops this rank once the ledger refused its heartbeat: another rank ended the attempt.

        Called from the heartbeat thread about once a second. A rank blocked in a
        collective whose peer died never returns to Python, so it is stopped like a
        hang: diagnostics, SIGTERM, SIGKILL after ``kill_grace`` (no failed event:
        the attempt already has its ending).
        """
        ack = self._last_beat
        error = ack.error if ack is not None and ack.settled else None
        if not isinstance(error, LedgerRejected) or error.reason != "ATTEMPT_ENDED":
            return False
        with self._lock:
            if self._state != "active":
                return self._state == "ended"
            self._state = "ended"
        message = f"attempt ended by another rank ({error}); stopping this rank"
        log.error("attempt_ended_by_other_rank shard=%s %s", self.shard_id, message)
        if self._watchdog is not None:
            self._watchdog.stop_after_peer(message)
        else:
            threading.Thread(
                target=terminate_self,
                args=(self.shard_id, self.options.kill_grace or 30.0),
                kwargs={"stack_label": self._stack_label},
                name=f"shard_client-stop-{self.shard_id}",
                daemon=True,
            ).start()
        return True

    def _flush_progress(self) -> None:
        """Sends the progress held for the next beat; telemetry never fails the job's exit."""
        try:
            self._heartbeats.flush()
        except LedgerClientError as error:
            log.warning("progress_not_sent shard=%s error=%s", self.shard_id, error)

    def _claim_timeout(self) -> bool:
        """Lets the watchdog end the attempt, unless the block is ending by itself."""
        with self._lock:
            if self._state != "active":
                return False
            self._state = "timed_out"
            return True

    def _record_timeout(self, failed: pb.AttemptFailed) -> None:
        """Records the watchdog's failed(timeout), acknowledged or durably spooled."""
        timeout = self.ledger.ack_timeout_s
        self._emit(failed=failed).result(_WATCHDOG_ACK_S if timeout is None else timeout)
        self.ledger.flush(self.ledger.flush_timeout_s)

    def _read_fingerprint(self) -> Fingerprint:
        if isinstance(self.options.fingerprint, Fingerprint):
            return self.options.fingerprint
        if not self.options.fingerprint:
            return Fingerprint(fields={}, digest="")
        try:
            return read_fingerprint()
        except Exception as exc:  # the fingerprint is evidence, never a reason to fail the job
            return Fingerprint.from_fields({"error": describe(exc)})

    # --- events -----------------------------------------------------------------

    def _emit(self, *, ack: Ack | None = None, **payload: Any) -> Ack:
        if "heartbeat" not in payload:
            # Progress held for the next beat goes first: the ledger keeps the job's order.
            self._heartbeats.flush()
        if self.rank_info is not None:
            for message in payload.values():
                if "rank" in message.DESCRIPTOR.fields_by_name:
                    message.rank = self.rank_info.rank
        event = pb.ShardEvent(
            event_id=new_event_id() if ack is None else ack.event_id,
            namespace=self.ledger.namespace,
            run_id=self.run_id,
            shard_id=self.shard_id,
            attempt_id=self.attempt_id,
            client_time=_now(),
            **payload,
        )
        return self.ledger.sender.emit(event, ack=ack)

    def _check_active(self) -> None:
        if self._state == "ended":
            raise RuntimeError(
                f"shard {self.shard_id}: another rank ended the attempt; this rank stops"
            )
        if self._state == "timed_out":
            raise RuntimeError(
                f"shard {self.shard_id} was stopped by the SDK hang watchdog"
                " (failed(timeout) is recorded; a rerun resumes from the last recorded checkpoint)"
            )
        if self._state != "active":
            raise RuntimeError(f"shard {self.shard_id} is not inside its `with` block")

    def progress(self, step: int, progress: float = 0.0, **metrics: object) -> Ack:
        """Reports the step, progress in [0, 1] and a few metrics; call it every step.

        Calls are coalesced: the ledger gets at most one heartbeat per
        ``heartbeat_interval`` with the latest values and the interval's lowest
        step, each metric's min and max, and the non-finite names (the first call,
        and a metric turning non-finite, go at once; ``coalesce_progress=False``
        sends every call). A checkpoint, commit or failure sends the pending
        heartbeat first. The Ack is that of the heartbeat that carries this call.

        Telemetry never raises into the job: NaN and ±Inf metrics are sent by name in
        ``nonfinite_metrics``, numpy and torch scalars are read with float(), values
        that are no number are dropped, and each problem is logged once (see
        shard_client.metrics).
        """
        self._check_active()
        return self._heartbeats.add(self._telemetry.coerce(step, progress, metrics))

    # --- artifacts --------------------------------------------------------------

    def _artifact_name(self, path: str | os.PathLike[str], name: str | None) -> str:
        chosen = name or os.path.basename(os.fspath(path).rstrip("/"))
        check_id("artifact name (pass name=...)", chosen)
        return chosen

    def _record_commit(self, name: str, info: atomic.CommitInfo, media_type: str) -> None:
        """Emits artifact_committed and waits until the ledger or the spool holds it."""
        event = pb.ArtifactCommitted(
            name=name,
            path=info.path,
            size_bytes=info.size_bytes,
            blake3_hex=info.blake3_hex,
            media_type=media_type,
            version_id=info.version_id,
            etag=info.etag,
            read_back=info.read_back,
        )
        # A commit not recorded durably anywhere must not be reported as done.
        self._emit(artifact_committed=event).result(self.ledger.ack_timeout_s)
        with self._lock:
            self._committed.append(name)
        self._heartbeats.made_progress()

    @contextlib.contextmanager
    def atomic_write(
        self,
        path: str | os.PathLike[str],
        *,
        name: str | None = None,
        mode: str = "wb",
        media_type: str = "",
        read_back_digest: bool | None = None,
        upload: UploadPolicy | None = None,
    ) -> Iterator[Any]:  # Any: an AtomicFile for "wb", an AtomicTextFile for "w"
        """Writes a file atomically and records it as the artifact ``name`` (default: its file name).

        ``path`` may be an object-store URL (``s3://bucket/key``): the bytes are
        staged locally, uploaded conditionally and read back before the commit is
        recorded (see shard_client.remote; ``read_back_digest`` forces or skips the
        full re-read, ``upload`` tunes sizes and retries).
        """
        self._check_active()
        artifact = self._artifact_name(path, name)

        def on_commit(info: atomic.CommitInfo) -> None:
            self._record_commit(artifact, info, media_type)

        writer: AbstractContextManager[Any]
        if storage.is_remote(path):
            from shard_client import remote

            writer = remote.remote_write(
                os.fspath(path),
                mode=mode,
                on_commit=on_commit,
                read_back_digest=read_back_digest,
                policy=upload,
            )
        else:
            writer = atomic.atomic_write(storage.local_path(path), mode=mode, on_commit=on_commit)
        with self._clock.paused(), writer as f:
            yield f

    def commit(
        self,
        path: str | os.PathLike[str],
        *,
        name: str | None = None,
        media_type: str = "",
        source: str | os.PathLike[str] | None = None,
        upload: UploadPolicy | None = None,
    ) -> atomic.CommitInfo:
        """Makes a file another library wrote durable and records it as an artifact.

        For an object-store URL: without ``source`` the object the job uploaded
        itself is re-read in full and recorded; with ``source`` (a local file, such
        as ``NotConfirmed.staged_path``) that file is uploaded conditionally and
        read back first, like ``atomic_write`` does; a staged file (the SDK's
        temp name) is removed once committed, any other ``source`` is left alone.
        """
        self._check_active()
        artifact = self._artifact_name(path, name)
        with self._clock.paused():
            if storage.is_remote(path):
                from shard_client import remote

                url = os.fspath(path)
                if source is None:
                    info = remote.commit_object(url)
                else:
                    size, digest = atomic.hash_file(source)
                    info = remote.upload_and_confirm(
                        os.fspath(source), url, size_bytes=size, blake3_hex=digest, policy=upload
                    )
                self._record_commit(artifact, info, media_type)
                if source is not None and os.path.basename(source).startswith(atomic.TEMP_PREFIX):
                    # A staged file kept by NotConfirmed has served its purpose once the
                    # commit is on record; a file of the job's own stays where it is.
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(source)
                return info
            return atomic.commit_file(
                storage.local_path(path),
                on_commit=lambda info: self._record_commit(artifact, info, media_type),
            )

    # --- checkpoints ------------------------------------------------------------

    def _checkpoint_dir(self) -> str | None:
        """Returns checkpoint_dir, else output_dir/checkpoints, else None."""
        if self.options.checkpoint_dir is not None:
            return self.options.checkpoint_dir
        if self.options.output_dir is not None:
            return os.path.join(self.options.output_dir, "checkpoints")
        return None

    def _checkpoint_path(self, step: int, path: str | os.PathLike[str] | None) -> str:
        if path is not None:
            return os.fspath(path)
        directory = self._checkpoint_dir()
        if directory is None:
            raise ValueError("pass checkpoint_dir= (or output_dir=) to ledger.shard(), or path=")
        atomic.makedirs_durable(directory)
        from shard_client import checkpoint

        return os.path.join(directory, checkpoint.checkpoint_name(step))

    def _labels(self) -> dict[str, str]:
        """Returns the attempt's labels: $SHARDLEDGER_LABEL_*, then the Ledger's, then the shard's."""
        return merged_labels(labels_from_env(), self.ledger.labels, self.options.labels)

    def _record_checkpoint(
        self, step: int, info: atomic.CommitInfo, began_ns: int, *, part: bool = False
    ) -> None:
        # The write time is the w of checkpoint_advice(): serialize + fsync + rename.
        took = Duration()
        took.FromNanoseconds(max(time.monotonic_ns() - began_ns, 1))
        saved = pb.CheckpointSaved(
            step=step,
            path=info.path,
            size_bytes=info.size_bytes,
            blake3_hex=info.blake3_hex,
            write_duration=took,
        )
        if part and self.rank_info is not None:
            saved.world_size = self.rank_info.world_size
        self._emit(checkpoint=saved).result(self.ledger.ack_timeout_s)
        self._heartbeats.made_progress(step)

    @contextlib.contextmanager
    def checkpoint_write(
        self, step: int, *, path: str | os.PathLike[str] | None = None, mode: str = "wb"
    ) -> Iterator[Any]:
        """Writes a checkpoint of any format atomically and records it (no torch needed)."""
        self._check_active()
        target = self._checkpoint_path(step, path)
        began = time.monotonic_ns()
        with (
            self._clock.paused(),
            atomic.atomic_write(
                target,
                mode=mode,
                on_commit=lambda info: self._record_checkpoint(step, info, began),
            ) as f,
        ):
            yield f

    def save_checkpoint(
        self, step: int, *, path: str | os.PathLike[str] | None = None, **states: Any
    ) -> atomic.CommitInfo:
        """Saves model/optimizer/scheduler/extra and every RNG with torch; records the checkpoint."""
        from shard_client import checkpoint

        self._check_active()
        began = time.monotonic_ns()
        with self._clock.paused():
            return checkpoint.save_checkpoint(
                self._checkpoint_path(step, path),
                step=step,
                on_commit=lambda info: self._record_checkpoint(step, info, began),
                **states,
            )

    def load_latest_checkpoint(self, **kwargs: Any) -> checkpoint.LoadedCheckpoint | None:
        """Restores the newest checkpoint the ledger recorded for this run and shard; None: fresh.

        Only a ``checkpoint_saved`` of this run and shard counts, and its file is
        re-hashed (BLAKE3) before loading: another run's checkpoint in the same
        directory is ignored, a file replaced after its commit is skipped for an
        older recorded one, and with the ledger unreachable the shard starts
        fresh. Each decision is logged (see shard_client.checkpoint_records).
        """
        from shard_client import checkpoint_records

        self._check_active()
        client, namespace = self.ledger.client, self.ledger.namespace
        with self._clock.paused():
            loaded = checkpoint_records.load_recorded_checkpoint(
                lambda: checkpoint_records.whole_files(
                    checkpoint_records.recorded_checkpoints(
                        client, namespace=namespace, run_id=self.run_id, shard_id=self.shard_id
                    )
                ),
                directory=self._checkpoint_dir(),
                label=f"run={self.run_id} shard={self.shard_id}",
                **kwargs,
            )
        if loaded is not None:
            self._heartbeats.step = max(self._heartbeats.step, loaded.step)
        return loaded

    # --- sharded checkpoints (one part per rank) --------------------------------

    def _part_rank(self) -> int:
        if self.rank_info is None:
            raise RuntimeError("a checkpoint part belongs to a rank: this shard has one process")
        return self.rank_info.rank

    def save_checkpoint_part(
        self, step: int, *, path: str | os.PathLike[str] | None = None, **states: Any
    ) -> atomic.CommitInfo:
        """Saves this rank's part of the step's sharded checkpoint (torch) and records it.

        The step's checkpoint exists for the ledger, and for a resume, only once every
        rank of the attempt recorded its part; call it on every rank.
        """
        from shard_client import checkpoint

        self._check_active()
        rank = self._part_rank()
        target = path or self._checkpoint_path(step, None).replace(".pt", f".rank{rank}.pt")
        began = time.monotonic_ns()
        with self._clock.paused():
            return checkpoint.save_checkpoint(
                target,
                step=step,
                on_commit=lambda info: self._record_checkpoint(step, info, began, part=True),
                **states,
            )

    def load_latest_checkpoint_part(self, **kwargs: Any) -> checkpoint.LoadedCheckpoint | None:
        """Restores this rank's part of the newest sharded checkpoint whose parts were all recorded.

        None: no complete one (start fresh; every rank sees the same records). The
        part is re-hashed before loading; a part gone or changed since its commit
        raises rather than falling back, since the other ranks resume from that step.
        """
        from shard_client import checkpoint, checkpoint_records

        self._check_active()
        rank = self._part_rank()
        client, namespace = self.ledger.client, self.ledger.namespace
        with self._clock.paused():
            recorded = checkpoint_records.recorded_checkpoints(
                client, namespace=namespace, run_id=self.run_id, shard_id=self.shard_id
            )
            parts = checkpoint_records.complete_parts(recorded, rank)
            if not parts:
                log.info(
                    "checkpoint_fresh_start shard=%s rank=%d: no complete one", self.shard_id, rank
                )
                return None
            newest = parts[0]
            loaded = checkpoint.load_checkpoint(
                newest.path, expected_blake3=newest.blake3_hex, **kwargs
            )
        log.info(
            "checkpoint_part_resumed shard=%s rank=%d step=%d", self.shard_id, rank, loaded.step
        )
        self._heartbeats.step = max(self._heartbeats.step, loaded.step)
        return loaded
