"""`shardledger watch RUN`: the watchdog for silent hangs.

A stale attempt is running, but silent past its heartbeat timeout on the
server clock. With --kill-stale, for each one (many at once, --parallel):

  1. diagnostics, when the process runs on this host: a Python stack dump
     (py-spy when installed, else SIGUSR1, which the SDK routes to
     faulthandler) and the last lines of the job's log (--log-file);
  2. stop it, through what its started event recorded:
       Slurm job       scancel --signal=TERM --full JOBID, after --grace: scancel JOBID,
                       then `scontrol -o show job JOBID` until it left (both must be
                       on this host's PATH and reach the cluster's slurmctld)
       Kubernetes pod  kubectl delete pod POD --namespace NS --grace-period=GRACE
       Ray task        through Ray ($RAY_ADDRESS, else the local cluster; needs the
                       ray extra): a task pinned to the attempt's node sends the
                       worker SIGTERM, --grace, SIGKILL (start time checked), as
                       ray.cancel(force=True) would; Ray retries it if it may
       --kill-command  your command, e.g. 'ssh {host} kill -TERM {pid}' (no shell)
       this host       SIGTERM, --grace, SIGKILL: only when the pid's start time
                       (/proc/PID/stat) is the recorded one, never a reused pid
  3. record failed(timeout) (once: a second watchdog's record is the same event).

The ledger is asked again before each step; an attempt that heartbeated
meanwhile is left alone, one that ended meanwhile (e.g. failed(preempted) from
the job's own SIGTERM handler) is done. With --interval the watchdog runs as a
service: an unreachable ledger (a restart) is logged on stderr and retried
with backoff, and watching goes on.

kill-command placeholders: {job_id} {array_job_id} {array_task_id} {cluster}
{node} {namespace} {task_id} {task_attempt} {actor_id} {pod} {host} {pid}
{start_ticks} {run_id} {shard_id} {attempt_id} {grace}

Examples:
  shardledger watch night-01                         # list stale attempts (exit 1 if any)
  shardledger watch night-01 --kill-stale --once     # one pass: stop them, record timeout
  shardledger watch night-01 --kill-stale --interval 30 --grace 30 --log-file 'logs/{shard_id}.log'

exit codes: 0 ok (or nothing stale); 1 stale attempts listed (without --kill-stale);
3 unreachable (one pass); 5 diagnostics or a stop failed (the rest still done)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shard_client import backoff
from shard_client.errors import LedgerClientError, LedgerUnavailable, Overloaded
from shardledger_cli.cli import (
    EXIT_LOCAL,
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    CommandError,
    at_least,
    client_from,
)
from shardledger_cli.commands import watch_stop
from shardledger_cli.commands.watch_diag import DIAG_ENV, LOG_FIELDS, default_diag_dir, log_path
from shardledger_cli.commands.watch_handle import Action, handle_stale, stale_checker
from shardledger_cli.commands.watch_stop import StartedIndex, Target
from shardledger_cli.local_ledger import serve_db_option
from shardledger_cli.parsing import json_help

__all__ = ["Action", "StartedIndex", "Target", "default_diag_dir", "handle_stale", "stale_checker"]


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds the watch command."""
    p = sub.add_parser(
        "watch",
        parents=[common],
        help="find stale attempts; with --kill-stale, diagnose and stop them (signals, scancel, "
        "kubectl, Ray) and record failed(timeout)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_id", metavar="RUN")
    p.add_argument(
        "--kill-stale", action="store_true", help="act on stale attempts (default: only list them)"
    )
    p.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds between TERM and the kill (scancel, SIGKILL; kubectl's --grace-period) "
        "(default 10)",
    )
    p.add_argument(
        "--interval",
        type=float,
        default=0.0,
        help="keep watching, polling every N seconds (--json prints one compact object per"
        " stale attempt as it is handled, in a loop as in a single pass)",
    )
    p.add_argument(
        "--once", action="store_true", help="one pass, then exit (the default without --interval)"
    )
    p.add_argument(
        "--parallel",
        type=at_least(1),
        default=32,
        metavar="N",
        help="handle up to N stale attempts at once (default 32): 20 hung jobs take about one "
        "grace period, not 20",
    )
    p.add_argument(
        "--kill-command",
        metavar="TEMPLATE",
        default=None,
        help="stop every stale attempt with this command instead (split like a shell would, "
        "run without one), e.g. 'ssh {host} kill -TERM {pid}'; placeholders above",
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
        help="also mark failed(timeout) the stale attempts the watchdog cannot stop (another "
        "host and no scheduler identity, no recorded start time, a failed stop)",
    )
    json_help(p, lines="one stale attempt and what was done to it")
    serve_db_option(p, run, refuse=_acts)


def _acts(args: argparse.Namespace) -> str:
    """Returns why watch cannot run on a ledger read with --db (it would act or wait), or ""."""
    for given, flag, why in (
        (args.kill_stale, "--kill-stale", "records failed(timeout)"),
        (args.record_remote, "--record-remote", "records failed(timeout)"),
        (args.interval > 0, "--interval", "waits for what a server records"),
    ):
        if given:
            return (
                f"{flag} {why}, and --db reads the ledger with no server and writes nothing:"
                " with --db, watch only lists the stale attempts (one pass); act through the"
                " server that writes the ledger (--server)"
            )
    return ""


