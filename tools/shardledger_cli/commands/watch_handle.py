"""What `shardledger watch --kill-stale` does about one stale attempt: diagnose, stop, record."""

from __future__ import annotations

import contextlib
import json
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.errors import LedgerRejected, LedgerUnavailable, Overloaded, StoreFault
from shardledger_cli.commands import watch_stop
from shardledger_cli.commands.watch_diag import STACK_WAIT_S, stack_dump, write_report
from shardledger_cli.commands.watch_stop import StartedIndex, StopFailed, Target

__all__ = ["Action", "Recheck", "handle_stale", "stale_checker"]

# recheck(shard_id, attempt_id): whether the ledger still holds that attempt stale now.
Recheck = Callable[[str, str], bool]


@dataclass(slots=True)
class Action:
    """What the watchdog did about one stale attempt."""

    shard_id: str
    attempt_id: str
    host: str
    pid: int | None
    steps: list[str] = field(default_factory=list)
    diagnostics: str = ""
    recorded: bool = False
    recovered: bool = False
    ended: bool = False
    method: str = ""
    scheduler: dict[str, str] = field(default_factory=dict)
    stop_error: str = ""
    diagnostics_errors: list[str] = field(default_factory=list)
    # A multi-rank attempt: what was done about each rank's process.
    ranks: list[Action] = field(default_factory=list)
    rank: int = -1

    @classmethod
    def of(cls, target: Target) -> Action:
        """Returns an empty action for the target."""
        pid = target.pid or None
        return cls(
            target.shard_id, target.attempt_id, target.host, pid, scheduler=dict(target.scheduler)
        )

    def to_json(self) -> dict[str, Any]:
        """Returns the action as JSON."""
        return {
            "shard_id": self.shard_id,
            "attempt_id": self.attempt_id,
            "host": self.host,
            "pid": self.pid,
            "scheduler": self.scheduler,
            "method": self.method,
            "steps": self.steps,
            "diagnostics": self.diagnostics,
            "diagnostics_errors": self.diagnostics_errors,
            "stop_error": self.stop_error,
            "recovered": self.recovered,
            "ended_meanwhile": self.ended,
            "recorded_failed_timeout": self.recorded,
            **({"ranks": [_rank_json(r) for r in self.ranks]} if self.ranks else {}),
        }


def _rank_json(action: Action) -> dict[str, Any]:
    return {
        "rank": action.rank,
        "host": action.host,
        "pid": action.pid,
        "method": action.method,
        "steps": action.steps,
        "diagnostics": action.diagnostics,
        "stop_error": action.stop_error,
    }


def stale_checker(client: Any, run_id: str, *, namespace: str) -> Recheck:
    """Returns a recheck that asks the ledger (one ListShards of the stale shards) about one attempt."""

    def recheck(shard_id: str, attempt_id: str) -> bool:
        for view in client.shards(run_id, namespace=namespace, state="stale"):
            if view.shard_id == shard_id:
                return bool(json.loads(view.view_json)["latest_attempt"] == attempt_id)
        return False

    return recheck


def _recovered(action: Action, recheck: Recheck | None) -> bool:
    """Returns whether the attempt is no longer stale on the ledger, noting it in the action."""
    if recheck is None or recheck(action.shard_id, action.attempt_id):
        return False
    action.recovered = True
    action.steps.append("recovered: no longer stale on the ledger, left alone")
    return True


def _stop(
    action: Action,
    target: Target,
    how: str | None,
    *,
    grace_s: float,
    kill_command: str | None,
    same: str,
) -> bool:
    """Stops the attempt one way; returns whether it is known to be stopped (or gone)."""
    steps = action.steps
    if how is None:
        steps.append(
            f"on host {target.host}: not stopped (no scheduler identity recorded; run the "
            "watchdog there, or pass --kill-command)"
        )
        return False
    try:
        if how == "command":
            assert kill_command is not None
            watch_stop.stop_command(steps, kill_command, target, grace_s)
        elif how == "slurm":
            watch_stop.stop_slurm(steps, watch_stop.slurm_job(target.scheduler), grace_s)
        elif how == "kubernetes":
            pod, ns = target.scheduler["job_id"], target.scheduler.get("namespace", "")
            watch_stop.stop_kubernetes(steps, pod, ns, grace_s)
        elif how == "ray":
            watch_stop.stop_ray(steps, target, grace_s)
        elif same == "same":
            watch_stop.stop_local(steps, target.pid, target.start_ticks, grace_s)
        elif same == "gone":
            steps.append("process already gone")
        elif same == "reused":
            steps.append(
                f"pid {target.pid} is now another process (its start time differs): not signalled"
            )
        else:
            steps.append(
                f"no process start time recorded: pid {target.pid} not signalled "
                "(it may be another process by now)"
            )
            return False
    except StopFailed as exc:
        action.stop_error = str(exc)
        steps.append(f"not stopped: {exc}")
        return False
    return True


