"""The planned inputs of a run, read again now: same, touched (same bytes), changed or gone.

What `verify --inputs` records and `plan --refresh-inputs` revises. The rules are
the SDK's (shard_client.inputs.difference): the cheap identity first (a local
file's size, mtime, inode and device; an object's size, version id and ETag), the
bytes re-hashed only when it differs, so a copied or touched input with the same
bytes is the same input.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Final

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.atomic import hash_file
from shard_client.inputs import IDENTITY_FIELDS, difference, local_identity
from shard_client.storage import is_remote, storage_error, store_for

__all__ = ["InputNow", "check_inputs", "collect_plans", "latest_plans", "planned_identity"]

SAME: Final = "same"
TOUCHED: Final = "touched"  # other cheap identity, the same bytes
CHANGED: Final = "changed"
GONE: Final = "gone"
UNKNOWN: Final = "unknown"  # the plan knows neither its identity nor its digest
STATUSES: Final = (SAME, TOUCHED, CHANGED, GONE, UNKNOWN)


@dataclass(frozen=True, slots=True)
class InputNow:
    """One shard's planned input as it is now."""

    shard_id: str
    ref: str
    status: str
    difference: str = ""
    size_bytes: int = 0
    blake3: str = ""
    # The cheap identity read now (IDENTITY_FIELDS that the store or file system gave).
    identity: dict[str, Any] = field(default_factory=dict)


def latest_plans(events: Iterable[pb.ShardEvent]) -> dict[str, pb.ShardEvent]:
    """Returns each shard's plan as it stands: its planned event, or the latest revision."""
    out: dict[str, pb.ShardEvent] = {}
    for _ in collect_plans(events, out):
        pass
    return out


def collect_plans(
    events: Iterable[pb.ShardEvent], into: dict[str, pb.ShardEvent]
) -> Iterator[pb.ShardEvent]:
    """Yields the events, keeping each shard's plan as it stands in ``into`` (latest_plans)."""
    for event in events:
        if event.WhichOneof("payload") == "planned" and (
            event.shard_id not in into or event.planned.input_revision
        ):
            into[event.shard_id] = event
        yield event


def planned_identity(p: pb.ShardPlanned) -> dict[str, Any]:
    """Returns what the plan knows of its input, as shard_client.inputs.difference reads it."""
    values = (p.input_mtime_ns, p.input_inode, p.input_device, p.input_version_id, p.input_etag)
    known = {name: value for name, value in zip(IDENTITY_FIELDS, values, strict=True) if value}
    return {
        "ref": p.input_ref,
        "bytes": p.input_bytes,
        "blake3": p.input_blake3,
        "known_size": bool(known),
        **known,
    }


def _read(ref: str) -> tuple[dict[str, Any] | None, Callable[[], tuple[int, str]]]:
    """Returns the input's cheap identity now (None: gone) and how to hash its bytes."""
    if is_remote(ref):
        store = store_for(ref)
        info = store.info(ref)
        if info is None:
            return None, lambda: (0, "")
        seen = {"bytes": info.size_bytes, "version_id": info.version_id, "etag": info.etag}
        return seen, lambda: store.digest(ref, version_id=info.version_id)
    try:
        st = os.stat(ref)
    except FileNotFoundError:
        return None, lambda: (0, "")
    return {"bytes": st.st_size, **local_identity(st)}, lambda: hash_file(ref)


def check_input(shard_id: str, p: pb.ShardPlanned, *, rehash: bool = False) -> InputNow:
    """Reads one planned input again and says how it stands; a store's error is raised."""
    plan = planned_identity(p)
    seen, digest = _read(p.input_ref)
    if seen is None:
        return InputNow(shard_id, p.input_ref, GONE, f"input {p.input_ref} is gone")
    seen["ref"] = p.input_ref
    cheap = {k: v for k, v in seen.items() if k in IDENTITY_FIELDS and v}
    cheap_differs = any(
        plan.get(name) and str(plan[name]) != str(value) for name, value in cheap.items()
    )
    known = plan["known_size"] or bool(plan["blake3"])
    if not known:
        return InputNow(shard_id, p.input_ref, UNKNOWN, "", seen["bytes"], "", cheap)
    same_size = seen["bytes"] == plan["bytes"] or not plan["known_size"]
    if not rehash and same_size and not cheap_differs and plan["known_size"]:
        return InputNow(shard_id, p.input_ref, SAME, "", seen["bytes"], p.input_blake3, cheap)
    size, blake = digest()
    seen.update(bytes=size, blake3=blake)
    diff = difference(plan, seen)
    status = CHANGED if diff else (TOUCHED if cheap_differs else SAME)
    return InputNow(shard_id, p.input_ref, status, diff, size, blake, cheap)


def check_inputs(
    plans: Mapping[str, pb.ShardEvent],
    shard_ids: Sequence[str],
    *,
    workers: int,
    rehash: bool = False,
    on_done: Callable[[], None] = lambda: None,
) -> tuple[list[InputNow], dict[str, str]]:
    """Checks the shards' planned inputs, at most ``workers`` at a time, in the order given.

    Returns what was found, and for the inputs that could not be read (a store away,
    credentials refused) shard id -> why: those are never judged.
    """
    found: list[InputNow] = []
    problems: dict[str, str] = {}
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="inputs") as pool:
        futures = [
            (sid, pool.submit(check_input, sid, plans[sid].planned, rehash=rehash))
            for sid in shard_ids
        ]
        for sid, future in futures:
            try:
                found.append(future.result())
            except Exception as exc:  # botocore's errors are no OSError; each is reported
                ref = plans[sid].planned.input_ref
                typed = storage_error(exc, ref) if is_remote(ref) else None
                problems[sid] = str(typed) if typed is not None else f"{ref}: {exc}"
            finally:
                on_done()
    return found, problems
