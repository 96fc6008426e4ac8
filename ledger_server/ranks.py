"""Multi-rank attempts (torchrun/DDP): the rank part of the fold, liveness and completeness.

Pure: no grpc, protobuf or SQL; time is passed in. Every rank of one launch
sends its own ``started`` with the same attempt id and its rank; the first one
opens the attempt, the others join it. An attempt of ``world_size`` ranks

- is stale as soon as any rank that has not finished is silent past its
  timeout (a rank that never joined counts from the attempt's start);
- fails as a whole when any rank records ``failed(tag)``; the other ranks'
  later events are refused (ATTEMPT_ENDED), which is how they learn of it;
- expects every output of the plan, a name with ``{rank}`` once per rank;
- is ``failed(incomplete)`` once every rank finished cleanly with an expected
  output still missing (rank 0 exiting while rank 1's output is not there);
- saves a sharded checkpoint of a step only once every part is recorded.

A one-process attempt (world_size 0 or 1) keeps no ranks and none of this applies.
"""

from __future__ import annotations

from typing import Any, Final

from ledger_server.errors import LifecycleViolation
from ledger_server.events import (
    AttemptStarted,
    CheckpointSaved,
    Event,
    Heartbeat,
    Payload,
)
from ledger_server.record import Attempt, Rank

RANK_PLACEHOLDER: Final = "{rank}"


def is_ranked(attempt: Attempt) -> bool:
    """Returns whether the attempt runs as several ranks."""
    return attempt.world_size > 1


def event_rank(payload: Payload) -> int:
    """Returns the rank an event's payload names (0 for kinds without one)."""
    rank = getattr(payload, "rank", 0)
    return rank if isinstance(rank, int) else 0


def expand_outputs(names: tuple[str, ...], world_size: int) -> tuple[str, ...]:
    """Returns the expected outputs with each ``{rank}`` name once per rank, in order."""
    if not any(RANK_PLACEHOLDER in n for n in names):
        return names
    out: list[str] = []
    for name in names:
        if RANK_PLACEHOLDER in name:
            out.extend(name.replace(RANK_PLACEHOLDER, str(r)) for r in range(max(world_size, 1)))
        else:
            out.append(name)
    return tuple(out)


# --- life cycle -------------------------------------------------------------


def check_join(attempt: Attempt, event: Event, p: AttemptStarted) -> None:
    """Allows a started event of an open attempt when it is another rank joining it."""
    if not is_ranked(attempt) or p.world_size != attempt.world_size:
        detail = (
            f" with world_size {p.world_size} (it has {attempt.world_size})"
            if is_ranked(attempt) or p.world_size > 1
            else ""
        )
        raise LifecycleViolation(
            f"attempt {event.attempt_id} already started{detail}",
            reason="ATTEMPT_ALREADY_STARTED",
            attempt_id=event.attempt_id,
            existing_sequence=attempt.started_seq,
        )
    if p.rank in attempt.ranks:
        raise LifecycleViolation(
            f"rank {p.rank} of attempt {event.attempt_id} already started",
            reason="ATTEMPT_ALREADY_STARTED",
            attempt_id=event.attempt_id,
            existing_sequence=attempt.started_seq,
        )
    if attempt.failed_tag:
        raise LifecycleViolation(
            f"attempt {event.attempt_id} already ended with failed({attempt.failed_tag})",
            reason="ATTEMPT_ENDED",
            attempt_id=event.attempt_id,
        )


def check_rank(attempt: Attempt, event: Event) -> None:
    """Raises LifecycleViolation when the event names a rank that did not start the attempt."""
    rank = event_rank(event.payload)
    if rank in attempt.ranks or (rank == 0 and not is_ranked(attempt)):
        return
    raise LifecycleViolation(
        f"rank {rank} of attempt {event.attempt_id} never started"
        + ("" if is_ranked(attempt) else " (the attempt has one process)"),
        reason="RANK_NOT_STARTED",
        attempt_id=event.attempt_id,
        rank=str(rank),
    )


# --- the fold ---------------------------------------------------------------


def open_ranks(attempt: Attempt, p: AttemptStarted, now_us: int) -> None:
    """Gives a new attempt its launch and its first rank (multi-rank attempts only)."""
    if p.world_size <= 1:
        return
    attempt.world_size = p.world_size
    attempt.launch_id = p.launch_id
    attempt.restart_count = p.restart_count
    attempt.started_us = now_us
    join_rank(attempt, p, now_us)


