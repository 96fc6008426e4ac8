"""Spool directories: where they live, how their records reach the ledger, and their leftovers.

Layout: ``$SHARDLEDGER_SPOOL_DIR`` (else ``~/.cache/shardledger/spool/<target>``)
holds one directory per process, ``<host>-<pid>-<random>``, because a spool has
exactly one writer. Each holds the :class:`Spool` files, ``target`` (the ledger
its events belong to) and, if the ledger refused any, ``rejected.jsonl``. The
directory of a process that died while the ledger was away is drained by
:func:`drain_spool_dirs` (``shardledger spool drain``).
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import logging
import os
import re
import secrets
import shutil
import socket
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import grpc

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.atomic import fsync_directory, makedirs_durable
from shard_client.client import LedgerClient, default_target
from shard_client.delivery import MAX_BATCH_BYTES, MAX_BATCH_EVENTS, Result, deliver
from shard_client.errors import (
    LedgerClientError,
    LedgerRejected,
    LedgerUnavailable,
    PermissionDenied,
)
from shard_client.spool import DAMAGED_SUFFIX, Spool, SpoolLockedError

__all__ = [
    "ENV_SPOOL_DIR",
    "DrainResult",
    "SpoolStatus",
    "default_spool_root",
    "drain_spool",
    "drain_spool_dirs",
    "find_spool_dirs",
    "remove_finished_spool",
    "spool_base",
    "spool_status",
]

ENV_SPOOL_DIR: Final = "SHARDLEDGER_SPOOL_DIR"
REJECTED_FILE: Final = "rejected.jsonl"
TARGET_FILE: Final = "target"
_SPOOL_FILES: Final = ("lock", "acked", REJECTED_FILE)
log = logging.getLogger("shard_client")


@dataclass(frozen=True, slots=True)
class DrainResult:
    """What draining one spool directory did: drained, locked, unavailable, denied or damaged."""

    directory: str
    sent: int
    rejected: int
    remaining: int
    status: str
    error: str = ""  # why a spool is damaged, or why the ledger denied our credentials


@dataclass(frozen=True, slots=True)
class SpoolStatus:
    """One spool directory as `shardledger spool status` shows it."""

    directory: str
    target: str
    pending: int
    size_bytes: int
    oldest: str  # client time of the oldest pending event, ISO 8601; "" if unknown
    rejected: int
    owner_pid: str  # pid of the live process that owns it; "" when nobody does
    error: str = ""  # why the spool cannot be opened (damaged); pending is then -1


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "default"


def spool_base() -> str:
    """Returns $SHARDLEDGER_SPOOL_DIR, or ~/.cache/shardledger/spool, where every spool lives."""
    explicit = os.environ.get(ENV_SPOOL_DIR)
    if explicit:
        return os.path.abspath(explicit)
    return os.path.join(os.path.expanduser("~"), ".cache", "shardledger", "spool")


def default_spool_root(target: str | None = None) -> str:
    """Returns $SHARDLEDGER_SPOOL_DIR, or ~/.cache/shardledger/spool/<target> (no pid in it)."""
    if os.environ.get(ENV_SPOOL_DIR):
        return spool_base()
    return os.path.join(spool_base(), _slug(target or default_target()))


def process_spool_dir(root: str) -> str:
    """Returns a fresh directory name for this process's spool (not created yet)."""
    name = f"{_slug(socket.gethostname())}-{os.getpid()}-{secrets.token_hex(3)}"
    return os.path.join(root, name)


