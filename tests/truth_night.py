"""A night whose jobs really run known, distinct durations, and the truth about it.

Every attempt is a real `Ledger.shard(...)` context of the SDK against a real
server, run concurrently in a few threads: it sleeps its known duration, writes a
checkpoint whose write takes a known time, commits (or fails) as its kind says.
Around each we record, on the clock the ledger reads, what its span must be:

    lo  from inside the block (started acknowledged) to before its end was sent
    hi  from before the started event was sent to after its end was acknowledged

so the span the ledger computes lies in [lo, hi], and hi is the measured span (the
job body timed from outside). A SIGKILLed job (kind ``hang``) has no end event: its
span ends at its last event (a checkpoint it acknowledged just before the kill), on
the ledger's clock, bracketed the same way by the child process's own readings.

What each attempt is, in the definitions of ledger_server.field, is stated by the
scenario (`NIGHT`), not computed: its cost bucket before and after the reruns, its
provider and GPUs. `Truth` sums those into the figures the server must serve.

The night (`play_truth_night`): plan two runs (labels provider=A/B/C per shard),
the first pass, `verify`, the resume list rerun, `verify` again, an idle wait much
longer than any job, and `verify --recheck`, with the report, `status --costs` and
`report --by provider` read after each verify.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from shard_client import DataError, Fingerprint, IncompleteShard, Ledger, LedgerClient, Preempted
from shard_client.api.shardledger.v1.ledger_pb2 import VERIFICATION_RESULT_FAILED

REPO: Final = Path(__file__).resolve().parents[1]
RUNS: Final = ("truth-1", "truth-2")
PROVIDERS: Final = ("A", "B", "C")
# A's GPU count is the started event's gpu_count (from its fingerprint's gpu.count), B's a
# gpus label, C's unknown (one GPU counted, in gpus_unknown_attempts).
GPUS: Final = {"A": (1, True), "B": (2, True), "C": (1, False)}
HANG_TIMEOUT_S: Final = 0.5
IDLE_S: Final = 3.0  # before the late --recheck: over twice the longest job
WORKERS: Final = 6
STAGES: Final = ("first", "final", "late")  # after each verify
FAILING: Final = {"oom": "oom", "data": "data", "preempted": "preempted"}
SILENT_FORM: Final = {
    "empty": "empty",
    "incomplete": "empty",
    "truncated": "truncated",
    "nan": "nan",
}
COMPLETE: Final = frozenset({"ok", "empty", "truncated", "nan"})


@dataclass(frozen=True, slots=True)
class Job:
    """One attempt as the night plays it."""

    kind: str  # ok, empty, truncated, nan, incomplete, oom, data, preempted, hang
    seconds: float  # how long its block runs, checkpoint included
    provider: str  # its provider label
    bucket: str  # its cost bucket at the end of the night
    first_bucket: str = ""  # its bucket after the first verify, where that differs
    checkpoint_s: float = 0.0  # a checkpoint whose write takes this long (0: none)
    driver: str = "550"
    subdir: str = ""  # output directory under the shard's (a rerun beside a truncated file)
    verified: bool = False  # its output passes verify (it is no superseded zombie)


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """One shard: its first-pass attempts (one after another), its rerun from the resume list."""

    run_id: str
    shard_id: str
    provider: str  # the plan's label
    first: tuple[Job, ...]
    rerun: Job | None = None
    # first[0] commits other bytes after first[1] started, and first[1] overwrites them.
    zombie: bool = False


def _ok(s: float, p: str, bucket: str = "counted", **kw: Any) -> Job:
    return Job("ok", s, p, bucket, verified=kw.pop("verified", True), **kw)


# Durations are distinct, 0.2-1.2 s; reruns run on a new driver (570): not first pass, so
# no fingerprint drift. The shard a-oom is rerun on provider B: its rerun's GPU time is B's.
NIGHT: Final = (
    ShardPlan("truth-1", "a-ok1", "A", (_ok(0.90, "A", checkpoint_s=0.04),)),
    ShardPlan("truth-1", "a-ok2", "A", (_ok(0.70, "A", checkpoint_s=0.10),)),
    ShardPlan(
        "truth-1",
        "a-empty",
        "A",
        (Job("empty", 0.30, "A", "silent"),),
        _ok(0.35, "A", driver="570"),
    ),
    ShardPlan(
        "truth-1",
        "a-trunc",
        "A",
        (Job("truncated", 0.40, "A", "silent", checkpoint_s=0.05),),
        _ok(0.45, "A", driver="570", subdir="rerun"),
    ),
    ShardPlan(
        "truth-1", "a-oom", "A", (Job("oom", 0.25, "A", "reruns"),), _ok(0.55, "B", driver="570")
    ),
    ShardPlan(
        "truth-1",
        "a-dup",
        "A",
        (_ok(0.60, "A", checkpoint_s=0.06), _ok(0.65, "A", "duplicates")),
    ),
    ShardPlan(
        "truth-1",
        "a-hang",
        "A",
        (Job("hang", 0.50, "A", "reruns", first_bucket="hung", checkpoint_s=0.03),),
        _ok(0.32, "A", driver="570"),
    ),
    ShardPlan(
        "truth-1", "b-nan", "B", (Job("nan", 0.38, "B", "silent"),), _ok(0.42, "B", driver="570")
    ),
    ShardPlan(
        "truth-1",
        "b-zombie",
        "B",
        (_ok(0.75, "B", "zombies", verified=False), _ok(0.85, "B", checkpoint_s=0.07)),
        zombie=True,
    ),
    ShardPlan("truth-2", "b-ok1", "B", (_ok(1.10, "B", checkpoint_s=0.08),)),
    ShardPlan(
        "truth-2",
        "b-incomplete",
        "B",
        (Job("incomplete", 0.20, "B", "silent"),),
        _ok(0.28, "B", driver="570"),
    ),
    ShardPlan("truth-2", "b-preempt", "B", (Job("preempted", 0.26, "B", "reruns"), _ok(0.52, "B"))),
    ShardPlan(
        "truth-2", "b-data", "B", (Job("data", 0.46, "B", "reruns"),), _ok(0.48, "B", driver="570")
    ),
    ShardPlan("truth-2", "c-ok1", "C", (_ok(1.20, "C", checkpoint_s=0.09),)),
    ShardPlan("truth-2", "c-drift", "C", (_ok(0.44, "C", driver="560"),)),
    ShardPlan(
        "truth-2",
        "c-empty",
        "C",
        (Job("empty", 0.34, "C", "silent"),),
        _ok(0.36, "C", driver="570"),
    ),
    ShardPlan(
        "truth-2",
        "c-trunc",
        "C",
        (Job("truncated", 0.53, "C", "silent"),),
        _ok(0.57, "C", driver="570", subdir="rerun"),
    ),
    ShardPlan(
        "truth-2",
        "c-preempt",
        "C",
        (Job("preempted", 0.24, "C", "reruns"),),
        _ok(0.41, "C", driver="570"),
    ),
    ShardPlan("truth-2", "c-missing", "C", (), _ok(0.29, "C", driver="570")),
)


def fingerprint(provider: str, driver: str) -> Fingerprint:
    """Returns the fingerprint of a provider's node; A's says how many GPUs it has."""
    fields = {"driver": driver, "cuda": "12.4", "node": f"provider-{provider}"}
    if provider == "A":
        fields["gpu.count"] = "1"
    return Fingerprint.from_fields(fields)


def labels_of(provider: str) -> dict[str, str]:
    """Returns an attempt's labels: its provider, and B's gpus."""
    return {"provider": provider, "gpus": "2"} if provider == "B" else {"provider": provider}


def output(shard_id: str, kind: str, value: float) -> bytes:
    """Returns the bytes the job writes: a keyed result, empty, or a NaN (JSON Lines)."""
    if kind == "empty":
        return b""
    number = "NaN" if kind == "nan" else repr(value)
    return f'{{"id": "{shard_id}", "value": {number}}}\n'.encode()


@dataclass(slots=True)
class Measured:
    """One attempt as it ran: what it was and its span's bracket (µs, the ledger's clocks)."""

    plan: ShardPlan
    job: Job
    rerun: bool
    lo_us: int
    hi_us: int
    measured_us: int  # the job body timed from outside (a hang: until its last event)
    ledger_clock: bool = False  # no end event: read on the ledger's clock (a hang)
    # Checkpoint write times (µs, monotonic), each bracketed like the span.
    writes: list[tuple[int, int]] = field(default_factory=list)
    # For a hang: the bracket of deadline - last checkpoint while it is stale.
    hang_lost_us: tuple[int, int] = (0, 0)

    @property
    def gpus(self) -> int:
        return GPUS[self.job.provider][0]

    @property
    def gpus_known(self) -> bool:
        return GPUS[self.job.provider][1]

    def bucket(self, stage: str) -> str:
        """Returns the attempt's cost bucket after the stage's verify."""
        if stage == "first" and self.job.first_bucket:
            return self.job.first_bucket
        return self.job.bucket

    def open_at(self, stage: str) -> bool:
        """Returns whether the ledger still sees it open (a stale hang before its rerun)."""
        return self.job.kind == "hang" and stage == "first"


def _us(ns: int) -> int:
    return ns // 1000


class _Stopwatch:
    """Reads of the job's clock around and inside one attempt (time.time_ns, as the SDK stamps)."""

    def __init__(self) -> None:
        self.before = time.time_ns()
        self.inside = self.end_sent = self.after = 0
        # Checkpoint writes (µs, monotonic as the SDK measures them): (inside, around).
        self.writes: list[tuple[int, int]] = []