def _record(
    action: Action,
    target: Target,
    append: Callable[[list[pb.ShardEvent]], object],
    namespace: str,
    *,
    rank: int = 0,
) -> None:
    """Records failed(timeout); an attempt that ended meanwhile is done, not an error."""
    message = f"watchdog: silent past its heartbeat timeout; {', '.join(action.steps)}"
    if action.diagnostics:
        message += f"; diagnostics in {action.diagnostics}"
    if action.diagnostics_errors:
        message += f"; diagnostics incomplete: {'; '.join(action.diagnostics_errors)}"
    key = f"{namespace}/{target.run_id}/{target.attempt_id}"
    # A deterministic id makes a second watchdog's record of the same attempt the same event.
    event = pb.ShardEvent(
        event_id=f"watchdog-{uuid.uuid5(uuid.NAMESPACE_URL, key).hex}",
        namespace=namespace,
        run_id=target.run_id,
        shard_id=target.shard_id,
        attempt_id=target.attempt_id,
        failed=pb.AttemptFailed(tag=pb.FAILURE_TAG_TIMEOUT, message=message[:4000], rank=rank),
    )
    try:
        append([event])
    except LedgerRejected as exc:
        if exc.reason == "ATTEMPT_ENDED":
            action.ended = True
            action.steps.append(f"ended meanwhile: {exc}")
            return
        if exc.reason == "EVENT_ID_REUSED":
            action.ended = True
            action.steps.append("failed(timeout) already recorded by another watchdog pass")
            return
        raise
    action.recorded = True


def handle_stale(
    view: dict[str, Any],
    *,
    append: Callable[[list[pb.ShardEvent]], object],
    run_id: str,
    namespace: str,
    grace_s: float,
    diag_dir: Path,
    target: Target | None = None,
    log_pattern: str | None = None,
    log_lines: int = 50,
    record_remote: bool = False,
    recheck: Recheck | None = None,
    kill_command: str | None = None,
    unrecorded: dict[str, Action] | None = None,
) -> Action:
    """Collects diagnostics, stops the attempt (TERM, grace, kill) and records failed(timeout).

    ``target`` is what the attempt's started event recorded (pid start time, scheduler);
    without it only the view's host and pid are known, and no pid is signalled.
    With a recheck, the ledger is asked again before the stack dump and before the stop.

    ``unrecorded`` (attempt id -> action) carries, from one pass to the next, the attempts
    stopped whose failed(timeout) the ledger did not take (it was unreachable): the next
    pass records that action, its diagnostics included, instead of finding the process
    gone and recording a failure that no longer names them.
    """
    target = target or StartedIndex(run_id, namespace).target(view)
    rank = _silent_rank(view, target) if target.ranks else 0
    earlier = unrecorded.pop(target.attempt_id, None) if unrecorded is not None else None
    if earlier is not None:
        earlier.steps.append("recorded on a later pass (the ledger was unreachable)")
        _record_or_keep(earlier, target, append, namespace, rank, unrecorded)
        return earlier
    action = Action.of(target)
    if _recovered(action, recheck):
        return action
    if target.ranks:
        _stop_ranks(
            action,
            target,
            # The failure is the first silent rank's (the one the others wait on).
            record=lambda: _record_or_keep(action, target, append, namespace, rank, unrecorded),
            grace_s=grace_s,
            diag_dir=diag_dir,
            log_pattern=log_pattern,
            log_lines=log_lines,
            kill_command=kill_command,
        )
        return action
    stopped = _diagnose_and_stop(
        action,
        target,
        grace_s=grace_s,
        diag_dir=diag_dir,
        log_pattern=log_pattern,
        log_lines=log_lines,
        recheck=recheck,
        kill_command=kill_command,
    )
    if stopped is None:
        return action
    if stopped:
        _discard_empty_stack(diag_dir, target.attempt_id)  # the process is gone: no dump comes
    if stopped or record_remote:
        _record_or_keep(action, target, append, namespace, 0, unrecorded)
    return action


def _discard_empty_stack(diag_dir: Path, attempt_id: str) -> None:
    """Removes the stopped attempt's <attempt>.stack if nothing was ever dumped into it.

    The SDK removes it when its block ends; a process that SIGKILL stopped never gets
    there, and an empty file per killed attempt is clutter, not evidence.
    """
    path = diag_dir / f"{attempt_id}.stack"
    with contextlib.suppress(OSError):
        if path.stat().st_size == 0:
            path.unlink()


