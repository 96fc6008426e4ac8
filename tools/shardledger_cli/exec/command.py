"""`shardledger exec RUN SHARD --output NAME=PATH ... -- COMMAND ...`: any process as a shard."""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from collections.abc import Sequence
from typing import Any, Final

from shard_client import Ledger
from shard_client.ids import check_id
from shard_client.inputs import INPUT_CHECKS, PlannedInput
from shard_client.options import ShardOptions
from shardledger_cli.cli import (
    EXIT_REJECTED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CommandError,
    at_least,
    client_from,
    positive_seconds,
)
from shardledger_cli.exec.attempt import read_fingerprint
from shardledger_cli.exec.outputs import parse_output, prepare_outputs
from shardledger_cli.exec.progress import MARKER, PROGRESS_FILE_ENV
from shardledger_cli.exec.run import ExecSpec, Report, execute
from shardledger_cli.exec.target import (
    ARRAY_ENV,
    PLACEHOLDERS,
    check_expected,
    resolve_target,
    substitute,
)
from shardledger_cli.parsing import json_help

__all__ = ["register", "run_exec"]

INPUT_CHECK_CHOICES: Final = (*INPUT_CHECKS, "off")

DESCRIPTION: Final = f"""\
Run any program (a shell script, a C++ renderer, a Julia simulation) as one
attempt at a planned shard, without changing it: `started` is recorded with the
node's fingerprint and the scheduler's identity, heartbeats go out while the
child lives, and its outputs are committed atomically only after a clean exit.

The child writes each declared output to a temp path beside the final one, given
as $SHARDLEDGER_OUTPUT_<NAME> (NAME upper-cased, other characters as _) and as
{{tmp:NAME}} in its arguments. Only when it exits 0 and every output exists and
passes the content checks `verify` runs (not empty, JSON that parses, complete
archives and images, ...) is each one fsynced, renamed to its final path and
recorded (size, blake3). Otherwise nothing reaches a final path and the attempt
is recorded failed(TAG): killed (SIGKILL, 137), preempted (SIGTERM to
shardledger exec, forwarded; KILL after --term-grace), oom (the cgroup's OOM
counter, or the child's last words), incomplete (exit 0 without every output,
or with an empty or invalid one), timeout (the hang watchdog), or what the
child's last output lines say (oom, data, nccl), else unknown.

Progress: a line `{MARKER} step=N [progress=F] [key=NUMBER ...]` on stdout or
stderr, or the same pairs written to ${PROGRESS_FILE_ENV}, is sent as a
heartbeat with those metrics and feeds the hang watchdog. By default any output
line also counts as a sign of life (--liveness output); with --liveness
progress only progress reports do. The watchdog trips after --hang-timeout
seconds without one, or, once two progress reports came, after 10 x the median
step time + --hang-grace (the SDK's rule): it writes a diagnostics bundle (the
child group's /proc state, its last output lines), records failed(timeout),
sends TERM to the child's process group and KILL after --kill-grace.

Placeholders in the command: {PLACEHOLDERS}. The child also gets
$SHARDLEDGER_RUN, $SHARDLEDGER_SHARD, $SHARDLEDGER_ATTEMPT and, from a plan
line, $SHARDLEDGER_PLAN_LINE and $SHARDLEDGER_INPUT.

The child never outlives exec: it runs in its own process group with a
parent-death signal (PR_SET_PDEATHSIG, SIGKILL), and a guard process holding a
pipe from exec SIGKILLs that whole group, grandchildren too, and removes the
attempt's temp files within a second of exec's death, SIGKILL included.

Input: with a plan line (or --input), the input is read again before the
child starts and compared with the plan (docs/concepts.md, "Input identity"): an
input with other bytes than planned, or gone, is failed(input_changed) and the
child never runs (exit 66).

exit codes: the child's own exit status (128+N when signal N killed it);
124 the hang watchdog stopped it; 65 it exited 0 but its outputs were refused
(failed(incomplete)); 66 its input is not the one planned (failed(input_changed),
the child never ran); 74 committing them failed; 126/127 the command could not
be run. Before the child starts: 2 usage, 4 refused by the ledger (unknown run
or shard), 5 local error (an input that cannot be read). A ledger that cannot be reached is no exit: started
waits --unavailable-after seconds, then spools, and the child runs; at the end
exec waits $SHARDLEDGER_EXIT_WAIT (default 10 s) for the spool to drain and
leaves the rest to `shardledger spool drain`.
"""

