"""`shardledger plan RUN`: register a run's shards from a manifest or a directory of inputs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.canonical import canonical_json
from shard_client.client import LedgerClient
from shard_client.delivery import deliver
from shard_client.errors import LedgerRejected
from shard_client.ids import (
    PlanEntry,
    check_digest,
    check_id,
    duplicate_ids,
    hash_input,
    plan_events,
    shard_id_for,
)
from shardledger_cli.cli import (
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_REJECTED,
    EXIT_USAGE,
    CommandError,
    client_from,
)
from shardledger_cli.output import print_json, progress

BATCH: Final = 1000
MAX_ERRORS_SHOWN: Final = 20
_RULES_RUN: Final = "plan-check"  # any valid run id: the rules checked do not depend on it
# The server refuses events whose canonical content exceeds 64 KiB; keep room for the envelope.
MAX_ENTRY_CHARS: Final = 60 * 1024

DESCRIPTION: Final = """\
Register every shard of a run, one `planned` event each, before any job starts.

From a manifest (--manifest FILE, or - for stdin), one JSON object per line:
  {"input": "/data/a.bin", "params": {"lr": 0.1}, "expected_outputs": ["out"]}
with optional "shard_id" (else derived from the input's blake3 and the params,
see shard_client.shard_id_for) and "input_blake3"/"input_bytes". An input path
that exists (relative paths are resolved against the current directory) is
hashed, and a given input_blake3 must match it; an input that does not exist
here (a URL, an object key) needs input_blake3. The line is kept, as canonical
JSON with "shard_id" filled in, as the plan line that `resume` hands back.

From a directory (--inputs DIR --glob '*.bin'), one shard per matching file in
sorted order, all with the same --params and --expected-outputs.

Every line is checked before anything is sent: a bad line is reported with its
number and nothing is registered. Planning again is idempotent: an identical
shard (same input, params and expected outputs) is counted as already planned
and keeps its first plan index and plan line; a new shard in a re-plan of a run
that has shards is numbered after the highest stored index (said on stderr), so
no two shards share an index; a shard id planned before with a different
definition is a conflict, listed on stderr.

