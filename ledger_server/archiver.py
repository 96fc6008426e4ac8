"""Archive a settled run (bundle out, verified, then tombstone in) and restore it; read it back.

The order is what makes a crash safe at every step: nothing is removed from the
hot store until the bundle at its location has been read back and checked whole,
and the switch is one short transaction that writes the tombstone. A process killed
before that commit leaves the run hot (a bundle without a tombstone is only an
orphan, overwritten by the next archive); killed after it, the run is archived:
every read answers from the tombstone and the bundle, whatever rows are still there.
Those rows are dead and are purged a chunk at a time, each chunk its own
transaction, so an append waits for one chunk at most, never for the whole run; a
purge cut short is finished by the next archive, restore or retention step
(finish_purges). ``SHARDLEDGER_ARCHIVE_FAILPOINT=<step>`` kills the process at a
step (the fault tests); STEPS lists them.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, Final

from ledger_server import archive as ar
from ledger_server.archive_read import Expected, archived_rows, read_rows, tombstone_of
from ledger_server.errors import ArchiveBroken, RunNotFound
from ledger_server.rebuild import gc_paused, take_projections
from ledger_server.replay import RunReplay
from ledger_server.service import report_at, run_labels, summary_at
from ledger_server.signing import SigningKey
from ledger_server.store.base import (
    ArchiveConflict,
    ReadView,
    RunRow,
    Store,
    StoredEvent,
    Tombstone,
)

FAILPOINT_ENV: Final = "SHARDLEDGER_ARCHIVE_FAILPOINT"
STEPS: Final = (
    "before_upload",
    "uploaded_events",
    "uploaded_head",
    "after_upload",
    "after_verify",
    "mid_transaction",
    "after_commit",
    "mid_purge",
)
# Dead rows deleted per transaction once the tombstone stands. A row costs ~20 us on
# SQLite (its delete trigger and three indexes), so a writer waits ~10 ms at most.
PURGE_CHUNK: Final = 500


def failpoint(step: str) -> None:
    """Kills this process (SIGKILL, no cleanup) when the failpoint names this step."""
    if os.environ.get(FAILPOINT_ENV) == step:
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What archive or restore did with one run."""

    namespace: str
    run_id: str
    # archived, would_archive, restored, refused (nothing could be done), failed (the
    # location or the read-back failed; nothing was removed)
    action: str
    events: int = 0
    size_bytes: int = 0
    location: str = ""
    digest: str = ""
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        """Returns the outcome as a JSON-ready mapping."""
        return asdict(self)

    @property
    def ok(self) -> bool:
        """True when the run is where it was asked to go (or would be, for a dry run)."""
        return self.action in ("archived", "would_archive", "restored")


def _get_run(view: ReadView, namespace: str, run_id: str) -> RunRow:
    run = view.get_run(namespace, run_id)
    if run is None:
        raise RunNotFound(f"run {run_id} in namespace {namespace} does not exist")
    return run


def archive_run(
    store: Store,
    key: SigningKey,
    namespace: str,
    run_id: str,
    base_url: str,
    *,
    now_us: int,
    dry_run: bool = False,
    step: Callable[[str], None] = failpoint,
    paced: bool = False,
    purge_chunk: int = PURGE_CHUNK,
    stop: threading.Event | None = None,
) -> Outcome:
    """Archives one settled run under base_url; refuses (nothing changed) what it must not move.

    paced and stop: how the dead rows are purged (purge()).
    """
    prepared = prepare(
        store, key, namespace, run_id, base_url, now_us=now_us, dry_run=dry_run, step=step
    )
    if isinstance(prepared, Outcome):
        return prepared
    return commit(
        store,
        namespace,
        run_id,
        prepared,
        step=step,
        paced=paced,
        purge_chunk=purge_chunk,
        stop=stop,
    )


