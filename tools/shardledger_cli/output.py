"""Output helpers every command shares: JSON, times, plan lines, atomic files, progress bars."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import IO, Any, Final

from ledger_server.states import PARTITION
from shardledger_cli import cli
from shardledger_cli.cli import CommandError

REASON_KEY: Final = "_resume_reason"


def print_json(value: Any) -> None:
    """Prints one JSON document on stdout."""
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=True) + "\n")


def print_json_lines(values: Iterable[Any]) -> None:
    """Prints one compact JSON object per line on stdout: the --json shape of every list."""
    write = sys.stdout.write
    for value in values:
        write(json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n")


# How often a piped progress report prints a line (a Slurm job log, a CI log).
PIPED_EVERY_S: Final = 10.0


def progress(label: str, total: int) -> AbstractContextManager[Callable[[int], None]]:
    """Returns a context yielding advance(n) for work of ``total`` items.

    On a terminal: a bar with N/M, rate and time left. Piped (a batch log): after the
    work has run PIPED_EVERY_S, one line on stderr every PIPED_EVERY_S with N/M, the
    rate and the time left, and a last line when it ends, so a long verify in a Slurm
    job log is never silent; work that ends sooner prints nothing. --quiet: neither.
    """
    if cli.QUIET or total < 2:
        return nullcontext(lambda n: None)
    if not sys.stderr.isatty():
        return _lines(label, total)

    @contextmanager
    def bar() -> Iterator[Callable[[int], None]]:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            ProgressColumn,
            Task,
            TaskProgressColumn,
            TextColumn,
            TimeRemainingColumn,
        )
        from rich.text import Text

        class Rate(ProgressColumn):
            """Items per second (rich's speed columns count bytes)."""

            def render(self, task: Task) -> Text:
                return Text(f"{task.speed:,.1f}/s" if task.speed else "")

        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TaskProgressColumn(),
            Rate(),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=Console(stderr=True), transient=True) as shown:
            task = shown.add_task(label, total=total)
            yield lambda n: shown.advance(task, n)

    return bar()


