"""The store interface: rows and transactions, nothing about protobuf or the domain."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Final, NamedTuple, Protocol

# How often the server's probe retries a store that failed (store_health.StoreProbe), and so
# the delay a refused caller is told to wait before resending (google.rpc.RetryInfo).
PROBE_RETRY_S: Final = 0.25


class StoreError(Exception):
    """A backend failure (I/O, corruption, lost connection); never a domain error.

    ``reason`` is the ErrorInfo reason a caller sees; ``permanent`` says whether waiting
    can help: a transient fault (a full disk, a database restarting) answers UNAVAILABLE
    and clears by itself, a permanent one (a read-only file) answers FAILED_PRECONDITION
    until an operator acts, so clients stop retrying and keep their events.
    """

    reason: str = "STORE_UNAVAILABLE"
    permanent: bool = False
    # How long a client should wait before resending (sent as google.rpc.RetryInfo), if known.
    retry_after_s: float | None = None


class StoreFull(StoreError):
    """The disk (or a file size limit) is full; writes succeed again once space is freed."""

    reason = "STORE_FULL"


class StoreIOError(StoreError):
    """A read or write failed at the operating system (EIO, a file size limit)."""

    reason = "STORE_IO_ERROR"


class StoreReadOnly(StoreError):
    """The ledger's file, directory or file system refuses writes (mode, owner, a ro mount)."""

    reason = "STORE_READ_ONLY"
    permanent = True


class StoreCorrupt(StoreError):
    """The database file is damaged or is not a database."""

    reason = "STORE_CORRUPT"
    permanent = True


class StoreSyncFailed(StoreError):
    """An fsync failed: the store stops writing until a restart recovers from what is on disk.

    After a failed fsync the kernel may have dropped the dirty pages and cleared the
    error, so a retried fsync "succeeds" without the data (PostgreSQL's "fsyncgate",
    2018; it now PANICs instead). Nothing more is acknowledged on top of such a file.
    """

    reason = "STORE_SYNC_FAILED"
    permanent = True


class StoreUnreachable(StoreError):
    """No writable database can be reached; calls are refused at once until a probe reaches one.

    Raised without touching the connection pool while the store's background probe
    fails, so a call never waits out its deadline for a database that is not there.
    """

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StoreCommitWaitExceeded(StoreUnreachable):
    """A COMMIT waited past --pg-commit-wait-bound (for its synchronous standby) and was cancelled.

    Its outcome is unknown: it may be committed on the primary only. It is never
    acknowledged; the caller resends with the same event ids (store/pg_commit.py).
    """


class ConcurrentWriteError(StoreError):
    """Another writer (a replica) won a race; the transaction was rolled back and may be retried."""


class DuplicateEventError(ConcurrentWriteError):
    """An inserted event id is already stored: the writer skipped the lookup and must redo it."""


class ImmutableRowError(StoreError):
    """An UPDATE or DELETE on the events table was refused by the database."""


class WriterBusy(StoreError):
    """Another process is the writer of this single-writer store (a SQLite file)."""


@dataclass(frozen=True, slots=True)
class RunRow:
    """One run's chain head."""

    run_pk: int
    namespace: str
    run_id: str
    event_count: int
    head_hash: bytes
    created_us: int
    updated_us: int
    # True once the run's events moved to an archive and a tombstone stands in for them.
    archived: bool = False


@dataclass(frozen=True, slots=True)
class Tombstone:
    """What stays hot of an archived run: where its events went, and the proofs to check them.

    The run's head row and summary counters stay in their tables; its events, shard rows
    and heartbeat rows leave in the one transaction that writes this row.
    """

    run_pk: int
    location: str  # the bundle's directory URL
    digest: str  # blake3 of the bundle's manifest.json, hex
    event_count: int
    head_hash: bytes
    first_sequence: int
    last_sequence: int
    size_bytes: int  # the bundle's size
    tree_head: str  # the signed tree head, JSON
    summary: str  # the run summary at archive time, JSON
    report: str  # the run report at archive time, JSON
    labels: str  # the run's labels, JSON
    archived_us: int


class ArchiveConflict(StoreError):
    """The run moved (or was archived or restored) since the archive read it; nothing changed."""

    reason = "ARCHIVE_CONFLICT"


def require_archived_head(head: Sequence[Any] | None, tombstone: Tombstone) -> None:
    """Raises ArchiveConflict unless a run's head row (event count, head hash) is the tombstone's."""
    if head is None or (int(head[0]), bytes(head[1])) != (
        tombstone.event_count,
        tombstone.head_hash,
    ):
        raise ArchiveConflict(
            "the run moved since its archive was written (its head is not the archived one)"
        )


class StoredEvent(NamedTuple):
    """One stored event row (a tuple: replays build millions of them)."""

    sequence: int
    run_pk: int
    run_sequence: int
    event_id: str
    row: bytes
    row_hash: bytes


