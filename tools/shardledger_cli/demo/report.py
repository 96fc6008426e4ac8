"""How the demo shows itself: a progress bar on a terminal, then the operator's report."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any, Final

from shardledger_cli.commands.status import render_summary
from shardledger_cli.demo.faults import (
    DELETED_OBJECT,
    DUPLICATE_RETRY,
    EMPTY_OUTPUT,
    ENV_DRIFT,
    FORMS,
    HANG,
    NAN_WEIGHTS,
    REPLACED_OBJECT,
    SILENT_MISSING,
    STORAGE_FORMS,
    TORN_UPLOAD,
    TRUNCATION,
)
from shardledger_cli.output import equation, print_note, print_table

LABELS: Final = {
    SILENT_MISSING: "silent missing",
    TRUNCATION: "silent truncation",
    EMPTY_OUTPUT: "empty output committed",
    NAN_WEIGHTS: "numeric pollution (NaN)",
    HANG: "hang holding the GIL",
    DUPLICATE_RETRY: "duplicate retry",
    ENV_DRIFT: "environment drift",
    TORN_UPLOAD: "torn upload (S3)",
    REPLACED_OBJECT: "object replaced (S3)",
    DELETED_OBJECT: "object deleted (S3)",
}

# What each form did, and how the ledger caught it: the closing "what just happened".
# The object-storage forms, explained only in a `--storage s3` night.
STORAGE_EXPLAINED: Final = {
    TORN_UPLOAD: (
        "the worker SIGKILLed itself in the middle of a multipart upload of weights.pt",
        "an incomplete multipart upload is invisible at the key and nothing was committed; "
        "the attempt went stale and the watchdog recorded failed(timeout)",
    ),
    REPLACED_OBJECT: (
        "after the commit, someone overwrote weights.pt in the bucket",
        "`shardledger verify` found another version id than the one committed: version_mismatch",
    ),
    DELETED_OBJECT: (
        "after the commit, someone deleted weights.pt from the bucket",
        "`shardledger verify` found no object at the committed URL: missing",
    ),
}
EXPLAINED: Final = {
    SILENT_MISSING: (
        "the job swallowed an exception and returned 0 without writing anything",
        "shard_client saw a clean exit with no committed outputs and recorded "
        "failed(incomplete) instead of a bare success; it counts as a silent error",
    ),
    TRUNCATION: (
        "the worker SIGKILLed itself halfway through writing weights.pt",
        "atomic_write never renamed the half-written temp file, so nothing was committed; "
        "the heartbeats stopped, the attempt went stale and the watchdog recorded failed(timeout)",
    ),
    EMPTY_OUTPUT: (
        "the job committed a zero-byte metrics.json and exited 0",
        "`shardledger verify` re-read the artifact and failed it as empty",
    ),
    NAN_WEIGHTS: (
        "the job committed weights.pt with a NaN in it and exited 0",
        "`shardledger verify` loaded the tensors and failed it as nan_or_inf",
    ),
    HANG: (
        "the job fell into a catastrophic-backtracking regex that holds the GIL, "
        "so its heartbeat thread starved",
        "after {timeout:g} s of silence the watchdog dumped every thread's stack, sent SIGTERM, "
        "waited {grace:g} s, sent SIGKILL and recorded failed(timeout)",
    ),
    DUPLICATE_RETRY: (
        "the launcher ran one shard twice, and both attempts committed",
        "two commits of the same outputs are counted as a `wasted` duplicate; same "
        "fingerprint, same bytes, so not non-deterministic; verified, not re-run",
    ),
    ENV_DRIFT: (
        "a few shards ran on a different image (SHARDLEDGER_IMAGE_DIGEST)",
        "each attempt records its environment fingerprint: the run splits into two "
        "fingerprint groups, and numbers are only compared inside one",
    ),
}


class Ui:
    """A transient rich progress bar on stderr when it is a terminal; otherwise nothing."""

    def __init__(self, *, enabled: bool) -> None:
        self._progress: Any = None
        self._task: Any = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

            self._progress = Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(file=sys.stderr),
                transient=True,
            )
            self._progress.start()

    def phase(self, description: str, *, total: int | None = None) -> None:
        """Shows a new phase, with a bar when it has a total."""
        if self._progress is None:
            return
        if self._task is not None:
            self._progress.remove_task(self._task)
        self._task = self._progress.add_task(description, total=total)

    def advance(self, n: int = 1) -> None:
        """Advances the current phase's bar."""
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task, n)

    def describe(self, description: str) -> None:
        """Renames the current phase (the bar keeps its count)."""
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, description=description)

    def add_total(self, n: int) -> None:
        """Grows the current phase's total (a retried shard)."""
        if self._progress is not None and self._task is not None:
            task = next(t for t in self._progress.tasks if t.id == self._task)
            self._progress.update(self._task, total=(task.total or 0) + n)

    def close(self) -> None:
        """Removes the bar."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def render(report: Mapping[str, Any], *, plain: bool | None = None) -> None:
    """Prints the demo's report for an operator: faults, ledger, checks, rerun, explanation.

    plain (the default when stdout is not a terminal: a CI log, a file) prints the
    same report as tab-separated blocks, each after a "# NAME" line, and its prose as
    "#" lines: never a box-drawing character.
    """
    from rich.console import Console

    if plain is None:
        plain = not sys.stdout.isatty()
    # Piped into a file or a CI log, 80 columns would fold every table; 120 reads better there.
    width = None if sys.stdout.isatty() else 120
    console = Console(file=sys.stdout, markup=False, highlight=False, width=width)
    say = _Say(console, plain=plain)
    cfg = report["config"]
    say.line(
        f"Project X: {cfg['shards']} shards, {cfg['workers']} workers, {cfg['steps']} steps, "
        f"seed {cfg['seed']}; run {report['run_id']} on {report['server']['target']}",
        style="bold",
    )
    _faults_table(say, report)
    _batch_notes(say, report)
    say.rule("the ledger after the batch (shardledger status)")
    sys.stdout.flush()
    render_summary(dict(report["summary_before"]), plain=plain)
    _checks(say, report)
    _rerun(say, report)
    _explain(say, report)
    t = report["timings"]
    say.line(
        f"wall time {t['total']:.1f} s (start {t['start']:.1f}, batch {t['batch']:.1f}, "
        f"settle {t['settle_batch']:.1f}, verify {t['verify_batch']:.1f}, "
        f"rerun {t['rerun']:.1f})"
    )
    if report["kept"]:
        work = report["work_dir"]
        say.line(f"kept in {work}: ledger.db (the events; try `shardledger serve --db`),")
        say.line("  out/ (artifacts), resume.jsonl, plan.jsonl, diag/ (stack dumps), ledger.log")


class _Say:
    """Prints the report's prose, rules and tables: rich on a terminal, plain blocks piped."""

    def __init__(self, console: Any, *, plain: bool) -> None:
        self.console = console
        self.plain = plain

    def line(self, text: str, *, style: str | None = None) -> None:
        """One line of prose ("# " before it when plain, so no block gains a row)."""
        if self.plain:
            print_note(text, plain=True)
        else:
            self.console.print(text, style=style)

    def rule(self, title: str) -> None:
        """A section title: a rule on a terminal, a "# == title ==" line when plain."""
        if self.plain:
            print_note(f"== {title} ==", plain=True)
        else:
            self.console.rule(title)

    def table(
        self, title: str | None, headers: Sequence[str], rows: Sequence[Sequence[str]]
    ) -> None:
        """A table: rich, or a plain block (a "# title" line, a header line, its rows)."""
        if self.plain:
            print_table(title or "table", headers, rows, plain=True)
            return
        from rich.table import Table

        table = Table(*headers, title=title)
        for row in rows:
            table.add_row(*row)
        self.console.print(table)