def _sleep_until(deadline_ns: int) -> None:
    left = deadline_ns - time.monotonic_ns()
    if left > 0:
        time.sleep(left / 1e9)


def _checkpoint(shard: Any, seconds: float, writes: list[tuple[int, int]]) -> None:
    around = time.monotonic_ns()
    with shard.checkpoint_write(1) as f:
        inside = time.monotonic_ns()
        f.write(b"checkpoint")
        time.sleep(seconds)
        took = time.monotonic_ns() - inside
    writes.append((took // 1000, (time.monotonic_ns() - around) // 1000 + 1))


@dataclass(frozen=True, slots=True)
class Gates:
    """The zombie's choreography: set once started, waited for before committing, set after."""

    started: threading.Event | None = None
    before_commit: threading.Event | None = None
    committed: threading.Event | None = None


def _failure(kind: str) -> BaseException:
    """Returns what the job raises: the SDK maps it to failed(oom), (data) or (preempted)."""
    if kind == "oom":
        return MemoryError("CUDA out of memory")
    if kind == "data":
        return DataError("a corrupt input record")
    return Preempted("the platform reclaimed the node")


def _body(shard: Any, job: Job, out: Path, data: bytes, watch: _Stopwatch, gates: Gates) -> None:
    """What the job does inside its block: checkpoint, work, then commit, fail or leave."""
    watch.inside = time.time_ns()
    began = time.monotonic_ns()
    if gates.started is not None:
        gates.started.set()
    if job.checkpoint_s:
        _checkpoint(shard, job.checkpoint_s, watch.writes)
    _sleep_until(began + int(job.seconds * 1e9))
    if gates.before_commit is not None:
        gates.before_commit.wait(30)
    watch.end_sent = time.time_ns()
    if job.kind in FAILING:
        raise _failure(job.kind)
    if job.kind == "incomplete":
        return  # the block ends without its output: failed(incomplete)
    with shard.atomic_write(out, name="out") as f:
        f.write(data)
        watch.end_sent = time.time_ns()
    watch.after = time.time_ns()  # the commit is acknowledged
    if gates.committed is not None:
        gates.committed.set()


def run_attempt(
    ledger: Ledger,
    plan: ShardPlan,
    job: Job,
    root: Path,
    *,
    rerun: bool,
    value: float = 1.0,
    gates: Gates = Gates(),
) -> Measured:
    """Runs one attempt in a shard context as its job says; returns its measured span."""
    out_dir = root / plan.run_id / plan.shard_id / job.subdir
    out_dir.mkdir(parents=True, exist_ok=True)  # not timed: the SDK finds it there
    data = output(plan.shard_id, job.kind, value)
    watch = _Stopwatch()
    with (
        contextlib.suppress(MemoryError, DataError, Preempted, IncompleteShard),
        ledger.shard(
            plan.run_id,
            plan.shard_id,
            labels=labels_of(job.provider),
            fingerprint=fingerprint(job.provider, job.driver),
            output_dir=out_dir,
            watchdog=False,
            sigterm_grace=None,
        ) as shard,
    ):
        _body(shard, job, out_dir / "out.jsonl", data, watch, gates)
    watch.after = watch.after or time.time_ns()  # a failure is acknowledged on the way out
    if job.kind == "truncated":  # the file loses its tail on disk after the commit
        os.truncate(out_dir / "out.jsonl", len(data) // 2)
    return Measured(
        plan,
        job,
        rerun,
        lo_us=_us(watch.end_sent - watch.inside),
        hi_us=_us(watch.after - watch.before) + 1,
        measured_us=_us(watch.after - watch.before),
        writes=watch.writes,
    )


_HANG_CHILD: Final = """
import sys, time
from shard_client import Fingerprint, Ledger
fields = {fields!r}
with Ledger({target!r}, spool_dir={spool!r}) as ledger:
    before = time.time_ns()
    with ledger.shard({run_id!r}, {shard_id!r}, labels={labels!r},
                      fingerprint=Fingerprint.from_fields(fields), output_dir={out!r},
                      heartbeat_timeout={timeout!r}, heartbeat_interval=0.2, watchdog=False) as shard:
        inside = time.time_ns()
        began = time.monotonic_ns()
        time.sleep(max(0.0, {seconds!r} - {checkpoint_s!r}))
        around = time.monotonic_ns()
        with shard.checkpoint_write(1) as f:
            f.write(b"checkpoint")
            time.sleep({checkpoint_s!r})
            took, ckpt_sent = time.monotonic_ns() - around, time.time_ns()
        ckpt_after, written = time.time_ns(), time.monotonic_ns() - around
        print(before, inside, ckpt_sent, ckpt_after, took, written, flush=True)
        time.sleep(600)
"""


def run_hang(target: str, plan: ShardPlan, job: Job, root: Path) -> Measured:
    """Runs a job process that checkpoints, then is SIGKILLed (no goodbye): a stale attempt."""
    fp = fingerprint(job.provider, job.driver)
    code = textwrap.dedent(_HANG_CHILD).format(
        fields=dict(fp.fields),
        target=target,
        spool=str(root / ".hang-spool"),
        run_id=plan.run_id,
        shard_id=plan.shard_id,
        labels=labels_of(job.provider),
        out=str(root / plan.run_id / plan.shard_id),
        timeout=HANG_TIMEOUT_S,
        seconds=job.seconds,
        checkpoint_s=job.checkpoint_s,
    )
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env, cwd=root
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    dead = time.time_ns()
    before, inside, ckpt_sent, ckpt_after, took, written = map(int, line.split())
    # Its last event is the checkpoint (sent after ckpt_sent), or a heartbeat before the
    # kill. The deadline is that + the timeout; the work lost is since the checkpoint.
    timeout_us = int(HANG_TIMEOUT_S * 1e6)
    return Measured(
        plan,
        job,
        False,
        lo_us=_us(ckpt_sent - inside),
        hi_us=_us(dead - before) + 1,
        measured_us=_us(ckpt_after - before),
        ledger_clock=True,
        writes=[(took // 1000, written // 1000 + 1)],
        hang_lost_us=(timeout_us, timeout_us + _us(dead - ckpt_sent) + 1),
    )


def _play_shard(
    target: str, ledger: Ledger, plan: ShardPlan, root: Path, jobs: Sequence[Job], *, rerun: bool
) -> list[Measured]:
    """Plays a shard's jobs one after another (the zombie pair overlapping)."""
    if plan.zombie and not rerun:
        started, committed = threading.Event(), threading.Event()
        with ThreadPoolExecutor(1) as pool:
            zombie = pool.submit(
                run_attempt,
                ledger,
                plan,
                jobs[0],
                root,
                rerun=False,
                value=-1.0,  # other bytes on the same path, which the next attempt replaces
                gates=Gates(started=started, committed=committed),
            )
            started.wait(30)
            time.sleep(0.15)
            second = run_attempt(
                ledger, plan, jobs[1], root, rerun=False, gates=Gates(before_commit=committed)
            )
            return [zombie.result(), second]
    out = []
    for job in jobs:
        if job.kind == "hang":
            out.append(run_hang(target, plan, job, root))
        else:
            out.append(run_attempt(ledger, plan, job, root, rerun=rerun))
    return out


def play_pass(
    target: str, ledger: Ledger, plans: Iterable[ShardPlan], root: Path, *, rerun: bool
) -> list[Measured]:
    """Plays every shard's first pass (or rerun) in WORKERS threads, the longest first."""

    def jobs(p: ShardPlan) -> tuple[Job, ...]:
        return (p.rerun,) if rerun and p.rerun is not None else () if rerun else p.first

    todo = sorted((p for p in plans if jobs(p)), key=lambda p: -sum(j.seconds for j in jobs(p)))
    with ThreadPoolExecutor(WORKERS) as pool:
        done = [
            pool.submit(_play_shard, target, ledger, p, root, jobs(p), rerun=rerun) for p in todo
        ]
        return [m for f in done for m in f.result()]


def cli(*argv: str) -> tuple[int, str, str]:
    """Runs the CLI in process without capsys (the night is played once per module)."""
    from shardledger_cli.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:
            assert isinstance(exc.code, int), exc.code
            code = exc.code
    return code, out.getvalue(), err.getvalue()


@dataclass(slots=True)
class Snapshot:
    """What the server answered after one verify."""

    reports: dict[str, dict[str, Any]]  # run -> `report RUN --json`
    status: dict[str, dict[str, Any]]  # run -> `status RUN --costs --json`
    by_provider: dict[str, dict[str, Any]]  # value -> `report RUNS --by provider --json` line
    # (run, shard, reason) -> failed verdicts recorded so far (every verify's, rechecks too)
    failed_verdicts: Counter[tuple[str, str, str]]


@dataclass(slots=True)
class Played:
    """The night as played: every attempt measured, and the server's answers per stage."""

    attempts: list[Measured]
    snapshots: dict[str, Snapshot]
    resume_ids: dict[str, list[str]]  # run -> `resume --format ids` after the first verify
    resume_after: dict[str, int]  # run -> resume's exit code after the reruns
    wall_s: float


def _snapshot(target: str) -> Snapshot:
    reports, status = {}, {}
    for run in RUNS:
        code, out, err = cli("report", run, "--json", "--server", target)
        assert code == 0, err
        reports[run] = json.loads(out)
        code, out, err = cli("status", run, "--costs", "--json", "--server", target)
        assert code in (0, 1), err
        status[run] = json.loads(out)
    code, out, err = cli("report", *RUNS, "--by", "provider", "--json", "--server", target)
    assert code == 0, err
    groups = {g["value"]: g for g in map(json.loads, out.splitlines())}
    failed: Counter[tuple[str, str, str]] = Counter()
    with contextlib.closing(LedgerClient(target)) as client:
        for run in RUNS:
            for event in client.list_events(run):
                verdict = event.verified
                if event.HasField("verified") and verdict.result == VERIFICATION_RESULT_FAILED:
                    failed[(run, event.shard_id, verdict.reason)] += 1
    return Snapshot(reports, status, groups, failed)


def _verify(target: str, root: Path, *extra: str) -> None:
    for run in RUNS:
        code, _, err = cli("verify", run, "--root", str(root), "--server", target, *extra)
        assert code in (0, 1), err


def _plan(target: str, root: Path) -> None:
    for run in RUNS:
        for provider in PROVIDERS:
            lines = [
                json.dumps(
                    {
                        "shard_id": p.shard_id,
                        "input": f"ref:{p.shard_id}",
                        "input_bytes": 1,
                        "input_blake3": "ab" * 32,
                        "expected_outputs": ["out"],
                    }
                )
                for p in NIGHT
                if (p.run_id, p.provider) == (run, provider)
            ]
            if not lines:
                continue
            manifest = root / f"{run}-{provider}.jsonl"
            manifest.write_text("\n".join(lines) + "\n")
            code, _, err = cli(
                "plan", run, "--manifest", str(manifest), "--label", f"provider={provider}",
                "--server", target,
            )  # fmt: skip
            assert code == 0, err


def play_truth_night(target: str, root: Path) -> Played:
    """Plans, plays, verifies, reruns, verifies, idles and rechecks the night; returns it all."""
    t0 = time.monotonic()
    root.mkdir(parents=True, exist_ok=True)
    _plan(target, root)
    snapshots: dict[str, Snapshot] = {}
    with Ledger(target, spool_dir=str(root / ".spool")) as ledger:
        attempts = play_pass(target, ledger, NIGHT, root, rerun=False)
        time.sleep(HANG_TIMEOUT_S + 0.3)  # past the killed job's deadline: it is stale now
        _verify(target, root)
        snapshots["first"] = _snapshot(target)
        resume_ids = {}
        for run in RUNS:
            code, out, err = cli("resume", run, "--format", "ids", "--server", target)
            assert code == 1, err
            resume_ids[run] = out.split()
        repair = {(r, s) for r, ids in resume_ids.items() for s in ids}
        plans = [p for p in NIGHT if (p.run_id, p.shard_id) in repair]
        attempts += play_pass(target, ledger, plans, root, rerun=True)
    _verify(target, root)
    snapshots["final"] = _snapshot(target)
    resume_after = {r: cli("resume", r, "--format", "ids", "--server", target)[0] for r in RUNS}
    time.sleep(IDLE_S)
    _verify(target, root, "--recheck")
    snapshots["late"] = _snapshot(target)
    return Played(attempts, snapshots, resume_ids, resume_after, time.monotonic() - t0)


# --- the truth ------------------------------------------------------------------------


@dataclass(slots=True)
class Span:
    """A GPU-time figure's truth: the bracket [lo, hi] and the measured value (GPU-seconds)."""

    lo: float = 0.0
    hi: float = 0.0
    measured: float = 0.0
    attempts: int = 0
    ledger_clock: int = 0  # of them, read on the ledger's clock

    def add(self, m: Measured) -> None:
        self.lo += m.lo_us * m.gpus / 1e6
        self.hi += m.hi_us * m.gpus / 1e6
        self.measured += m.measured_us * m.gpus / 1e6
        self.attempts += 1
        self.ledger_clock += m.ledger_clock


BUCKETS: Final = ("running", "hung", "counted", "zombies", "silent", "duplicates", "reruns")


def lower_median(values: Sequence[int]) -> int:
    """Returns the lower median (the server's: the first value with half the count at or below)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


@dataclass(slots=True)
class Truth:
    """The figures the night must produce, from what its attempts were and how long they ran."""

    attempts: list[Measured]

    def seen(self, stage: str, runs: Sequence[str] = RUNS) -> list[Measured]:
        """Returns the attempts the ledger had at the stage, of these runs."""
        return [
            m for m in self.attempts if m.plan.run_id in runs and (stage != "first" or not m.rerun)
        ]

    def gpu(self, stage: str, runs: Sequence[str], provider: str | None = None) -> dict[str, Span]:
        """Returns GPU time per bucket (of one provider's attempts, or all)."""
        out = {b: Span() for b in BUCKETS}
        for m in self.seen(stage, runs):
            if provider is None or m.job.provider == provider:
                out[m.bucket(stage)].add(m)
        return out

    def total(self, stage: str, runs: Sequence[str], provider: str | None = None) -> Span:
        """Returns the GPU time of every attempt (of one provider, or all)."""
        out = Span()
        for m in self.seen(stage, runs):
            if provider is None or m.job.provider == provider:
                out.add(m)
        return out

    def ended(self, stage: str, run: str) -> list[Measured]:
        """Returns the attempts that ended as the ledger sees it (not the open, stale hang)."""
        return [m for m in self.seen(stage, [run]) if not m.open_at(stage)]

    def durations(self, stage: str, run: str) -> tuple[int, int]:
        """Returns T's bracket (µs): the lower medians of the completed attempts' lo and hi."""
        done = [m for m in self.ended(stage, run) if m.job.kind in COMPLETE]
        return lower_median([m.lo_us for m in done]), lower_median([m.hi_us for m in done])

    def measured_duration(self, stage: str, run: str) -> int:
        """Returns T as measured: the lower median of the completed attempts' measured spans."""
        done = [m for m in self.ended(stage, run) if m.job.kind in COMPLETE]
        return lower_median([m.measured_us for m in done])

    def writes(self, stage: str, run: str) -> tuple[int, int]:
        """Returns w's bracket (µs): the lower medians of the ended attempts' write brackets."""
        writes = [w for m in self.ended(stage, run) for w in m.writes]
        return lower_median([w[0] for w in writes]), lower_median([w[1] for w in writes])

    def reclaim(self, stage: str, run: str) -> tuple[int, int]:
        """Returns p as (reclaimed, ended): ended are the attempts that failed or committed."""
        # A vanished attempt (the hang, rerun) neither failed nor committed.
        ended = [m for m in self.ended(stage, run) if m.job.kind != "hang"]
        return sum(m.job.kind == "preempted" for m in ended), len(ended)

    def by_provider(self, stage: str) -> dict[str, dict[str, Any]]:
        """Returns the platform table's first-pass counts per provider over both runs (exact)."""
        out: dict[str, dict[str, Any]] = {}

        def group(p: str) -> dict[str, Any]:
            return out.setdefault(p, _empty_group())

        for plan in NIGHT:
            # A shard is its first attempt's (c-missing's rerun is C's, as its plan).
            shard_provider = plan.first[0].provider if plan.first else plan.provider
            g = group(shard_provider)
            g["runs"].add(plan.run_id)
            g["shards"] += 1
            verified = [j.verified for j in plan.first]
            g["first_pass_verified"] += any(verified)
            g["first_attempt_verified"] += bool(verified) and verified[0]
            g["missing"] += not plan.first
            silent = [j for j in plan.first if j.kind in SILENT_FORM]
            if silent and not any(verified):
                g["silent_errors"] += 1
                g["silent_by_form"][SILENT_FORM[silent[0].kind]] += 1
        for m in self.seen(stage):
            g = group(m.job.provider)
            g["runs"].add(m.plan.run_id)
            if m.rerun:
                continue
            g["fingerprints"].add(m.job.driver)
            g["truncations"] += m.job.kind == "truncated"
            if m.job.kind in FAILING:
                g["loud_failures"][FAILING[m.job.kind]] += 1
            if m.open_at(stage):  # stale now: missing, and a hang someone must stop
                g["missing"] += 1
                g["hangs"] += 1
        for g in out.values():
            g["reclaims"] = g["loud_failures"]["preempted"]
            g["silent_empty"] = g["silent_by_form"]["empty"]
            g["fingerprint_drift"] = len(g["fingerprints"]) - 1
        return out


def _empty_group() -> dict[str, Any]:
    return {
        "runs": set(),
        "shards": 0,
        "first_pass_verified": 0,
        "first_attempt_verified": 0,
        "missing": 0,
        "silent_errors": 0,
        "silent_by_form": Counter(),
        "truncations": 0,
        "loud_failures": Counter(),
        "hangs": 0,
        "fingerprints": set(),
    }


def exact_counts(group: Mapping[str, Any]) -> dict[str, Any]:
    """Returns a served group's counts in the truth's shape (for one comparison)."""
    return {
        "runs": set(group["runs"]),
        "shards": group["shards"],
        "first_pass_verified": group["first_pass_verified"],
        "first_attempt_verified": group["first_attempt_verified"],
        "missing": group["missing"],
        "silent_errors": group["silent_errors"],
        "silent_by_form": Counter({k: v for k, v in group["silent_by_form"].items() if v}),
        "truncations": group["truncations"],
        "loud_failures": Counter({k: v for k, v in group["loud_failures"].items() if v}),
        "hangs": group["hangs"],
        "reclaims": group["reclaims"],
        "silent_empty": group["silent_empty"],
        "fingerprint_drift": group["fingerprint_drift"],
    }


def truth_counts(group: Mapping[str, Any]) -> dict[str, Any]:
    """Returns the truth's group in the same shape as exact_counts."""
    out = dict(group)
    out.pop("fingerprints")
    out["silent_by_form"] = +Counter(group["silent_by_form"])
    out["loud_failures"] = +Counter(group["loud_failures"])
    return out
