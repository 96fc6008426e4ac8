"""A durable local spool that keeps events while the ledger server is unreachable.

Layout of a spool directory::

    lock                        flock held by the one writer; holds its pid for diagnostics
    acked                       decimal count of records drained, replaced atomically
    seg-<base:020d>.log         records numbered from <base>, appended in batches

Records are framed by `shard_client.spool_records` (length, flags, CRC, with an
end-of-batch flag): a crash mid-append loses the whole unfinished batch and
nothing else.
Reading stops at the first bad record of a segment and, on open, the last
segment is truncated there so that new batches follow intact data. A crash
leaves nothing intact after its unfinished batch (a warning says how many
bytes were trimmed); if intact records do follow the bad bytes, the segment
was damaged, not torn: it is copied whole to ``seg-<base>.log.damaged-<ns>``
first and an error is logged, and a directory holding such a copy is never
removed as drained.

Global record numbers come from segment names, never from counting across
files, so a damaged segment cannot shift the numbering of the ones after it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import threading
import time
from collections.abc import Sequence
from types import TracebackType

from shard_client.atomic import atomic_write, fsync_directory, makedirs_durable
from shard_client.spool_records import (
    MAX_RECORD_BYTES,
    decode_records,
    encode_batch,
    intact_record_after,
)

__all__ = [
    "DAMAGED_SUFFIX",
    "DEFAULT_SEGMENT_BYTES",
    "Spool",
    "SpoolLockedError",
]

log = logging.getLogger("shard_client")

DEFAULT_SEGMENT_BYTES = 16 * 1024 * 1024
_SEGMENT_NAME = re.compile(r"^seg-(\d{20})\.log$")
# A copy of a segment whose intact batches followed a corrupt record, kept for an operator.
DAMAGED_SUFFIX = ".damaged"
_ACKED = "acked"
_LOCK = "lock"


class SpoolLockedError(RuntimeError):
    """Raised when another open Spool (in any process) already owns the directory."""

    def __init__(self, *, directory: str, holder: str) -> None:
        super().__init__(f"spool {directory} is locked by another writer (pid {holder or '?'})")
        self.directory = directory
        self.holder = holder


class _Segment:
    """Bookkeeping for one segment file: first record number, intact records, bytes."""

    __slots__ = ("base", "count", "path", "size")

    def __init__(self, *, path: str, base: int, count: int, size: int) -> None:
        self.path = path
        self.base = base
        self.count = count
        self.size = size

    @property
    def end(self) -> int:
        """Returns the number one past this segment's last record."""
        return self.base + self.count


def _read(path: str) -> bytes:
    """Returns a file's bytes."""
    with open(path, "rb") as f:
        return f.read()


