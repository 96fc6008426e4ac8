# Over 400 lines on purpose: verify's flags and its one pass (check, record, explain); the checks live in verify_scan/_report/_keyed.py.
"""`shardledger verify RUN`: re-read committed artifacts and record what was found."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Final

import blake3

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.canonical import canonical_json
from shard_client.checks import (
    VERIFIER_REASONS,
    CheckResult,
    load_entry_point_validators,
    verify_artifact,
)
from shard_client.errors import LedgerRejected
from shard_client.remote_checks import verify_object
from shard_client.storage import is_remote, store_for
from shardledger_cli.cli import (
    EXIT_LOCAL,
    EXIT_OK,
    EXIT_PROBLEMS,
    CommandError,
    at_least,
    client_from,
)
from shardledger_cli.commands.verify_keyed import check_keyed
from shardledger_cli.commands.verify_report import Tally, entry, print_report
from shardledger_cli.commands.verify_scan import (
    Commit,
    CommitState,
    any_present,
    common_dir,
    outside,
    plan,
    scan_events,
    unique,
)
from shardledger_cli.input_check import CHANGED, GONE, InputNow, check_inputs, collect_plans
from shardledger_cli.local_ledger import serve_db_option, unless_dry_run
from shardledger_cli.output import progress
from shardledger_cli.parsing import add_format_option, json_help, output_format

__all__ = ["Commit", "Recorder", "register", "verdict_event"]

APPEND_BATCH: Final = 500
# The verdict on a commit whose shard's input is no longer the one planned.
INPUT_CHANGED: Final = "input_changed"
MAX_REASON_CHARS: Final = 255
MAX_DETAIL_CHARS: Final = 2000

DESCRIPTION: Final = """\
Re-read every artifact the run committed (the latest commit of each name in each
attempt): it must exist under --root (or, for a URL such as s3://bucket/key, in
its object store: read through fsspec with the store's standard credential
chain, never a flag), have the committed size and blake3 digest,
and pass the content checks for its type and any validators installed under the
`shardledger.validators` entry-point group. Each outcome is appended as a
`verified` event about that one commit (PASSED, or FAILED with a reason about
the artifact: missing, not_a_file, size_mismatch, digest_mismatch, empty,
truncated, nan_or_inf, json_invalid, tensor_unreadable, image_undecodable,
image_degenerate, id_set_mismatch, validator:NAME, ...; for objects also
version_mismatch: the version id differs from the one committed). Each distinct
file is read once; objects are streamed, at most --workers at a time.
An output the plan's params declare keyed ({"keyed_outputs": {"out": "id"},
"input_ids": [...]} or "input_ids_file") must hold exactly the shard's input
ids, each once (report 2, §4.4; docs/metrics.md, "Keyed result sets").

A verdict belongs to one commit. A new commit (a rerun, even of byte-identical
bytes at the same path) is unverified until verify reads it; a commit that
already has a verdict of its own is skipped unless --recheck, which reads them
again (a scrub for bit rot). Event ids are derived from the commit and the
outcome, so a retried or concurrent verify stores each verdict once.

A commit whose path a later commit (say, a retry racing a zombie attempt) filled
with other bytes is superseded: it is neither checked nor counted as a failure.
A commit that a later commit of the same output replaced is still checked, but
its failure does not fail verify: the output's latest commit decides.

The verifier's own mistakes record nothing. --root must be a readable
directory. An artifact whose path lies outside it (an absolute path elsewhere,
or `..` or a symlink leading out), or that the verifier may not read, is never
judged: it is listed as NOT CHECKED with the reason (outside_root,
permission_denied; for objects also storage_unreachable, credentials_refused,
storage_throttled), nothing is recorded for it, and verify exits 5. When --root holds none of the run's
committed artifacts, verify refuses before reading any (exit 5): a wrong
directory must not condemn a good run.

--dry-run reads and judges exactly as above and records nothing: the report
says how many verdicts it did not record, and the exit code is the one a
recording verify would give. It is the one verify that reads a ledger file with
--db (read-only, no server): a verify that records needs the server that writes
the ledger.

Examples:
  shardledger verify night-01 --root /scratch/night-01/out
  shardledger verify night-01 --root out/ --recheck --workers 16 --json
  AWS_PROFILE=batch shardledger verify night-01     # artifacts committed to s3://
  shardledger verify night-01 --root out/ --db copy/ledger.db --dry-run   # no server
  shardledger verify night-01 --format plain | awk -F'\\t' '$1 == "FAILED" {print $2}'