class OpenRow(NamedTuple):
    """A running shard's open attempt, as the field figures read it (the shard_open table).

    One narrow row per running shard: a heartbeat moves its deadline and last-seen
    time, and a scrape or a report finds the stale ones by a range on the deadline
    and sums them in SQL, instead of parsing every running shard's record.
    """

    deadline_us: int | None
    seen_us: int  # the attempt's last event (a heartbeat's receive time, server clock)
    started_us: int
    gpus: int
    gpus_known: bool
    saved_us: int  # its last whole checkpoint, else its start: what a hang loses is since then
    first_pass: bool
    labels: str  # canonical JSON: the plan's labels under the attempt's own
    shard_labels: str  # canonical JSON: the plan's labels under the shard's first attempt's


class StaleOpen(NamedTuple):
    """The stale open attempts of a run that share labels and pass, summed (one SQL group)."""

    first_pass: bool
    labels: str
    shard_labels: str
    attempts: int
    gpu_us: int  # the sum of gpus x (seen_us - started_us), each at least 0
    gpus_unknown: int
    hang_lost_us: int  # the sum of deadline_us - saved_us, each at least 0


@dataclass(frozen=True, slots=True)
class ShardRow:
    """One shard's projection row."""

    shard_id: str
    plan_index: int
    state: str
    detail: str
    deadline_us: int | None
    plan_line: str
    record: bytes | None
    # Liveness of the latest attempt written by heartbeats without re-encoding the record
    # (None when the record is current); merge with projections.record_from_row.
    beat_us: int | None = None
    beat_step: int | None = None
    # Its open attempt while it runs (written beside the row; reads of rows leave it None).
    open: OpenRow | None = None


@dataclass(frozen=True, slots=True)
class StoredShard:
    """A shard's stored projection record and the heartbeat columns written after it."""

    record: bytes
    beat_us: int | None
    beat_step: int | None


@dataclass(frozen=True, slots=True)
class TokenRow:
    """One access token; the secret is stored only as a hash."""

    token_id: str
    namespace: str
    role: str
    run_prefix: str
    secret_hash: str
    description: str
    created_us: int
    expires_us: int | None
    revoked_us: int | None


class WriteTx(Protocol):
    """Operations inside the one write transaction of a group commit."""

    def savepoint(self) -> AbstractContextManager[None]:
        """Returns a context that rolls back its writes if it exits with an exception."""

    def flush(self) -> None:
        """Sends the buffered writes now; a long transaction calls it to bound its memory."""

    def get_run(self, namespace: str, run_id: str) -> RunRow | None:
        """Returns the run's head, or None."""

    def create_run(self, namespace: str, run_id: str, *, now_us: int, genesis: bytes) -> RunRow:
        """Creates an empty run and returns its head."""

    def find_events(self, event_ids: Sequence[str]) -> dict[str, StoredEvent]:
        """Returns the stored events with these ids."""

    def load_shards(self, run_pk: int, shard_ids: Sequence[str]) -> dict[str, StoredShard]:
        """Returns the stored projection records of these shards."""

    def insert_event(
        self, *, run_pk: int, run_sequence: int, event_id: str, row: bytes, row_hash: bytes
    ) -> int:
        """Inserts one event row and returns its global sequence."""

    def save_shard(self, run_pk: int, shard: ShardRow) -> None:
        """Inserts or replaces one shard's projection row (its heartbeat columns cleared).

        Its open attempt row is written from ``shard.open``, or deleted when that is None.
        """

    def touch_shard(
        self, *, run_pk: int, shard_id: str, deadline_us: int | None, beat_us: int, beat_step: int
    ) -> None:
        """Moves an existing shard's deadline and heartbeat columns; the record stays as it is.

        Its open attempt row, when it has one, moves to the same deadline and last-seen time.
        """

    def add_counters(self, run_pk: int, deltas: Mapping[str, int]) -> None:
        """Adds the deltas to the run's summary counters."""

    def counter(self, run_pk: int, key: str) -> int:
        """Returns one of the run's summary counters as this transaction sees it (0 if none)."""

    def clear_projections(self, run_pk: int) -> None:
        """Deletes the run's shard, heartbeat and open attempt rows and counters (a rebuild rewrites them)."""

    def update_run(self, run_pk: int, *, event_count: int, head_hash: bytes, now_us: int) -> None:
        """Moves the run's chain head."""