@contextmanager
def _lines(
    label: str,
    total: int,
    *,
    every_s: float = PIPED_EVERY_S,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[Callable[[int], None]]:
    """Yields advance(n) that reports progress as a line every ``every_s`` (see progress)."""
    start = last = clock()
    done = 0
    printed = False

    def line(now: float) -> None:
        elapsed = max(now - start, 1e-9)
        rate = done / elapsed
        left = f"{(total - done) / rate:.0f} s left" if rate > 0 and done < total else "done"
        print(
            f"shardledger: {label}: {done:,}/{total:,} ({100 * done // total}%),"
            f" {rate:,.1f}/s, {left}",
            file=sys.stderr,
            flush=True,
        )

    def advance(n: int) -> None:
        nonlocal done, last, printed
        done += n
        now = clock()
        if now - last >= every_s:
            line(now)
            last, printed = now, True

    yield advance
    if printed:
        line(clock())


def ts_us(ts: Any) -> int:
    """Returns a protobuf Timestamp as microseconds since the epoch."""
    return int(ts.seconds) * 1_000_000 + int(ts.nanos) // 1000


def iso_us(us: int | None) -> str:
    """Returns microseconds since the epoch as an ISO-8601 UTC time ("-" for None)."""
    return "-" if us is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(us // 1_000_000))


# The shard states in the order of the reconciliation line; they partition the
# submitted shards, and each is the set `shards --state NAME` lists.
SHARD_STATES: Final = PARTITION


def by_state(s: Mapping[str, Any]) -> dict[str, int]:
    """Returns a run summary's shards by state, each name the set `shards --state` lists.

    The summary's own "failed" counts verify_failed shards too (kept for the scripts
    that read it); its "by_state" does not. A server older than by_state is read the
    same way: its failed less its verify_failed.
    """
    if "by_state" in s:
        return {k: int(s["by_state"].get(k, 0)) for k in SHARD_STATES}
    counts = {k: int(s[k]) for k in SHARD_STATES}
    return counts | {"failed": counts["failed"] - counts["verify_failed"]}


def equation(s: Mapping[str, Any]) -> str:
    """Returns the reconciliation line: submitted = verified + failed + missing + ..."""
    counts = by_state(s)
    return f"submitted {s['submitted']} = " + " + ".join(f"{k} {counts[k]}" for k in SHARD_STATES)


def write_lines(
    entries: Iterable[Any], out: IO[str], reasons: Counter[str], *, ids: bool, with_reason: bool
) -> None:
    """Writes one plan line (or shard id) per entry, counting reasons."""
    batch: list[str] = []
    for entry in entries:
        reasons[entry.reason] += 1
        line = entry.shard_id if ids else entry.plan_line
        batch.append((with_resume_reason(line, entry.reason) if with_reason else line) + "\n")
        if len(batch) >= 4096:
            out.writelines(batch)
            batch.clear()
    out.writelines(batch)


def with_resume_reason(line: str, reason: str) -> str:
    """Returns the plan line with a _resume_reason key, its other bytes unchanged."""
    stripped = line.rstrip()
    if f'"{REASON_KEY}"' in stripped or not stripped.endswith("}"):
        obj = json.loads(stripped)
        obj[REASON_KEY] = reason
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    # Appending before the closing brace keeps the stored line byte for byte.
    sep = "" if stripped[:-1].rstrip().endswith("{") else ","
    return f'{stripped[:-1]}{sep}"{REASON_KEY}":{json.dumps(reason)}}}'


@contextlib.contextmanager
def atomic_output(path: str | None) -> Iterator[IO[str]]:
    """Yields stdout, or a file whose contents replace path atomically and durably on success."""
    if path is None or path == "-":
        yield sys.stdout
        sys.stdout.flush()
        return
    try:
        if os.path.exists(path) and not os.path.isfile(path):
            # A device or FIFO (-o /dev/null, a named pipe) is written in place:
            # renaming a temp file over it would replace the device node itself.
            with open(path, "w", encoding="utf-8") as fh:
                yield fh
        else:
            from shard_client.atomic import atomic_write  # a file written, not a read

            with atomic_write(path, mode="w") as fh:
                yield fh
    except OSError as exc:
        raise CommandError(f"cannot write {path}: {exc.strerror or exc}") from None


def count_shards(n: int) -> str:
    """Returns "1 shard" or "N shards": counts printed as integers, with the right plural."""
    return f"{n} shard" if n == 1 else f"{n} shards"


# --format plain (the default when stdout is not a terminal; the rule is in parsing.py):
# blocks of tab-separated lines, a header line then one line per row. A line starting
# with "#" is a comment: a block's name just before its header ("# shards"), or a note.


def tsv_cell(value: Any) -> str:
    """Returns a value as one plain field: no tab or newline inside, no edge blanks."""
    return " ".join(str(value).replace("\t", " ").splitlines()).strip()


def print_note(text: str, *, plain: bool) -> None:
    """Prints a line of prose: as a "# " comment in plain output, so no block gains a row."""
    sys.stdout.write(("# " + tsv_cell(text) if plain else text) + "\n")


def print_table(
    title: str | None,
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    plain: bool,
    console: Any = None,
    upper: bool = True,
) -> None:
    """Prints a table: rich (nothing cut, wide cells fold), or plain with a "# title" line."""
    if plain:
        out = sys.stdout
        if title:
            out.write(f"# {tsv_cell(title)}\n")
        out.write("\t".join(tsv_cell(h).upper() if upper else tsv_cell(h) for h in headers) + "\n")
        out.writelines("\t".join(tsv_cell(c) for c in row) + "\n" for row in rows)
        return
    from rich.console import Console
    from rich.table import Column, Table

    if console is None:
        # markup off: ids, tags and reasons are data, never rich markup.
        console = Console(file=sys.stdout, markup=False, highlight=False)
    cells = [[str(c) for c in row] for row in rows]

    def numeric(i: int) -> bool:
        return bool(cells) and all(r[i].rstrip(" %").replace(".", "").isdigit() for r in cells)

    columns = [
        Column(h, justify="right" if numeric(i) else "left", overflow="fold")
        for i, h in enumerate(headers)
    ]
    table = Table(*columns, title=title)
    for row in cells:
        table.add_row(*row)
    # A terminal narrower than the table gets a wider console: rows wrap on screen
    # rather than cells being cut with an ellipsis (a timestamp, a shard id).
    need = sum(max([len(h), *(len(r[i]) for r in cells)]) + 3 for i, h in enumerate(headers)) + 1
    if need > console.width:
        console.width = need
    console.print(table)
