"""A compressed year of nights, with and without retention: does the hot store plateau?

    python -m tools.bench retention                     # 365 nights of 50 shards, each way
    python -m tools.bench.retention --shards 100        # docs/performance.md's run (~13 min here)

Each configuration plays the same year into its own SQLite ledger, in process (the
ledger service, its group committer and the store; no gRPC), on a clock that moves
one day per night. A night is the generator's mix: every shard planned and started,
heartbeats, then nine in ten commit and pass verification and one in ten fails
(oom); the submission is closed, so the night settles. With retention the server's
own Retention archives runs settled more than --after nights ago to a local
directory, running beside the night's appends (its step in a thread, as serve runs
it), so the appends' p99 includes any wait for the archive's transaction.

    python -m tools.bench.retention --pause            # appends during one big archive
    python -m tools.bench.retention --read-rss         # peak RSS reading an archived night

At nights 1, 30, 180 and 365 (scaled to --nights) it records the hot store's size
(the file, and the pages in use), the p99 of that night's append batches, and the
latency of `status` and `report` of the night before and of the first night
(archived by then, with retention: answered from its tombstone). JSON goes to
bench-results/retention.json.

--pause measures what one archive costs the appends beside it on SQLite: one night
of --shards (10,000 by default: ~89,000 events) is played, its bundle prepared,
then a thread appends the next night in batches of 50 while the archive's commit
runs, twice on copies of the same ledger: the whole run's rows deleted in the
tombstone's one transaction (the shape before issue 48's purge, reproduced here
as the baseline), then the tombstone alone and the paced, chunked purge (as serve's
retention runs it). It reports the p50, p99 and max of the append batches that
overlapped the commit, and the commit's own time. JSON goes to
bench-results/retention-pause.json.

--read-rss archives one night of --shards (20,000 by default) and reads its resume
list back from the bundle, each way in a new process: every shard's record kept as
an object (the read before issue 48's fix), then the spilling replay `shards` and
`resume` use now (compact.CompactRecords) with its default hot set and a small one.
It reports each read's peak RSS and time. JSON goes to
bench-results/retention-read-rss.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Final

from ledger_server import archiver
from ledger_server.events import (
    ArtifactCommitted,
    ArtifactVerified,
    AttemptFailed,
    AttemptStarted,
    Event,
    Heartbeat,
    ShardPlanned,
    SubmissionClosed,
)
from ledger_server.retention import Retention, RetentionPolicy
from ledger_server.service import LedgerService
from ledger_server.signing import SigningKey
from ledger_server.store.base import Tombstone
from ledger_server.store.sqlite import SqliteStore
from shard_client.canonical import fingerprint_digest
from tools.bench.projections import save_result

DAY_US: Final = 86_400 * 1_000_000
START_US: Final = 1_767_225_600_000_000  # 2026-01-01T00:00:00Z
DIGEST: Final = "ab" * 32
FINGERPRINT: Final = {"gpu": "H100"}
FP: Final = fingerprint_digest(FINGERPRINT)
BATCH: Final = 500  # events per append (the SDK sends up to 10,000: a spool drain, `plan`)


class YearClock:
    """The ledger's clock: one day per night, a microsecond per reading within it."""

    def __init__(self) -> None:
        self.night = 0
        self._tick = 0
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            self._tick += 1
            return START_US + self.night * DAY_US + self._tick


def night_events(night: int, shards: int, beats: int) -> list[Event]:
    """Returns one night's events in log order."""
    run = f"night-{night:03d}"

    def ev(kind: str, i: int, payload: Any, attempt: str = "a1") -> Event:
        return Event(f"{run}-{kind}-{i}", "", run, f"s{i:05d}", attempt, 0, payload)

    out = [
        ev(
            "p",
            i,
            ShardPlanned(f"s3://in/{i}.bin", 1 << 20, "", f'{{"seed":{i}}}', ("out",), "", i),
            "",
        )
        for i in range(shards)
    ]
    out += [
        ev("s", i, AttemptStarted("node-1", 42, 3_600_000_000, FINGERPRINT, FP))
        for i in range(shards)
    ]
    for step in range(beats):
        out += [
            ev(f"h{step}", i, Heartbeat(step, step / beats, {"loss": 0.5})) for i in range(shards)
        ]
    for i in range(shards):
        if i % 10 == 9:
            out.append(ev("f", i, AttemptFailed("oom", "CUDA out of memory")))
            continue
        path = f"/out/{run}/{i}.bin"
        out.append(ev("c", i, ArtifactCommitted("out", path, 1 << 20, DIGEST, "")))
        out.append(ev("v", i, ArtifactVerified("out", path, DIGEST, "passed", "", ""), ""))
    out.append(Event(f"{run}-close", "", run, "", "", 0, SubmissionClosed("night over", shards)))
    return out


