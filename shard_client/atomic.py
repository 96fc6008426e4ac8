# Over 400 lines on purpose: tests/helpers/atomic_kill_writer.py loads this file alone, by path, 100+ times a run.
"""Crash-safe file commits: write to a temp file, fsync, rename, fsync the directory.

The recipe, and why each step is there:

1. The temp file is created exclusively (``O_EXCL`` via :func:`tempfile.mkstemp`)
   *beside* the target, because ``os.replace`` is atomic only within one
   filesystem.
2. Every byte written also feeds a BLAKE3 hasher, so the digest describes exactly
   the bytes handed to the kernel and the file is never read back.
3. ``fsync(file)`` before the rename, so the new name never points at data that
   is still only in the page cache.
4. ``os.replace`` swaps the name atomically: readers see the old file or the new
   one, never a mix.
5. ``fsync(directory)`` makes the rename itself durable; only then is the commit
   reported to ``on_commit``.

A process killed at any point therefore leaves either the previous file (or no
file) plus an orphaned ``TEMP_PREFIX`` file, which :func:`cleanup_orphans`
removes, or the complete new file.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

import blake3

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

__all__ = [
    "FAILPOINTS",
    "TEMP_PREFIX",
    "AtomicFile",
    "AtomicTextFile",
    "CommitInfo",
    "Failpoint",
    "OnCommit",
    "atomic_replace",
    "atomic_write",
    "cleanup_orphans",
    "commit_file",
    "fsync_directory",
    "hash_fd",
    "hash_file",
    "makedirs_durable",
    "reserve_temp_path",
]

TEMP_PREFIX = ".shardledger-tmp-"

# Below this size a plain read loop beats setting up a mapping and worker threads.
MMAP_HASH_THRESHOLD = 8 * 1024 * 1024
_READ_CHUNK = 1024 * 1024
_WRITE_BUFFER = 1024 * 1024
# Writes at least this large hash on a second thread while the kernel copies them.
_OVERLAP_BYTES = 256 * 1024
# Immutable chunks that may still be hashing while later ones are written.
_MAX_HASH_LAG = 8
# Leaves room for the prefix and mkstemp's random part within NAME_MAX (255).
_MAX_STEM_IN_TEMP_NAME = 100
FAILPOINTS = ("after_write", "after_fsync", "after_rename", "after_dir_fsync")


@dataclass(frozen=True, slots=True)
class CommitInfo:
    """Describes a durably committed file: absolute path (or URL), size and BLAKE3 digest.

    For an object in object storage (see shard_client.remote) it also carries the
    store's version id and ETag and what was read back before the commit.
    """

    path: str
    size_bytes: int
    blake3_hex: str
    version_id: str = ""
    etag: str = ""
    read_back: str = ""


OnCommit = Callable[[CommitInfo], None]
Failpoint = Callable[[str], None]


class _HashingSink(io.RawIOBase):
    """Writes to a borrowed file descriptor and hashes exactly the bytes written.

    Large chunks hash on a second thread while the kernel copies the same bytes
    (both release the GIL). A mutable buffer is hashed before its write returns,
    because the caller may refill it; an immutable ``bytes`` chunk may be hashed
    later, so the hash of a file's tail overlaps the next writes and the fsync.
    The hashing thread takes chunks in the order they were written.
    """

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd
        self._hasher = blake3.blake3()
        self._size = 0
        # Created on the first large write, per file: an executor never crosses a fork.
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[Future[object]] = deque()

    def writable(self) -> bool:
        """Returns True: the sink only writes."""
        return True

    def write(self, data: ReadableBuffer, /) -> int:
        """Writes what the kernel accepts and hashes that same prefix."""
        if self.closed:
            # The descriptor may already be closed and reused by another file.
            raise ValueError("write to a closed atomic file")
        view = memoryview(data).cast("B")
        if len(view) < _OVERLAP_BYTES:
            self.settle()
            written = os.write(self._fd, view)
            self._hasher.update(view[:written])
            self._size += written
            return written
        # The whole chunk is written before returning, so the digest covers exactly
        # the bytes in the file; if a write fails the atomic write fails and nothing
        # commits.
        self._hash_later(view)
        try:
            self._write_all(view)
        finally:
            self.settle()
        return len(view)

    def write_immutable(self, data: bytes | memoryview) -> int:
        """Writes a chunk nobody can change; its hash may finish after this returns."""
        if self.closed:
            raise ValueError("write to a closed atomic file")
        view = memoryview(data).cast("B")
        self._hash_later(view)
        self._write_all(view)
        # Bounds the chunks held for hashing when the disk outruns the hash.
        self.settle(keep=_MAX_HASH_LAG)
        return len(view)

    def _hash_later(self, view: memoryview) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atomic-hash")
        self._pending.append(self._pool.submit(self._hasher.update, view))

    def _write_all(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            done += os.write(self._fd, view[done:])
        self._size += done

    def settle(self, keep: int = 0) -> None:
        """Waits until at most ``keep`` chunks are still being hashed."""
        while len(self._pending) > keep:
            self._pending.popleft().result()

    def close(self) -> None:
        """Closes the sink; chunks still queued keep hashing until :meth:`digest`."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        super().close()

    def tell(self) -> int:
        """Returns the number of bytes written so far."""
        return self._size

    def digest(self) -> tuple[int, str]:
        """Returns the size and BLAKE3 hex digest of everything written."""
        self.settle()
        return self._size, self._hasher.hexdigest()


