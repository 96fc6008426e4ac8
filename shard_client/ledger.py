"""The job's handle on a ledger: one `Ledger` per process, one ``with ledger.shard(...)`` per attempt."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Unpack

from shard_client.ack import Ack
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from shard_client.labels import label_problem
from shard_client.options import ShardOptionKwargs, ShardOptions
from shard_client.sender import Policy, Sender
from shard_client.shard import Shard

__all__ = ["Ledger"]


class Ledger:
    """The job's handle on a ledger: one per process (module level), shared by every shard.

    ``target`` defaults to $SHARDLEDGER_SERVER; pass ``client=`` for TLS or a
    token. ``spool_dir`` is the root under which each process keeps its own
    spool (default $SHARDLEDGER_SPOOL_DIR or ~/.cache/shardledger/spool/<target>);
    ``policy`` says what happens while the ledger is unreachable (see
    shard_client.sender). Waits for commits are bounded by ``ack_timeout_s``
    (None: as long as the policy takes); the end of a shard waits at most
    ``flush_timeout_s`` until its remaining events are acknowledged or spooled.

    ``close()`` (and interpreter exit) waits at most ``exit_wait_s`` (None:
    $SHARDLEDGER_EXIT_WAIT, else 10 s) for the ledger to acknowledge every event,
    spooled ones included; what is left is logged with its spool directory and
    drains later (docs/spools.md). With ``drain_orphans`` (the default) the
    sender also sends, in the background, the spools that dead processes left
    under the same spool root.
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        namespace: str = "",
        spool_dir: str | None = None,
        policy: Policy = "spool",
        client: LedgerClient | None = None,
        unavailable_after_s: float = 5.0,
        ack_timeout_s: float | None = None,
        flush_timeout_s: float = 30.0,
        exit_wait_s: float | None = None,
        drain_orphans: bool = True,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        problem = label_problem(labels or {})
        if problem:
            raise ValueError(f"labels: {problem}")
        # Every attempt's labels (provider, pool, region, image): over $SHARDLEDGER_LABEL_*,
        # under a shard's own labels=.
        self.labels = dict(labels or {})
        self.client = client or LedgerClient(target)
        self.namespace = namespace
        self.ack_timeout_s = ack_timeout_s
        self.flush_timeout_s = flush_timeout_s
        self.sender = Sender(
            self.client,
            spool_root=spool_dir,
            policy=policy,
            unavailable_after_s=unavailable_after_s,
            exit_wait_s=exit_wait_s,
            drain_orphans=drain_orphans,
        )

    def shard(
        self,
        run_id: str,
        shard_id: str,
        *,
        attempt_id: str | None = None,
        **options: Unpack[ShardOptionKwargs],
    ) -> Shard:
        """Returns a context manager for one attempt at a planned shard.

        Options (keyword only; defaults and types in `shard_client.options.ShardOptions`):

        - ``heartbeat_timeout=60.0``: seconds without a heartbeat before the
          ledger calls the attempt stale (at most 7 days);
        - ``heartbeat_interval=None``: seconds between background heartbeats
          (None: a quarter of ``heartbeat_timeout``);
        - ``expected_outputs=None``: the artifact names a clean exit must have
          committed (None: at least one); the server judges completeness by the
          plan anyway;
        - ``output_dir=None``: created on entry, and loses temp files of killed
          writers older than ``orphan_age_s``;
        - ``checkpoint_dir=None``: where checkpoints go (None:
          ``output_dir/checkpoints``); its stale temp files are removed too;
        - ``orphan_age_s=300.0``: how old a temp file must be to count as orphaned;
        - ``sigterm_grace=30.0``: seconds between SIGTERM and Preempted
          (None leaves SIGTERM alone);
        - ``fingerprint=True``: record the environment fingerprint (False: none;
          or pass a Fingerprint to record);
        - ``progress_timeout=None``: the background thread heartbeats while the
          process lives; with this it stops once no ``progress()``, checkpoint or
          commit came for that long, so a job hung with its process alive (a
          deadlock, a stuck collective) goes stale on the ledger; beats resume
          with progress;
        - ``watchdog=True``: the in-job hang watchdog (see shard_client.watchdog;
          $SHARDLEDGER_WATCHDOG=off turns it off): once ``progress()`` has been
          called twice, no progress for 10 × the median step time + ``hang_grace``
          (the clock paused while a checkpoint or commit is written) writes a
          diagnostics bundle under $SHARDLEDGER_DIAG_DIR, records failed(timeout)
          with it, sends SIGTERM and, ``kill_grace`` later, SIGKILL;
        - ``hang_timeout=None``: a fixed quiet time that counts as hung instead,
          watched with or without ``progress()`` calls ($SHARDLEDGER_HANG_TIMEOUT);
        - ``hang_grace=None``: the fixed part of the threshold (None:
          $SHARDLEDGER_HANG_GRACE, else 300 s);
        - ``kill_grace=None``: seconds from the watchdog's SIGTERM to its SIGKILL
          (None: $SHARDLEDGER_KILL_GRACE, else 30 s);
        - ``log_file=None``: the job's log, whose last 200 lines go into the
          diagnostics bundle (None: $SHARDLEDGER_LOG_FILE, else none);
        - ``labels=None``: labels of this attempt (provider, pool, region, image, ...),
          over the Ledger's ``labels=`` and $SHARDLEDGER_LABEL_<KEY> (docs/metrics.md).
        - ``ranks=True``: under torchrun (``$WORLD_SIZE`` > 1) every rank of the launch
          joins one attempt, whose id is derived from the launch
          (``$TORCHELASTIC_RUN_ID``, ``$TORCHELASTIC_RESTART_COUNT``); pass a
          `shard_client.RankInfo` to say it yourself, or False when each process runs
          a shard of its own (see docs/multirank.md). ``expected_outputs`` may then
          name per-rank outputs as ``weights.rank{rank}``: each rank must commit its
          own, rank 0 the names without ``{rank}``.
        - ``coalesce_progress=True``: ``progress()`` calls reach the ledger as at
          most one heartbeat per ``heartbeat_interval`` with the latest values and
          the interval's extremes (see shard_client.progress); False sends every call.
        - ``input=None``: the input the job reads, checked on entry against the plan
          (docs/concepts.md, "Input identity"): a path or URL, or better the shard's
          plan line as `resume` hands it back, which carries the plan's identity of
          it. A changed input records failed(input_changed) and raises
          `shard_client.InputChanged` before the block runs;
        - ``input_check='identity'``: compare the cheap identity (size, mtime, inode,
          device; an object's version id and ETag) and re-hash only when it differs
          from a known plan; ``'hash'`` re-hashes always.

        ``attempt_id`` defaults to a fresh random id (a multi-rank launch: the launch's).
        """
        return Shard(
            self,
            run_id,
            shard_id,
            options=ShardOptions.given(**options),
            attempt_id=attempt_id,
        )

    def emit(self, event: pb.ShardEvent) -> Ack:
        """Queues a raw event (namespace filled in) for the background sender."""
        if not event.namespace:
            event.namespace = self.namespace
        return self.sender.emit(event)

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every emitted event is acknowledged, spooled or refused."""
        return self.sender.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Waits up to ``timeout`` (default ``exit_wait_s``) for acknowledgements, then stops the sender."""
        self.sender.close(timeout)

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