EPILOG: Final = f"""\
Examples:
  # the child writes where $SHARDLEDGER_OUTPUT_WEIGHTS / {{tmp:weights}} point
  shardledger exec night-01 s-1f2e --output weights=out/w.bin --output metrics=out/m.json \\
      -- ./render --frame 17 --out {{tmp:weights}} --stats {{tmp:metrics}}
  # a bash job from a plan line, watched for hangs (no output for 10 minutes)
  shardledger exec night-01 --plan-line "$LINE" --output counts=out/{{shard}}.counts.txt \\
      --output summary=out/{{shard}}.summary.json --hang-timeout 600 -- bash examples/shell_job.sh
  # in a Slurm array: line N+1 of the plan file for ${ARRAY_ENV}=N
  shardledger exec night-01 --plan-file plan-lines.jsonl --output frame=out/{{shard}}.png \\
      -- ./render --input {{input}} --frame {{param:frame}} --out {{tmp:frame}}
  # only progress lines count as signs of life; the outcome as JSON on the last line
  shardledger exec night-01 s-1f2e --output log=out/run.txt --liveness progress --json -- make render

Output paths may use {{shard}}, {{run}} and {{param:KEY}} too. The whole story: docs/exec.md.
"""


class _ExecParser(argparse.ArgumentParser):
    """Takes everything after the first `--` as the child's command, options and all."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        words = list(sys.argv[1:] if args is None else args)
        before, command = (
            (words[: words.index("--")], words[words.index("--") + 1 :])
            if "--" in words
            else (words, [])
        )
        parsed, unknown = super().parse_known_args(before, namespace)
        parsed.command = command
        return parsed, unknown


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds `shardledger exec`."""
    # argparse offers no other way to give one subcommand its own parser class.
    default_class, sub._parser_class = sub._parser_class, _ExecParser
    try:
        p = sub.add_parser(
            "exec",
            parents=[common],
            formatter_class=argparse.RawDescriptionHelpFormatter,
            help="run any program as one attempt at a shard: started, heartbeats, atomic commits"
            " of its outputs, failed(tag) from its exit",
            description=DESCRIPTION,
            epilog=EPILOG,
            usage="shardledger exec [options] RUN [SHARD] --output NAME=PATH ... -- COMMAND [ARG ...]",
        )
    finally:
        sub._parser_class = default_class
    json_help(p, single="the attempt's report, after the child ended")
    p.add_argument("run", metavar="RUN", help="run id")
    p.add_argument(
        "shard",
        metavar="SHARD",
        nargs="?",
        help="shard id, whole or cut as the CLI prints ids (s-3c52ba9ca020…: the ledger names"
        " the one shard it starts), or --plan-line / --plan-file",
    )
    shard = p.add_argument_group("the shard")
    shard.add_argument(
        "--plan-line", metavar="JSON", help="one plan line (plan --dry-run) with its shard_id"
    )
    shard.add_argument(
        "--plan-file",
        metavar="FILE",
        help=f"plan lines; line N+1 is used for --index N or ${ARRAY_ENV}",
    )
    shard.add_argument(
        "--index",
        type=at_least(0),
        metavar="N",
        help=f"the plan file's line (0-based; default ${ARRAY_ENV})",
    )
    shard.add_argument(
        "--attempt-id", metavar="ID", help="the attempt's id (default: a fresh random one)"
    )
    shard.add_argument(
        "--input",
        metavar="REF",
        help="the input the child reads (a path or URL), checked against the plan before it"
        ' starts; default: the plan line\'s "input" (whose input_identity says what the plan'
        " recorded)",
    )
    shard.add_argument(
        "--input-check",
        choices=INPUT_CHECK_CHOICES,
        default="identity",
        help="identity (default): compare the input's size, mtime, inode and device (an"
        " object's version id and ETag) with the plan, re-hashing only when they differ;"
        " hash: always re-hash; off: no check. A changed input is failed(input_changed),"
        " exit 66, and the child never runs",
    )
    outs = p.add_argument_group("outputs")
    outs.add_argument(
        "--output",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="an output the child must write (repeatable); committed to PATH after a clean exit",
    )
    watch = p.add_argument_group("heartbeats and the hang watchdog")
    watch.add_argument(
        "--heartbeat-timeout",
        type=positive_seconds,
        default=60.0,
        metavar="S",
        help="seconds without a heartbeat before the ledger calls the attempt stale (default 60)",
    )
    watch.add_argument(
        "--heartbeat-interval",
        type=positive_seconds,
        default=None,
        metavar="S",
        help="seconds between heartbeats (default: a quarter of --heartbeat-timeout)",
    )
    watch.add_argument(
        "--hang-timeout",
        type=positive_seconds,
        default=None,
        metavar="S",
        help="seconds without a sign of life that count as hung (default $SHARDLEDGER_HANG_TIMEOUT, else the step rule)",
    )
    watch.add_argument(
        "--hang-grace",
        type=float,
        default=None,
        metavar="S",
        help="the fixed part of the step rule (default $SHARDLEDGER_HANG_GRACE, else 300)",
    )
    watch.add_argument(
        "--kill-grace",
        type=float,
        default=None,
        metavar="S",
        help="seconds from the watchdog's TERM to its KILL (default $SHARDLEDGER_KILL_GRACE, else 30)",
    )
    watch.add_argument(
        "--liveness",
        choices=("output", "progress"),
        default="output",
        help="what counts as a sign of life: any output line (default) or progress reports only",
    )
    watch.add_argument(
        "--no-watchdog", action="store_true", help="no hang watchdog (heartbeats still go out)"
    )
    watch.add_argument(
        "--term-grace",
        type=positive_seconds,
        default=30.0,
        metavar="S",
        help="seconds from a forwarded SIGTERM to SIGKILL of the child's group (default 30)",
    )
    env = p.add_argument_group("environment and spool")
    env.add_argument(
        "--fingerprint-field",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="add a field to the fingerprint (the child's runtime: renderer.version=2.3)",
    )
    env.add_argument(
        "--no-fingerprint", action="store_true", help="record no environment fingerprint"
    )
    env.add_argument(
        "--unavailable-after",
        type=positive_seconds,
        default=5.0,
        metavar="S",
        help="seconds the ledger may be unreachable before events go to the spool (default 5)",
    )
    env.add_argument(
        "--spool-dir",
        metavar="DIR",
        default=None,
        help="spool root while the ledger is unreachable (default $SHARDLEDGER_SPOOL_DIR)",
    )
    p.set_defaults(func=run_exec)