def _check_options(args: argparse.Namespace, diag_dir: Path) -> None:
    """Fails now on options that would otherwise only break when a job hangs."""
    if args.once and args.interval > 0:
        raise CommandError("--once and --interval exclude each other", EXIT_USAGE)
    if args.kill_command:
        try:
            watch_stop.check_template(args.kill_command)
        except ValueError as exc:
            raise CommandError(f"--kill-command: {exc}", EXIT_USAGE) from None
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
        job = (
            f" {action.scheduler['kind']}:{action.scheduler.get('job_id', '')}"
            if action.scheduler
            else ""
        )
        print(
            f"{action.shard_id}  attempt {action.attempt_id}  {action.host}:{action.pid}{job}  {what}"
        )
    sys.stdout.flush()


def _warn(message: str) -> None:
    print(f"shardledger: watch: {message}", file=sys.stderr, flush=True)


@dataclass(slots=True)
class _Watch:
    """One watch command's state across passes."""

    args: argparse.Namespace
    client: Any
    diag_dir: Path
    index: StartedIndex
    pool: ThreadPoolExecutor
    found: int = 0
    failed_locally: bool = False
    # Stopped attempts whose failed(timeout) the ledger did not take yet: the next pass
    # records them with their diagnostics (watch_handle.handle_stale).
    unrecorded: dict[str, Action] = field(default_factory=dict)

    def one_pass(self, *, keep_going: bool) -> list[Action]:
        """Lists the stale attempts and handles them concurrently; returns the actions in plan order."""
        args = self.args
        stale = [
            json.loads(v.view_json)
            for v in self.client.shards(args.run_id, namespace=args.namespace, state="stale")
        ]
        self.found += len(stale)
        targets = [self.index.target(view, self.client) for view in stale]
        if not args.kill_stale:
            return [Action.of(t) for t in targets]
        recheck = stale_checker(self.client, args.run_id, namespace=args.namespace)
        futures: list[Future[Action]] = [
            self.pool.submit(
                handle_stale,
                view,
                target=target,
                append=self.client.append,
                run_id=args.run_id,
                namespace=args.namespace,
                grace_s=args.grace,
                diag_dir=self.diag_dir,
                log_pattern=args.log_file,
                record_remote=args.record_remote,
                recheck=recheck,
                kill_command=args.kill_command,
                unrecorded=self.unrecorded,
            )
            for view, target in zip(stale, targets, strict=True)
        ]
        actions, first_error = [], None
        for target, future in zip(targets, futures, strict=True):
            try:
                actions.append(future.result())
            except LedgerClientError as exc:
                # The others still finish; the next pass retries this one (its record is idempotent).
                _warn(
                    f"attempt {target.attempt_id} of shard {target.shard_id}: not recorded: {exc}"
                )
                first_error = first_error or exc
        if first_error is not None and not keep_going:
            raise first_error
        return actions

    def report(self, actions: list[Action], *, json_lines: bool) -> None:
        """Prints the pass's actions and their diagnostics problems."""
        for action in actions:
            for problem in action.diagnostics_errors:
                _warn(
                    f"diagnostics of attempt {action.attempt_id} of shard {action.shard_id}: {problem}"
                )
            if action.stop_error:
                _warn(
                    f"attempt {action.attempt_id} of shard {action.shard_id}: {action.stop_error}"
                )
            self.failed_locally |= bool(action.diagnostics_errors or action.stop_error)
            _print_action(action, json_lines=self.args.json)
        if not actions and not self.args.json:
            print(f"no stale attempts in {self.args.run_id}", file=sys.stderr)
        sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    """Lists or handles stale attempts, once or in a loop that outlives ledger restarts."""
    diag_dir = Path(args.diag_dir) if args.diag_dir else default_diag_dir()
    _check_options(args, diag_dir)
    loop = args.interval > 0
    # --json is JSON Lines, one pass or a loop that never ends: one action per line.
    json_lines = args.json
    # A loop waits out an absent ledger (its own backoff below); one pass fails fast.
    client = client_from(args, probe=not loop)
    if loop:
        # The loop's own backoff, which logs, takes over from the client's silent retries.
        client.retry_deadline_s = min(client.retry_deadline_s, args.timeout)
    with ThreadPoolExecutor(args.parallel, thread_name_prefix="watch") as pool:
        watch = _Watch(args, client, diag_dir, StartedIndex(args.run_id, args.namespace), pool)
        delay = 0.0
        while True:
            try:
                actions = watch.one_pass(keep_going=loop)
            except (LedgerUnavailable, Overloaded) as exc:
                if not loop:
                    raise
                delay = backoff.grown(delay, 30.0) if delay else max(1.0, args.interval)
                _warn(f"ledger unreachable: {exc}; retrying in {delay:.0f} s")
                time.sleep(delay)
                continue
            if delay:
                _warn("ledger reachable again")
                delay = 0.0
            watch.report(actions, json_lines=json_lines)
            if not loop:
                break
            time.sleep(args.interval)
    if watch.failed_locally:
        return EXIT_LOCAL
    return EXIT_PROBLEMS if watch.found and not args.kill_stale else EXIT_OK
