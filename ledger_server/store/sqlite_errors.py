"""SQLite's errors as StoreErrors of a kind (full, read-only, damaged, a failed fsync), with the fix."""

from __future__ import annotations

import os
import sqlite3
from typing import Final

from ledger_server.store.base import (
    DuplicateEventError,
    ImmutableRowError,
    StoreCorrupt,
    StoreError,
    StoreFull,
    StoreIOError,
    StoreReadOnly,
    StoreSyncFailed,
)

__all__ = ["translate"]


def translate(exc: sqlite3.Error, path: str | None = None) -> StoreError:
    """Returns the StoreError for a driver error, its kind from SQLite's result code."""
    # Driver errors are translated at this one edge; callers see StoreError only.
    if "append-only" in str(exc):
        return ImmutableRowError(str(exc))
    if isinstance(exc, sqlite3.IntegrityError) and "events.event_id" in str(exc):
        return DuplicateEventError(str(exc))
    code = getattr(exc, "sqlite_errorcode", None)
    where = path or "the ledger file"
    name = getattr(exc, "sqlite_errorname", None) or type(exc).__name__
    if code in _SYNC_CODES:
        return StoreSyncFailed(
            f"SQLite: {exc} ({name}): a write to {where} may not have reached the disk;"
            " the server stopped writing so nothing is acknowledged on top of it:"
            " check the disk (dmesg), then restart the server"
        )
    primary = (code or 0) & 0xFF
    if (
        primary == 10 and path is not None
    ):  # IOERR: the file system may say what it is (EROFS or ENOSPC under it)
        primary = _file_system_fault(path) or primary
    kind = _KINDS.get(primary)
    if kind is not None:
        cls, advice = kind
        return cls(f"SQLite: {exc} ({name}) on {where}; {advice}")
    return StoreError(f"{type(exc).__name__}: {exc}")


# Primary result codes that name a storage fault, with what the operator does about it.
_KINDS: Final[dict[int, tuple[type[StoreError], str]]] = {
    13: (StoreFull, "free space on its file system; writes resume by themselves"),  # FULL
    10: (StoreIOError, "check the disk (dmesg) and file size limits (ulimit -f)"),  # IOERR
    8: (  # READONLY
        StoreReadOnly,
        "the server needs write access to the file, its -wal and -shm files and their"
        " directory (check mode, owner and a read-only mount), then appends resume",
    ),
    3: (StoreReadOnly, "the server's user may not access the file: fix its owner or mode"),  # PERM
    11: (StoreCorrupt, "restore it from a backup (docs/operations.md)"),  # CORRUPT
    26: (StoreCorrupt, "the file is not a SQLite database: restore it from a backup"),  # NOTADB
}


def _file_system_fault(path: str) -> int | None:
    """Returns READONLY or FULL when the file system of path is read-only or full, else None."""
    try:
        fs = os.statvfs(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return None
    if fs.f_flag & os.ST_RDONLY:  # e.g. ext4's errors=remount-ro after a disk error
        return 8
    if fs.f_bavail == 0:
        return 13
    return None


# SQLITE_IOERR_FSYNC and SQLITE_IOERR_DIR_FSYNC.
_SYNC_CODES: Final = frozenset({10 | (4 << 8), 10 | (5 << 8)})