exit codes: 0 every current commit (the latest commit of each output, not
superseded) has a PASSED verdict of its own; 1 some current commit failed, now
or in an earlier verify, or a verdict was refused; 3 unreachable; 4 refused
(e.g. unknown run); 5 --root does not exist, is not a directory, cannot be read
or holds none of the run's artifacts, or some artifact was not checked
"""


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds the verify command."""
    p = sub.add_parser(
        "verify",
        parents=[common],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="re-read committed artifacts and record PASSED/FAILED verdicts",
        description=DESCRIPTION,
    )
    p.add_argument("run", help="run id")
    p.add_argument("--root", default=".", help="directory every artifact must lie in (default: .)")
    p.add_argument(
        "--workers", type=at_least(1), default=min(8, os.cpu_count() or 4), help="parallel readers"
    )
    p.add_argument(
        "--recheck",
        action="store_true",
        help="read again commits that already have a verdict (a scrub for bit rot)",
    )
    p.add_argument(
        "--inputs",
        action="store_true",
        help="also read again the planned input of every shard with a current commit: one"
        " that changed since it was planned (other bytes; a copy or a touch is no change) or"
        " is gone gets a FAILED input_changed verdict on each of the shard's current commits,"
        ' so the shard is back in `resume` (docs/concepts.md, "Input identity")',
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="judge every artifact and record no verdict (what --db requires)",
    )
    json_help(p, single="the verification report")
    add_format_option(p)
    serve_db_option(
        p,
        run_verify,
        refuse=unless_dry_run(
            "verify records a verdict on every commit it reads", "judge without recording", "verify"
        ),
    )


def verdict_event(
    commit: Commit, result: CheckResult, *, namespace: str, run_id: str, generation: int
) -> pb.ShardEvent:
    """Returns the verified event for one check of one commit; its id is derived from what it says.

    The id hashes the commit (attempt and commit event), the verdict's content and
    how many verdicts of its own the commit had before, so a retried or concurrent
    verify that reaches the same verdict is stored once, two attempts' identical
    commits get one verdict each, and --recheck records a new one. client_time
    stays unset so the content, and hence the retry, is byte-identical.
    """
    reason = "" if result.passed else (result.reason or "unknown")[:MAX_REASON_CHARS]
    detail = result.detail[:MAX_DETAIL_CHARS]
    status = pb.VERIFICATION_RESULT_PASSED if result.passed else pb.VERIFICATION_RESULT_FAILED
    identity = [
        namespace or "default",
        run_id,
        commit.shard_id,
        commit.attempt_id,
        commit.event_id,
        commit.name,
        commit.path,
        commit.blake3_hex,
        "passed" if result.passed else "failed",
        reason,
        detail,
        generation,
    ]
    digest = blake3.blake3(canonical_json(identity).encode()).hexdigest()
    return pb.ShardEvent(
        event_id=f"verify-{digest[:32]}",
        namespace=namespace,
        run_id=run_id,
        shard_id=commit.shard_id,
        attempt_id=commit.attempt_id,
        verified=pb.ArtifactVerified(
            name=commit.name,
            path=commit.path,
            blake3_hex=commit.blake3_hex,
            result=status,
            reason=reason,
            detail=detail,
            version_id=commit.version_id,
        ),
    )


def check_all(
    commits: list[Commit],
    *,
    root: str,
    workers: int,
    validators: Mapping[str, Any],
    on_done: Callable[[], None] = lambda: None,
) -> Iterator[tuple[Commit, CheckResult]]:
    """Yields each commit with its check result as the pool finishes them (bounded in flight)."""

    def check(commit: Commit) -> CheckResult:
        if is_remote(commit.path):
            return verify_object(
                url=commit.path,
                expected_size=commit.size_bytes,
                expected_blake3=commit.blake3_hex,
                version_id=commit.version_id,
                media_type=commit.media_type,
                validators=validators,
            )
        return verify_artifact(
            root=root,
            path=commit.path,
            expected_size=commit.size_bytes,
            expected_blake3=commit.blake3_hex,
            media_type=commit.media_type,
            validators=validators,
        )

    pending: dict[Future[CheckResult], Commit] = {}
    queue = iter(commits)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verify") as pool:
        while True:
            # A bounded window keeps memory flat however many artifacts the run has.
            for commit in queue:
                pending[pool.submit(check, commit)] = commit
                if len(pending) >= workers * 4:
                    break
            if not pending:
                return
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                commit = pending.pop(future)
                on_done()
                yield commit, future.result()