class AtomicFile(io.BufferedWriter):
    """Binary file object yielded by :func:`atomic_write`; not seekable.

    Seeking is refused because the digest is computed from the write stream; a
    writer that seeks back would make the digest disagree with the file.
    """

    def __init__(self, sink: _HashingSink) -> None:
        super().__init__(sink, buffer_size=_WRITE_BUFFER)
        self._sink = sink
        self._commit_info: CommitInfo | None = None

    def write(self, data: ReadableBuffer, /) -> int:
        """Writes ``data``; a large ``bytes`` chunk goes straight to the hashing sink."""
        # BufferedWriter hands the sink a view without its owner, so only here can we
        # tell that a chunk is immutable and need not be hashed before returning.
        if type(data) is memoryview:
            owner = data.obj
            size = data.nbytes
        else:
            owner, size = data, len(data) if type(data) is bytes else 0
        if type(owner) is bytes and size >= _OVERLAP_BYTES:
            self.flush()
            return self._sink.write_immutable(data)  # type: ignore[arg-type]
        return super().write(data)

    @property
    def commit_info(self) -> CommitInfo:
        """Returns the commit record; raises RuntimeError before a successful commit."""
        if self._commit_info is None:
            raise RuntimeError("atomic write has not committed")
        return self._commit_info


class AtomicTextFile(io.TextIOWrapper):
    """UTF-8 text file object yielded by :func:`atomic_write` in mode ``"w"``."""

    def __init__(self, binary: AtomicFile) -> None:
        super().__init__(binary, encoding="utf-8")
        self._binary = binary

    @property
    def commit_info(self) -> CommitInfo:
        """Returns the commit record; raises RuntimeError before a successful commit."""
        return self._binary.commit_info


def _no_failpoint(name: str) -> None:
    """Does nothing; the default failpoint."""


def _creation_mode() -> int:
    """Returns the permission bits a plain ``open()`` would give a new file."""
    # mkstemp creates 0600 files; committed artifacts should look like any other
    # file the job writes. /proc avoids os.umask(), which briefly changes the
    # umask for every thread in the process.
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass  # Not Linux, or /proc is not mounted: fall back to the common default.
    return 0o644


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Fsyncs a directory so that renames and unlinks inside it are durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durable(directory: str | os.PathLike[str]) -> None:
    """Creates a directory and any missing parents, each new entry fsynced into its parent.

    A file fsynced into a directory created a moment ago is lost with the directory
    itself after a power cut unless the directory's own entry was made durable too.
    """
    path = os.path.abspath(os.fspath(directory))
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for created in reversed(missing):
        try:
            os.mkdir(created)
        except FileExistsError:
            if not os.path.isdir(created):
                raise
        fsync_directory(os.path.dirname(created))