def open_process_spool(directory: str, *, target: str) -> Spool:
    """Creates a process's spool directory, records its target, and opens the spool."""
    spool = Spool(directory)
    with open(os.path.join(directory, TARGET_FILE), "w", encoding="utf-8") as f:
        f.write(target + "\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_directory(directory)  # `spool drain` finds the target after a power cut too
    return spool


def record_rejection(directory: str, event: pb.ShardEvent | bytes, exc: LedgerRejected) -> None:
    """Logs a refused event and appends it, fsynced, to the directory's rejected.jsonl."""
    raw = event if isinstance(event, bytes) else event.SerializeToString()
    about: dict[str, str] = {}
    if not isinstance(event, bytes):
        about = {"event_id": event.event_id, "run_id": event.run_id, "shard_id": event.shard_id}
        about["kind"] = event.WhichOneof("payload") or ""
    line = {
        "time": dt.datetime.now(dt.UTC).isoformat(),
        "reason": exc.reason,
        "code": exc.code.name,
        "message": str(exc),
        **about,
        "event_b64": base64.b64encode(raw).decode(),
    }
    log.warning("event_rejected reason=%s event=%s directory=%s", exc.reason, about, directory)
    makedirs_durable(directory)
    path = os.path.join(directory, REJECTED_FILE)
    created = not os.path.exists(path)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    if created:
        fsync_directory(directory)


def _decode(record: bytes) -> pb.ShardEvent | None:
    try:
        return pb.ShardEvent.FromString(record)
    except Exception:  # a record we cannot parse is set aside, never retried forever
        return None


def _head(records: list[bytes]) -> list[bytes]:
    size = 0
    for count, record in enumerate(records):
        size += len(record)
        if size > MAX_BATCH_BYTES and count:
            return records[:count]
    return records


def drain_spool(
    spool: Spool,
    client: LedgerClient,
    *,
    directory: str,
    gate: threading.Lock | None = None,
    on_result: Callable[[str, Result], None] | None = None,
    max_batches: int | None = None,
    retry: bool = False,
) -> tuple[int, int, LedgerClientError | None]:
    """Sends a spool's records in order and acks them; returns (sent, rejected, why it stopped).

    ``gate`` is held around each append RPC only; the Spool serializes its own readers
    and writers, so a writer spilling to it meanwhile never waits for the network.
    """
    sent = rejected = batches = 0
    while max_batches is None or batches < max_batches:
        batches += 1
        records = _head(spool.pending(limit=MAX_BATCH_EVENTS))
        if not records:
            break
        decoded = [_decode(r) for r in records]
        bad = next((i for i, e in enumerate(decoded) if e is None), len(decoded))
        events = [e for e in decoded[:bad] if e is not None]
        results, stop = deliver(client, events, gate=gate, retry=retry)
        for event, result in zip(events, results, strict=False):
            if isinstance(result, LedgerRejected):
                rejected += 1
                record_rejection(directory, event, result)
            else:
                sent += 1
            if on_result is not None:
                on_result(event.event_id, result)
        count = len(results)
        if stop is None and bad < len(decoded):
            error = LedgerRejected(
                "undecodable spool record",
                code=grpc.StatusCode.DATA_LOSS,
                reason="UNDECODABLE",
                metadata={},
            )
            record_rejection(directory, records[bad], error)
            rejected, count = rejected + 1, count + 1
        spool.ack(count)
        if stop is not None:
            return sent, rejected, stop
    return sent, rejected, None


def find_spool_dirs(root: str) -> list[str]:
    """Returns the spool directories at or up to two levels below root, sorted."""
    found: list[str] = []

    def visit(path: str, depth: int) -> None:
        try:
            names = os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return
        if any(n in _SPOOL_FILES or n.startswith("seg-") for n in names):
            found.append(path)
        elif depth < 2:
            for name in names:
                visit(os.path.join(path, name), depth + 1)

    visit(os.path.abspath(root), 0)
    return sorted(found)


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def _count_lines(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def spool_status(directory: str) -> SpoolStatus:
    """Describes one spool directory; one that a live process owns is described from its files."""
    target = _read_text(os.path.join(directory, TARGET_FILE))
    rejected = _count_lines(os.path.join(directory, REJECTED_FILE))
    try:
        spool = Spool(directory)
    except SpoolLockedError as exc:
        size = sum(
            os.path.getsize(os.path.join(directory, n))
            for n in os.listdir(directory)
            if n.startswith("seg-")
        )
        return SpoolStatus(directory, target, -1, size, "", rejected, exc.holder or "?")
    except (ValueError, OSError) as exc:  # one damaged spool must not hide the others
        return SpoolStatus(directory, target, -1, 0, "", rejected, "", _damage(exc))
    with spool:
        head = spool.pending(limit=1)
        event = _decode(head[0]) if head else None
        oldest = ""
        if event is not None and event.HasField("client_time"):
            oldest = event.client_time.ToDatetime(dt.UTC).isoformat()
        return SpoolStatus(
            directory, target, spool.pending_count(), spool.size_bytes(), oldest, rejected, ""
        )


def drain_spool_dirs(
    root: str | None = None,
    *,
    target: str | None = None,
    exclude: Sequence[str] = (),
    client_factory: Callable[[str], LedgerClient] = LedgerClient,
    connect_timeout_s: float | None = 5.0,
    only_target: str | None = None,
    gate: threading.Lock | None = None,
    retry: bool = True,
) -> list[DrainResult]:
    """Sends the spools of dead processes to their ledger; spools a live process owns are skipped.

    Each spool goes to ``target`` when given, else to the one its process
    recorded; ``client_factory(target)`` makes the clients (credentials come
    from the environment by default), and a ledger that does not answer within
    ``connect_timeout_s`` counts as unreachable (None: the first append tells).
    A spool emptied without refusals is removed. A ledger that cannot be reached
    leaves its spools in place, reported with status "unavailable".

    ``only_target`` skips every spool that did not record exactly that target,
    including one whose process has not written it yet (a spool being opened);
    ``gate`` and ``retry`` are passed to `drain_spool` (the background drain of a
    job's sender uses them).
    """
    results: list[DrainResult] = []
    clients: dict[str, LedgerClient] = {}
    unreachable: set[str] = set()
    denied: dict[str, str] = {}  # target -> why it refused our credentials
    for directory in find_spool_dirs(root or default_spool_root(target)):
        recorded = _read_text(os.path.join(directory, TARGET_FILE))
        dest = target or recorded or default_target()
        if directory in exclude or (only_target is not None and recorded != only_target):
            continue
        if dest in denied:
            results.append(DrainResult(directory, 0, 0, -1, "denied", denied[dest]))
            continue
        if dest in unreachable:
            results.append(DrainResult(directory, 0, 0, -1, "unavailable"))
            continue
        try:
            spool = Spool(directory)
        except SpoolLockedError:
            results.append(DrainResult(directory, 0, 0, -1, "locked"))
            continue
        except (ValueError, OSError) as exc:  # one damaged spool must not stop the others
            log.error("spool_damaged directory=%s error=%s", directory, _damage(exc))
            results.append(DrainResult(directory, 0, 0, -1, "damaged", _damage(exc)))
            continue
        _DRAINING.add(spool)
        with spool:
            if dest not in clients:
                clients[dest] = client_factory(dest)
            client = clients[dest]
            stop: LedgerClientError | None
            try:
                if connect_timeout_s is not None:
                    client.wait_ready(connect_timeout_s)
            except LedgerUnavailable as exc:
                sent, rejected, stop = 0, 0, exc
            else:
                sent, rejected, stop = drain_spool(
                    spool, client, directory=directory, gate=gate, retry=retry
                )
            remaining = spool.pending_count()
        _DRAINING.discard(spool)
        if stop is not None:
            unreachable.add(dest)
            log.warning(
                "spool_drain_stopped directory=%s target=%s error=%s", directory, dest, stop
            )
        if stop is None:
            results.append(DrainResult(directory, sent, rejected, remaining, "drained"))
            remove_finished_spool(directory)
        elif isinstance(stop, PermissionDenied):
            # Credentials, not the network: say so; the events stay spooled for a later drain.
            denied[dest] = str(stop)
            results.append(DrainResult(directory, sent, rejected, remaining, "denied", str(stop)))
        else:
            results.append(DrainResult(directory, sent, rejected, remaining, "unavailable"))
    return results


def _damage(exc: BaseException) -> str:
    """Returns a one-line reason a spool directory cannot be opened."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename or ''}".rstrip(": ")
    return str(exc) or type(exc).__name__


# Spools a drain holds open; a forked child closes its copies of their descriptors, or
# its copy of the flock would keep the directory locked for as long as the child lives.
_DRAINING: weakref.WeakSet[Spool] = weakref.WeakSet()


def _forget_draining_in_child() -> None:
    for spool in list(_DRAINING):
        spool.forget_inherited()
    _DRAINING.clear()


os.register_at_fork(after_in_child=_forget_draining_in_child)


def remove_finished_spool(directory: str) -> bool:
    """Removes a drained spool directory unless it holds evidence; returns whether it did.

    Evidence is ``rejected.jsonl`` (events the ledger refused) or a damaged segment's
    copy: both are for an operator to read, so the directory stays.
    """
    names = os.listdir(directory)
    if REJECTED_FILE in names or any(DAMAGED_SUFFIX in name for name in names):
        return False
    try:
        shutil.rmtree(directory)
    except OSError as exc:  # e.g. another process writes a file into it meanwhile
        log.warning("spool_not_removed directory=%s error=%s", directory, exc)
        return False
    return True