def prepare(
    store: Store,
    key: SigningKey,
    namespace: str,
    run_id: str,
    base_url: str,
    *,
    now_us: int,
    dry_run: bool = False,
    step: Callable[[str], None] = failpoint,
) -> Outcome | Tombstone:
    """Writes, uploads and reads back the run's bundle; returns its tombstone, or why not.

    Reads the store only: the server's retention runs it in a child process on a
    read-only store (prepare_in_child), so the bundle's CPU never holds the GIL its
    appends need; commit() then runs in the server.
    """
    view = store.read()
    try:
        run = _get_run(view, namespace, run_id)
    except RunNotFound as exc:
        return Outcome(namespace, run_id, "refused", reason=str(exc))
    refused = _refusal(view, run, now_us)
    if refused:
        return Outcome(namespace, run_id, "refused", events=run.event_count, reason=refused)
    figures = {
        "summary": summary_at(view, run, now_us),
        "report": report_at(view, run, now_us),
        "labels": run_labels(view, run),
    }
    location = ar.bundle_location(base_url, namespace, run_id)
    with ar.staging_directory() as directory:
        try:
            bundle = ar.stage_bundle(
                view.iter_events(run.run_pk), run, key, directory, now_us=now_us, figures=figures
            )
        except ArchiveBroken as exc:
            return Outcome(namespace, run_id, "refused", events=run.event_count, reason=str(exc))
        except OSError as exc:  # the staging directory is full or unwritable
            reason = f"cannot stage the bundle in {directory}: {exc}; the run stays hot"
            return Outcome(namespace, run_id, "failed", run.event_count, reason=reason)
        if dry_run:
            return Outcome(
                namespace, run_id, "would_archive", bundle.events, bundle.size_bytes, location.url
            )
        failed = _upload_and_check(bundle, location, step)
        if failed:
            return Outcome(
                namespace, run_id, "failed", bundle.events, location=location.url, reason=failed
            )
    return Tombstone(
        run_pk=run.run_pk,
        location=location.url,
        digest=bundle.digest,
        event_count=bundle.events,
        head_hash=bundle.head_hash,
        first_sequence=bundle.first_sequence,
        last_sequence=bundle.last_sequence,
        size_bytes=bundle.size_bytes,
        tree_head=json.dumps(bundle.head.to_json(), sort_keys=True),
        summary=json.dumps(figures["summary"], sort_keys=True),
        report=json.dumps(figures["report"], sort_keys=True),
        labels=json.dumps(figures["labels"], sort_keys=True),
        archived_us=now_us,
    )


def commit(
    store: Store,
    namespace: str,
    run_id: str,
    tombstone: Tombstone,
    *,
    step: Callable[[str], None] = failpoint,
    paced: bool = False,
    purge_chunk: int = PURGE_CHUNK,
    stop: threading.Event | None = None,
) -> Outcome:
    """Puts the checked bundle's tombstone in place of the run, then purges its dead rows."""
    try:
        store.archive_run(tombstone, before_commit=lambda: step("mid_transaction"))
    except ArchiveConflict as exc:
        return Outcome(
            namespace, run_id, "refused", tombstone.event_count, reason=f"{exc}; nothing removed"
        )
    step("after_commit")
    purge(store, tombstone.run_pk, paced=paced, chunk=purge_chunk, step=step, stop=stop)
    return Outcome(
        namespace,
        run_id,
        "archived",
        tombstone.event_count,
        tombstone.size_bytes,
        tombstone.location,
        tombstone.digest,
    )


def purge(
    store: Store,
    run_pk: int,
    *,
    paced: bool = False,
    chunk: int = PURGE_CHUNK,
    step: Callable[[str], None] = failpoint,
    stop: threading.Event | None = None,
) -> int:
    """Deletes an archived run's dead rows a chunk at a time; returns how many went.

    paced (the server, beside its appends): after each chunk it rests as long as the
    chunk took. A lock is not fair: released and retaken at once, it would seldom
    pass to the writer waiting on it; resting hands it over, so the writer holds the
    store at least half the time a purge runs. stop, once set, ends it between two
    chunks (a server shutting down): what is left is finished later, like a crash's.
    """
    stop = stop or threading.Event()
    total = 0
    while not stop.is_set():
        started = time.monotonic()
        deleted = store.purge_archived(run_pk, limit=chunk)
        if not deleted:
            break
        total += deleted
        step("mid_purge")
        if paced:
            stop.wait(time.monotonic() - started)
    return total


