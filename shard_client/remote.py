"""Commits to object storage: stage locally while hashing, upload conditionally, read back, then commit.

The recipe, and why each step is there:

1. The job writes into a staged temp file (``TEMP_PREFIX`` name in the staging
   directory) and every byte feeds BLAKE3, as for a local atomic write. The
   staged file is not fsynced: the object store, not the node, is its durable
   home, and a node that loses power loses the attempt anyway.
2. The upload is conditional (``If-None-Match: *``, on ``PutObject`` and on
   ``CompleteMultipartUpload``): two attempts racing to one key cannot both
   win, and the loser is told (:class:`~shard_client.storage.ObjectExists`).
   Big files go up as a multipart upload, which is invisible until completed: a
   writer killed mid-upload leaves nothing at the key.
3. The object is read back before anything is recorded: ``HeadObject`` must
   report the uploaded size, ETag and version id; for files under
   ``digest_under_bytes`` (or always, when asked) the bytes are re-read and
   their BLAKE3 compared. A store that still serves stale or partial bytes is
   asked again with backoff; after ``attempts`` reads the commit fails with
   :class:`NotConfirmed` and the staged file is kept for a retry that does not
   recompute (``shard.commit(url, source=err.staged_path)``).
4. Only then is ``on_commit`` called with a :class:`~shard_client.atomic.CommitInfo`
   carrying the URL, size, digest, version id, ETag and what was read back.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

from shard_client import atomic
from shard_client.storage import ObjectExists, ObjectInfo, ObjectStore, Uploaded, store_for

__all__ = ["NotConfirmed", "UploadPolicy", "commit_object", "remote_write", "upload_and_confirm"]

READ_BACK_SIZE_ETAG: Final = "size_etag"
READ_BACK_DIGEST: Final = "digest"


@dataclass(frozen=True, slots=True)
class UploadPolicy:
    """How an object-storage commit uploads and reads back (the defaults suit S3)."""

    # Files smaller than this are re-read in full and their digest compared.
    digest_under_bytes: int = 64 * 1024 * 1024
    # Read-backs before giving up, and the backoff between them (doubling, capped).
    attempts: int = 6
    first_delay_s: float = 0.2
    max_delay_s: float = 5.0
    part_size: int = 16 * 1024 * 1024
    # Where staged files live; None: the system temp directory.
    staging_dir: str | None = None


class NotConfirmed(RuntimeError):
    """An upload could not be confirmed by reading it back; nothing was committed.

    ``staged_path`` is the local file with the bytes (kept, so a retry need not
    recompute them); ``found`` is what the store served at the last read-back.
    """

    def __init__(self, url: str, message: str, *, staged_path: str) -> None:
        super().__init__(
            f"{url}: {message}; nothing was committed (staged bytes kept at {staged_path})"
        )
        self.url = url
        self.staged_path = staged_path


Sleep = Callable[[float], None]


def _mismatch(found: ObjectInfo | None, sent: Uploaded) -> str:
    """Returns why the read-back does not show the upload, or "" when it does."""
    if found is None:
        return "the read-back found no object"
    if found.size_bytes != sent.size_bytes:
        return f"the read-back found {found.size_bytes} bytes, {sent.size_bytes} were uploaded"
    if sent.etag and found.etag != sent.etag:
        return f"the read-back found ETag {found.etag}, the upload returned {sent.etag}"
    if sent.version_id and found.version_id != sent.version_id:
        return f"the read-back found version {found.version_id}, the upload made {sent.version_id}"
    return ""


def confirm(
    store: ObjectStore,
    sent: Uploaded,
    *,
    blake3_hex: str,
    full_digest: bool,
    policy: UploadPolicy,
    staged_path: str,
    sleep: Sleep = time.sleep,
) -> str:
    """Reads the object back until it shows the upload; returns what was read back."""
    delay, why = policy.first_delay_s, ""
    for attempt in range(max(1, policy.attempts)):
        if attempt:
            sleep(delay)
            delay = min(delay * 2, policy.max_delay_s)
        try:
            why = _mismatch(store.info(sent.url), sent)
            if why:
                continue
            if not full_digest:
                return READ_BACK_SIZE_ETAG
            size, digest = store.digest(sent.url)
        except FileNotFoundError:
            why = "the read-back found no object"
            continue
        except OSError as exc:  # a store that blinked is asked again, like a stale one
            why = f"the read-back failed: {exc}"
            continue
        if (size, digest) == (sent.size_bytes, blake3_hex):
            return READ_BACK_DIGEST
        why = (
            f"the read-back served {size} bytes with blake3 {digest}, not the {blake3_hex} uploaded"
        )
    raise NotConfirmed(
        sent.url,
        f"not confirmed after {policy.attempts} read-backs: {why}",
        staged_path=staged_path,
    )


def upload_and_confirm(
    source: str,
    url: str,
    *,
    size_bytes: int,
    blake3_hex: str,
    read_back_digest: bool | None = None,
    policy: UploadPolicy | None = None,
    store: ObjectStore | None = None,
    sleep: Sleep = time.sleep,
) -> atomic.CommitInfo:
    """Uploads a local file conditionally and reads it back; returns the commit record.

    A conditional write refused because an object is already there counts as this
    upload only when the object holds exactly these bytes (a retry of an upload
    whose answer was lost); otherwise :class:`ObjectExists` propagates.
    """
    policy = policy or UploadPolicy()
    store = store or store_for(url)
    full = (
        read_back_digest if read_back_digest is not None else size_bytes < policy.digest_under_bytes
    )
    try:
        sent = store.upload(source, url, if_absent=True, part_size=policy.part_size)
    except Exception:
        # A refused conditional write, or an upload whose answer was lost (a retried
        # CompleteMultipartUpload that had landed): the object at the key is this
        # upload only if it holds exactly these bytes, which a full read decides.
        there = _identical(store, url, size_bytes=size_bytes, blake3_hex=blake3_hex)
        if there is None:
            raise
        sent, full = Uploaded(url, size_bytes, there.etag, there.version_id, True), True
    how = confirm(
        store,
        sent,
        blake3_hex=blake3_hex,
        full_digest=full,
        policy=policy,
        staged_path=source,
        sleep=sleep,
    )
    return atomic.CommitInfo(
        path=url,
        size_bytes=size_bytes,
        blake3_hex=blake3_hex,
        version_id=sent.version_id,
        etag=sent.etag,
        read_back=how,
    )


def _identical(
    store: ObjectStore, url: str, *, size_bytes: int, blake3_hex: str
) -> ObjectInfo | None:
    """Returns the object at url when it holds exactly these bytes, else None."""
    try:
        there = store.info(url)
        if there is None or there.size_bytes != size_bytes:
            return None
        same = store.digest(url, version_id=there.version_id) == (size_bytes, blake3_hex)
    except Exception:  # the store is still failing: the upload's own error is raised instead
        return None
    return there if same else None


def commit_object(url: str, *, store: ObjectStore | None = None) -> atomic.CommitInfo:
    """Returns the commit record of an object the job uploaded itself: its bytes re-read in full."""
    store = store or store_for(url)
    before = store.info(url)
    if before is None:
        raise FileNotFoundError(f"{url}: no such object; nothing was committed")
    size, digest = store.digest(url, version_id=before.version_id)
    if size != before.size_bytes:
        raise NotConfirmed(
            url, f"read {size} bytes, the store reported {before.size_bytes}", staged_path=""
        )
    return atomic.CommitInfo(
        path=url,
        size_bytes=size,
        blake3_hex=digest,
        version_id=before.version_id,
        etag=before.etag,
        read_back=READ_BACK_DIGEST,
    )


@contextlib.contextmanager
def remote_write(
    url: str,
    *,
    mode: str = "wb",
    on_commit: Callable[[atomic.CommitInfo], None] | None = None,
    read_back_digest: bool | None = None,
    policy: UploadPolicy | None = None,
) -> Iterator[Any]:
    """Yields a file whose bytes, on clean exit, are uploaded to ``url``, read back and committed."""
    if mode not in ("wb", "w", "wt"):
        raise ValueError(f"atomic_write supports modes 'wb' and 'w', not {mode!r}")
    policy = policy or UploadPolicy()
    store = store_for(url)
    store.check_url(url)
    directory = policy.staging_dir or tempfile.gettempdir()
    fd, staged = tempfile.mkstemp(prefix=atomic._temp_prefix_for(url), dir=directory)
    sink = atomic._HashingSink(fd)
    binary = atomic.AtomicFile(sink)
    handle: Any = binary if mode == "wb" else atomic.AtomicTextFile(binary)
    keep = False
    try:
        yield handle
        handle.close()
        size, digest = sink.digest()
        os.close(fd)
        fd = -1
        try:
            info = upload_and_confirm(
                staged,
                url,
                size_bytes=size,
                blake3_hex=digest,
                read_back_digest=read_back_digest,
                policy=policy,
                store=store,
            )
        except ObjectExists:
            raise  # another attempt's bytes hold the key: these are of no further use
        except NotConfirmed:
            keep = True  # a retry uploads these bytes again without recomputing them
            raise
        except Exception as exc:
            keep = True
            raise NotConfirmed(url, f"the upload failed: {exc}", staged_path=staged) from exc
        binary._commit_info = info
        if on_commit is not None:
            on_commit(info)
    finally:
        with contextlib.suppress(Exception):
            sink.close()
            handle.close()
        if fd >= 0:
            os.close(fd)
        if not keep:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staged)