class ReadView(Protocol):
    """Read-only queries on a snapshot-consistent connection of the calling thread."""

    def get_run(self, namespace: str, run_id: str) -> RunRow | None:
        """Returns the run's head, or None."""

    def list_runs(self, namespace: str | None, limit: int) -> list[RunRow]:
        """Returns runs, most recently updated first (all namespaces when None)."""

    def list_events(self, run_pk: int, *, after_sequence: int, limit: int) -> list[StoredEvent]:
        """Returns up to limit events of the run with sequence > after_sequence."""

    def iter_events(
        self, run_pk: int, *, until_sequence: int | None = None
    ) -> Iterator[StoredEvent]:
        """Yields every event of the run in order, up to and including until_sequence."""

    def counters(self, run_pk: int) -> dict[str, int]:
        """Returns the run's summary counters."""

    def count_stale(self, run_pk: int, now_us: int) -> int:
        """Returns how many running shards passed their deadline before now_us."""

    def stale_open(self, run_pk: int, now_us: int) -> list[StaleOpen]:
        """Returns the open attempts past their deadline at now_us, summed by labels and pass."""

    def oldest_open_seen(self, run_pk: int) -> int | None:
        """Returns the earliest last-seen time among the run's running shards (None: none)."""

    def open_rows(self, run_pk: int) -> dict[str, OpenRow]:
        """Returns every open attempt row of the run by shard id (a rebuild compares them)."""

    def iter_shards(
        self,
        run_pk: int,
        *,
        states: Sequence[str] | None = None,
        after_index: tuple[int, str] | None = None,
    ) -> Iterator[ShardRow]:
        """Yields shard rows in plan order, optionally only some base states."""

    def iter_resume(self, run_pk: int, now_us: int) -> Iterator[tuple[str, int, str, str]]:
        """Yields (shard_id, plan_index, plan_line, reason) of the resume list in plan order.

        Plain tuples, the reason computed in the query (store.resume_sql.resume_reason_sql)
        as of now_us, for lists of a million lines.
        """

    def max_sequence(self) -> int:
        """Returns the highest sequence ever stored (archived runs' included; 0 when empty)."""

    def get_tombstone(self, run_pk: int) -> Tombstone | None:
        """Returns the archived run's tombstone, or None while the run is hot."""

    def archived_with_rows(self) -> list[int]:
        """Returns the archived runs (run_pk) whose dead rows are not all purged yet."""


class Store(Protocol):
    """A durable event store."""

    # True when this process is the store's only writer, so the writer may keep shard
    # records in memory between transactions (SQLite); False for shared databases.
    exclusive_writer: bool

    def claim_writer(self) -> None:
        """Makes this process the store's writer; WriterBusy if another process is.

        A single-writer store (SQLite) holds the claim until close() or the process
        ends (a crash included); write() claims on first use. Shared stores
        (PostgreSQL) have many writers and claim nothing.
        """

    def write(self) -> AbstractContextManager[WriteTx]:
        """Opens the write transaction; it commits durably when the context exits cleanly."""

    def read(self) -> ReadView:
        """Returns the calling thread's read view."""

    def integrity_check(self) -> str:
        """Returns the backend's own integrity verdict ("ok" when healthy)."""

    def create_token(self, token: TokenRow) -> None:
        """Stores a new token (its secret only as a hash)."""

    def get_token(self, token_id: str) -> TokenRow | None:
        """Returns the token with this id, or None."""

    def list_tokens(self) -> list[TokenRow]:
        """Returns every token, oldest first."""

    def revoke_token(self, token_id: str, *, now_us: int) -> bool:
        """Marks a token revoked; returns False when there is no such live token."""

    def probe(self) -> StoreError | None:
        """Checks cheaply that a write could commit now; returns the fault, or None.

        Called by the server's background probe (store_health.StoreProbe), never on the
        hot path; it must return within a few seconds and never raise.
        """

    def on_fault(self, wake: Callable[[], None]) -> None:
        """Calls wake whenever a call meets a fault the next probe should look at at once."""

    def archive_run(self, tombstone: Tombstone, *, before_commit: Callable[[], None]) -> None:
        """Writes the run's tombstone, in one short transaction.

        From its commit the run is archived for every read and write (answered from the
        tombstone and the bundle) and its events, shard and heartbeat rows are dead:
        purge_archived deletes them. Raises ArchiveConflict (nothing changed) unless the
        run's head still has the tombstone's event count and head hash and no tombstone
        yet. before_commit runs inside the transaction (a test's failpoint).
        """

    def purge_archived(self, run_pk: int, *, limit: int) -> int:
        """Deletes up to limit dead rows of an archived run, in one transaction; returns how many.

        0 once none is left; a run without a tombstone loses nothing. Each call is its
        own short transaction, so a writer waits for one chunk at most.
        """

    def restore_run(
        self,
        tombstone: Tombstone,
        events: Iterable[StoredEvent],
        projections: Callable[[], tuple[Collection[ShardRow], dict[str, int]]],
    ) -> None:
        """Writes the archived rows back verbatim (their sequences kept), rebuilds the
        projections and drops the tombstone, in one transaction.

        ``projections`` is called once ``events`` is exhausted. Raises ArchiveConflict
        unless the run still has this tombstone.
        """

    def close(self) -> None:
        """Closes every connection."""