def finish_purges(store: Store, *, paced: bool = False, stop: threading.Event | None = None) -> int:
    """Finishes the purges a crash (or a stop) cut short; returns the rows deleted."""
    pending = store.read().archived_with_rows()
    return sum(purge(store, run_pk, paced=paced, stop=stop) for run_pk in pending)


def prepare_in_child(
    database: str, key_path: str, namespace: str, run_id: str, base_url: str, now_us: int
) -> Outcome | Tombstone:
    """prepare() on the database opened read-only: what a child process of the server runs."""
    from pathlib import Path

    from ledger_server.store import open_store

    key = SigningKey.from_pem(Path(key_path).read_bytes())
    store = open_store(database, read_only=True)
    try:
        return prepare(store, key, namespace, run_id, base_url, now_us=now_us)
    finally:
        store.close()


def _refusal(view: ReadView, run: RunRow, now_us: int) -> str:
    """Returns why the run must stay hot ("" when it may move)."""
    if run.archived:
        tombstone = view.get_tombstone(run.run_pk)
        where = tombstone.location if tombstone else "?"
        return f"run {run.run_id} is archived already (at {where})"
    life = summary_at(view, run, now_us)["lifecycle"]
    if not life["settled"]:
        waiting = ", ".join(f"{n} {k}" for k, n in life["waiting_on"].items() if n)
        why = (
            "its submission is not closed"
            if not life["submission_closed"]
            else f"waiting on {waiting}"
        )
        return (
            f"run {run.run_id} is {life['state']}, not settled ({why}): only a settled run is"
            " archived; nothing removed"
        )
    return ""


def _upload_and_check(bundle: ar.Bundle, location: ar.Location, step: Callable[[str], None]) -> str:
    """Uploads the bundle and reads it back whole; returns what failed ("" when it checks)."""
    step("before_upload")
    try:
        ar.upload(bundle, location, step)
    except ar.ArchiveUnwritable as exc:
        return f"{exc}; the run stays hot"
    step("after_upload")
    expected = Expected(bundle.digest, bundle.head.to_json(), bundle.events, bundle.head_hash)
    try:
        count = sum(1 for _ in read_rows(location, expected))
    except ArchiveBroken as exc:
        return f"the archive read back does not check: {exc}; the run stays hot"
    if count != bundle.events:
        return f"the archive read back holds {count} events, not {bundle.events}; the run stays hot"
    step("after_verify")
    return ""


# --- reading and restoring -------------------------------------------------------


def restore_run(
    store: Store, namespace: str, run_id: str, *, from_url: str | None = None
) -> Outcome:
    """Brings an archived run back hot from its bundle, rows byte for byte; the bundle stays."""
    view = store.read()
    try:
        run = _get_run(view, namespace, run_id)
    except RunNotFound as exc:
        return Outcome(namespace, run_id, "refused", reason=str(exc))
    if not run.archived:
        return Outcome(namespace, run_id, "refused", reason=f"run {run_id} is not archived")
    tombstone = tombstone_of(view, run)
    location = (
        ar.bundle_location(from_url, namespace, run_id).url if from_url else tombstone.location
    )
    replay = RunReplay()

    def rows() -> Iterator[StoredEvent]:
        for row in archived_rows(tombstone, location=location):
            replay.feed_row(row.sequence, row.row, row.row_hash)
            yield row

    try:
        with gc_paused():
            store.restore_run(tombstone, rows(), lambda: take_projections(replay))
    except (ArchiveBroken, ArchiveConflict) as exc:
        return Outcome(
            namespace, run_id, "failed", location=location, reason=f"{exc}; the run stays archived"
        )
    return Outcome(
        namespace,
        run_id,
        "restored",
        tombstone.event_count,
        tombstone.size_bytes,
        location,
        tombstone.digest,
    )
