"""Which checkpoints a shard may resume from: only those the ledger recorded for its run and shard.

A checkpoint directory on disk says nothing about who wrote it: a new run over
the same inputs, a copied output tree, or a file replaced after its commit all
look like "the latest checkpoint". So a resume starts from the ledger's
``CheckpointSaved`` events of this run and shard (any attempt), newest step
first, and loads a file only when its bytes still hash (BLAKE3) to the recorded
digest; a file that does not is skipped for the next older recorded one.

When the ledger cannot be read, nothing on disk is trusted and the shard starts
fresh: losing some GPU time is recoverable, resuming from another run's state
is a silent wrong result. Each decision is logged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from shard_client.checkpoint import (
    CheckpointDigestMismatch,
    LoadedCheckpoint,
    checkpoints_newest_first,
    load_checkpoint,
)
from shard_client.client import LedgerClient
from shard_client.errors import LedgerClientError

__all__ = [
    "RecordedCheckpoint",
    "complete_parts",
    "load_recorded_checkpoint",
    "recorded_checkpoints",
]

log = logging.getLogger("shard_client")


@dataclass(frozen=True, slots=True)
class RecordedCheckpoint:
    """One checkpoint_saved event of the shard: where, which bytes, which step, which attempt."""

    step: int
    path: str
    blake3_hex: str
    attempt_id: str
    sequence: int
    # A part of a sharded checkpoint: the rank's, one of world_size (0: a whole file).
    rank: int = 0
    world_size: int = 0


def recorded_checkpoints(
    client: LedgerClient, *, namespace: str, run_id: str, shard_id: str
) -> list[RecordedCheckpoint]:
    """Returns the shard's recorded checkpoints, highest step first (latest record on a tie)."""
    found = [
        RecordedCheckpoint(
            step=e.checkpoint.step,
            path=e.checkpoint.path,
            blake3_hex=e.checkpoint.blake3_hex,
            attempt_id=e.attempt_id,
            sequence=e.sequence,
            rank=e.checkpoint.rank,
            world_size=e.checkpoint.world_size,
        )
        for e in client.list_events(run_id, namespace=namespace)
        if e.shard_id == shard_id and e.WhichOneof("payload") == "checkpoint"
    ]
    return sorted(found, key=lambda c: (c.step, c.sequence), reverse=True)


def whole_files(recorded: list[RecordedCheckpoint]) -> list[RecordedCheckpoint]:
    """Returns the recorded checkpoints that are one file each (no part of a sharded one)."""
    return [c for c in recorded if c.world_size <= 1]


def complete_parts(recorded: list[RecordedCheckpoint], rank: int) -> list[RecordedCheckpoint]:
    """Returns ``rank``'s part of every sharded checkpoint whose parts were all recorded.

    A step's checkpoint counts only when every rank of one attempt recorded its part
    (with one world size): a step that one rank saved and another never did is no
    checkpoint to resume from. Highest step first, as ``recorded`` is ordered.
    """
    groups: dict[tuple[str, int, int], dict[int, RecordedCheckpoint]] = {}
    for c in recorded:
        if c.world_size > 1:
            groups.setdefault((c.attempt_id, c.step, c.world_size), {}).setdefault(c.rank, c)
    whole = [
        parts[rank]
        for (_, _, world), parts in groups.items()
        if len(parts) == world and rank in parts
    ]
    return sorted(whole, key=lambda c: (c.step, c.sequence), reverse=True)


def _log_unrecorded(
    directory: str | None, recorded: Iterable[RecordedCheckpoint], label: str
) -> None:
    """Says which files in the checkpoint directory were ignored for not being on record."""
    if directory is None:
        return
    known = {os.path.abspath(c.path) for c in recorded}
    for path in checkpoints_newest_first(directory):
        if path not in known:
            log.info(
                "checkpoint_not_recorded %s path=%s: not saved by this run and shard, ignored",
                label,
                path,
            )


def load_recorded_checkpoint(
    read: Callable[[], list[RecordedCheckpoint]],
    *,
    directory: str | None,
    label: str,
    **kwargs: Any,
) -> LoadedCheckpoint | None:
    """Loads the newest recorded checkpoint whose bytes match its record; None: start fresh.

    A recorded file that is gone or whose digest differs is skipped for an older
    one; one that matches but does not load (a changed model, say) is raised
    when no older one loads, since starting fresh would hide the mistake.
    """
    try:
        recorded = read()
    except LedgerClientError as exc:
        log.warning(
            "checkpoint_resume_skipped %s reason=ledger_unreachable error=%s: starting fresh",
            label,
            exc,
        )
        return None
    _log_unrecorded(directory, recorded, label)
    first_error: Exception | None = None
    for record in recorded:
        try:
            loaded = load_checkpoint(record.path, expected_blake3=record.blake3_hex, **kwargs)
        except FileNotFoundError:
            log.warning("checkpoint_missing %s path=%s step=%d", label, record.path, record.step)
            continue
        except CheckpointDigestMismatch as exc:
            log.warning(
                "checkpoint_digest_mismatch %s path=%s step=%d actual=%s: replaced after its"
                " commit; trying an older one",
                label,
                record.path,
                record.step,
                exc.actual,
            )
            continue
        except Exception as exc:  # raised below when no older checkpoint loads
            log.warning(
                "checkpoint_unloadable %s path=%s error=%s: %s; trying an older one",
                label,
                record.path,
                type(exc).__name__,
                exc,
            )
            first_error = first_error or exc
            continue
        log.info("checkpoint_resumed %s path=%s step=%d", label, loaded.path, loaded.step)
        return loaded
    if first_error is not None:
        raise first_error
    if recorded:  # work on record is lost: worth a warning, not a note
        log.warning("checkpoint_fresh_start %s reason='no recorded checkpoint matches'", label)
    else:
        log.info("checkpoint_fresh_start %s reason='no checkpoint recorded'", label)
    return None
