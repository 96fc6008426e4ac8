"""One `shardledger exec` attempt from start to end: started, the child, then commit or failed(tag).

Exit codes (`EXIT_*` below, docs/exec.md): the child's own status (128+N when
signal N killed it), so a scheduler sees what the job did; 124 when the hang
watchdog stopped it; 65 when it exited 0 but its outputs were refused (missing,
empty, invalid: failed(incomplete)); 74 when committing them failed; 126/127
when the command could not be started.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from shard_client import Ledger
from shard_client.environment import Fingerprint
from shard_client.errors import LedgerClientError
from shard_client.inputs import PlannedInput, observe
from shard_client.signals import diagnostics_dir
from shard_client.storage import is_remote, storage_error
from shard_client.vocabulary import FailureTag
from shard_client.watchdog import HangPolicy
from shardledger_cli.cli import CommandError
from shardledger_cli.exec.attempt import ExecAttempt
from shardledger_cli.exec.diagnose import write_bundle
from shardledger_cli.exec.guard import Guard
from shardledger_cli.exec.outcome import cgroup_oom_kills, judge_failure, oom_delta
from shardledger_cli.exec.outputs import (
    DeclaredOutput,
    check_outputs,
    commit_outputs,
    discard_temps,
)
from shardledger_cli.exec.supervise import ChildResult, Hang, Liveness, Supervisor
from shardledger_cli.exec.target import Target, child_env

__all__ = [
    "EXIT_COMMIT_FAILED",
    "EXIT_HUNG",
    "EXIT_INPUT_CHANGED",
    "EXIT_NOT_EXECUTABLE",
    "EXIT_NOT_FOUND",
    "EXIT_OUTPUTS_REFUSED",
    "ExecSpec",
    "Report",
    "execute",
]

log = logging.getLogger("shard_client")

EXIT_OUTPUTS_REFUSED: Final = 65  # sysexits' EX_DATAERR
EXIT_COMMIT_FAILED: Final = 74  # sysexits' EX_IOERR
EXIT_INPUT_CHANGED: Final = 66  # sysexits' EX_NOINPUT: the planned input is not there
EXIT_HUNG: Final = 124  # timeout(1)'s
EXIT_NOT_EXECUTABLE: Final = 126  # the shells'
EXIT_NOT_FOUND: Final = 127


@dataclass(frozen=True, slots=True)
class ExecSpec:
    """Everything one exec needs, checked: the shard, the command, its outputs, the watch settings."""

    run_id: str
    target: Target
    attempt_id: str
    command: Sequence[str]  # placeholders filled (target.substitute)
    outputs: Sequence[DeclaredOutput]  # with temp paths (outputs.prepare_outputs)
    heartbeat_timeout_s: float
    heartbeat_interval_s: float
    policy: HangPolicy | None
    liveness: Liveness
    term_grace_s: float
    fingerprint: Fingerprint
    # The input checked against the plan before the child starts (None: not checked).
    input: PlannedInput | None = None
    input_check: str = "identity"


@dataclass(slots=True)
class Report:
    """What happened, as `--json` prints it."""

    run_id: str
    shard_id: str
    attempt_id: str
    outcome: str = ""  # committed | failed
    tag: str = ""
    exit_code: int = 0
    child_exit_code: int | None = None
    signal: str = ""
    recorded: bool = False  # the ledger (or the spool) holds the attempt's ending
    outputs: list[dict[str, Any]] = field(default_factory=list)
    problems: list[dict[str, str]] = field(default_factory=list)
    diagnostics_path: str = ""
    message: str = ""

    def as_json(self) -> dict[str, Any]:
        """Returns the report as a JSON object."""
        return {name: getattr(self, name) for name in self.__slots__}


@contextlib.contextmanager
def _signals_deferred() -> Iterator[list[int]]:
    """Notes TERM, INT and HUP instead of dying of them while the attempt's end is recorded.

    The child is gone by then; a commit or a failed event cut in half by the
    signal's default action would leave the attempt to go stale for nothing.
    (Blocking the signals would not do: a process-directed signal goes to any
    thread that does not block it, the sender's included.)
    """
    noted: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield noted  # handlers can be set from the main thread only
        return
    deferred = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {s: signal.signal(s, lambda signum, frame: noted.append(signum)) for s in deferred}
    try:
        yield noted
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for number in noted:
            log.warning("signal_deferred signal=%s: the attempt's end was being recorded", number)


def _fail(
    attempt: ExecAttempt, report: Report, tag: FailureTag, message: str, tail: Sequence[str]
) -> None:
    diag = None
    try:
        diag = write_bundle(
            attempt_id=attempt.attempt_id,
            header=f"run {attempt.run_id} shard {attempt.shard_id} attempt {attempt.attempt_id}\n"
            f"failed({tag.value}): {message}",
            kind="exec",
            pgid=None,
            tail=tail,
            with_gpus=False,
        )
        report.diagnostics_path = diag.path
    except Exception as exc:  # evidence only: the failure is recorded without it
        log.error("exec_diagnostics_failed attempt=%s error=%r", attempt.attempt_id, exc)
    report.outcome, report.tag, report.message = "failed", tag.value, message
    report.recorded = attempt.fail(tag, message, diagnostics=diag)


def _commit(spec: ExecSpec, attempt: ExecAttempt, result: ChildResult, report: Report) -> None:
    problems = check_outputs(spec.outputs)
    if problems:
        report.problems = [
            {"name": p.name, "reason": p.reason, "detail": p.detail} for p in problems
        ]
        # A job stopped by its scheduler that exits 0 without its outputs was preempted.
        tag = FailureTag.PREEMPTED if result.term_received else FailureTag.INCOMPLETE
        text = "; ".join(str(p) for p in problems)
        _fail(attempt, report, tag, f"exit status 0, but outputs refused: {text}", result.tail)
        report.exit_code = EXIT_OUTPUTS_REFUSED
        return
    try:
        infos = commit_outputs(spec.outputs, attempt.record_commit)
    except OSError as exc:
        _fail(attempt, report, FailureTag.UNKNOWN, f"commit failed: {exc}", result.tail)
        report.exit_code = EXIT_COMMIT_FAILED
        return
    except LedgerClientError as exc:
        log.error("commit_not_recorded shard=%s error=%s", attempt.shard_id, exc)
        report.outcome, report.message = "failed", f"commit not recorded: {exc}"
        report.exit_code = EXIT_COMMIT_FAILED
        return
    report.outcome, report.recorded = "committed", True
    names = [o.name for o in spec.outputs]
    report.outputs = [
        {"name": n, "path": i.path, "size_bytes": i.size_bytes, "blake3_hex": i.blake3_hex}
        for n, i in zip(names, infos, strict=True)
    ]


def _judge(
    spec: ExecSpec,
    attempt: ExecAttempt,
    result: ChildResult,
    oom_before: int | None,
    report: Report,
) -> None:
    report.child_exit_code = result.exit_code
    if result.returncode < 0:
        report.signal = signal.Signals(-result.returncode).name
    if result.hang is not None:
        report.outcome, report.tag = "failed", FailureTag.TIMEOUT.value
        report.diagnostics_path = result.hang.diagnostics.path if result.hang.diagnostics else ""
        report.message = result.hang.message(
            spec.policy.kill_grace if spec.policy else 0, spec.liveness
        )
        report.exit_code = EXIT_HUNG
        return
    if result.returncode == 0:
        _commit(spec, attempt, result, report)
        return
    verdict = judge_failure(result, spec.command, oom_kills=oom_delta(oom_before))
    _fail(attempt, report, verdict.tag, verdict.message, result.tail)
    report.exit_code = result.exit_code


def _start_guard(spec: ExecSpec, progress_file: str) -> Guard | None:
    """Starts the process that kills the child's group and removes its temps if exec dies."""
    temps = [o.temp for o in spec.outputs] + [progress_file]
    try:
        return Guard.start(attempt_id=spec.attempt_id, temps=temps)
    except OSError as exc:  # the child still dies with exec (PDEATHSIG); its children may not
        log.warning("exec_guard_unavailable attempt=%s error=%s", spec.attempt_id, exc)
        return None


def execute(spec: ExecSpec, ledger: Ledger) -> Report:
    """Runs the attempt; raises LedgerClientError when started is refused (the child never ran)."""
    report = Report(spec.run_id, spec.target.shard_id, spec.attempt_id)
    attempt = ExecAttempt(
        ledger,
        run_id=spec.run_id,
        shard_id=spec.target.shard_id,
        attempt_id=spec.attempt_id,
        heartbeat_timeout_s=spec.heartbeat_timeout_s,
        heartbeat_interval_s=spec.heartbeat_interval_s,
    )
    progress_file = os.path.join(diagnostics_dir(), f"{spec.attempt_id}.progress")
    argv = list(spec.command)
    env = child_env(
        os.environ,
        run_id=spec.run_id,
        target=spec.target,
        attempt_id=spec.attempt_id,
        outputs=spec.outputs,
        progress_file=progress_file,
    )
    seen, changed = (None, "")
    if spec.input is not None:
        # Read before started: an input that cannot be read stops exec here (exit 5).
        try:
            seen, changed = observe(spec.input, check=spec.input_check)
        except Exception as exc:  # botocore's errors are no OSError; the child never runs
            typed = storage_error(exc, spec.input.ref) if is_remote(spec.input.ref) else None
            raise CommandError(f"cannot read the input: {typed or exc}") from None
    ack = attempt.start(spec.fingerprint, seen)
    changed = ack.input_changed or changed
    if changed and spec.input is not None:
        # The child never runs on other bytes than the plan's.
        _fail(attempt, report, FailureTag.INPUT_CHANGED, f"input {spec.input.ref}: {changed}", [])
        report.exit_code = EXIT_INPUT_CHANGED
        return report
    os.makedirs(os.path.dirname(progress_file), exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(progress_file)

    def on_hang(hang: Hang) -> None:
        # On record before any signal: the child may take its group's TERM badly.
        attempt.stop_beats()
        message = hang.message(spec.policy.kill_grace if spec.policy else 0, spec.liveness)
        report.recorded = attempt.fail(FailureTag.TIMEOUT, message, diagnostics=hang.diagnostics)

    guard = _start_guard(spec, progress_file)
    supervisor = Supervisor(
        argv=argv,
        env=env,
        attempt_id=spec.attempt_id,
        on_progress=attempt.report,
        on_hang=on_hang,
        policy=spec.policy,
        liveness=spec.liveness,
        term_grace_s=spec.term_grace_s,
        progress_file=progress_file,
        guard=guard,
    )
    attempt.start_beats()
    oom_before = cgroup_oom_kills()
    try:
        try:
            result = supervisor.run()
        except OSError as exc:
            attempt.stop_beats()
            missing = isinstance(exc, FileNotFoundError)
            text = f"cannot run {argv[0]!r}: {exc.strerror or exc}"
            _fail(attempt, report, FailureTag.UNKNOWN, text, [])
            report.exit_code = EXIT_NOT_FOUND if missing else EXIT_NOT_EXECUTABLE
            return report
        with _signals_deferred():
            attempt.stop_beats()
            _judge(spec, attempt, result, oom_before, report)
        return report
    finally:
        discard_temps(spec.outputs)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(progress_file)
        if guard is not None:
            guard.close()