def _faults_table(say: _Say, report: Mapping[str, Any]) -> None:
    rows = []
    for form in (*FORMS, *STORAGE_FORMS):
        for f in report["faults"].get(form, []):
            mark = "ok" if f["expected"] == f["found"] else "MISMATCH"
            shard = f["shard_id"] if say.plain else f"{f['shard_id'][:14]}…"
            rows.append(
                (LABELS[form], str(f["plan_index"]), shard, f["expected"], f["found"], mark)
            )
    check = "check" if say.plain else ""  # a plain header names every column
    heads = ("injected failure", "plan index", "shard", "expected", "the ledger says", check)
    say.table("injected failures" if say.plain else None, heads, rows)


def _batch_notes(say: _Say, report: Mapping[str, Any]) -> None:
    kill = report["server_kill"]
    if kill["happened"]:
        say.line(
            f"ledger server SIGKILLed at +{kill['at_s']:.1f} s, back {kill['down_s']:.1f} s later "
            f"on the same port: {kill['spooled_events']} events from {kill['attempts']} attempts "
            f"waited in the jobs' spools and arrived afterwards ({kill['stored_after']} stored "
            "after the restart)"
        )
    else:
        say.line(f"ledger server kill skipped: {kill['reason']}")
    for action in report["watchdog"]:
        say.line(
            f"watchdog: shard {action['shard_id'][:14]}… pid {action['pid']}: "
            f"{', '.join(action['steps'])} -> failed(timeout)"
        )
    if report.get("hang_stack"):
        say.line("  stack of the hung job, dumped before the kill:")
        for line in report["hang_stack"]:
            say.line(f"    {line}")
    v = report["verify_before"]
    say.line(
        f"shardledger verify: {v['checked']} artifacts checked, {v['passed']} passed, "
        f"{v['failed']} failed"
    )


