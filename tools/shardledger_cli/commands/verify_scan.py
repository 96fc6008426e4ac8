"""What the event log says a verify must read: each commit, its own verdicts, and what replaced it."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.checks import VERIFIER_REASONS, PathOutsideRoot, resolve_within_root
from shardledger_cli.commands.verify_keyed import KeyedOutput, keyed_outputs

__all__ = [
    "Commit",
    "CommitState",
    "Plan",
    "Scan",
    "any_present",
    "common_dir",
    "outside",
    "plan",
    "scan_events",
    "unique",
]


@dataclass(frozen=True, slots=True)
class Commit:
    """The latest commit of one name in one attempt."""

    shard_id: str
    attempt_id: str
    name: str
    path: str
    size_bytes: int
    blake3_hex: str
    media_type: str
    # The commit event's id: a verdict's event id names it, so a re-commit of the same
    # bytes by the same attempt gets a verdict of its own instead of a duplicate.
    event_id: str = ""
    # Object storage only: the version id the store gave the committed upload.
    version_id: str = ""

    @property
    def key(self) -> tuple[str, str, str]:
        """Returns what a verdict is about: (shard, attempt, name)."""
        return (self.shard_id, self.attempt_id, self.name)

    @property
    def read_key(self) -> tuple[str, str, int, str]:
        """Returns what one read of the file answers for: (path, digest, size, media type)."""
        return (self.path, self.blake3_hex, self.size_bytes, self.media_type)


@dataclass(slots=True)
class CommitState:
    """A commit, where it stands in the log, and the verdicts of its own recorded after it."""

    commit: Commit
    position: int
    verdicts: list[tuple[bool, str]] = field(default_factory=list)  # (passed, reason), log order


@dataclass(slots=True)
class Scan:
    """What the event log says about a run's artifacts."""

    commits: dict[tuple[str, str, str], CommitState]
    path_heads: dict[str, str]  # path -> digest of the latest commit to it (what is on disk)
    latest_of_output: dict[tuple[str, str], int]  # (shard, name) -> position of its latest commit
    # (shard, name) -> the plan's keyed-result declaration (verify_keyed).
    keyed: dict[tuple[str, str], KeyedOutput] = field(default_factory=dict)


def scan_events(events: Iterable[Any]) -> Scan:
    """Collects the latest commit per (shard, attempt, name) and the verdicts of its own.

    A verdict naming an attempt belongs to that attempt's commit when it names the
    same path and digest; one without an attempt (recorded by an older verifier)
    belongs to every commit of the name with that path and digest that existed when
    it was recorded. A commit replaces the attempt's earlier commit of the name and
    with it the earlier verdicts, so a new commit starts unverified whatever its digest.
    Verdicts with a reason about the verifier (outside_root) are ignored: they said
    nothing about the bytes, and ignoring them heals ledgers an older verifier poisoned.
    """
    commits: dict[tuple[str, str, str], CommitState] = {}
    attempts: dict[tuple[str, str], dict[str, None]] = {}  # (shard, name) -> attempts, ordered
    heads: dict[str, str] = {}
    latest: dict[tuple[str, str], int] = {}
    keyed: dict[tuple[str, str], KeyedOutput] = {}
    for position, event in enumerate(events):
        kind = event.WhichOneof("payload")
        if kind == "planned":
            for name, spec in keyed_outputs(event.planned.params_json).items():
                keyed[(event.shard_id, name)] = spec
        elif kind == "artifact_committed":
            a = event.artifact_committed
            commit = Commit(
                event.shard_id,
                event.attempt_id,
                a.name,
                a.path,
                a.size_bytes,
                a.blake3_hex,
                a.media_type,
                event.event_id,
                a.version_id,
            )
            commits[commit.key] = CommitState(commit, position)
            attempts.setdefault((event.shard_id, a.name), {})[event.attempt_id] = None
            heads[a.path] = a.blake3_hex
            latest[(event.shard_id, a.name)] = position
        elif kind == "verified" and event.verified.reason not in VERIFIER_REASONS:
            v = event.verified
            owners = (
                [event.attempt_id]
                if event.attempt_id
                else attempts.get((event.shard_id, v.name), {})
            )
            for attempt in owners:
                state = commits.get((event.shard_id, attempt, v.name))
                if state and (state.commit.path, state.commit.blake3_hex) == (v.path, v.blake3_hex):
                    state.verdicts.append((v.result == pb.VERIFICATION_RESULT_PASSED, v.reason))
    return Scan(commits, heads, latest, keyed)


@dataclass(slots=True)
class Plan:
    """Each commit sorted by what verify does with it, in log order."""

    todo: list[CommitState] = field(default_factory=list)  # no verdict of its own (or --recheck)
    skipped: list[CommitState] = field(default_factory=list)  # has one; not read again
    superseded: list[CommitState] = field(default_factory=list)  # its path holds other bytes now
    current: set[tuple[str, str, str]] = field(default_factory=set)  # keys that decide the exit


def plan(scan: Scan, *, recheck: bool) -> Plan:
    """Sorts the commits: to check, skipped (own verdict), superseded; and marks the current ones.

    A commit whose path a later commit (another attempt's retry) filled with other
    bytes is superseded: its bytes are gone, so it is neither checked nor a failure.
    A commit is current when it is the latest commit of its output (shard, name) and
    not superseded: only current commits decide verify's exit code, so an older
    attempt's failed verdict never fails the rerun that replaced it.
    """
    out = Plan()
    for key, state in scan.commits.items():
        commit = state.commit
        if scan.path_heads.get(commit.path, commit.blake3_hex) != commit.blake3_hex:
            out.superseded.append(state)
            continue
        if scan.latest_of_output.get((commit.shard_id, commit.name)) == state.position:
            out.current.add(key)
        (out.todo if recheck or not state.verdicts else out.skipped).append(state)
    return out


def any_present(root: str, paths: Iterable[str]) -> bool:
    """Returns whether any of the paths inside root exists (stops at the first that does)."""
    return any(_exists(root, path) for path in paths)


def _exists(root: str, path: str) -> bool:
    try:
        target = resolve_within_root(root, path)
    except (PathOutsideRoot, OSError, ValueError, RuntimeError):
        return False  # outside the root or unresolvable: no evidence that this root is right
    return os.path.exists(target)


def outside(root: str, paths: Iterable[str]) -> list[str]:
    """Returns the paths that resolve outside root."""
    away = []
    for path in paths:
        try:
            resolve_within_root(root, path)
        except PathOutsideRoot:
            away.append(path)
        except (OSError, ValueError, RuntimeError):
            continue  # unresolvable: reported by the check itself
    return away


def common_dir(root: str, paths: Iterable[str]) -> str:
    """Returns the deepest directory holding every path (relative ones taken from root)."""
    dirs = [os.path.dirname(os.path.normpath(os.path.join(root, p))) for p in paths]
    return os.path.commonpath(dirs) if dirs else root


def unique(paths: Iterable[str]) -> Iterator[str]:
    """Yields each path once, in order."""
    yield from dict.fromkeys(paths)