def _record_or_keep(
    action: Action,
    target: Target,
    append: Callable[[list[pb.ShardEvent]], object],
    namespace: str,
    rank: int,
    unrecorded: dict[str, Action] | None,
) -> None:
    """Records failed(timeout); when the ledger cannot be reached, keeps the action for later."""
    try:
        _record(action, target, append, namespace, rank=rank)
    except (LedgerUnavailable, Overloaded, StoreFault):
        if unrecorded is not None:
            unrecorded[target.attempt_id] = action
        raise


def _stop_ranks(action: Action, target: Target, *, record: Callable[[], None], **how: Any) -> None:
    """Diagnoses every rank's process, records failed(timeout), then stops them all at once.

    One silent rank makes the attempt stale, and the others wait on it in a
    collective: the whole attempt is stopped, every rank on its own host. The
    record comes before the signals: a rank that a signal wakes would otherwise
    record its own ending first (preempted, nccl), and a rank no signal reaches
    (another host, no scheduler) learns from the ledger, which refuses its next
    heartbeat, and stops itself.
    """
    ranks = [Action.of(rank_target) for rank_target in target.ranks]
    for rank_action, rank_target in zip(ranks, target.ranks, strict=True):
        rank_action.rank = rank_target.rank
    errors: list[Exception] = []

    def record_once() -> None:  # the barrier's action: one thread, once all are diagnosed
        _merge_ranks(action, ranks)
        try:
            record()
        except Exception as exc:  # raised below, once every rank is stopped
            errors.append(exc)

    barrier = threading.Barrier(len(ranks), action=record_once)
    with ThreadPoolExecutor(max_workers=len(ranks)) as pool:
        list(
            pool.map(
                lambda pair: _diagnose_and_stop(
                    pair[0], pair[1], recheck=None, before_stop=barrier.wait, **how
                ),
                zip(ranks, target.ranks, strict=True),
            )
        )
    action.steps.clear()
    action.diagnostics_errors.clear()
    _merge_ranks(action, ranks)
    if errors:
        raise errors[0]


def _merge_ranks(action: Action, ranks: list[Action]) -> None:
    """Copies what was done about each rank into the attempt's action, rank by rank."""
    action.ranks = ranks
    action.method = ",".join(sorted({r.method for r in ranks}))
    for rank_action in ranks:
        action.steps.extend(f"rank {rank_action.rank}: {step}" for step in rank_action.steps)
        action.diagnostics_errors.extend(
            f"rank {rank_action.rank}: {e}" for e in rank_action.diagnostics_errors
        )
        if rank_action.stop_error and not action.stop_error:
            action.stop_error = f"rank {rank_action.rank}: {rank_action.stop_error}"
    action.diagnostics = "; ".join(r.diagnostics for r in ranks if r.diagnostics)


def _diagnose_and_stop(
    action: Action,
    target: Target,
    *,
    grace_s: float,
    diag_dir: Path,
    log_pattern: str | None,
    log_lines: int,
    recheck: Recheck | None,
    kill_command: str | None,
    before_stop: Callable[[], object] = lambda: None,
) -> bool | None:
    """Diagnoses and stops one process; returns whether it is stopped, None: it recovered."""
    how = watch_stop.method(target, kill_command=kill_command)
    action.method = how or "none"
    same = (
        watch_stop.identity(target.pid, target.start_ticks)
        if target.local and target.pid
        else "unknown"
    )
    if same == "same":
        report = write_report(
            shard_id=target.shard_id,
            attempt_id=_label(target),
            pid=target.pid,
            diag_dir=diag_dir,
            log_pattern=log_pattern,
            log_lines=log_lines,
            stack=lambda: _stack(target, diag_dir, grace_s),
        )
        action.diagnostics, action.diagnostics_errors = report.path, report.errors
        action.steps.append("diagnostics" if report.path else "diagnostics not written")
        if _recovered(action, recheck):
            return None
    before_stop()
    return _stop(action, target, how, grace_s=grace_s, kill_command=kill_command, same=same)


def _stack(target: Target, diag_dir: Path, grace_s: float) -> str:
    # A frozen process never answers: its stack wait must not outlast the grace it is given.
    return stack_dump(
        target.pid, _label(target), diag_dir, wait_s=min(STACK_WAIT_S, max(grace_s, 1.0))
    )


def _label(target: Target) -> str:
    # The SDK names a rank's stack dumps <attempt>.rank<N> (its ranks share the attempt id).
    return target.attempt_id if target.rank < 0 else f"{target.attempt_id}.rank{target.rank}"


def _silent_rank(view: dict[str, Any], target: Target) -> int:
    silent = [r["rank"] for r in view.get("ranks", []) if r.get("state") == "silent"]
    return silent[0] if silent else target.ranks[0].rank