@dataclass(slots=True)
class Recorder:
    """Appends verdict events in batches and counts the outcomes."""

    client: Any
    dry_run: bool = False
    appended: int = 0
    duplicate: int = 0
    refused: int = 0
    not_recorded: int = 0
    batch: list[pb.ShardEvent] = field(default_factory=list)

    def add(self, event: pb.ShardEvent) -> None:
        """Queues one event, flushing a full batch."""
        self.batch.append(event)
        if len(self.batch) >= APPEND_BATCH:
            self.flush()

    def flush(self) -> None:
        """Appends the queued events; a refused batch is retried event by event."""
        events, self.batch = self.batch, []
        if self.dry_run:
            self.not_recorded += len(events)
            return
        if not events:
            return
        try:
            self._count(self.client.append(events))
        except LedgerRejected:
            # One refused verdict (say, the artifact was re-committed meanwhile)
            # must not cost the others: a batch is atomic, so retry one by one.
            for event in events:
                try:
                    self._count(self.client.append([event]))
                except LedgerRejected as exc:
                    self.refused += 1
                    print(
                        f"shardledger: verdict on {event.shard_id} {event.attempt_id} "
                        f"{event.verified.path} refused ({exc.reason}): {exc}",
                        file=sys.stderr,
                    )

    def _count(self, results: Iterable[Any]) -> None:
        for result in results:
            if result.outcome == pb.APPEND_OUTCOME_APPENDED:
                self.appended += 1
            else:
                self.duplicate += 1


def check_root(given: str) -> str:
    """Returns --root made absolute, or raises CommandError when it cannot be the artifacts' home."""
    root = os.path.abspath(given)
    if not os.path.lexists(root):
        raise CommandError(f"--root {given} does not exist")
    if not os.path.isdir(root):
        raise CommandError(f"--root {given} is not a directory")
    try:
        with os.scandir(root) as entries:
            next(entries, None)
    except OSError as exc:
        raise CommandError(f"--root {given} cannot be read: {exc.strerror or exc}") from None
    return root


def run_verify(args: argparse.Namespace) -> int:
    """Verifies the run's committed artifacts and appends one verdict per commit."""
    root = check_root(args.root)
    client = client_from(args)
    plans: dict[str, pb.ShardEvent] = {}
    events = client.list_events(args.run, namespace=args.namespace, page_size=5000)
    scan = scan_events(collect_plans(events, plans) if args.inputs else events)
    todo = plan(scan, recheck=args.recheck)
    moved, unread = _moved_inputs(todo, plans, workers=args.workers) if args.inputs else ({}, {})
    reads: dict[tuple[str, str, int, str], list[CommitState]] = {}
    for state in todo.todo:
        if state.commit.shard_id not in moved:  # judged by its input, not read again
            reads.setdefault(state.commit.read_key, []).append(state)
    # Objects in a store are read through its URL; only local paths must lie under --root.
    held = [s.commit.path for s in (*todo.todo, *todo.skipped) if not is_remote(s.commit.path)]
    if held and not any(is_remote(k[0]) for k in reads) and not any_present(root, unique(held)):
        # Every file missing (or outside the root) means the wrong directory far more often
        # than a wiped disk; recording `missing` for all of them would condemn a good run.
        paths = list(unique(held))
        away = outside(root, paths)
        share = f"all {len(away)}" if len(away) == len(paths) else f"{len(away)} of them"
        hint = f" ({share} lie outside it, under {common_dir(root, away)})" if away else ""
        raise CommandError(
            f"--root {args.root} holds none of the run's {len(paths)} artifact files"
            f" ({len(held)} commits): is it the right directory?{hint} Nothing was recorded."
        )
    validators = load_entry_point_validators()
    recorder = Recorder(client, dry_run=args.dry_run)
    tally = Tally(current=todo.current)

    def record(state: CommitState, verdict: CheckResult) -> None:
        """Queues the verdict on one commit and counts it."""
        generation = len(state.verdicts)
        recorder.add(
            verdict_event(
                state.commit,
                verdict,
                namespace=args.namespace,
                run_id=args.run,
                generation=generation,
            )
        )
        tally.add(state, verdict.passed, verdict.reason, verdict.detail, earlier=False)

    first = [group[0].commit for group in reads.values()]
    with progress("verifying", len(first)) as step:
        for read, result in check_all(
            first, root=root, workers=args.workers, validators=validators, on_done=lambda: step(1)
        ):
            for state in reads[read.read_key]:
                verdict = _keyed(scan, state.commit, root, result)
                if verdict.reason in VERIFIER_REASONS and not verdict.passed:
                    tally.unchecked.append(entry(state.commit, verdict.reason, verdict.detail))
                    continue
                record(state, verdict)
        for state in _current(todo):
            found = moved.get(state.commit.shard_id)
            if found is not None:
                record(state, CheckResult(False, INPUT_CHANGED, found.difference))
        for state in _current(todo):
            if state.commit.shard_id in unread:
                tally.unchecked.append(
                    entry(state.commit, "input_unreadable", unread[state.commit.shard_id])
                )
        recorder.flush()
    for state in todo.skipped:
        if state.commit.shard_id in moved and state.commit.key in todo.current:
            continue  # its new verdict is counted above
        passed, reason = state.verdicts[-1]
        tally.add(state, passed, reason, "", earlier=True)
    report = tally.report(args.run, root, read=len(first), recorder=recorder)
    report["superseded"] = len(todo.superseded)
    print_report(report, fmt=output_format(args))
    if not first:
        _probe_stores([s.commit.path for s in todo.skipped if is_remote(s.commit.path)])
    if tally.unchecked:
        _explain_unchecked(tally.unchecked, root)
        return EXIT_LOCAL
    return EXIT_PROBLEMS if tally.current_failed or recorder.refused else EXIT_OK