def _pragma(store: SqliteStore, name: str) -> int:
    return int(str(store.execute_raw(f"PRAGMA {name}")[0][0]))


def _used_bytes(store: SqliteStore) -> int:
    """Returns the bytes of the database's pages in use (its WAL included), free ones not."""
    pages = _pragma(store, "page_count") - _pragma(store, "freelist_count")
    return pages * _pragma(store, "page_size")


def _sizes(store: SqliteStore, path: str) -> dict[str, int]:
    store.execute_raw("PRAGMA wal_checkpoint(TRUNCATE)")
    return {"file_bytes": os.path.getsize(path), "used_bytes": _used_bytes(store)}


def _ms(seconds: list[float], q: float) -> float:
    if len(seconds) < 2:
        return round(1000 * seconds[0], 3) if seconds else 0.0
    return round(1000 * statistics.quantiles(seconds, n=100)[int(q) - 1], 3)


def _timed(call: Any) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def play_year(
    directory: str,
    *,
    nights: int,
    shards: int,
    beats: int,
    after: int | None,
    marks: list[int],
    isolation: str = "child",
) -> dict[str, Any]:
    """Plays the year; returns the figures at each mark night."""
    path = os.path.join(directory, "ledger.db")
    store = SqliteStore(path)
    clock = YearClock()
    ledger = LedgerService(store, clock=clock)
    retention = None
    if after is not None:
        policy = RetentionPolicy(after * 86_400.0, os.path.join(directory, "archive"), 0.0)
        key_path = os.path.join(directory, "ledger.db.signing-key.pem")
        key = SigningKey.load_or_create(key_path)
        # As serve runs it: the bundle built in a child process (or, "thread", in this one).
        child = (path, key_path) if isolation == "child" else None
        retention = Retention(ledger, key, policy, child=child)
    out: dict[str, Any] = {
        "marks": [],
        "archived_runs": 0,
        "archived_bytes": 0,
        "used_bytes_by_night": [],
    }
    archive_s: list[float] = []
    latencies: list[float] = []
    started = time.monotonic()
    try:
        for night in range(1, nights + 1):
            clock.night = night
            worker = _archive_beside(retention, out, archive_s) if retention else None
            latencies += _append_night(ledger, night_events(night, shards, beats))
            if worker is not None:
                worker.join()  # the next night starts with nothing left of this one's work
            out["used_bytes_by_night"].append(_used_bytes(store))
            if night in marks:
                # The appends' quantiles are over every batch since the previous mark.
                out["marks"].append(_mark(store, ledger, path, night, latencies))
                latencies = []
                print(f"  night {night}: {out['marks'][-1]}", file=sys.stderr, flush=True)
    finally:
        ledger.close()
        store.close()
    out["seconds"] = round(time.monotonic() - started, 1)
    out["archive_step_ms_p50"] = _ms(archive_s, 50)
    out["archive_step_ms_p99"] = _ms(archive_s, 99)
    return out


def _archive_beside(
    retention: Retention, out: dict[str, Any], archive_s: list[float]
) -> threading.Thread:
    """Starts the retention's steps in a thread, until nothing is due (as serve runs them)."""

    def archive_due() -> None:
        while True:
            t0 = time.perf_counter()
            outcome = retention.step()
            if outcome is None:
                return
            archive_s.append(time.perf_counter() - t0)
            if outcome.ok:
                out["archived_runs"] += 1
                out["archived_bytes"] += outcome.size_bytes

    worker = threading.Thread(target=archive_due)
    worker.start()
    return worker