def _checks(say: _Say, report: Mapping[str, Any]) -> None:
    r = report["resume"]
    where = r["path"] if report["kept"] else "resume.jsonl in the work dir (--keep DIR keeps it)"
    say.line(
        f"resume list: {r['shards']} shards -> {where} "
        f"({', '.join(f'{k} {n}' for k, n in sorted(r['reasons'].items()))})"
    )
    rows = [
        (check["name"], "ok" if check["ok"] else "FAILED", check["detail"])
        for check in report["ground_truth"]["checks"]
    ]
    say.table("the ledger vs what was injected", ("ground truth check", "result", "detail"), rows)
    for check in report["ground_truth"]["checks"]:
        for problem in check["problems"]:
            say.line(f"MISMATCH ({check['name']}): {problem}", style="bold red")
    verdict = "every injected fault was found, with the right reason, and nothing else"
    if not report["ground_truth"]["matched"]:
        verdict = "the ledger and the ground truth DISAGREE (see above)"
    say.line(verdict, style="bold")


def _rerun(say: _Say, report: Mapping[str, Any]) -> None:
    r, after = report["resume"], report["summary_after"]
    say.rule("resume: exactly the listed shards, from their plan lines, no faults")
    say.line(
        f"recomputed {r['recomputed']} of {r['total']} shards ({100 * r['share']:.1f} %) in "
        f"{r['seconds']:.1f} s; {r['resumed_from_checkpoint']} resumed from a checkpoint, "
        f"skipping {r['steps_skipped']} of {r['steps_total']} steps"
    )
    say.line(equation(after))
    say.line(
        f"completion rate {100 * after['completion_rate']:.1f} %  "
        f"(verified / submitted); resume list now {report['after']['resume_list']} shards",
        style="bold",
    )
    _first_pass_table(say, after)


def _first_pass_table(say: _Say, after: Mapping[str, Any]) -> None:
    """Shows the night's first pass beside the final figures: history the rerun did not rewrite."""
    fp = after["first_pass"]

    def pct(x: float) -> str:
        return f"{100 * x:.1f} %"

    rows = [
        (
            "completion (verified / submitted)",
            pct(fp["completion_rate"]),
            pct(after["completion_rate"]),
        ),
        ("silent error rate", pct(fp["silent_error_rate"]), pct(after["silent_error_rate"])),
        ("reconciled on the first attempt", pct(fp["reconciliation_rate"]), ""),
        ("recomputed shards", "", f"{after['recomputed']} ({pct(after['recomputed_rate'])})"),
        ("repairs (not duplicates)", "", str(after["repairs"])),
    ]
    title = "first pass (the night as launched) vs after the rerun"
    if say.plain:
        say.table(title, ("figure", "first pass", "final"), rows)
        return
    from rich.table import Column, Table

    table = Table(
        "figure",
        Column("first pass", justify="right"),
        Column("final", justify="right"),
        title=title,
    )
    for row in rows:
        table.add_row(*row)
    say.console.print(table)


def _explain(say: _Say, report: Mapping[str, Any]) -> None:
    say.rule("what just happened")
    cfg = report["config"]
    limits = {"timeout": cfg["heartbeat_timeout_s"], "grace": cfg["watchdog_grace_s"]}
    rows = [
        (LABELS[form], did, caught.format(**limits)) for form, (did, caught) in EXPLAINED.items()
    ]
    rows += [
        (LABELS[form], did, caught)
        for form, (did, caught) in STORAGE_EXPLAINED.items()
        if report["faults"].get(form)
    ]
    kill = report["server_kill"]
    if kill["happened"]:
        rows.append(
            (
                "ledger server killed",
                f"the ledger was SIGKILLed mid-run and came back {kill['down_s']:.1f} s later",
                "the SDK kept events in a durable local spool and drained it on reconnect; "
                "event ids make the drain idempotent: every event arrived, none twice",
            )
        )
    if say.plain:
        say.table(
            "what just happened", ("failure form", "what was done", "how it was caught"), rows
        )
        return
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    for label, did, caught in rows:
        grid.add_row(label, f"{did}\n-> {caught}")
    say.console.print(grid)