def _write_all(fd: int, data: bytes) -> None:
    """Writes every byte, looping over short writes."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Spool:
    """Durable FIFO of opaque records with explicit acknowledgement, one writer per directory.

    A second Spool on the same directory, in this process or another, fails at
    once with :class:`SpoolLockedError` instead of waiting: a job blocked
    forever behind a stuck sibling is harder to diagnose than an error. One
    instance may be shared between threads.
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, max_segment_bytes: int = DEFAULT_SEGMENT_BYTES
    ) -> None:
        self._dir = os.path.abspath(os.fspath(directory))
        self._max_segment_bytes = max_segment_bytes
        self._mutex = threading.Lock()
        self._fd: int | None = None  # append descriptor of the last segment
        self._sealed = False  # the last segment takes no more appends
        self._closed = False
        makedirs_durable(self._dir)
        self._lock_fd = self._acquire_lock()
        try:
            self._acked = self._read_acked()
            self._segments = self._recover()
            self._next = max([self._acked] + [s.end for s in self._segments[-1:]])
            self._compact()
        except BaseException:
            self._release_lock()
            raise

    def __enter__(self) -> Spool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __len__(self) -> int:
        return self.pending_count()

    def close(self) -> None:
        """Closes the segment and releases the directory lock; idempotent."""
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            self._close_fd()
            self._release_lock()

    def forget_inherited(self) -> None:
        """In a forked child: closes the descriptors inherited from the parent's open spool.

        The parent's flock stays held (it belongs to the parent's descriptor); without
        this the child's copy would keep the directory locked after the parent exits.
        The mutex is not taken: another thread of the parent may have held it at fork.
        A spool the parent had closed holds no descriptors (its numbers may be reused).
        Between fork() and this hook the child's copies exist, so a parent that closes
        its spool in that instant still sees the directory locked until the child runs.
        """
        if self._closed:
            return
        for fd in (self._fd, self._lock_fd):
            if fd is not None:
                os.close(fd)
        self._fd = None
        self._closed = True

    def append(self, records: Sequence[bytes]) -> None:
        """Durably appends records as one batch (one fsync); all of it survives a crash, or none."""
        for record in records:
            if not isinstance(record, bytes | bytearray | memoryview):
                raise TypeError(f"spool records are bytes, not {type(record).__name__}")
            if len(record) > MAX_RECORD_BYTES:
                raise ValueError(f"record of {len(record)} bytes exceeds {MAX_RECORD_BYTES}")
        if not records:
            return
        frame = encode_batch([bytes(r) for r in records])
        with self._mutex:
            self._check_open()
            segment, fd = self._writable_segment(len(frame))
            try:
                _write_all(fd, frame)
                os.fsync(fd)
            except BaseException:
                self._abandon(segment)
                raise
            segment.size += len(frame)
            segment.count += len(records)
            self._next = segment.end

    def pending(self, *, limit: int | None = None) -> list[bytes]:
        """Returns unacknowledged records, oldest first (at most ``limit`` of them)."""
        with self._mutex:
            self._check_open()
            out: list[bytes] = []
            for segment in self._segments:
                if segment.end <= self._acked:
                    continue
                records, _ = decode_records(_read(segment.path))
                skip = max(0, self._acked - segment.base)
                out += records[skip : segment.count]
                if limit is not None and len(out) >= limit:
                    return out[:limit]
            return out

    def pending_count(self) -> int:
        """Returns how many records are not yet acknowledged."""
        with self._mutex:
            return self._pending_count()

    def size_bytes(self) -> int:
        """Returns the bytes the segment files occupy."""
        with self._mutex:
            return sum(segment.size for segment in self._segments)

    def ack(self, count: int) -> None:
        """Durably marks the first ``count`` pending records as drained, then drops spent segments."""
        with self._mutex:
            self._check_open()
            if not 0 <= count <= self._pending_count():
                raise ValueError(f"cannot ack {count} of {self._pending_count()} pending records")
            if count == 0:
                return
            acked = self._acked
            for segment in self._segments:
                available = max(0, segment.end - max(acked, segment.base))
                if count <= available:
                    acked = max(acked, segment.base) + count
                    break
                count -= available
            # The count is durable before any segment goes, so a crash in between
            # leaves spent segments that the next open removes, never lost records.
            with atomic_write(os.path.join(self._dir, _ACKED), mode="w") as f:
                f.write(f"{acked}\n")
            self._acked = acked
            self._compact()

    def _pending_count(self) -> int:
        """Returns the pending count; the caller holds the mutex."""
        return sum(max(0, s.end - max(self._acked, s.base)) for s in self._segments)

    def _check_open(self) -> None:
        """Raises ValueError once the spool is closed."""
        if self._closed:
            raise ValueError(f"spool {self._dir} is closed")

    def _acquire_lock(self) -> int:
        """Takes the directory's exclusive flock and records our pid in it."""
        # flock (not lockf) so that a second Spool in this same process conflicts too.
        fd = os.open(os.path.join(self._dir, _LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise SpoolLockedError(directory=self._dir, holder=holder) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _release_lock(self) -> None:
        """Drops the flock by closing its descriptor."""
        os.close(self._lock_fd)

    def _read_acked(self) -> int:
        """Returns the durable ack count, 0 for a new spool."""
        try:
            text = _read(os.path.join(self._dir, _ACKED))
        except FileNotFoundError:
            return 0
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"spool {self._dir}: unreadable ack file {text[:40]!r}") from None

    def _recover(self) -> list[_Segment]:
        """Scans segments, ending each where the next begins, and trims a torn tail off the last."""
        found = sorted(
            (int(match.group(1)), name)
            for name in os.listdir(self._dir)
            if (match := _SEGMENT_NAME.match(name))
        )
        segments: list[_Segment] = []
        for position, (base, name) in enumerate(found):
            path = os.path.join(self._dir, name)
            data = _read(path)
            records, intact_end = decode_records(data)
            count, size = len(records), len(data)
            if position + 1 < len(found):
                # Records past the next segment's base were abandoned by a failed append.
                count = min(count, found[position + 1][0] - base)
            elif intact_end < size:
                self._keep_damage(path, data, intact_end)
                self._truncate(path, intact_end)
                size = intact_end
            segments.append(_Segment(path=path, base=base, count=count, size=size))
        return segments

    def _keep_damage(self, path: str, data: bytes, intact_end: int) -> None:
        """Says what a trim cuts; keeps a copy when intact data follows the bad bytes."""
        later = intact_record_after(data, intact_end)
        if later is None:  # an append a crash interrupted: its batch never counted
            log.warning("spool_torn_tail_trimmed segment=%s bytes=%d", path, len(data) - intact_end)
            return
        copy = f"{path}{DAMAGED_SUFFIX}-{time.time_ns()}"
        with atomic_write(copy) as f:
            f.write(data)
        log.error(
            "spool_segment_damaged segment=%s offset=%d intact_record_at=%d copy=%s: the"
            " batches after the damage cannot be drained; the whole segment is kept in the copy",
            path,
            intact_end,
            later,
            copy,
        )

    def _truncate(self, path: str, length: int) -> None:
        """Cuts a torn tail off a segment, durably."""
        fd = os.open(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, length)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _writable_segment(self, incoming: int) -> tuple[_Segment, int]:
        """Returns the segment to append to and its descriptor, starting a new one when needed."""
        last = self._segments[-1] if self._segments else None
        if (
            last is None
            or self._sealed
            or last.end != self._next
            or (last.size > 0 and last.size + incoming > self._max_segment_bytes)
        ):
            return self._new_segment()
        if self._fd is None:
            self._fd = os.open(last.path, os.O_WRONLY | os.O_APPEND)
        return last, self._fd

    def _new_segment(self) -> tuple[_Segment, int]:
        """Creates the next segment file durably and makes it the append target."""
        self._close_fd()
        path = os.path.join(self._dir, f"seg-{self._next:020d}.log")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self._fd = fd
        # Without this, a crash could lose the new name even after its data was fsynced.
        fsync_directory(self._dir)
        segment = _Segment(path=path, base=self._next, count=0, size=0)
        self._segments.append(segment)
        self._sealed = False
        return segment, fd

    def _abandon(self, segment: _Segment) -> None:
        """Stops appending to a segment whose contents are unknown after a failed write or fsync."""
        # After a failed fsync the kernel may have dropped the dirty pages, so the
        # file no longer provably holds what we wrote. Trim back what we can and
        # append to a fresh segment from now on; if the trim fails, _recover ends
        # this segment where the fresh one begins.
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, segment.size)
        self._close_fd()
        self._sealed = True
        if segment.count == 0:
            # An empty segment would block the name the fresh one needs.
            try:
                os.unlink(segment.path)
            except OSError:
                return
            self._segments.remove(segment)

    def _close_fd(self) -> None:
        """Closes the append descriptor if one is open."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _compact(self) -> None:
        """Deletes segments whose records are all acknowledged."""
        while self._segments and self._segments[0].end <= self._acked:
            spent = self._segments.pop(0)
            if not self._segments:
                self._close_fd()
                self._sealed = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(spent.path)