def _append_night(ledger: LedgerService, events: list[Event]) -> list[float]:
    """Appends the night in batches; returns each batch's latency."""
    latencies = []
    for start in range(0, len(events), BATCH):
        batch = events[start : start + BATCH]
        t0 = time.perf_counter()
        ledger.append(batch)
        latencies.append(time.perf_counter() - t0)
    return latencies


def _mark(
    store: SqliteStore, ledger: LedgerService, path: str, night: int, latencies: list[float]
) -> dict[str, Any]:
    latest, first = f"night-{max(1, night - 1):03d}", "night-001"
    reads: dict[str, list[float]] = {
        "status": [],
        "report": [],
        "status_first": [],
        "report_first": [],
    }
    for _ in range(20):
        reads["status"].append(_timed(lambda: ledger.summary("", latest)))
        reads["report"].append(_timed(lambda: ledger.report("", latest)))
        reads["status_first"].append(_timed(lambda: ledger.summary("", first)))
        reads["report_first"].append(_timed(lambda: ledger.report("", first)))
    run = store.read().get_run("default", first)
    return {
        "night": night,
        **_sizes(store, path),
        "append_batch_ms_p50": _ms(latencies, 50),
        "append_batch_ms_p99": _ms(latencies, 99),
        **{f"{name}_ms_p50": _ms(values, 50) for name, values in reads.items()},
        "first_night_archived": bool(run is not None and run.archived),
    }


def bench_retention(
    *,
    nights: int = 365,
    shards: int = 50,
    beats: int = 4,
    after: int = 7,
    isolation: str = "child",
) -> dict[str, Any]:
    """Plays the year without, then with, retention; returns both."""
    marks = sorted({max(1, round(nights * n / 365)) for n in (1, 30, 180, 365)})
    result: dict[str, Any] = {
        "nights": nights,
        "shards_per_night": shards,
        "events_per_night": len(night_events(1, shards, beats)),
        "archive_after_nights": after,
        "bundle_built_in": isolation,
    }
    for name, policy in (("without_archive", None), ("with_archive", after)):
        print(f"== {name}", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="shardledger-retention-") as directory:
            result[name] = play_year(
                directory,
                nights=nights,
                shards=shards,
                beats=beats,
                after=policy,
                marks=marks,
                isolation=isolation,
            )
    last = {k: result[k]["marks"][-1] for k in ("without_archive", "with_archive")}
    result["hot_used_ratio_at_end"] = round(
        last["with_archive"]["used_bytes"] / last["without_archive"]["used_bytes"], 4
    )
    return result


PAUSE_BATCH: Final = 50  # events per append while the archive commits (a few shards' worth)


def _one_transaction(store: SqliteStore, tombstone: Tombstone) -> None:
    """The archive's commit before the purge: the tombstone and every row's delete at once."""
    from ledger_server.store import sqlite_archive
    from ledger_server.store import sqlite_sql as q

    with store.write() as tx:
        sqlite_archive.archive(tx, tombstone, lambda: None)
        for sql in q.SQL_ARCHIVE_DELETES:
            tx.conn.execute(sql, (tombstone.run_pk,))