def _fields(pairs: Sequence[str]) -> dict[str, str]:
    fields = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CommandError(f"--fingerprint-field {pair!r}: expected KEY=VALUE", EXIT_USAGE)
        fields[key] = value
    return fields


def _spec(args: argparse.Namespace) -> ExecSpec:
    if not args.command:
        raise CommandError(
            "give the command after --: shardledger exec RUN SHARD ... -- COMMAND", EXIT_USAGE
        )
    if not args.output:
        raise CommandError(
            "declare at least one --output NAME=PATH (what the child writes)", EXIT_USAGE
        )
    attempt_id = args.attempt_id or uuid.uuid4().hex
    try:
        check_id("RUN", args.run)
        check_id("--attempt-id", attempt_id)
        target = resolve_target(
            shard=_whole_id(args) if args.shard else args.shard,
            plan_line=args.plan_line,
            plan_file=args.plan_file,
            index=args.index,
            env=os.environ,
        )
        # Output paths may name the shard, the run or a parameter (out/{shard}.json).
        names = {"shard": target.shard_id, "run": args.run}
        params = (target.plan_line or {}).get("params") or {}
        declared = [parse_output(_fill_path(text, names, params)) for text in args.output]
        check_expected(target, declared)
        options = ShardOptions(
            hang_timeout=args.hang_timeout,
            hang_grace=args.hang_grace,
            kill_grace=args.kill_grace,
            watchdog=not args.no_watchdog,
        )
        policy = options.hang_policy()
    except ValueError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    except OSError as exc:
        raise CommandError(str(exc)) from None
    try:
        outputs = prepare_outputs(declared, attempt_id=attempt_id)
        command = substitute(
            args.command, run_id=args.run, target=target, attempt_id=attempt_id, outputs=outputs
        )
    except ValueError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    except OSError as exc:
        raise CommandError(f"cannot prepare the outputs: {exc}") from None
    planned_input = None
    if args.input_check != "off":
        line = target.plan_line or {}
        named = args.input or line.get("input")
        if isinstance(named, str) and named:
            # The plan line's own identity counts only for the input it names.
            same = args.input is None or args.input == line.get("input")
            planned_input = PlannedInput.of({**line, "input": named} if same else {"input": named})
    return ExecSpec(
        input=planned_input,
        input_check=args.input_check if args.input_check != "off" else "identity",
        run_id=args.run,
        target=target,
        attempt_id=attempt_id,
        command=command,
        outputs=outputs,
        heartbeat_timeout_s=args.heartbeat_timeout,
        heartbeat_interval_s=args.heartbeat_interval or args.heartbeat_timeout / 4,
        policy=policy,
        liveness=args.liveness,
        term_grace_s=args.term_grace,
        fingerprint=read_fingerprint(
            _fields(args.fingerprint_field), enabled=not args.no_fingerprint
        ),
    )