def hash_fd(fd: int) -> tuple[int, str]:
    """Returns the size and BLAKE3 hex digest of an open file, read from offset 0."""
    size = os.fstat(fd).st_size
    if size >= MMAP_HASH_THRESHOLD:
        # Same effect as blake3's update_mmap(path), but on the descriptor already
        # open, so the bytes hashed are the bytes of the inode we fsynced.
        hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mapped:
            hasher.update(mapped)
        return size, hasher.hexdigest()
    hasher = blake3.blake3()
    total = 0
    while chunk := os.pread(fd, _READ_CHUNK, total):
        hasher.update(chunk)
        total += len(chunk)
    return total, hasher.hexdigest()


def hash_file(path: str | os.PathLike[str]) -> tuple[int, str]:
    """Returns ``(size_bytes, blake3_hex)`` of a file's current contents."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return hash_fd(fd)
    finally:
        os.close(fd)


def _temp_prefix_for(final: str) -> str:
    """Returns the mkstemp prefix for a target: TEMP_PREFIX plus a readable stem.

    The stem is cut by encoded bytes (NAME_MAX counts bytes: 100 CJK characters are
    300), never inside a character.
    """
    stem = os.fsencode(os.path.basename(final))[:_MAX_STEM_IN_TEMP_NAME]
    return f"{TEMP_PREFIX}{stem.decode('utf-8', 'ignore') or 'file'}."


def reserve_temp_path(final_path: str | os.PathLike[str]) -> str:
    """Creates an empty, uniquely named temp file beside ``final_path`` and returns its path.

    Use it with libraries that insist on writing to a path themselves, then commit
    with :func:`atomic_replace`; the name carries ``TEMP_PREFIX`` so
    :func:`cleanup_orphans` reclaims it if the process dies first.
    """
    final = os.path.abspath(os.fspath(final_path))
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix_for(final), dir=os.path.dirname(final))
    os.close(fd)
    return tmp


@overload
def atomic_write(
    path: str | os.PathLike[str],
    *,
    mode: Literal["wb"] = "wb",
    on_commit: OnCommit | None = None,
    failpoint: Failpoint | None = None,
) -> AbstractContextManager[AtomicFile]: ...


@overload
def atomic_write(
    path: str | os.PathLike[str],
    *,
    mode: Literal["w", "wt"],
    on_commit: OnCommit | None = None,
    failpoint: Failpoint | None = None,
) -> AbstractContextManager[AtomicTextFile]: ...


@overload
def atomic_write(
    path: str | os.PathLike[str],
    *,
    mode: str,
    on_commit: OnCommit | None = None,
    failpoint: Failpoint | None = None,
) -> AbstractContextManager[AtomicFile | AtomicTextFile]: ...


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike[str],
    *,
    mode: str = "wb",
    on_commit: OnCommit | None = None,
    failpoint: Failpoint | None = None,
) -> Iterator[Any]:  # Any: the overloads above give each mode its precise type.
    """Yields a file object whose contents replace ``path`` atomically and durably on clean exit.

    After the block the yielded object's ``commit_info`` holds the
    :class:`CommitInfo`, which is also passed to ``on_commit``. If the block
    raises, or any fsync or the rename fails, the temp file is removed,
    ``on_commit`` is not called and the exception propagates. A failure after the
    rename (directory fsync) leaves the complete new file in place but still
    reports no commit, because its durability is unknown; the job should rewrite
    it. If ``on_commit`` itself raises, the file is committed and the exception
    propagates. ``failpoint(name)`` runs at "after_write", "after_fsync",
    "after_rename" and "after_dir_fsync" so tests can inject faults.
    """
    if mode not in ("wb", "w", "wt"):
        raise ValueError(f"atomic_write supports modes 'wb' and 'w', not {mode!r}")
    final = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(final)
    fire = failpoint or _no_failpoint
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix_for(final), dir=directory)
    sink = _HashingSink(fd)
    binary = AtomicFile(sink)
    handle: AtomicFile | AtomicTextFile = binary if mode == "wb" else AtomicTextFile(binary)
    renamed = False
    try:
        os.fchmod(fd, _creation_mode())
        yield handle
        # close() flushes every buffer layer into the descriptor, which we still own.
        handle.close()
        fire("after_write")
        os.fsync(fd)
        # The hash of the last chunks ran during the fsync; the rename waits for it.
        size, digest = sink.digest()
        fire("after_fsync")
        os.close(fd)
        fd = -1
        os.replace(tmp, final)
        renamed = True
        fire("after_rename")
        fsync_directory(directory)
        fire("after_dir_fsync")
    except BaseException:
        # Close the buffers first: a buffered flush after os.close(fd) could land in
        # whatever file reuses that descriptor number.
        with contextlib.suppress(Exception):
            sink.close()
            handle.close()
        if fd >= 0:
            os.close(fd)
        if not renamed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        raise
    binary._commit_info = CommitInfo(path=final, size_bytes=size, blake3_hex=digest)
    if on_commit is not None:
        on_commit(binary._commit_info)


def commit_file(path: str | os.PathLike[str], *, on_commit: OnCommit | None = None) -> CommitInfo:
    """Fsyncs an already written file and its directory, hashes it, and reports the commit.

    This makes an existing file durable but not atomic: a crash while the other
    library was writing ``path`` can leave a torn file under the final name. For
    atomicity, write to :func:`reserve_temp_path` and use :func:`atomic_replace`.
    """
    final = os.path.abspath(os.fspath(path))
    fd = os.open(final, os.O_RDONLY)
    try:
        os.fsync(fd)
        size, digest = hash_fd(fd)
    finally:
        os.close(fd)
    fsync_directory(os.path.dirname(final))
    info = CommitInfo(path=final, size_bytes=size, blake3_hex=digest)
    if on_commit is not None:
        on_commit(info)
    return info


def atomic_replace(
    tmp_path: str | os.PathLike[str],
    final_path: str | os.PathLike[str],
    *,
    on_commit: OnCommit | None = None,
) -> CommitInfo:
    """Fsyncs and hashes ``tmp_path``, renames it over ``final_path``, fsyncs, and reports the commit.

    Both paths must be on one filesystem (``os.replace`` raises ``OSError`` with
    EXDEV otherwise). On failure the temp file is left for the caller, who owns it.
    """
    tmp = os.path.abspath(os.fspath(tmp_path))
    final = os.path.abspath(os.fspath(final_path))
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
        size, digest = hash_fd(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    fsync_directory(os.path.dirname(final))
    if os.path.dirname(tmp) != os.path.dirname(final):
        # A cross-directory rename also changes the source directory.
        fsync_directory(os.path.dirname(tmp))
    info = CommitInfo(path=final, size_bytes=size, blake3_hex=digest)
    if on_commit is not None:
        on_commit(info)
    return info


def cleanup_orphans(directory: str | os.PathLike[str], *, older_than_s: float = 0.0) -> list[str]:
    """Removes ``TEMP_PREFIX`` files left by killed writers and returns their paths, sorted.

    A live writer in the same directory would lose its temp file (its commit then
    fails cleanly); pass ``older_than_s`` to spare files modified recently.
    """
    root = os.path.abspath(os.fspath(directory))
    removed: list[str] = []
    with os.scandir(root) as entries:
        for entry in entries:
            if not entry.name.startswith(TEMP_PREFIX) or not entry.is_file(follow_symlinks=False):
                continue
            if older_than_s > 0 and _age_s(entry) < older_than_s:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(entry.path)
    return sorted(removed)


def _age_s(entry: os.DirEntry[str]) -> float:
    """Returns seconds since the entry was last modified."""
    return time.time() - entry.stat(follow_symlinks=False).st_mtime