def join_rank(attempt: Attempt, p: AttemptStarted, now_us: int) -> None:
    """Folds one rank's started event into its attempt."""
    attempt.ranks[p.rank] = Rank(
        host=p.host,
        pid=p.pid,
        local_rank=p.local_rank,
        timeout_us=p.heartbeat_timeout_us,
        last_seen_us=now_us,
        process_start_ticks=p.process_start_ticks,
        scheduler=dict(p.scheduler),
    )
    attempt.last_seen_us = max(attempt.last_seen_us, now_us)
    if p.rank == 0:
        # The attempt's own host and pid are rank 0's, whichever rank started first.
        attempt.host, attempt.pid = p.host, p.pid
        attempt.process_start_ticks, attempt.scheduler = p.process_start_ticks, dict(p.scheduler)


def fold_rank_event(attempt: Attempt, payload: Payload, now_us: int) -> None:
    """Folds what any event of a rank says about that rank: seen, step, finished, failed."""
    rank = attempt.ranks.get(event_rank(payload))
    if rank is None:
        return
    if now_us > rank.last_seen_us:
        rank.last_seen_us = now_us
    if isinstance(payload, Heartbeat):
        rank.last_step = max(rank.last_step, payload.step)
        rank.finished = rank.finished or payload.rank_finished
    elif isinstance(payload, CheckpointSaved):
        rank.last_step = max(rank.last_step, payload.step)
    tag = getattr(payload, "tag", "")
    if isinstance(tag, str) and tag:
        rank.failed_tag = tag


def fold_checkpoint_part(attempt: Attempt, p: CheckpointSaved) -> bool:
    """Notes one part of a sharded checkpoint; returns whether the step's checkpoint is whole."""
    if p.world_size <= 1:
        return True
    parts = attempt.checkpoint_parts.setdefault(p.step, [])
    if p.rank not in parts:
        parts.append(p.rank)
        parts.sort()
    if len(parts) < p.world_size:
        return False
    # A whole checkpoint needs no parts list any more: the record keeps only open ones.
    del attempt.checkpoint_parts[p.step]
    return True


def changes_state(payload: Payload) -> bool:
    """Returns whether a heartbeat may change the shard's state (a rank that finished)."""
    return isinstance(payload, Heartbeat) and payload.rank_finished


# --- derived views ----------------------------------------------------------


def all_finished(attempt: Attempt) -> bool:
    """Returns whether every rank of a multi-rank attempt left its block cleanly."""
    return (
        is_ranked(attempt)
        and len(attempt.ranks) == attempt.world_size
        and all(r.finished for r in attempt.ranks.values())
    )


def deadline_us(attempt: Attempt) -> int:
    """Returns when the attempt turns stale: the earliest deadline of a rank still expected."""
    deadlines = []
    for index in range(attempt.world_size):
        rank = attempt.ranks.get(index)
        if rank is None:
            # A rank that never joined is silent since the attempt started.
            deadlines.append(attempt.started_us + attempt.timeout_us)
        elif not rank.finished and not rank.failed_tag:
            deadlines.append(rank.last_seen_us + rank.timeout_us)
    return min(deadlines) if deadlines else attempt.last_seen_us + attempt.timeout_us


def ranks_view(attempt: Attempt, now_us: int) -> list[dict[str, Any]]:
    """Returns every rank of the attempt (those never started too) as `shards` shows them."""
    out: list[dict[str, Any]] = []
    for index in range(attempt.world_size):
        rank = attempt.ranks.get(index)
        if rank is None:
            out.append({"rank": index, "state": "not_started", "alive": False})
            continue
        if rank.failed_tag:
            state = "failed"
        elif rank.finished:
            state = "finished"
        elif rank.last_seen_us + rank.timeout_us < now_us:
            state = "silent"
        else:
            state = "alive"
        out.append(
            {
                "rank": index,
                "state": state,
                "alive": state == "alive",
                "local_rank": rank.local_rank,
                "host": rank.host,
                "pid": rank.pid,
                "process_start_ticks": rank.process_start_ticks,
                "scheduler": dict(rank.scheduler),
                "last_seen_us": rank.last_seen_us,
                "last_step": rank.last_step,
                "failed_tag": rank.failed_tag,
            }
        )
    return out
