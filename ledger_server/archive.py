"""A settled run's events moved to object storage, and read back against their tombstone.

A run's bundle is a directory (a local path or an fsspec URL such as
``s3://bucket/prefix``) at ``<base>/<namespace>/<run_id>/`` holding

- ``events.jsonl``: the run in the export format (``shardledger-export-v1``; each
  event line also names its ledger ``sequence``), so `shardledger import` reads it
  and anyone can check it offline: rows re-encode to their hashed bytes, hashes
  chain, the rows' Merkle root is the signed root;
- ``head.json``: the run's signed tree head (the trailer's, on its own);
- ``manifest.json``: written last, so a bundle without it is no bundle: the run,
  its event count, first and last sequence, chain head, Merkle root, and the size
  and blake3 of every other file.

The tombstone (store.base.Tombstone) keeps the manifest's blake3 and the signed
head: every read of the archive is checked against them, so a tampered, truncated
or missing bundle is an error that names what differs, never a quiet answer.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote

import blake3

from ledger_server.chain import ChainWalker
from ledger_server.errors import ArchiveBroken
from ledger_server.merkle import MerkleTree
from ledger_server.signing import (
    SigningKey,
    TreeHead,
    public_key_id,
    sign_tree_head,
)
from ledger_server.store.base import RunRow, StoredEvent
from shard_client.canonical import legacy_json
from shard_client.storage import is_remote, local_path, store_for

EXPORT_FORMAT: Final = "shardledger-export-v1"
ARCHIVE_FORMAT: Final = "shardledger-archive-v1"
EVENTS_FILE: Final = "events.jsonl"
HEAD_FILE: Final = "head.json"
MANIFEST_FILE: Final = "manifest.json"
_READ_CHUNK: Final = 1 << 20


class ArchiveUnwritable(OSError):
    """The archive location refused or lost a write; the run stays hot."""


# --- where a bundle lives -------------------------------------------------------


class Location:
    """A bundle's directory: a local path or an fsspec URL, read and written whole files at a time."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.remote = is_remote(self.url)

    def child(self, *names: str) -> Location:
        """Returns the directory below this one (each name quoted: ids never make a path)."""
        return Location("/".join([self.url, *(quote(n, safe="") for n in names)]))

    def _path(self, name: str) -> str:
        return f"{self.url}/{name}" if self.remote else os.path.join(local_path(self.url), name)

    def put(self, name: str, source: str) -> None:
        """Writes a local file into the directory under name, replacing what is there."""
        target = self._path(name)
        try:
            if self.remote:
                store_for(target).upload(source, target, if_absent=False)
                return
            os.makedirs(os.path.dirname(target), exist_ok=True)
            # os.replace is atomic only within one filesystem: the copy goes beside the target.
            staged = f"{target}.tmp-{os.getpid()}"
            try:
                with open(source, "rb") as src, open(staged, "wb") as dst:
                    while chunk := src.read(_READ_CHUNK):
                        dst.write(chunk)
                    dst.flush()
                    os.fsync(dst.fileno())
                os.replace(staged, target)
            except OSError:
                # A full disk: the part written must not keep the space it took.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(staged)
                raise
            fd = os.open(os.path.dirname(target), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except (OSError, ValueError, ImportError) as exc:
            raise ArchiveUnwritable(f"cannot write {target}: {exc}") from exc

    def chunks(self, name: str) -> Iterator[bytes]:
        """Yields the file's bytes; ArchiveBroken when it is missing or cannot be read."""
        source = self._path(name)
        try:
            if self.remote:
                yield from store_for(source).iter_bytes(source)
                return
            with open(source, "rb") as fh:
                while chunk := fh.read(_READ_CHUNK):
                    yield chunk
        except FileNotFoundError:
            raise ArchiveBroken(f"the archive has no {source}", file=name) from None
        except (OSError, ValueError, ImportError) as exc:
            raise ArchiveBroken(f"cannot read {source}: {exc}", file=name) from None

    def read(self, name: str) -> bytes:
        """Returns the whole (small) file."""
        return b"".join(self.chunks(name))


def bundle_location(base_url: str, namespace: str, run_id: str) -> Location:
    """Returns where a run's bundle lives under an archive base URL."""
    return Location(base_url).child(namespace, run_id)


# --- writing --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Bundle:
    """A run's bundle staged in a local directory, with what its tombstone will keep."""

    directory: str
    events: int
    first_sequence: int
    last_sequence: int
    head_hash: bytes
    head: TreeHead
    manifest: bytes
    size_bytes: int

    @property
    def digest(self) -> str:
        """Returns the blake3 of the manifest: the bundle's identity in its tombstone."""
        return blake3.blake3(self.manifest).hexdigest()


def _line(value: dict[str, Any]) -> bytes:
    # As export writes it: Python's json round-trips every parsed number exactly.
    return (legacy_json(value) + "\n").encode()


class _HashedFile:
    """A local file written through blake3, counting its bytes."""

    def __init__(self, path: str) -> None:
        self.handle = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.hasher = blake3.blake3()
        self.size = 0

    def write(self, data: bytes) -> None:
        self.handle.write(data)
        self.hasher.update(data)
        self.size += len(data)

    def close(self) -> dict[str, Any]:
        self.handle.close()
        return {"bytes": self.size, "blake3": self.hasher.hexdigest()}


def stage_bundle(
    rows: Iterator[StoredEvent],
    run: RunRow,
    key: SigningKey,
    directory: str,
    *,
    now_us: int,
    figures: dict[str, Any],
) -> Bundle:
    """Writes the run's bundle into a local directory, checking its chain on the way.

    Raises ArchiveBroken when the stored rows do not chain to the run's head: a
    broken run is never archived (`audit verify` tells what changed).
    """
    events = _HashedFile(os.path.join(directory, EVENTS_FILE))
    chain, tree = ChainWalker(), MerkleTree()
    first = last = 0
    try:
        events.write(_line(_header(run, key)))
        for stored in rows:
            if chain.count == run.event_count:
                break  # appended since the head was read: the transaction will refuse
            if not chain.in_order(stored.run_sequence) or not chain.links(
                stored.row, stored.row_hash
            ):
                raise ArchiveBroken(
                    f"run {run.namespace}/{run.run_id}: the hash chain breaks at sequence"
                    f" {stored.sequence}; nothing is archived (`shardledger audit verify`)"
                )
            chain.advance(stored.row_hash)
            tree.append(stored.row)
            first, last = first or stored.sequence, stored.sequence
            body = json.loads(stored.row)
            line = {
                "type": "event",
                "sequence": stored.sequence,
                "run_sequence": stored.run_sequence,
                "receive_time_us": body["receive_time_us"],
                "row": body,
                "row_hash": stored.row_hash.hex(),
            }
            events.write(_line(line))
        if (chain.count, chain.head) != (run.event_count, run.head_hash):
            raise ArchiveBroken(
                f"run {run.namespace}/{run.run_id}: its head says {run.event_count} events,"
                f" the rows give {chain.count}; nothing is archived"
            )
        head = _sign(key, run, chain.count, tree.root(), now_us)
        events.write(_line({"type": "trailer", "events": chain.count, "tree_head": head.to_json()}))
    finally:
        events_file = events.close()
    head_bytes = (legacy_json(head.to_json()) + "\n").encode()
    with open(os.path.join(directory, HEAD_FILE), "wb") as fh:
        fh.write(head_bytes)
    manifest = {
        "format": ARCHIVE_FORMAT,
        "namespace": run.namespace,
        "run_id": run.run_id,
        "events": chain.count,
        "first_sequence": first,
        "last_sequence": last,
        "head_hash": chain.head.hex(),
        "root_hex": head.root_hex,
        "key_id": head.key_id,
        "files": {
            EVENTS_FILE: events_file,
            HEAD_FILE: {"bytes": len(head_bytes), "blake3": blake3.blake3(head_bytes).hexdigest()},
        },
        **figures,
    }
    manifest_bytes = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    with open(os.path.join(directory, MANIFEST_FILE), "wb") as fh:
        fh.write(manifest_bytes)
    return Bundle(
        directory,
        chain.count,
        first,
        last,
        chain.head,
        head,
        manifest_bytes,
        events_file["bytes"] + len(head_bytes) + len(manifest_bytes),
    )


def _header(run: RunRow, key: SigningKey) -> dict[str, Any]:
    pem = key.public_key_pem()
    return {
        "type": "header",
        "format": EXPORT_FORMAT,
        "namespace": run.namespace,
        "run_id": run.run_id,
        "public_key_pem": pem,
        "key_id": public_key_id(pem),
    }


def _sign(key: SigningKey, run: RunRow, size: int, root: bytes, now_us: int) -> TreeHead:
    return sign_tree_head(
        key,
        namespace=run.namespace,
        run_id=run.run_id,
        tree_size=size,
        root=root,
        timestamp_ms=now_us // 1000,
    )


def upload(bundle: Bundle, location: Location, step: Callable[[str], None]) -> None:
    """Puts the bundle's files at the location, the manifest last (it makes the bundle)."""
    for name in (EVENTS_FILE, HEAD_FILE):
        location.put(name, os.path.join(bundle.directory, name))
        step(f"uploaded_{name.split('.')[0]}")
    location.put(MANIFEST_FILE, os.path.join(bundle.directory, MANIFEST_FILE))


def staging_directory() -> tempfile.TemporaryDirectory[str]:
    """Returns a private directory for a bundle before it is uploaded."""
    return tempfile.TemporaryDirectory(prefix="shardledger-archive-")
