"""Input identity on the job's side: read what the input is now and compare it with the plan.

The plan records each input's size, blake3 and cheap identity (a local file's
mtime, inode and device; an object's version id and ETag), and hands them back
in every plan line it stores (``input_identity``) and so in `resume` lists. A job
that names its input (``ledger.shard(run, shard, input=line)``, `exec --input`)
reads the cheap identity again at the start of its attempt; when it differs from
the plan's it re-hashes before it judges, so a file that was only copied or
touched is still the same input. What it saw travels in the started event, and
the ledger, which holds the plan, judges again (docs/concepts.md, "Input identity").

`difference` is the one rule, shared with the ledger (ledger_server.inputs).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.atomic import hash_file
from shard_client.storage import is_remote, store_for

__all__ = [
    "IDENTITY_FIELDS",
    "IDENTITY_KEY",
    "INPUT_CHECKS",
    "PlannedInput",
    "difference",
    "line_identity",
    "local_identity",
    "observe",
]

# The key under which `plan` stores an input's identity in each plan line.
IDENTITY_KEY: Final = "input_identity"
# The cheap identity, in the order messages name it.
IDENTITY_FIELDS: Final = ("mtime_ns", "inode", "device", "version_id", "etag")
# "identity": the cheap identity, re-hashed only when it differs from a known plan;
# "hash": always re-hash (exact, costs a read of the whole input).
INPUT_CHECKS: Final = ("identity", "hash")


@dataclass(frozen=True, slots=True)
class PlannedInput:
    """An input as the job names it: its reference, and the plan's identity when known."""

    ref: str
    # bytes, blake3 and the IDENTITY_FIELDS the plan recorded ({} when the job passed a path).
    identity: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, value: str | os.PathLike[str] | Mapping[str, Any]) -> PlannedInput:
        """Returns the input a job named: a path or URL, or a plan line / resume entry."""
        if isinstance(value, Mapping):
            ref = value.get("input")
            if not isinstance(ref, str) or not ref:
                raise ValueError('input=: a plan line needs "input", a non-empty string')
            identity = value.get(IDENTITY_KEY) or {}
            if not isinstance(identity, Mapping):
                raise ValueError(f'input=: "{IDENTITY_KEY}" must be an object')
            return cls(ref, dict(identity))
        ref = os.fspath(value)
        if not ref:
            raise ValueError("input= must not be empty")
        return cls(ref)


def local_identity(st: os.stat_result) -> dict[str, int]:
    """Returns a local file's cheap identity (what `plan` records and a job reads again)."""
    return {"mtime_ns": st.st_mtime_ns, "inode": st.st_ino, "device": st.st_dev}


def line_identity(size: int, blake3: str, cheap: Mapping[str, Any]) -> dict[str, Any]:
    """Returns the ``input_identity`` a plan line carries: size, blake3, the cheap identity.

    Integers of the cheap identity go as decimal strings (an mtime in nanoseconds is
    past 2**53, which a JSON number cannot hold exactly); empty values are left out.
    """
    out: dict[str, Any] = {"bytes": size, "blake3": blake3}
    for name in IDENTITY_FIELDS:
        value = cheap.get(name)
        if value:
            out[name] = str(value) if isinstance(value, int) else value
    return out


def difference(planned: Mapping[str, Any], seen: Mapping[str, Any]) -> str:
    """Returns what differs between a planned input and one seen ("" when it is the same).

    Both map ``ref``, ``bytes``, ``blake3`` and the IDENTITY_FIELDS (absent or empty:
    unknown). ``known_size`` in ``planned`` says whether its size of 0 is a size. The
    rules: another reference or another size is another input; a blake3 on both sides
    decides alone; without one, any cheap identity known on both sides that differs.
    """
    notes: list[str] = []
    if planned.get("ref") and seen.get("ref") and planned["ref"] != seen["ref"]:
        notes.append(f"input {seen['ref']!r}, planned {planned['ref']!r}")
    planned_bytes, seen_bytes = int(planned.get("bytes") or 0), int(seen.get("bytes") or 0)
    if (planned_bytes or planned.get("known_size")) and planned_bytes != seen_bytes:
        notes.append(f"size {planned_bytes} -> {seen_bytes} bytes")
    before, now = planned.get("blake3") or "", seen.get("blake3") or ""
    if before and now:
        if before != now:
            notes.append(f"content blake3 {before[:12]}… -> {now[:12]}…")
        return "; ".join(notes)
    for name in IDENTITY_FIELDS:
        a, b = planned.get(name), seen.get(name)
        if a and b and str(a) != str(b):
            notes.append(f"{name} {a} -> {b}")
    return "; ".join(notes)


def _cheap_differs(planned: Mapping[str, Any], seen: Mapping[str, Any]) -> bool:
    return any(
        planned.get(name) and seen.get(name) and str(planned[name]) != str(seen[name])
        for name in IDENTITY_FIELDS
    )


def observe(planned: PlannedInput, *, check: str = "identity") -> tuple[pb.InputSeen, str]:
    """Reads the input's identity now; returns it as the started event carries it, and the
    difference from the plan's identity the job was handed ("" when none is known or none).

    Re-hashes when ``check`` is "hash", or when the plan's identity is known, its size
    matches and some cheap identity differs (a copy or a touch is no change). A missing
    local input is a change; a store error (unreachable, refused) is raised: the job
    cannot read its input either, and nothing is judged.
    """
    if check not in INPUT_CHECKS:
        raise ValueError(f"input_check must be one of {', '.join(INPUT_CHECKS)}")
    seen: dict[str, Any] = {"ref": planned.ref}
    if is_remote(planned.ref):
        store = store_for(planned.ref)
        info = store.info(planned.ref)
        if info is None:
            return pb.InputSeen(input_ref=planned.ref), f"input {planned.ref} is gone"
        seen.update(bytes=info.size_bytes, version_id=info.version_id, etag=info.etag)

        def rehash() -> str:
            return store.digest(planned.ref, version_id=info.version_id)[1]
    else:
        try:
            st = os.stat(planned.ref)
        except FileNotFoundError:
            return pb.InputSeen(input_ref=planned.ref), f"input {planned.ref} is gone"
        seen.update(bytes=st.st_size, **local_identity(st))

        def rehash() -> str:
            return hash_file(planned.ref)[1]

    plan = {"ref": planned.ref, **planned.identity}
    known = bool(planned.identity)
    if check == "hash" or (
        known
        and int(plan.get("bytes") or 0) == seen["bytes"]
        and plan.get("blake3")
        and _cheap_differs(plan, seen)
    ):
        seen["blake3"] = rehash()
    if known:
        plan["known_size"] = True
    message = pb.InputSeen(
        input_ref=planned.ref,
        size_bytes=seen["bytes"],
        mtime_ns=seen.get("mtime_ns", 0),
        inode=seen.get("inode", 0),
        device=seen.get("device", 0),
        version_id=seen.get("version_id", ""),
        etag=seen.get("etag", ""),
        blake3_hex=seen.get("blake3", ""),
    )
    return message, difference(plan, seen) if known else ""
