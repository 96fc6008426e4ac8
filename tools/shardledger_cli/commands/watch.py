"""`shardledger watch RUN`: the watchdog for silent hangs.

For every stale attempt (running, but silent past its heartbeat timeout on the
server clock) it collects diagnostics first — a Python stack dump of the
process (py-spy when installed, else SIGUSR1, which the SDK's shard context
routes to faulthandler) and the last lines of the job's log — then sends
SIGTERM, waits a grace period, sends SIGKILL, and records failed(timeout).
Just before it signals each attempt it asks the ledger again, and leaves alone
one that heartbeated meanwhile. Diagnostics that cannot be written are reported
on stderr (exit code 5) but never stop the kill and the record.
Only processes on this host can be signalled; stale attempts elsewhere are
reported (and, with --record-remote, marked failed(timeout) without a kill).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shardledger_cli.cli import (
    EXIT_LOCAL,
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    CommandError,
    client_from,
)
from shardledger_cli.output import print_json

DIAG_ENV = "SHARDLEDGER_DIAG_DIR"
LOG_FIELDS = "{shard_id}, {attempt_id}, {pid}"

# recheck(shard_id, attempt_id): whether the ledger still holds that attempt stale now.
Recheck = Callable[[str, str], bool]


def default_diag_dir() -> Path:
    """Returns where the SDK writes stack dumps and the watchdog writes its reports."""
    return Path(
        os.environ.get(DIAG_ENV) or Path(os.environ.get("TMPDIR", "/tmp")) / "shardledger-diag"
    )


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
    diagnostics_errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """Returns the action as JSON."""
        return {
            "shard_id": self.shard_id,
            "attempt_id": self.attempt_id,
            "host": self.host,
            "pid": self.pid,
            "steps": self.steps,
            "diagnostics": self.diagnostics,
            "diagnostics_errors": self.diagnostics_errors,
            "recovered": self.recovered,
            "recorded_failed_timeout": self.recorded,
        }


def stale_checker(client: Any, run_id: str, *, namespace: str) -> Recheck:
    """Returns a recheck that asks the ledger (one ListShards of the stale shards) about one attempt."""

    def recheck(shard_id: str, attempt_id: str) -> bool:
        for view in client.shards(run_id, namespace=namespace, state="stale"):
            if view.shard_id == shard_id:
                return bool(json.loads(view.view_json)["latest_attempt"] == attempt_id)
        return False

    return recheck


def log_path(pattern: str, *, shard_id: str, attempt_id: str, pid: int | None) -> Path:
    """Returns the job log path for one attempt; ValueError names what is wrong with the pattern."""
    try:
        return Path(pattern.format(shard_id=shard_id, attempt_id=attempt_id, pid=pid))
    except KeyError as exc:
        raise ValueError(
            f"{pattern!r} names an unknown field {{{exc.args[0]}}} (known: {LOG_FIELDS})"
        ) from None
    except IndexError:
        raise ValueError(
            f"{pattern!r} has a positional field {{}} (use a named one: {LOG_FIELDS})"
        ) from None
    except (ValueError, AttributeError, TypeError) as exc:
        raise ValueError(f"{pattern!r} is not a valid path template: {exc}") from None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            # Reap it when it is our own child (the demo's workers are), else just poll.
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done == pid:
                return True
        except ChildProcessError:
            pass
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return not _alive(pid)


def _stack_dump(pid: int, attempt_id: str, diag_dir: Path) -> str:
    """Returns a stack dump of the process: py-spy if installed, else the SDK's faulthandler file."""
    if shutil.which("py-spy"):
        proc = subprocess.run(
            ["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30
        )
        if proc.returncode == 0:
            return proc.stdout
    stack_file = diag_dir / f"{attempt_id}.stack"
    before = stack_file.stat().st_size if stack_file.exists() else 0
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        return "(process already gone)"
    deadline = time.monotonic() + 5.0
    size = before
    while time.monotonic() < deadline:
        time.sleep(0.1)
        grown = stack_file.stat().st_size if stack_file.exists() else before
        # faulthandler writes thread by thread: read once the file stops growing.
        if grown > before and grown == size:
            break
        size = grown
    if size <= before:
        return "(no stack dump: install py-spy, or run the job inside shard_client's shard context)"
    with stack_file.open("rb") as f:
        f.seek(before)
        return f.read().decode(errors="replace")


def _log_tail(pattern: str | None, view: dict[str, Any], lines: int) -> str:
    if not pattern:
        return ""
    path = log_path(
        pattern, shard_id=view["shard_id"], attempt_id=view["latest_attempt"], pid=view.get("pid")
    )
    if not path.exists():
        return f"(no log at {path})"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _write_diagnostics(
    action: Action,
    view: dict[str, Any],
    *,
    pid: int,
    diag_dir: Path,
    log_pattern: str | None,
    log_lines: int,
) -> None:
    """Writes the stack dump and log tail to a report; what fails goes to action.diagnostics_errors."""
    # Each part is tried on its own: a hung job must still be stopped and recorded,
    # and a partial report (a stack without its log) beats none.
    try:
        diag_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        action.diagnostics_errors.append(f"cannot create {diag_dir}: {exc.strerror}")
    try:
        stack = _stack_dump(pid, action.attempt_id, diag_dir)
    except (OSError, subprocess.SubprocessError) as exc:
        stack = f"(no stack dump: {exc})"
        action.diagnostics_errors.append(f"stack dump failed: {exc}")
    try:
        tail = _log_tail(log_pattern, view, log_lines)
    except OSError as exc:
        tail = f"(cannot read log {exc.filename}: {exc.strerror})"
        action.diagnostics_errors.append(f"cannot read log {exc.filename}: {exc.strerror}")
    except ValueError as exc:
        tail = f"(bad --log-file: {exc})"
        action.diagnostics_errors.append(f"bad --log-file: {exc}")
    report = diag_dir / f"{action.attempt_id}.watchdog.txt"
    try:
        report.write_text(
            f"stale attempt {action.attempt_id} of shard {action.shard_id}, pid {pid}\n\n"
            f"== stack\n{stack}\n== last log lines\n{tail}\n"
        )
    except OSError as exc:
        action.diagnostics_errors.append(f"cannot write {report}: {exc.strerror}")
        action.steps.append("diagnostics not written")
        return
    action.diagnostics = str(report)
    action.steps.append("diagnostics")


def _stop(action: Action, pid: int, grace_s: float) -> None:
    """Sends SIGTERM, waits the grace period, then SIGKILL; a process that exits first is fine."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        action.steps.append("exited before SIGTERM")
        return
    action.steps.append("SIGTERM")
    if _wait_gone(pid, grace_s):
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return  # it exited between the last poll and the kill
    action.steps.append("SIGKILL")
    _wait_gone(pid, 5.0)


def _recovered(action: Action, recheck: Recheck | None) -> bool:
    """Returns whether the attempt is no longer stale on the ledger, noting it in the action."""
    if recheck is None or recheck(action.shard_id, action.attempt_id):
        return False
    action.recovered = True
    action.steps.append("recovered: no longer stale on the ledger, left alone")
    return True


def handle_stale(
    view: dict[str, Any],
    *,
    append: Callable[[list[pb.ShardEvent]], object],
    run_id: str,
    namespace: str,
    grace_s: float,
    diag_dir: Path,
    log_pattern: str | None = None,
    log_lines: int = 50,
    record_remote: bool = False,
    recheck: Recheck | None = None,
) -> Action:
    """Collects diagnostics, stops the process (TERM, grace, KILL) and records failed(timeout).

    With a recheck, the ledger is asked again before the stack dump and before SIGTERM,
    since the view may be seconds old (the watchdog handles shards one at a time) and a
    shard that heartbeated meanwhile is healthy again.
    """
    pid = view.get("pid")
    action = Action(view["shard_id"], view["latest_attempt"], view.get("host", ""), pid)
    local = action.host in ("", socket.gethostname())
    if not local and not record_remote:
        action.steps.append(f"on host {action.host}: not signalled (run the watchdog there)")
        return action
    if _recovered(action, recheck):
        return action
    if local and pid and _alive(pid):
        _write_diagnostics(
            action,
            view,
            pid=pid,
            diag_dir=diag_dir,
            log_pattern=log_pattern,
            log_lines=log_lines,
        )
        if _recovered(action, recheck):
            return action
        _stop(action, pid, grace_s)
    elif local and pid:
        action.steps.append("process already gone")
    message = f"watchdog: silent past its heartbeat timeout; {', '.join(action.steps)}"
    if action.diagnostics:
        message += f"; diagnostics in {action.diagnostics}"
    if action.diagnostics_errors:
        message += f"; diagnostics incomplete: {'; '.join(action.diagnostics_errors)}"
    # A deterministic id makes a second watchdog pass on the same attempt a no-op.
    event = pb.ShardEvent(
        event_id=f"watchdog-{uuid.uuid5(uuid.NAMESPACE_URL, f'{namespace}/{run_id}/{action.attempt_id}').hex}",
        namespace=namespace,
        run_id=run_id,
        shard_id=action.shard_id,
        attempt_id=action.attempt_id,
        failed=pb.AttemptFailed(tag=pb.FAILURE_TAG_TIMEOUT, message=message),
    )
    append([event])
    action.recorded = True
    return action


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds the watch command."""
    p = sub.add_parser(
        "watch",
        parents=[common],
        help="find stale attempts; with --kill-stale, dump stacks, stop them and record failed(timeout)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_id", metavar="RUN")
    p.add_argument(
        "--kill-stale", action="store_true", help="act on stale attempts (default: only list them)"
    )
    p.add_argument(
        "--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL (default 10)"
    )
    p.add_argument(
        "--interval",
        type=float,
        default=0.0,
        help="keep watching, polling every N seconds; with --json, print JSON Lines: one compact "
        "object per stale attempt as it is handled (a single pass prints one JSON array)",
    )
    p.add_argument(
        "--diag-dir",
        default=None,
        help=f"where diagnostics go (default ${DIAG_ENV} or /tmp/shardledger-diag); "
        "created at start, exit 5 if that fails",
    )
    p.add_argument(
        "--log-file",
        default=None,
        help=f"job log path pattern, e.g. 'logs/{{shard_id}}.log' (fields: {LOG_FIELDS}); "
        "checked at start",
    )
    p.add_argument(
        "--record-remote",
        action="store_true",
        help="also mark stale attempts of other hosts failed(timeout)",
    )
    p.set_defaults(func=run)


def _check_options(args: argparse.Namespace, diag_dir: Path) -> None:
    """Fails now on options that would otherwise only break when a job hangs."""
    if args.log_file:
        try:
            sample = log_path(args.log_file, shard_id="shard", attempt_id="attempt", pid=1)
        except ValueError as exc:
            raise CommandError(f"--log-file: {exc}", EXIT_USAGE) from None
        if sample.is_dir():
            raise CommandError(f"--log-file: {sample} is a directory, not a log file")
    if not args.kill_stale:
        return
    if diag_dir.exists() and not diag_dir.is_dir():
        raise CommandError(f"--diag-dir: {diag_dir} exists and is not a directory")
    try:
        diag_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CommandError(f"--diag-dir: cannot create {diag_dir}: {exc.strerror}") from None
    if not os.access(diag_dir, os.W_OK | os.X_OK):
        raise CommandError(f"--diag-dir: {diag_dir} is not writable")


def _print_action(action: Action, *, json_lines: bool) -> None:
    if json_lines:
        sys.stdout.write(json.dumps(action.to_json(), sort_keys=True, separators=(",", ":")) + "\n")
    else:
        what = ", ".join(action.steps) if action.steps else "stale"
        print(f"{action.shard_id}  attempt {action.attempt_id}  {action.host}:{action.pid}  {what}")
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    """Lists or handles stale attempts, once or in a loop."""
    diag_dir = Path(args.diag_dir) if args.diag_dir else default_diag_dir()
    _check_options(args, diag_dir)
    client = client_from(args)
    recheck = stale_checker(client, args.run_id, namespace=args.namespace)
    # A poll loop never ends, so it cannot print one JSON document: it streams JSON Lines.
    json_lines = args.json and args.interval > 0
    found = 0
    diagnostics_failed = False
    while True:
        stale = [
            json.loads(v.view_json)
            for v in client.shards(args.run_id, namespace=args.namespace, state="stale")
        ]
        found += len(stale)
        actions: list[Action] = []
        for view in stale:
            if args.kill_stale:
                action = handle_stale(
                    view,
                    append=client.append,
                    run_id=args.run_id,
                    namespace=args.namespace,
                    grace_s=args.grace,
                    diag_dir=diag_dir,
                    log_pattern=args.log_file,
                    record_remote=args.record_remote,
                    recheck=recheck,
                )
            else:
                action = Action(
                    view["shard_id"], view["latest_attempt"], view.get("host", ""), view.get("pid")
                )
            for problem in action.diagnostics_errors:
                print(
                    f"shardledger: diagnostics of attempt {action.attempt_id} of shard "
                    f"{action.shard_id}: {problem}",
                    file=sys.stderr,
                )
            diagnostics_failed |= bool(action.diagnostics_errors)
            actions.append(action)
            if json_lines or not args.json:
                _print_action(action, json_lines=json_lines)
        if args.json and not json_lines:
            print_json([a.to_json() for a in actions])
        elif not actions and not args.json:
            print(f"no stale attempts in {args.run_id}", file=sys.stderr)
        sys.stdout.flush()
        if args.interval <= 0:
            break
        time.sleep(args.interval)
    if diagnostics_failed:
        return EXIT_LOCAL
    return EXIT_PROBLEMS if found and not args.kill_stale else EXIT_OK