def _current(todo: Any) -> list[CommitState]:
    """Returns the current commits (the latest of each output, not superseded), in log order."""
    return [s for s in (*todo.todo, *todo.skipped) if s.commit.key in todo.current]


def _moved_inputs(
    todo: Any, plans: Mapping[str, pb.ShardEvent], *, workers: int
) -> tuple[dict[str, InputNow], dict[str, str]]:
    """Reads again the planned inputs of the shards with current commits.

    Returns the shards whose input changed or is gone, and those whose input could
    not be read (shard id -> why: nothing is judged for them).
    """
    shard_ids = [sid for sid in unique(s.commit.shard_id for s in _current(todo)) if sid in plans]
    with progress("reading planned inputs", len(shard_ids)) as step:
        found, unread = check_inputs(plans, shard_ids, workers=workers, on_done=lambda: step(1))
    moved = {f.shard_id: f for f in found if f.status in (CHANGED, GONE)}
    return moved, unread


def _probe_stores(urls: Sequence[str]) -> None:
    """Says on stderr which stores holding the run's objects cannot be reached now.

    With nothing left to check verify reads no object, so a store that is away would
    go unnoticed: one HEAD per bucket tells. The exit status stays that of the check
    (nothing was left to judge); the line is for the person reading.
    """
    first_of: dict[str, str] = {}
    for url in urls:
        parts = url.split("/", 3)
        first_of.setdefault("/".join(parts[:3]), url)
    for bucket, url in first_of.items():
        count = sum(1 for u in urls if u.startswith(bucket + "/"))
        try:
            store_for(url).info(url)
        except (OSError, ImportError, ValueError) as exc:
            print(
                f"shardledger: nothing was left to check, but {bucket} cannot be read now"
                f" ({exc}): its {count} objects of this run could not be rechecked",
                file=sys.stderr,
            )


def _explain_unchecked(unchecked: Sequence[Mapping[str, Any]], root: str) -> None:
    """Says on stderr why artifacts went unchecked: local ones and objects apart."""
    objects = [u for u in unchecked if is_remote(u["path"])]
    local = [u for u in unchecked if not is_remote(u["path"])]
    if local:
        where = common_dir(root, [u["path"] for u in local])
        print(
            f"shardledger: {len(local)} artifacts were not checked and nothing was"
            f" recorded for them ({', '.join(sorted({u['reason'] for u in local}))}):"
            f" run verify with a --root that holds them (they lie under {where}) and may read them",
            file=sys.stderr,
        )
    if objects:
        kinds = sorted({u["reason"] for u in objects})
        print(
            f"shardledger: {len(objects)} objects were not checked and nothing was recorded for"
            f" them ({', '.join(kinds)}; the first: {objects[0]['detail']}): check the store's"
            " endpoint (AWS_ENDPOINT_URL), the network and the credentials, then run verify"
            " again",
            file=sys.stderr,
        )


def _keyed(scan: Any, commit: Commit, root: str, result: CheckResult) -> CheckResult:
    """Returns the id-set check of a commit its plan declares keyed, once its file passed."""
    keyed = scan.keyed.get((commit.shard_id, commit.name))
    if keyed is None or not result.passed:
        return result
    return check_keyed(keyed, root=root, path=commit.path)
