"""`shardledger demo`: a night of batch shards, end to end, with every failure form injected."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from shardledger_cli.cli import EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, CommandError, at_least
from shardledger_cli.demo.faults import (
    DUPLICATE_RETRY,
    ENV_DRIFT,
    EXPECTED_REASON,
    FORMS,
    HANG,
    MIN_SHARDS,
    Check,
    FaultPlan,
    check_drift,
    check_duplicates,
    check_resume_list,
    check_summary,
)
from shardledger_cli.demo.infra import check_accounting, count_events, late_arrivals, overlapping
from shardledger_cli.output import print_json
from shardledger_cli.parsing import add_format_option, examples, json_help, output_format
from shardledger_cli.s3local import S3_ENV_KEYS

if TYPE_CHECKING:  # demo.run needs numpy; the CLI must load without the [torch] extra
    from shardledger_cli.demo.run import Demo, Outage

DEMO_BUCKET: Final = "project-x"

DESCRIPTION: Final = """\
Run a night of batch shards on this machine, end to end:

  1. start a ledger server (a subprocess on a temp SQLite file; or use --server)
  2. make N seeded synthetic inputs and plan them (outputs: weights, metrics)
  3. train a tiny MLP per shard in W worker processes through shard_client,
     checkpointing, committing weights.pt and metrics.json atomically, while
     injecting, on a few seeded shards each: silent missing output, truncation
     (the worker SIGKILLs itself mid-write), an empty committed file, NaN weights,
     a hang holding the GIL, a duplicate retry, environment drift; and SIGKILL the
     ledger server mid-run and restart it (skipped with --server)
  4. let the watchdog settle silent attempts, verify every artifact, print the
     ledger, write the resume list and compare it with the injected ground truth
  5. re-run exactly the resume list, verify again, and show 100 % verified

With --storage s3 the demo also starts a local S3 endpoint (moto in server mode,
on 127.0.0.1; needs moto[server] and shardledger[s3]) with a versioned bucket,
the workers commit weights.pt and metrics.json to s3://BUCKET/RUN/SHARD/ATTEMPT/
(staged, uploaded conditionally, read back), and three object-storage forms are
injected as well: a worker SIGKILLed mid-upload (torn upload), and after the
batch an object replaced and an object deleted in the bucket; verify finds them
as failed(timeout), version_mismatch and missing.