def _commit_beside_appends(
    directory: str, key: SigningKey, shape: str, shards: int, beats: int, chunk: int
) -> dict[str, Any]:
    """Commits night 1's archive while night 2 is appended; returns the appends' figures."""
    path = os.path.join(directory, "ledger.db")
    store = SqliteStore(path)
    clock = YearClock()
    clock.night = 30
    ledger = LedgerService(store, clock=clock)
    try:
        prepared = archiver.prepare(
            store, key, "default", "night-001", os.path.join(directory, "archive"), now_us=clock()
        )
        assert isinstance(prepared, Tombstone), prepared
        spans: list[tuple[float, float]] = []
        window: list[float] = []
        done = threading.Event()

        def append() -> None:
            night = 2  # night after night, until the archive is over
            while not done.is_set():
                events = night_events(night, shards, beats)
                for start in range(0, len(events), PAUSE_BATCH):
                    t0 = time.perf_counter()
                    ledger.append(events[start : start + PAUSE_BATCH])
                    spans.append((t0, time.perf_counter()))
                    if done.is_set():
                        return
                night += 1

        worker = threading.Thread(target=append)
        worker.start()
        time.sleep(2.0)  # the appends' own pace first
        window.append(time.perf_counter())
        if shape == "one_transaction":
            _one_transaction(store, prepared)
        else:
            archiver.commit(store, "default", "night-001", prepared, paced=True, purge_chunk=chunk)
        window.append(time.perf_counter())
        time.sleep(0.2)
        done.set()
        worker.join()
    finally:
        ledger.close()
        store.close()
    during = [end - t0 for t0, end in spans if end >= window[0] and t0 <= window[1]]
    before = [end - t0 for t0, end in spans if end < window[0]]
    return {
        "commit_s": round(window[1] - window[0], 3),
        "appends_during": len(during),
        "append_ms_p50": _ms_within(during, 50),
        "append_ms_p99": _ms_within(during, 99),
        "append_ms_max": round(1000 * max(during), 3) if during else 0.0,
        "appends_before": len(before),
        "append_ms_p99_before": _ms_within(before, 99),
    }


def _ms_within(seconds: list[float], q: int) -> float:
    """The q-th percentile in ms, never past the largest sample (a handful of appends waited)."""
    if len(seconds) < 2:
        return round(1000 * seconds[0], 3) if seconds else 0.0
    return round(1000 * statistics.quantiles(seconds, n=100, method="inclusive")[q - 1], 3)


def bench_pause(
    *, shards: int = 10_000, beats: int = 5, chunk: int = archiver.PURGE_CHUNK
) -> dict[str, Any]:
    """Plays one night, then commits its archive both ways beside appends; returns both."""
    result: dict[str, Any] = {
        "shards": shards,
        "events": len(night_events(1, shards, beats)),
        "append_batch_events": PAUSE_BATCH,
        "purge_chunk_rows": chunk,
    }
    with tempfile.TemporaryDirectory(prefix="shardledger-pause-") as directory:
        source = os.path.join(directory, "night")
        os.mkdir(source)
        key = SigningKey.load_or_create(os.path.join(source, "key.pem"))
        store = SqliteStore(os.path.join(source, "ledger.db"))
        clock = YearClock()
        ledger = LedgerService(store, clock=clock)
        clock.night = 1
        _append_night(ledger, night_events(1, shards, beats))
        ledger.close()
        store.close()
        for shape in ("one_transaction", "chunked_purge"):
            copy = os.path.join(directory, shape)
            shutil.copytree(source, copy)
            result[shape] = _commit_beside_appends(copy, key, shape, shards, beats, chunk)
            print(f"  {shape}: {result[shape]}", file=sys.stderr, flush=True)
            shutil.rmtree(copy)
    base, new = result["one_transaction"], result["chunked_purge"]
    if base["append_ms_max"]:
        result["append_p99_ratio"] = round(new["append_ms_p99"] / base["append_ms_p99"], 4)
        result["append_max_ratio"] = round(new["append_ms_max"] / base["append_ms_max"], 4)
    return result


def _read_archived(database: str, how: str, hot: int) -> dict[str, Any]:
    """In a fresh process: reads the archived night's resume list; returns its peak RSS."""
    from ledger_server.archive_read import archived_resume, archived_rows
    from ledger_server.projections import resume_reason
    from ledger_server.rebuild import gc_paused
    from ledger_server.replay import RunReplay

    store = SqliteStore(database, read_only=True)
    view = store.read()
    run = view.get_run("default", "night-001")
    assert run is not None
    tombstone = view.get_tombstone(run.run_pk)
    assert tombstone is not None
    at = START_US + 30 * DAY_US
    started = time.perf_counter()
    if how == "objects":
        # The read before issue 48's fix: every shard's record as an object, then sorted.
        replay = RunReplay()
        with gc_paused():
            for row in archived_rows(tombstone):
                replay.feed_row(row.sequence, row.row, row.row_hash)
        resume = sum(1 for r in replay.ordered() if resume_reason(r, at) is not None)
    else:
        resume = sum(1 for _ in archived_resume(tombstone, at, hot=hot))
    seconds = time.perf_counter() - started
    store.close()
    # VmHWM, not getrusage's ru_maxrss: Linux carries the forking parent's peak into
    # ru_maxrss across exec, and this bench's parent held a whole night of events.
    with open("/proc/self/status") as status:
        (peak_kib,) = [int(line.split()[1]) for line in status if line.startswith("VmHWM:")]
    return {
        "resume": resume,
        "seconds": round(seconds, 2),
        "peak_rss_mib": round(peak_kib / 1024, 1),
    }