def _whole_id(args: argparse.Namespace) -> str:
    """Returns the shard SHARD names: itself, or, cut as the CLI prints ids (s-3c52ba9ca020…),
    the one shard of the run whose id it starts.

    Only the cut form is looked up (a listing of the run's shards): an uncut SHARD is an
    id as it stands, so a job starts without asking the ledger, which may be away.
    """
    given: str = args.shard
    if not given.endswith(("…", "...")) or args.plan_line is not None or args.plan_file:
        return given
    from shard_client.errors import LedgerRejected, LedgerUnavailable
    from shardledger_cli.commands.events import resolve_shard

    try:
        client = client_from(args)
        try:
            return resolve_shard(client, args.run, given, namespace=args.namespace, what="SHARD")
        finally:
            client.close()
    except LedgerUnavailable as exc:
        raise CommandError(
            f"SHARD {given} is cut and the ledger, which knows the whole id, is unreachable"
            f" ({exc}): give the whole shard id",
            EXIT_UNAVAILABLE,
        ) from None
    except LedgerRejected as exc:
        raise CommandError(f"cannot look up SHARD {given}: {exc}", EXIT_REJECTED) from None


def _fill_path(text: str, names: dict[str, str], params: Any) -> str:
    out = text
    for key, value in names.items():
        out = out.replace("{" + key + "}", value)
    if isinstance(params, dict):
        for key, value in params.items():
            out = out.replace(
                "{param:" + key + "}", value if isinstance(value, str) else json.dumps(value)
            )
    return out


def _print(report: Report, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(report.as_json(), sort_keys=True) + "\n")
        sys.stdout.flush()
        return
    where = f"shardledger exec: shard {report.shard_id} attempt {report.attempt_id}"
    if report.outcome == "committed":
        names = ", ".join(
            f"{o['name']} ({o['size_bytes']} bytes) -> {o['path']}" for o in report.outputs
        )
        print(f"{where}: committed {names}", file=sys.stderr)
        return
    recorded = "" if report.recorded else " (NOT recorded: see the log above)"
    print(
        f"{where}: failed({report.tag}){recorded}: {report.message.splitlines()[0] if report.message else ''}",
        file=sys.stderr,
    )
    for problem in report.problems:
        print(f"  {problem['name']}: {problem['reason']}: {problem['detail']}", file=sys.stderr)
    if report.diagnostics_path:
        print(f"  diagnostics: {report.diagnostics_path}", file=sys.stderr)


def run_exec(args: argparse.Namespace) -> int:
    """Runs the command as one attempt; returns its exit code (see DESCRIPTION)."""
    client = client_from(args, probe=False)  # a malformed address: usage, before any output
    spec = _spec(args)
    with Ledger(
        client=client,  # an absent ledger: spool, as the SDK does
        namespace=args.namespace,
        spool_dir=args.spool_dir,
        unavailable_after_s=args.unavailable_after,
    ) as ledger:
        report = execute(spec, ledger)
    _print(report, args.json)
    return report.exit_code