exit codes: 0 the ledger found exactly the injected faults and the rerun reached
100 %; 1 any mismatch; 2 bad arguments; 3 the --server ledger is unreachable
"""


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds the demo command."""
    p = sub.add_parser(
        "demo",
        epilog=examples(
            "shardledger demo                           # 200 shards, 4 workers, local files",
            "shardledger demo --shards 40 --workers 2 --keep /tmp/night",
            "shardledger demo --storage s3 --shards 40  # artifacts in a local S3 endpoint",
            "shardledger demo --json > report.json",
        ),
        parents=[common],
        help="run a night end to end: inject every failure form, find each in the ledger, resume",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--shards", type=at_least(MIN_SHARDS), default=200, help="shards (default 200)")
    p.add_argument("--workers", type=at_least(1), default=4, help="worker processes (default 4)")
    p.add_argument("--steps", type=at_least(2), default=30, help="training steps per shard")
    p.add_argument("--seed", type=at_least(0), default=7, help="seed of data and faults")
    p.add_argument("--keep", metavar="DIR", help="keep db, artifacts, resume list, diagnostics")
    p.add_argument(
        "--storage",
        choices=("local", "s3"),
        default="local",
        help="where artifacts go: local files, or s3 (a local S3 endpoint the demo starts; "
        "adds torn upload, replaced and deleted objects)",
    )
    json_help(p, single="the demo's report")
    add_format_option(p)
    p.set_defaults(func=run_demo)


@contextlib.contextmanager
def _work_dir(keep: str | None) -> Iterator[Path]:
    if keep is None:
        with tempfile.TemporaryDirectory(prefix="shardledger-demo-") as tmp:
            yield Path(tmp)
        return
    path = Path(keep).resolve()
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise CommandError(f"--keep {keep} must be a new or empty directory", EXIT_USAGE)
    path.mkdir(parents=True, exist_ok=True)
    yield path


@contextlib.contextmanager
def _storage(kind: str) -> Iterator[str]:
    """Yields the artifacts' bucket URL for --storage s3 (a local endpoint, started here), else ""."""
    if kind != "s3":
        yield ""
        return
    missing = [m for m in ("moto", "s3fs") if importlib.util.find_spec(m) is None]
    if missing:
        raise CommandError(
            f"--storage s3 runs a local S3 endpoint: pip install 'moto[server]' 'shardledger[s3]'"
            f" ({missing})"
        )
    from shardledger_cli.s3local import local_s3

    saved = {k: os.environ.get(k) for k in S3_ENV_KEYS}
    with local_s3(DEMO_BUCKET, versioned=True) as env:
        # The workers (forked later) and verify reach the endpoint through botocore's
        # standard variables; dummy credentials, never real ones.
        os.environ.update(env)
        try:
            yield f"s3://{DEMO_BUCKET}"
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def run_demo(args: argparse.Namespace) -> int:
    """Runs the demo and prints its report; exits 0 only when the ledger matched the truth."""
    if args.token_file or args.tls_ca or args.tls_cert or args.tls_key:
        # The workers build their own clients from the environment, so flags would reach only half.
        raise CommandError(
            "demo takes credentials from the environment only: set $SHARDLEDGER_TOKEN, "
            "$SHARDLEDGER_TLS_CA, $SHARDLEDGER_TLS_CERT, $SHARDLEDGER_TLS_KEY",
            EXIT_USAGE,
        )
    missing = [m for m in ("torch", "numpy") if importlib.util.find_spec(m) is None]
    if missing:
        raise CommandError(
            f"the demo trains with torch: pip install 'shardledger[torch]' ({missing})"
        )
    from shardledger_cli.demo.report import Ui
    from shardledger_cli.demo.run import Demo, Settings

    settings = Settings(
        shards=args.shards,
        workers=args.workers,
        steps=args.steps,
        seed=args.seed,
        namespace=args.namespace,
        server=args.server,
        progress=output_format(args) != "json" and sys.stderr.isatty(),
        storage=args.storage,
    )
    began = time.monotonic()
    with _work_dir(args.keep) as work, _storage(args.storage) as bucket_url:
        settings.bucket_url = bucket_url
        demo = Demo(settings, work, Ui(enabled=settings.progress))
        try:
            report = _run(demo)
        finally:
            demo.close()
        report["kept"] = args.keep is not None
        report["timings"]["total"] = round(time.monotonic() - began, 3)
    fmt = output_format(args)
    if fmt == "json":
        print_json(report)
    else:
        from shardledger_cli.demo.report import render

        render(report, plain=fmt == "plain")
    return int(report["exit_code"])


def _run(demo: Demo) -> dict[str, Any]:
    """Runs every phase and returns the report (JSON-ready)."""
    from shardledger_cli.demo.run import HEARTBEAT_TIMEOUT_S, WATCHDOG_GRACE_S

    began = time.time()
    demo.start()
    results, outage = demo.run_batch()
    demo.settle("batch")
    demo.tamper_objects()
    verify_before = demo.verify("batch")
    summary, views = demo.summary(), demo.views()
    entries = demo.resume_list(demo.work / "resume.jsonl")
    events = demo.events()
    assert demo.faults is not None
    ids = demo.shard_ids
    found = {shard_id: reason for shard_id, reason, _ in entries}
    faults = _fault_rows(demo.faults, ids, found, views)
    kill, kill_check = _server_kill(outage, results, events, began)
    checks = [
        check_resume_list(demo.faults.expected(ids), found),
        check_duplicates([ids[i] for i in demo.faults.indexes(DUPLICATE_RETRY)], views),
        check_drift([ids[i] for i in demo.faults.indexes(ENV_DRIFT)], views, summary),
        check_summary(summary, shards=len(ids), plan=demo.faults),
        check_accounting(results, count_events(events)),
        _check_hang(demo, [ids[i] for i in demo.faults.indexes(HANG)]),
    ] + ([kill_check] if kill_check else [])
    rerun_began = time.monotonic()
    rerun = demo.rerun([line for _, _, line in entries])
    rerun_seconds = time.monotonic() - rerun_began
    demo.settle("rerun")
    verify_after = demo.verify("rerun")
    after = demo.summary()
    left = demo.resume_list(demo.work / "resume-after-rerun.jsonl")
    after_check = _check_after(after, left, rerun, first_pass=summary["first_pass"])
    matched = all(c.ok for c in checks)
    steps = int(demo.settings.steps)
    return {
        "run_id": demo.run_id,
        "namespace": demo.settings.namespace or "default",
        "work_dir": str(demo.work),
        "server": {"target": demo.target, "embedded": demo.server is not None},
        "config": {
            "shards": demo.settings.shards,
            "workers": demo.settings.workers,
            "steps": steps,
            "seed": demo.settings.seed,
            "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
            "watchdog_grace_s": WATCHDOG_GRACE_S,
        },
        "faults": faults,
        "server_kill": kill,
        "watchdog": [a.to_json() for a in demo.watchdog.actions] if demo.watchdog else [],
        "hang_stack": _hang_stack(demo),
        "orphan_spool_events": demo.orphan_spool_events,
        "verify_before": _verify_counts(verify_before),
        "summary_before": summary,
        "ground_truth": {
            "matched": matched,
            "expected": demo.faults.expected(ids),
            "found": found,
            "checks": [c.to_json() for c in checks],
        },
        "resume": {
            "path": str(demo.work / "resume.jsonl"),
            "shards": len(entries),
            "reasons": dict(Counter(reason for _, reason, _ in entries)),
            "recomputed": len(rerun),
            "total": len(ids),
            "share": len(rerun) / len(ids),
            "seconds": round(rerun_seconds, 3),
            "resumed_from_checkpoint": sum(1 for r in rerun if r.get("resumed_from")),
            "steps_skipped": sum(int(r.get("resumed_from") or 0) for r in rerun),
            "steps_total": steps * len(rerun),
        },
        "verify_after": _verify_counts(verify_after),
        "summary_after": after,
        "after": {"resume_list": len(left), "check": after_check.to_json()},
        "timings": dict(demo.timings),
        "exit_code": EXIT_OK if matched and after_check.ok else EXIT_PROBLEMS,
    }


def _fault_rows(
    plan: FaultPlan, ids: Sequence[str], found: dict[str, str], views: dict[str, dict[str, Any]]
) -> dict[str, list[dict[str, Any]]]:
    rows: dict[str, list[dict[str, Any]]] = {form: [] for form in (*FORMS, *plan.extra_forms)}
    for index, form in plan.by_index.items():
        shard_id = ids[index]
        state = views[shard_id]["state"]
        rows[form].append(
            {
                "plan_index": index,
                "shard_id": shard_id,
                "expected": EXPECTED_REASON.get(form, "verified"),
                "found": found.get(shard_id, state if state != "verified" else "verified"),
            }
        )
    return rows


def _server_kill(
    outage: Outage, results: list[dict[str, Any]], events: list[Any], began: float
) -> tuple[dict[str, Any], Check | None]:
    if outage.state == "off":
        return {
            "happened": False,
            "reason": "the ledger is external (--server): not ours to kill",
        }, None
    written, stored_after, attempts = late_arrivals(
        events, down=outage.down_at, up=outage.restart_at
    )
    ran = overlapping(results, down=outage.down_at, up=outage.up_at)
    happened = outage.state == "done" and written > 0
    problems = [] if happened else ["no event was written while the ledger was down"]
    if stored_after != written:
        problems.append(f"{written - stored_after} outage events were stored before the restart")
    kill = {
        "happened": happened,
        "at_s": round(outage.down_at - began, 3),
        "down_s": round(outage.up_at - outage.down_at, 3),
        "spooled_events": written,
        "stored_after": stored_after,
        "attempts": attempts,
        "attempts_overlapping": len(ran),
    }
    detail = f"{written} events from {attempts} attempts spooled, drained after the restart"
    return kill, Check("ledger SIGKILLed and restarted mid-run", not problems, detail, problems)


def _check_hang(demo: Demo, hang_ids: Sequence[str]) -> Check:
    actions = {a.shard_id: a for a in demo.watchdog.actions} if demo.watchdog else {}
    problems = []
    for shard_id in hang_ids:
        action = actions.get(shard_id)
        if action is None:
            problems.append(f"{shard_id}: the watchdog never acted on it")
        elif "diagnostics" not in action.steps:
            problems.append(
                f"{shard_id}: the watchdog collected no diagnostics"
                f" (what it did: {'; '.join(action.steps) or 'nothing'})"
            )
        elif "_hang" not in Path(action.diagnostics).read_text(errors="replace"):
            problems.append(f"{shard_id}: the stack dump does not show the hung frame")
    detail = f"hung jobs: {len(hang_ids)}; stack dumped, then SIGTERM, grace, SIGKILL"
    return Check("hang diagnosed before the kill", not problems, detail, problems)


def _hang_stack(demo: Demo) -> list[str]:
    """Returns the hung job's frames in this demo's code, from the watchdog's report."""
    for action in demo.watchdog.actions if demo.watchdog else []:
        if action.diagnostics and os.path.exists(action.diagnostics):
            lines = Path(action.diagnostics).read_text(errors="replace").splitlines()
            frames = [ln.strip() for ln in lines if "worker.py" in ln]
            if frames:
                return frames[:4]
    return []


def _check_after(
    after: dict[str, Any],
    left: list[tuple[str, str, str]],
    rerun: list[dict[str, Any]],
    *,
    first_pass: dict[str, Any],
) -> Check:
    problems = [f"{s}: still to re-run ({r})" for s, r, _ in left]
    if after["first_pass"] != first_pass:
        # The first pass is history: a rerun must never rewrite it.
        problems.append(f"first-pass figures changed: {first_pass} -> {after['first_pass']}")
    problems += [f"{r['shard_id']}: {r['outcome']}" for r in rerun if r["outcome"] != "committed"]
    if after["completion_rate"] != 1.0:
        problems.append(f"completion rate {after['completion_rate']:.4f}, expected 1.0")
    detail = f"completion {100 * after['completion_rate']:.1f} %, {len(left)} left"
    return Check("after the rerun: 100 % verified", not problems, detail, problems)


def _verify_counts(report: dict[str, Any]) -> dict[str, Any]:
    keys = ("checked", "passed", "failed", "skipped", "exit_code")
    reasons = Counter(f["reason"] for f in report["failures"])
    return {k: report[k] for k in keys} | {"failures": dict(reasons)}