def bench_read_rss(*, shards: int = 20_000, beats: int = 1) -> dict[str, Any]:
    """Archives one night, then reads its resume list from the bundle each way, each in a new process."""
    import multiprocessing

    result: dict[str, Any] = {"shards": shards, "events": len(night_events(1, shards, beats))}
    with tempfile.TemporaryDirectory(prefix="shardledger-rss-") as directory:
        path = os.path.join(directory, "ledger.db")
        key = SigningKey.load_or_create(os.path.join(directory, "key.pem"))
        store = SqliteStore(path)
        clock = YearClock()
        ledger = LedgerService(store, clock=clock)
        clock.night = 1
        _append_night(ledger, night_events(1, shards, beats))
        clock.night = 30
        outcome = archiver.archive_run(
            store, key, "default", "night-001", os.path.join(directory, "archive"), now_us=clock()
        )
        assert outcome.action == "archived", outcome
        ledger.close()
        store.close()
        # spawn: each read starts from a bare interpreter, so its peak is its own.
        context = multiprocessing.get_context("spawn")
        ways = [("objects", 0), ("compact", 50_000), ("compact", 2_000)]
        with context.Pool(1, maxtasksperchild=1) as pool:
            for how, hot in ways:
                name = how if how == "objects" else f"{how}_hot_{hot}"
                result[name] = pool.apply(_read_archived, (path, how, hot))
                print(f"  {name}: {result[name]}", file=sys.stderr, flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and saves bench-results/retention.json."""
    from ledger_server.server import configure_logging

    configure_logging("warning")
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.retention",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nights", type=int, default=365)
    parser.add_argument("--shards", type=int, help="shards per night (default 50)")
    parser.add_argument("--beats", type=int, help="heartbeats per attempt (default 4)")
    parser.add_argument(
        "--after", type=int, default=7, help="archive runs settled this many nights ago"
    )
    parser.add_argument(
        "--isolation",
        choices=("child", "thread"),
        default="child",
        help="build bundles in a child process as serve does (default), or in a thread of"
        " the ledger's process",
    )
    parser.add_argument(
        "--pause",
        action="store_true",
        help="measure appends during one archive's commit, one transaction vs chunked purge"
        " (--shards defaults to 10,000 and --beats to 5 here)",
    )
    parser.add_argument("-o", "--output", help="default: bench-results/retention[-pause].json")
    parser.add_argument(
        "--chunk",
        type=int,
        default=archiver.PURGE_CHUNK,
        help="with --pause: rows per purge transaction (default %(default)s, as serve)",
    )
    parser.add_argument(
        "--read-rss",
        action="store_true",
        help="peak RSS of reading an archived night's resume list, every record as an object"
        " vs the spilling replay (--shards defaults to 20,000 and --beats to 1 here)",
    )
    args = parser.parse_args(argv)
    if args.read_rss:
        shards = 20_000 if args.shards is None else args.shards
        result = bench_read_rss(shards=shards, beats=1 if args.beats is None else args.beats)
        output = args.output or "bench-results/retention-read-rss.json"
    elif args.pause:
        shards = 10_000 if args.shards is None else args.shards
        beats = 5 if args.beats is None else args.beats
        result = bench_pause(shards=shards, beats=beats, chunk=args.chunk)
        output = args.output or "bench-results/retention-pause.json"
    else:
        result = bench_retention(
            nights=args.nights,
            shards=50 if args.shards is None else args.shards,
            beats=4 if args.beats is None else args.beats,
            after=args.after,
        )
        output = args.output or "bench-results/retention.json"
    import json

    print(json.dumps(result, indent=2))
    save_result(output, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