exit codes: 0 all shards new or already planned identically; 1 some conflict;
3 unreachable; 4 refused by the server; 5 bad manifest or inputs (nothing sent)
"""


@dataclass(slots=True)
class Outcome:
    """What the ledger said about the plan."""

    new: int = 0
    identical: int = 0
    conflicts: list[tuple[PlanEntry, str]] = field(default_factory=list)
    refused: list[tuple[PlanEntry, str]] = field(default_factory=list)


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds the plan command."""
    p = sub.add_parser(
        "plan",
        parents=[common],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="register a run's shards from a manifest or a directory of inputs",
        description=DESCRIPTION,
    )
    p.add_argument("run", help="run id")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--manifest", metavar="FILE", help="JSON-lines manifest, or - for stdin")
    source.add_argument("--inputs", metavar="DIR", help="plan one shard per file in DIR")
    p.add_argument(
        "--glob", default="*", help="with --inputs: file pattern, ** recurses (default *)"
    )
    p.add_argument("--params", default=None, help="with --inputs: parameters as a JSON object")
    p.add_argument(
        "--expected-outputs", default=None, metavar="A,B", help="with --inputs: artifact names"
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan lines; send nothing")
    p.add_argument(
        "--workers", type=int, default=min(8, os.cpu_count() or 4), help="parallel input hashing"
    )
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    """Builds the plan, checks all of it, then sends it (unless --dry-run)."""
    try:
        check_id("run id", args.run)
    except ValueError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    if args.manifest is None:
        entries = entries_from_dir(args)
    elif args.params is not None or args.expected_outputs is not None:
        raise CommandError("--params and --expected-outputs go with --inputs", EXIT_USAGE)
    else:
        entries = entries_from_manifest(args.manifest, workers=args.workers)
    if not entries:
        raise CommandError("nothing to plan: no manifest lines or matching inputs")
    if args.dry_run:
        return _print_dry_run(entries, as_json=args.json)
    client = client_from(args)
    entries = keep_stored_indexes(client, args.run, entries, namespace=args.namespace)
    outcome = send_plan(client, args.run, entries, namespace=args.namespace)
    return _report(args, entries, outcome)


def keep_stored_indexes(
    client: LedgerClient, run_id: str, entries: Sequence[PlanEntry], *, namespace: str = ""
) -> list[PlanEntry]:
    """Returns the entries renumbered for a run that already has shards.

    The ledger keeps each shard's first plan index, so a re-plan of a grown or
    re-sorted listing numbers the shards it already has as stored and the new ones
    after the highest stored index, in listing order: two shards never share an
    index (a Slurm array of the resume list would lose one).
    """
    try:
        stored = {
            view.shard_id: int(json.loads(view.view_json)["plan_index"])
            for view in client.shards(run_id, namespace=namespace)
        }
    except LedgerRejected as exc:
        if exc.reason == "RUN_NOT_FOUND":
            return list(entries)
        raise
    if not stored:
        return list(entries)
    following = max(stored.values()) + 1
    renumbered: list[PlanEntry] = []
    for entry in entries:
        index = stored.get(entry.shard_id)
        if index is None:
            index, following = following, following + 1
        renumbered.append(dataclasses.replace(entry, plan_index=index))
    moved = sum(a.plan_index != b.plan_index for a, b in zip(entries, renumbered, strict=True))
    if moved:
        print(
            f"shardledger: run {run_id} already has {len(stored)} shards: {moved} of this"
            " plan's indexes follow the stored ones (new shards are numbered from"
            f" {max(stored.values()) + 1})",
            file=sys.stderr,
        )
    return renumbered


# --- building the plan -------------------------------------------------------------


def _parse_line(text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError("must be a JSON object")
    if not isinstance(obj.get("input"), str) or not obj["input"]:
        raise ValueError('needs "input": a non-empty string (a path or a reference)')
    if not isinstance(obj.get("params", {}), dict):
        raise ValueError('"params" must be a JSON object')
    outputs = obj.get("expected_outputs", [])
    if not isinstance(outputs, list) or not all(isinstance(n, str) for n in outputs):
        raise ValueError('"expected_outputs" must be a list of names')
    for key in ("shard_id", "input_blake3"):
        if key in obj and not isinstance(obj[key], str):
            raise ValueError(f'"{key}" must be a string')
    size = obj.get("input_bytes", 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError('"input_bytes" must be a non-negative integer')
    return obj


def _entry(obj: dict[str, Any], index: int, digest: tuple[int, str] | None) -> PlanEntry:
    """Returns the entry for a parsed line; digest is (size, blake3) when the input was hashed."""
    given = obj.get("input_blake3", "")
    if digest is not None:
        if given and given != digest[1]:
            raise ValueError(f"input_blake3 {given} does not match the file ({digest[1]})")
        size, blake = digest
    elif given:
        check_digest("input_blake3", given)
        size, blake = obj.get("input_bytes", 0), given
    elif os.path.isdir(obj["input"]):
        raise ValueError(f"input {obj['input']!r} is a directory: a shard's input is one file")
    else:
        raise ValueError(
            f"input {obj['input']!r} does not exist here and the line has no input_blake3"
        )
    params = obj.get("params", {})
    shard_id = obj.get("shard_id") or shard_id_for(input_blake3=blake, params=params)
    entry = PlanEntry(
        shard_id=shard_id,
        input_ref=obj["input"],
        input_bytes=size,
        input_blake3=blake,
        params=params,
        expected_outputs=tuple(obj.get("expected_outputs", [])),
        plan_line=canonical_json({**obj, "shard_id": shard_id}),
        plan_index=index,
    )
    entry.check()
    if len(entry.plan_line) + len(canonical_json(entry.definition())) > MAX_ENTRY_CHARS:
        raise ValueError(f"the line is too large (the limit is {MAX_ENTRY_CHARS} characters)")
    _check_server_rules(entry)
    return entry


def _check_server_rules(entry: PlanEntry) -> None:
    """Raises ValueError when the ledger would refuse the entry's planned event.

    The server's own validation runs here, so a line it would refuse stops the
    whole plan before anything is sent instead of leaving a hole in it.
    """
    from ledger_server.codec import decode_event
    from ledger_server.errors import LedgerError
    from ledger_server.validation import validate

    try:
        validate(decode_event(plan_events(_RULES_RUN, [entry])[0]))
    except LedgerError as exc:
        raise ValueError(str(exc)) from None


def _read_manifest(path: str) -> list[tuple[int, str]]:
    try:
        if path == "-":
            lines = sys.stdin.read().splitlines()
        else:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise CommandError(f"cannot read manifest {path}: {exc}") from None
    return [(number, text) for number, text in enumerate(lines, 1) if text.strip()]


def entries_from_manifest(path: str, *, workers: int) -> list[PlanEntry]:
    """Parses, hashes and checks every manifest line; raises CommandError listing the bad ones."""
    errors: list[str] = []
    parsed: list[tuple[int, dict[str, Any]]] = []
    for number, text in _read_manifest(path):
        try:
            parsed.append((number, _parse_line(text)))
        except ValueError as exc:
            errors.append(f"line {number}: {exc}")
    local = [obj["input"] for _, obj in parsed if os.path.isfile(obj["input"])]
    digests = _hash_all(local, workers=workers)
    entries: list[PlanEntry] = []
    for index, (number, obj) in enumerate(parsed):
        try:
            entries.append(_entry(obj, index, digests.get(obj["input"])))
        except (ValueError, TypeError) as exc:
            errors.append(f"line {number}: {exc}")
    numbers = [number for number, _ in parsed]
    for shard_id, indexes in duplicate_ids(entries).items():
        lines = ", ".join(str(numbers[i]) for i in indexes)
        errors.append(f"lines {lines}: shard id {shard_id} appears more than once")
    _raise_errors(path, errors)
    return entries


def entries_from_dir(args: argparse.Namespace) -> list[PlanEntry]:
    """Plans one shard per file under --inputs matching --glob, in sorted order."""
    root = Path(args.inputs)
    if not root.is_dir():
        raise CommandError(f"--inputs {args.inputs} is not a directory")
    try:
        params = json.loads(args.params) if args.params else {}
    except json.JSONDecodeError as exc:
        raise CommandError(f"--params is not valid JSON: {exc}", EXIT_USAGE) from None
    if not isinstance(params, dict):
        raise CommandError("--params must be a JSON object", EXIT_USAGE)
    outputs = [n.strip() for n in (args.expected_outputs or "").split(",") if n.strip()]
    files = sorted(str(p.resolve()) for p in _glob(root, args.glob) if p.is_file())
    digests = _hash_all(files, workers=args.workers)
    entries, errors = [], []
    for index, path in enumerate(files):
        obj = {"input": path, "params": params, "expected_outputs": outputs}
        try:
            entries.append(_entry(obj, index, digests[path]))
        except ValueError as exc:
            errors.append(f"{path}: {exc}")
    for shard_id, indexes in duplicate_ids(entries).items():
        same = ", ".join(files[i] for i in indexes)
        errors.append(f"{same}: identical content and params give one shard id {shard_id}")
    _raise_errors(args.inputs, errors)
    return entries


def _glob(root: Path, pattern: str) -> list[Path]:
    """Returns the files under root that pattern (relative, inside root) matches."""
    if not pattern or Path(pattern).is_absolute() or ".." in Path(pattern).parts:
        raise CommandError(
            f"--glob {pattern!r} must be a non-empty pattern relative to --inputs, without '..'",
            EXIT_USAGE,
        )
    return list(root.glob(pattern))


def _raise_errors(source: str, errors: Sequence[str]) -> None:
    if not errors:
        return
    shown = "\n  ".join(errors[:MAX_ERRORS_SHOWN])
    more = (
        f"\n  ... and {len(errors) - MAX_ERRORS_SHOWN} more"
        if len(errors) > MAX_ERRORS_SHOWN
        else ""
    )
    raise CommandError(f"{source}: {len(errors)} bad line(s), nothing was sent:\n  {shown}{more}")


def _hash_all(paths: Sequence[str], *, workers: int) -> dict[str, tuple[int, str]]:
    unique = sorted(set(paths))
    out: dict[str, tuple[int, str]] = {}
    with (
        progress("hashing inputs", len(unique)) as advance,
        ThreadPoolExecutor(max(1, workers)) as pool,
    ):
        for path, digest in zip(unique, pool.map(hash_input, unique), strict=True):
            out[path] = digest
            advance(1)
    return out


# --- sending -----------------------------------------------------------------------


def send_plan(
    client: LedgerClient, run_id: str, entries: Sequence[PlanEntry], *, namespace: str = ""
) -> Outcome:
    """Sends the planned events in batches; refused shards are isolated, the rest still go."""
    events = plan_events(run_id, entries, namespace=namespace)
    outcome = Outcome()
    with progress("registering shards", len(events)) as advance:
        for start in range(0, len(events), BATCH):
            batch = events[start : start + BATCH]
            for entry, result in zip(entries[start:], _deliver_all(client, batch), strict=False):
                _count(outcome, entry, result)
            advance(len(batch))
    return outcome


def _deliver_all(
    client: LedgerClient, events: Sequence[pb.ShardEvent]
) -> list[pb.AppendResult | LedgerRejected]:
    """Delivers every event, retrying while the ledger is briefly unreachable."""
    done: list[pb.AppendResult | LedgerRejected] = []
    give_up, backoff = time.monotonic() + client.retry_deadline_s, 0.1
    while len(done) < len(events):
        results, stop = deliver(client, events[len(done) :])
        done += results
        if stop is None:
            break
        if time.monotonic() + backoff > give_up:
            raise stop
        time.sleep(backoff)
        backoff = min(backoff * 2, 2.0)
    return done


def _count(outcome: Outcome, entry: PlanEntry, result: pb.AppendResult | LedgerRejected) -> None:
    if isinstance(result, LedgerRejected):
        target = outcome.conflicts if result.reason == "PLAN_CONFLICT" else outcome.refused
        target.append((entry, f"{result.reason}: {result}"))
    elif result.outcome == pb.APPEND_OUTCOME_APPENDED:
        outcome.new += 1
    else:
        outcome.identical += 1


# --- output ------------------------------------------------------------------------


def _print_dry_run(entries: Sequence[PlanEntry], *, as_json: bool) -> int:
    if as_json:
        print_json([{**json.loads(e.plan_line), "plan_index": e.plan_index} for e in entries])
    else:
        sys.stdout.writelines(e.plan_line + "\n" for e in entries)
    return EXIT_OK


def _report(args: argparse.Namespace, entries: Sequence[PlanEntry], outcome: Outcome) -> int:
    for entry, why in outcome.conflicts + outcome.refused:
        print(
            f"shardledger: shard {entry.shard_id} (plan index {entry.plan_index}): {why}",
            file=sys.stderr,
        )
    if args.json:
        print_json(
            {
                "run_id": args.run,
                "namespace": args.namespace or "default",
                "shards": len(entries),
                "new": outcome.new,
                "already_planned": outcome.identical,
                "conflicting": [e.shard_id for e, _ in outcome.conflicts],
                "refused": [e.shard_id for e, _ in outcome.refused],
            }
        )
    else:
        print(
            f"run {args.run}: {len(entries)} shards: {outcome.new} new, "
            f"{outcome.identical} already planned identically, "
            f"{len(outcome.conflicts)} conflicting"
            + (f", {len(outcome.refused)} refused" if outcome.refused else "")
        )
    if outcome.refused:
        return EXIT_REJECTED
    return EXIT_PROBLEMS if outcome.conflicts else EXIT_OK
