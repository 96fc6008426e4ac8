"""`shardledger verify RUN`: re-read committed artifacts and record what was found."""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Final

import blake3

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.canonical import canonical_json
from shard_client.checks import CheckResult, load_entry_point_validators, verify_artifact
from shard_client.errors import LedgerRejected
from shardledger_cli.cli import EXIT_OK, EXIT_PROBLEMS, CommandError, at_least, client_from
from shardledger_cli.output import print_json

APPEND_BATCH: Final = 500
MAX_REASON_CHARS: Final = 255
MAX_DETAIL_CHARS: Final = 2000

DESCRIPTION: Final = """\
Re-read every artifact the run committed (the latest commit of each name in each
attempt): it must exist under --root, have the committed size and blake3 digest,
and pass the content checks for its type and any validators installed under the
`shardledger.validators` entry-point group. Each outcome is appended as a
`verified` event (PASSED, or FAILED with a reason such as missing, size_mismatch,
digest_mismatch, empty, truncated, nan_or_inf).

A commit whose path a later commit (say, a retry racing a zombie attempt) filled
with other bytes is superseded: it is neither checked nor counted as a failure.

Re-running is harmless and cheap: an artifact whose (path, digest) already has a
verdict is skipped unless --recheck, and event ids are derived from the outcome,
so a retried or concurrent verify stores each verdict once.

Paths are resolved against --root (default: the current directory); an absolute
path, or a relative one that escapes through `..` or a symlink, must land inside
it. An artifact outside the root is never opened: it is recorded as FAILED with
reason outside_root, because an artifact the verifier may not read cannot be
confirmed, and leaving it unrecorded would hide it from `status`.

exit codes: 0 every committed artifact's latest verdict is PASSED; 1 some
artifact failed (now or in an earlier verify) or a verdict was refused;
3 unreachable; 4 refused (e.g. unknown run); 5 --root is not a directory
"""


@dataclass(frozen=True, slots=True)
class Commit:
    """The latest commit of one name in one attempt."""

    shard_id: str
    attempt_id: str
    name: str
    path: str
    size_bytes: int
    blake3_hex: str
    media_type: str

    @property
    def key(self) -> tuple[str, str, str]:
        """Returns what a verdict is about: (shard, path, digest)."""
        return (self.shard_id, self.path, self.blake3_hex)


@dataclass(slots=True)
class Scan:
    """What the event log says about a run's artifacts."""

    commits: dict[tuple[str, str, str], Commit]
    verdicts: dict[tuple[str, str, str], tuple[str, str]]
    verdict_count: Counter[tuple[str, str, str]]
    path_heads: dict[str, str]  # path -> digest of the latest commit to it (what is on disk)


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
    p.add_argument("--recheck", action="store_true", help="verify again artifacts already verified")
    p.set_defaults(func=run_verify)


def scan_events(events: Iterable[Any]) -> Scan:
    """Collects the latest commit per (shard, attempt, name) and the verdicts given so far."""
    commits: dict[tuple[str, str, str], Commit] = {}
    verdicts: dict[tuple[str, str, str], tuple[str, str]] = {}
    count: Counter[tuple[str, str, str]] = Counter()
    heads: dict[str, str] = {}
    for event in events:
        kind = event.WhichOneof("payload")
        if kind == "artifact_committed":
            a = event.artifact_committed
            heads[a.path] = a.blake3_hex
            commits[(event.shard_id, event.attempt_id, a.name)] = Commit(
                event.shard_id,
                event.attempt_id,
                a.name,
                a.path,
                a.size_bytes,
                a.blake3_hex,
                a.media_type,
            )
        elif kind == "verified":
            v = event.verified
            key = (event.shard_id, v.path, v.blake3_hex)
            result = "passed" if v.result == pb.VERIFICATION_RESULT_PASSED else "failed"
            verdicts[key] = (result, v.reason)
            count[key] += 1
    return Scan(commits, verdicts, count, heads)


def targets(scan: Scan, *, recheck: bool) -> tuple[list[Commit], list[Commit], list[Commit]]:
    """Returns (to check, skipped, superseded): one commit per (shard, path, digest), log order.

    A commit whose path a later commit (another attempt's retry) filled with other
    bytes is superseded: its bytes are gone, so it is neither checked nor a failure
    (the ledger already counts only a path's latest commit).
    """
    seen: set[tuple[str, str, str]] = set()
    todo: list[Commit] = []
    skipped: list[Commit] = []
    superseded: list[Commit] = []
    for commit in scan.commits.values():
        if commit.key in seen:
            continue  # two attempts wrote identical bytes to one path: one verdict covers both
        seen.add(commit.key)
        if scan.path_heads.get(commit.path, commit.blake3_hex) != commit.blake3_hex:
            superseded.append(commit)
        elif recheck or commit.key not in scan.verdicts:
            todo.append(commit)
        else:
            skipped.append(commit)
    return todo, skipped, superseded


