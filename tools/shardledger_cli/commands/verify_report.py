"""What `shardledger verify` found: the tally of verdicts, the report and its text form."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardledger_cli.commands.verify_scan import Commit, CommitState
from shardledger_cli.output import print_json, print_note, print_table

__all__ = ["Tally", "entry", "print_report", "summary_line"]


@dataclass(slots=True)
class Tally:
    """Counts verify's outcomes; only current commits decide the exit code."""

    current: set[tuple[str, str, str]]
    checked: int = 0
    passed: int = 0
    skipped: int = 0
    skipped_failed: int = 0
    older_failed: int = 0
    current_failed: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)
    unchecked: list[dict[str, Any]] = field(default_factory=list)

    def add(
        self, state: CommitState, passed: bool, reason: str, detail: str, *, earlier: bool
    ) -> None:
        """Counts one commit's verdict, new (checked now) or earlier (skipped)."""
        current = state.commit.key in self.current
        self.checked += not earlier
        self.passed += passed and not earlier
        self.skipped += earlier
        if passed:
            return
        if not current:
            # An older attempt's failure stays in the ledger but is not news: the output's
            # latest commit decides. Reported only when found now.
            self.older_failed += 1
            if not earlier:
                self.failures.append(
                    entry(state.commit, reason, detail) | {"earlier": False, "current": False}
                )
            return
        self.current_failed += 1
        self.skipped_failed += earlier
        self.failures.append(
            entry(state.commit, reason, detail) | {"earlier": earlier, "current": True}
        )

    def report(self, run_id: str, root: str, *, read: int, recorder: Any) -> dict[str, Any]:
        """Returns the report `--json` prints."""
        return {
            "run_id": run_id,
            "root": root,
            "checked": self.checked,
            "read": read,
            "passed": self.passed,
            "failed": self.checked - self.passed,
            "skipped": self.skipped,
            "skipped_failed": self.skipped_failed,
            "older_failed": self.older_failed,
            "not_checked": len(self.unchecked),
            "appended": recorder.appended,
            "duplicate": recorder.duplicate,
            "refused": recorder.refused,
            "dry_run": recorder.dry_run,
            "not_recorded": recorder.not_recorded,
            "failures": self.failures,
            "unchecked": self.unchecked,
        }


def entry(commit: Commit, reason: str, detail: str) -> dict[str, Any]:
    return {
        "shard_id": commit.shard_id,
        "attempt_id": commit.attempt_id,
        "name": commit.name,
        "path": commit.path,
        "reason": reason,
        "detail": detail,
    }


def print_report(report: dict[str, Any], *, fmt: str) -> None:
    """Prints the report: JSON, lines for a person (table), or one tab-separated block (plain).

    Plain, the default when piped: a header line and one row per verdict that failed
    or could not be reached (VERDICT is FAILED or NOT CHECKED), then the summary as a
    "#" note, so `awk -F'\\t' '$1 == "FAILED"'` picks the failures.
    """
    if fmt == "json":
        print_json(report)
        return
    if fmt == "plain":
        rows = [
            (
                "FAILED",
                f["shard_id"],
                f["attempt_id"],
                f["name"],
                f["path"],
                f["reason"],
                "earlier" if f["earlier"] else "new",
                "current" if f["current"] else "older",
                f["detail"],
            )
            for f in report["failures"]
        ] + [
            (
                "NOT CHECKED",
                u["shard_id"],
                u["attempt_id"],
                u["name"],
                u["path"],
                u["reason"],
                "",
                "",
                u.get("detail") or "",
            )
            for u in report["unchecked"]
        ]
        heads = (
            "verdict",
            "shard",
            "attempt",
            "name",
            "path",
            "reason",
            "verdict of",
            "commit",
            "detail",
        )
        if rows:  # a header over no rows reads as a table that lost its rows
            print_table(None, heads, rows, plain=True)
        print_note(summary_line(report), plain=True)
        return
    for f in report["failures"]:
        when = " (earlier verdict)" if f["earlier"] else ""
        older = "" if f["current"] else " (older commit: a later commit of this output decides)"
        detail = f": {f['detail']}" if f["detail"] else ""
        print(
            f"FAILED {f['shard_id']} {f['attempt_id']} {f['name']} {f['path']} "
            f"{f['reason']}{when}{older}{detail}"
        )
    for u in report["unchecked"]:
        detail = f": {u['detail']}" if u.get("detail") else ""
        print(
            f"NOT CHECKED {u['shard_id']} {u['attempt_id']} {u['name']} {u['path']} {u['reason']}"
            f"{detail}"
        )
    print(summary_line(report))


def summary_line(report: dict[str, Any]) -> str:
    """Returns the one line that counts what verify checked, passed, failed and recorded."""
    skipped_failed = report["skipped_failed"]
    return (
        f"verify {report['run_id']}: {report['checked']} checked ({report['read']} files read),"
        f" {report['passed']} passed, {report['failed']} failed;"
        f" {report['skipped']} skipped as they already have a verdict"
        + (
            f" ({skipped_failed} of them failed: use --recheck to read them again)"
            if skipped_failed
            else ""
        )
        + (
            f"; dry run: {report['not_recorded']} verdicts not recorded"
            if report["dry_run"]
            else f"; {report['appended']} verdicts recorded"
        )
        + (f", {report['refused']} refused" if report["refused"] else "")
        + (f"; {report['not_checked']} not checked" if report["not_checked"] else "")
        + (
            f"; {report['superseded']} superseded by a later commit to the same path"
            if report["superseded"]
            else ""
        )
        + (
            f"; {report['older_failed']} failed commits replaced by a later commit"
            if report["older_failed"]
            else ""
        )
    )
