"""`shardledger watch RUN`: the watchdog for silent hangs.

For every stale attempt (running, but silent past its heartbeat timeout on the
server clock) it collects diagnostics first — a Python stack dump of the
process (py-spy when installed, else SIGUSR1, which the SDK's shard context
routes to faulthandler) and the last lines of the job's log — then sends
SIGTERM, waits a grace period, sends SIGKILL, and records failed(timeout).
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
from tools.cli import EXIT_OK, EXIT_PROBLEMS, client_from, print_json

DIAG_ENV = "SHARDLEDGER_DIAG_DIR"


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

    def to_json(self) -> dict[str, Any]:
        """Returns the action as JSON."""
        return {
            "shard_id": self.shard_id,
            "attempt_id": self.attempt_id,
            "host": self.host,
            "pid": self.pid,
            "steps": self.steps,
            "diagnostics": self.diagnostics,
            "recorded_failed_timeout": self.recorded,
        }


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
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        if stack_file.exists() and stack_file.stat().st_size > before:
            time.sleep(0.1)  # let faulthandler finish writing every thread
            return stack_file.read_text(errors="replace")[before:]
        time.sleep(0.05)
    return "(no stack dump: install py-spy, or run the job inside shard_client's shard context)"


def _log_tail(pattern: str | None, view: dict[str, Any], lines: int) -> str:
    if not pattern:
        return ""
    path = Path(
        pattern.format(
            shard_id=view["shard_id"], attempt_id=view["latest_attempt"], pid=view.get("pid")
        )
    )
    if not path.exists():
        return f"(no log at {path})"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


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
) -> Action:
    """Collects diagnostics, stops the process (TERM, grace, KILL) and records failed(timeout)."""
    pid = view.get("pid")
    action = Action(view["shard_id"], view["latest_attempt"], view.get("host", ""), pid)
    local = action.host in ("", socket.gethostname())
    diag_dir.mkdir(parents=True, exist_ok=True)
    if local and pid and _alive(pid):
        stack = _stack_dump(pid, action.attempt_id, diag_dir)
        report = diag_dir / f"{action.attempt_id}.watchdog.txt"
        report.write_text(
            f"stale attempt {action.attempt_id} of shard {action.shard_id}, pid {pid}\n\n== stack\n{stack}\n"
            f"== last log lines\n{_log_tail(log_pattern, view, log_lines)}\n"
        )
        action.diagnostics = str(report)
        action.steps.append("diagnostics")
        os.kill(pid, signal.SIGTERM)
        action.steps.append("SIGTERM")
        if not _wait_gone(pid, grace_s):
            os.kill(pid, signal.SIGKILL)
            action.steps.append("SIGKILL")
            _wait_gone(pid, 5.0)
    elif local and pid:
        action.steps.append("process already gone")
    elif not record_remote:
        action.steps.append(f"on host {action.host}: not signalled (run the watchdog there)")
        return action
    message = f"watchdog: silent past its heartbeat timeout; {', '.join(action.steps)}"
    if action.diagnostics:
        message += f"; diagnostics in {action.diagnostics}"
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
        "--interval", type=float, default=0.0, help="keep watching, polling every N seconds"
    )
    p.add_argument(
        "--diag-dir",
        default=None,
        help=f"where diagnostics go (default ${DIAG_ENV} or /tmp/shardledger-diag)",
    )
    p.add_argument(
        "--log-file",
        default=None,
        help="job log path pattern, e.g. 'logs/{shard_id}.log' ({attempt_id}, {pid} too)",
    )
    p.add_argument(
        "--record-remote",
        action="store_true",
        help="also mark stale attempts of other hosts failed(timeout)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Lists or handles stale attempts, once or in a loop."""
    client = client_from(args)
    diag_dir = Path(args.diag_dir) if args.diag_dir else default_diag_dir()
    found = 0
    while True:
        stale = [
            json.loads(v.view_json)
            for v in client.shards(args.run_id, namespace=args.namespace, state="stale")
        ]
        found += len(stale)
        actions: list[Action] = []
        for view in stale:
            if args.kill_stale:
                actions.append(
                    handle_stale(
                        view,
                        append=client.append,
                        run_id=args.run_id,
                        namespace=args.namespace,
                        grace_s=args.grace,
                        diag_dir=diag_dir,
                        log_pattern=args.log_file,
                        record_remote=args.record_remote,
                    )
                )
            else:
                actions.append(
                    Action(
                        view["shard_id"],
                        view["latest_attempt"],
                        view.get("host", ""),
                        view.get("pid"),
                    )
                )
        if args.json:
            print_json([a.to_json() for a in actions])
        else:
            for a in actions:
                what = ", ".join(a.steps) if a.steps else "stale"
                print(f"{a.shard_id}  attempt {a.attempt_id}  {a.host}:{a.pid}  {what}")
            if not actions:
                print(f"no stale attempts in {args.run_id}", file=sys.stderr)
        sys.stdout.flush()
        if args.interval <= 0:
            break
        time.sleep(args.interval)
    return EXIT_PROBLEMS if found and not args.kill_stale else EXIT_OK