def verdict_event(
    commit: Commit, result: CheckResult, *, namespace: str, run_id: str, generation: int
) -> pb.ShardEvent:
    """Returns the verified event for one check; its id is derived from what it says.

    The id hashes the verdict's content (and how many verdicts on the artifact
    came before), so a retried or concurrent verify that reaches the same verdict
    is stored once, while --recheck records a new one. client_time stays unset
    so the content, and hence the retry, is byte-identical.
    """
    reason = "" if result.passed else (result.reason or "unknown")[:MAX_REASON_CHARS]
    detail = result.detail[:MAX_DETAIL_CHARS]
    status = pb.VERIFICATION_RESULT_PASSED if result.passed else pb.VERIFICATION_RESULT_FAILED
    identity = [
        namespace or "default",
        run_id,
        commit.shard_id,
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
        attempt_id="",
        verified=pb.ArtifactVerified(
            name=commit.name,
            path=commit.path,
            blake3_hex=commit.blake3_hex,
            result=status,
            reason=reason,
            detail=detail,
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
    appended: int = 0
    duplicate: int = 0
    refused: int = 0
    batch: list[pb.ShardEvent] = field(default_factory=list)

    def add(self, event: pb.ShardEvent) -> None:
        """Queues one event, flushing a full batch."""
        self.batch.append(event)
        if len(self.batch) >= APPEND_BATCH:
            self.flush()

    def flush(self) -> None:
        """Appends the queued events; a refused batch is retried event by event."""
        events, self.batch = self.batch, []
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
                        f"shardledger: verdict on {event.shard_id} {event.verified.path} "
                        f"refused ({exc.reason}): {exc}",
                        file=sys.stderr,
                    )

    def _count(self, results: Iterable[Any]) -> None:
        for result in results:
            if result.outcome == pb.APPEND_OUTCOME_APPENDED:
                self.appended += 1
            else:
                self.duplicate += 1


def run_verify(args: argparse.Namespace) -> int:
    """Verifies the run's committed artifacts and appends the verdicts."""
    root = os.path.abspath(args.root)
    if not os.path.isdir(root):
        raise CommandError(f"--root {args.root} is not a directory")
    client = client_from(args)
    scan = scan_events(client.list_events(args.run, namespace=args.namespace, page_size=5000))
    todo, skipped, superseded = targets(scan, recheck=args.recheck)
    validators = load_entry_point_validators()
    recorder = Recorder(client)
    failures: list[dict[str, Any]] = []
    passed = 0
    with _Progress(len(todo), enabled=not args.json and sys.stderr.isatty()) as advance:
        for commit, result in check_all(
            todo, root=root, workers=args.workers, validators=validators, on_done=advance
        ):
            generation = scan.verdict_count[commit.key]
            recorder.add(
                verdict_event(
                    commit, result, namespace=args.namespace, run_id=args.run, generation=generation
                )
            )
            if result.passed:
                passed += 1
            else:
                failures.append(_failure(commit, result.reason, result.detail, earlier=False))
        recorder.flush()
    for commit in skipped:
        verdict, reason = scan.verdicts[commit.key]
        if verdict != "passed":
            failures.append(_failure(commit, reason, "", earlier=True))
    report = {
        "run_id": args.run,
        "root": root,
        "checked": len(todo),
        "passed": passed,
        "failed": len(todo) - passed,
        "skipped": len(skipped),
        "skipped_failed": sum(1 for f in failures if f["earlier"]),
        "superseded": len(superseded),
        "appended": recorder.appended,
        "duplicate": recorder.duplicate,
        "refused": recorder.refused,
        "failures": failures,
    }
    _print_report(report, as_json=args.json)
    return EXIT_PROBLEMS if failures or recorder.refused else EXIT_OK


def _failure(commit: Commit, reason: str, detail: str, *, earlier: bool) -> dict[str, Any]:
    return {
        "shard_id": commit.shard_id,
        "attempt_id": commit.attempt_id,
        "name": commit.name,
        "path": commit.path,
        "reason": reason,
        "detail": detail,
        "earlier": earlier,
    }


def _print_report(report: dict[str, Any], *, as_json: bool) -> None:
    if as_json:
        print_json(report)
        return
    for f in report["failures"]:
        when = " (earlier verdict)" if f["earlier"] else ""
        detail = f": {f['detail']}" if f["detail"] else ""
        print(f"FAILED {f['shard_id']} {f['name']} {f['path']} {f['reason']}{when}{detail}")
    print(
        f"verify {report['run_id']}: {report['checked']} checked, {report['passed']} passed, "
        f"{report['failed']} failed; {report['skipped']} skipped as already verified "
        f"({report['skipped_failed']} of them failed); {report['appended']} verdicts recorded"
        + (f", {report['refused']} refused" if report["refused"] else "")
        + (
            f"; {report['superseded']} superseded by a later commit to the same path"
            if report["superseded"]
            else ""
        )
    )


class _Progress:
    """A rich progress bar on stderr when it is a terminal, else nothing."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled and total > 0
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Callable[[], None]:
        if not self.enabled:
            return lambda: None
        from rich.console import Console
        from rich.progress import Progress

        self._bar = Progress(console=Console(file=sys.stderr), transient=True)
        self._bar.start()
        self._task = self._bar.add_task("verifying", total=self.total)
        return lambda: self._bar.advance(self._task)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
