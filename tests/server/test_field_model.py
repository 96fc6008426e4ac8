"""The field figures == an independent reference model, and incremental == replay.

The model below is written from the definitions (ledger_server.field's docstrings and
the issue), not from field.py: it keeps each attempt's plain facts (when it started,
what it last sent, how it ended, on both clocks; what it committed and what verdicts
said) and recomputes GPU time by cost bucket, the checkpoint advice's inputs and
the platform table (first pass by label) from scratch, on random histories appended to a
real LedgerService (SQLite, fixed clock). The same histories check that the counters
the writer keeps in the append's transaction are those a replay of the events sums
(the `f.` counters; test_projections_replay compares only what the run summary reads of
them), and that the report computed from a replay's records is the one served.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import event as label
from hypothesis import strategies as st

from ledger_server import field as figures
from ledger_server.events import (
    ArtifactCommitted,
    ArtifactVerified,
    AttemptFailed,
    AttemptStarted,
    CheckpointSaved,
    Event,
    Heartbeat,
    Payload,
    ShardPlanned,
)
from ledger_server.projections import base_state
from ledger_server.replay import replay_run
from ledger_server.service import LedgerService
from ledger_server.states import ShardState
from ledger_server.store.sqlite import SqliteStore
from shard_client.advice import advise
from shard_client.canonical import fingerprint_digest

RUN: Final = "r1"
T0: Final = 1_000_000
SHARDS: Final = ("s0", "s1", "s2")
OUTPUT_SETS: Final = ((), ("a",), ("a", "b"))
PLAN_LABELS: Final[tuple[dict[str, str], ...]] = (
    {},
    {"provider": "P"},
    {"provider": "P", "gpus": "3"},
)
ATTEMPT_LABELS: Final[tuple[dict[str, str], ...]] = (
    {},
    {"provider": "P"},
    {"provider": "Q"},
    {"provider": "Q", "gpus": "2"},
)
GPU_COUNTS: Final = (0, 1, 4)
FINGERPRINTS: Final[tuple[dict[str, str], ...]] = ({}, {"fp": "1"}, {"fp": "2"})
TAGS: Final = ("oom", "preempted", "killed", "timeout", "incomplete", "data")
REASONS: Final = (
    "empty",
    "missing",
    "size_mismatch",
    "truncated",
    "nan_or_inf",
    "digest_mismatch",
    "json_invalid",
    "outside_root",  # about the verifier: not a verdict on the artifact
)
VERIFIER_REASONS: Final = frozenset({"outside_root"})
BUCKETS: Final = ("running", "hung", "counted", "zombies", "silent", "duplicates", "reruns")
FORMS: Final = {
    "empty": "empty",
    "missing": "empty",
    "size_mismatch": "truncated",
    "truncated": "truncated",
    "nan_or_inf": "nan",
    "digest_mismatch": "digest",
}
LABEL: Final = "provider"


# --- the reference model ----------------------------------------------------------------


@dataclass
class MAttempt:
    attempt_id: str
    labels: dict[str, str]  # the plan's, then the attempt's own over them
    gpu_count: int
    timeout: int
    fingerprint: str
    first_pass: bool  # started before the run's first verdict
    started: int  # ledger clock
    client_started: int  # the job's clock (0: not sent)
    seen: int  # the last event the ledger had from it (never a verdict)
    failed: str = ""
    failed_late: bool = False  # its failure reached the ledger after the first pass closed
    end: int = 0  # its failed event, else its latest commit (ledger clock; 0: none)
    client_end: int = 0
    outputs: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (path, digest)
    late: set[str] = field(default_factory=set)  # names committed after the pass closed
    verdicts: dict[str, tuple[str, str]] = field(default_factory=dict)  # on its current commits
    zombie: bool = False
    saved: int = 0
    writes: list[int] = field(default_factory=list)
    step: int = -1


@dataclass
class MShard:
    expected: tuple[str, ...]
    labels: dict[str, str]
    attempts: list[MAttempt] = field(default_factory=list)  # in start order
    heads: dict[str, str] = field(default_factory=dict)  # path -> digest last committed there

    def names(self, a: MAttempt) -> list[str]:
        return list(self.expected) or sorted(a.outputs)

    def complete(self, a: MAttempt) -> bool:
        return all(n in a.outputs for n in self.expected) if self.expected else bool(a.outputs)

    def verdict(self, a: MAttempt, name: str) -> tuple[str, str] | None:
        return a.verdicts.get(name)

    def passed(self, a: MAttempt) -> bool:
        return self.complete(a) and all(
            (v := self.verdict(a, n)) is not None and v[0] == "passed" for n in self.names(a)
        )

    def failing(self, a: MAttempt) -> list[str]:
        return [
            v[1]
            for n in self.names(a)
            if (v := self.verdict(a, n)) is not None and v[0] == "failed"
        ]

    def sound(self, a: MAttempt) -> bool:
        return self.complete(a) and not self.failing(a)

    def counted(self) -> MAttempt | None:
        clean = [a for a in self.attempts if not a.failed]
        return next((a for a in clean if self.passed(a)), None) or next(
            (a for a in clean if self.sound(a)), None
        )

    def latest(self) -> MAttempt | None:
        return self.attempts[-1] if self.attempts else None

    def is_open(self, a: MAttempt) -> bool:
        return a is self.latest() and not a.failed and not self.complete(a)

    def confirmed(self) -> bool:
        intact = [
            a
            for a in self.attempts
            if all(self.heads[path] == digest for path, digest in a.outputs.values())
        ]
        return any(self.passed(a) for a in intact)

    def uncounted(self, a: MAttempt) -> bool:
        # docs/metrics.md: a rerun still running on a shard already verified (a duplicate
        # in the making) is counted when it ends.
        return self.is_open(a) and self.confirmed()

    def stale(self, a: MAttempt, now: int) -> bool:
        # Only a running shard goes stale: one with a confirmed result is verified.
        return self.is_open(a) and not self.confirmed() and a.seen + a.timeout < now

    # The first pass, as the summary judges it.
    def seen_first(self, a: MAttempt) -> bool:
        if not self.complete(a):
            return False
        if self.expected:
            return not any(n in a.late for n in self.expected)
        return any(n not in a.late for n in a.outputs)

    def verified_first(self, a: MAttempt) -> bool:
        return self.seen_first(a) and self.passed(a)

    def silent_first(self, a: MAttempt) -> bool:
        return (a.failed == "incomplete" and not a.failed_late) or (
            self.seen_first(a) and bool(self.failing(a))
        )


def span(a: MAttempt, *, is_open: bool = False) -> tuple[int, str]:
    """From its start to its own end (failed, else latest commit), else to its last event.

    An open attempt (the latest, neither failed nor complete) has no end yet, even if it
    committed some of its outputs: it runs to its last event.
    """
    if a.end and not is_open:
        job = a.client_end - a.client_started
        if a.client_started and a.client_end and job >= 0:
            return job, "job"
        return max(0, a.end - a.started), "ledger"
    return max(0, a.seen - a.started), "ledger"


def gpus(a: MAttempt) -> tuple[int, bool]:
    raw = a.labels.get("gpus", "")
    if raw.isdigit() and int(raw) > 0:
        return int(raw), True
    return (a.gpu_count, True) if a.gpu_count > 0 else (1, False)


def bucket(shard: MShard, a: MAttempt, now: int) -> str:
    if shard.is_open(a):
        return "hung" if shard.stale(a, now) else "running"
    if a.failed == "timeout":
        return "hung"
    if a is shard.counted():
        return "counted"
    if a.zombie:
        return "zombies"
    if a.failed == "incomplete" or shard.failing(a):
        return "silent"
    if not a.failed and shard.sound(a):
        return "duplicates"
    return "reruns"


def log_bucket_median(values: list[float]) -> float | None:
    """The lower median, read off 2**(1/32)-wide log buckets as the server keeps them."""
    if not values:
        return None
    x = sorted(values)[(len(values) - 1) // 2]
    return float(2 ** (round(32 * math.log2(max(x, 1e-9))) / 32))


@dataclass
class Model:
    shards: dict[str, MShard] = field(default_factory=dict)
    pass_closed: bool = False

    def apply(self, e: Event, at: int) -> None:
        """Folds one event the builder made legal."""
        p = e.payload
        if isinstance(p, ShardPlanned):
            self.shards[e.shard_id] = MShard(p.expected_outputs, dict(p.labels))
            return
        shard = self.shards[e.shard_id]
        if isinstance(p, AttemptStarted):
            shard.attempts.append(
                MAttempt(
                    e.attempt_id,
                    shard.labels | p.labels,
                    p.gpu_count,
                    p.heartbeat_timeout_us,
                    p.fingerprint_digest,
                    not self.pass_closed,
                    at,
                    e.client_time_us,
                    at,
                )
            )
            return
        if isinstance(p, ArtifactVerified):
            if p.reason in VERIFIER_REASONS:
                return
            for a in shard.attempts:
                if (not e.attempt_id or a.attempt_id == e.attempt_id) and a.outputs.get(p.name) == (
                    p.path,
                    p.blake3_hex,
                ):
                    a.verdicts[p.name] = (p.result, p.reason)
            self.pass_closed = True
            return
        a = next(x for x in shard.attempts if x.attempt_id == e.attempt_id)
        a.seen = max(a.seen, at)
        if isinstance(p, Heartbeat):
            a.step = max(a.step, p.step)
        elif isinstance(p, CheckpointSaved):
            a.step, a.saved = max(a.step, p.step), max(a.saved, at)
            if p.write_us > 0:
                a.writes.append(p.write_us)
        elif isinstance(p, ArtifactCommitted):
            a.outputs[p.name] = (p.path, p.blake3_hex)
            a.verdicts.pop(p.name, None)
            shard.heads[p.path] = p.blake3_hex
            if a.first_pass and self.pass_closed:
                a.late.add(p.name)
            a.zombie = a.zombie or a is not shard.latest()
            if not a.failed:
                a.end, a.client_end = at, e.client_time_us
        elif isinstance(p, AttemptFailed):
            a.end, a.client_end = at, e.client_time_us
            a.failed, a.failed_late = p.tag, a.first_pass and self.pass_closed

    def attempts(self) -> Iterator[tuple[MShard, MAttempt]]:
        for shard in self.shards.values():
            for a in shard.attempts:
                yield shard, a

    def priced(self) -> Iterator[tuple[MShard, MAttempt]]:
        """Yields the attempts the figures count now (all but a verified shard's open rerun)."""
        return ((s, a) for s, a in self.attempts() if not s.uncounted(a))

    def costs(self, now: int) -> dict[str, Any]:
        gpu_us: Counter[str] = Counter()
        count: Counter[str] = Counter()
        clock: Counter[str] = Counter()
        hangs = lost = unknown = 0
        for shard, a in self.priced():
            b = bucket(shard, a, now)
            us, on = span(a, is_open=shard.is_open(a))
            n, known = gpus(a)
            gpu_us[b] += us * n
            count[b] += 1
            clock["ledger" if shard.is_open(a) else on] += 1
            unknown += not known
            if b == "hung":
                hangs += 1
                stop = a.end if a.failed else a.seen + a.timeout
                lost += max(0, stop - (a.saved or a.started))
        gpu_s = {b: gpu_us[b] / 1e6 for b in BUCKETS}
        return {
            "gpu_s": sum(gpu_s.values()),
            "counted_gpu_s": gpu_s["counted"],
            "running_gpu_s": gpu_s["running"],
            "lost_gpu_s": {b: gpu_s[b] for b in BUCKETS if b not in ("counted", "running")},
            "attempts": {b: count[b] for b in BUCKETS},
            "hangs": hangs,
            "hang_lost_s": lost / 1e6,
            "gpus_unknown_attempts": unknown,
            "clock": {"job": clock["job"], "ledger": clock["ledger"]},
        }

    def advice(self) -> dict[str, Any]:
        ended = [(s, a) for s, a in self.attempts() if not s.is_open(a)]
        finished = [(s, a) for s, a in ended if a.failed or a.outputs]
        done = [(a, span(a)[0]) for s, a in ended if not a.failed and s.complete(a)]
        done = [(a, us) for a, us in done if us > 0]
        T = log_bucket_median([us for _, us in done])
        w = log_bucket_median([x for _, a in ended for x in a.writes])
        sps = log_bucket_median([a.step / (us / 1e6) * 1e6 for a, us in done if a.step > 0])
        reclaimed = sum(a.failed in ("preempted", "killed") for _, a in finished)
        return advise(
            shard_duration_s=T / 1e6 if T is not None else None,
            checkpoint_write_s=w / 1e6 if w is not None else None,
            reclaim_probability=reclaimed / len(finished) if finished else None,
            attempts=len(finished),
            steps_per_s=sps / 1e6 if sps is not None else None,
        ).as_json()

    def table(self, now: int) -> dict[str, dict[str, Any]]:
        """The platform table by LABEL: shards by their first attempt's labels, the rest by each's."""
        groups: dict[str, dict[str, Any]] = {}

        def g(labels: dict[str, str]) -> dict[str, Any]:
            return groups.setdefault(labels.get(LABEL, "(none)"), _group())

        for shard in self.shards.values():
            first = [a for a in shard.attempts if a.first_pass]
            group = g(shard.attempts[0].labels if shard.attempts else shard.labels)
            group["shards"] += 1
            group["first_attempt_verified"] += bool(
                shard.attempts
                and shard.attempts[0].first_pass
                and shard.verified_first(shard.attempts[0])
            )
            if not first:
                group["missing"] += 1
            elif any(shard.verified_first(a) for a in first):
                group["first_pass_verified"] += 1
            elif silent := [a for a in first if shard.silent_first(a)]:
                reasons = shard.failing(silent[0])
                form = FORMS.get(reasons[0], "other") if reasons else "empty"
                group["silent_errors"] += 1
                group["silent_by_form"][form] += 1
        for shard, a in self.attempts():
            group = g(a.labels)
            if a.first_pass and a.fingerprint:
                group["fingerprints"].add(a.fingerprint)
            if shard.uncounted(a):
                continue
            us = span(a, is_open=shard.is_open(a))[0]
            group["gpu_s_by_bucket"][bucket(shard, a, now)] += us * gpus(a)[0]
            if not a.first_pass:
                continue
            if shard.stale(a, now):  # a hang of the attempt, a missing shard of the shard's
                group["hangs"] += 1
                g(shard.attempts[0].labels)["missing"] += 1
            if shard.is_open(a):
                continue  # what an attempt says of its failure and commits counts once it ended
            if a.failed and a.failed != "incomplete" and not a.failed_late:
                group["loud_failures"][a.failed] += 1
            # A truncated commit counts once, and only one the first pass saw.
            group["truncations"] += sum(
                1
                for n in shard.names(a)
                if n not in a.late
                and (v := shard.verdict(a, n)) is not None
                and v[0] == "failed"
                and v[1] in ("truncated", "size_mismatch")
            )
        return {k: _finish(v) for k, v in groups.items()}


def _group() -> dict[str, Any]:
    return {
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
        "gpu_s_by_bucket": Counter(),
    }


def _finish(g: dict[str, Any]) -> dict[str, Any]:
    loud = g["loud_failures"]
    return {
        "shards": g["shards"],
        "first_pass_verified": g["first_pass_verified"],
        "first_attempt_verified": g["first_attempt_verified"],
        "missing": g["missing"],
        "silent_errors": g["silent_errors"],
        "silent_by_form": {f: g["silent_by_form"][f] for f in figures.SILENT_FORMS},
        "truncations": g["truncations"],
        "loud_failures": dict(sorted((+loud).items())),
        "reclaims": loud["preempted"] + loud["killed"],
        "hangs": g["hangs"] + loud["timeout"],
        "fingerprints": len(g["fingerprints"]),
        "fingerprint_drift": max(len(g["fingerprints"]) - 1, 0),
        "gpu_s_by_bucket": {b: g["gpu_s_by_bucket"][b] / 1e6 for b in BUCKETS},
    }


# --- random histories --------------------------------------------------------------------

# Repeats weight the draw towards what moves shards along: commits and verdicts.
KINDS: Final = ("start",) * 2 + ("hb",) * 2 + ("ckpt", "fail") + ("commit",) * 5 + ("verify",) * 4
OP: Final = st.tuples(
    st.sampled_from(KINDS),
    st.integers(0, len(SHARDS) - 1),
    st.integers(0, 11),  # picks among choices (attempt, name, tag, labels ...)
    st.integers(0, 11),
    st.sampled_from((0, 1, 3, 8, 25)),  # µs to wait before it
)


@dataclass
class Builder:
    """Turns abstract ops into events the ledger must accept, given the model so far."""

    model: Model
    counter: int = 0
    # attempt -> its job clock's offset from the ledger's (None: it sends no client time)
    skew: dict[str, int | None] = field(default_factory=dict)

    def event(self, shard: str, attempt: str, payload: Payload, at: int, jitter: int = 0) -> Event:
        self.counter += 1
        offset = self.skew.get(attempt)
        client = 0 if offset is None else at + offset + jitter
        return Event(f"e{self.counter}", "", RUN, shard, attempt, client, payload)

    def build(self, op: tuple[str, int, int, int, int], at: int) -> Event | None:
        kind, i, x, y, _ = op
        sid = SHARDS[i]
        shard = self.model.shards[sid]
        live = [a for a in shard.attempts if not a.failed]
        if kind == "start":
            attempt = f"a{self.counter}"
            self.skew[attempt] = (None, 0, 500, -300)[x % 4]
            fp = FINGERPRINTS[y % 3]
            payload: Payload = AttemptStarted(
                "node",
                1,
                (10, 40)[y % 2],
                fp,
                fingerprint_digest(fp) if fp else "",
                labels=ATTEMPT_LABELS[x % len(ATTEMPT_LABELS)],
                gpu_count=GPU_COUNTS[y % 3],
            )
            return self.event(sid, attempt, payload, at)
        if kind == "verify":
            held = [(a, n) for a in shard.attempts for n in sorted(a.outputs)]
            unjudged = [(a, n) for a, n in held if n not in a.verdicts]
            if not held:
                return None
            # Mostly a commit no verdict judged yet, as verify does; sometimes a recheck.
            a, name = unjudged[x % len(unjudged)] if unjudged and x % 4 else held[x % len(held)]
            path, digest = a.outputs[name]
            passed = y % 3 != 0
            reason = "" if passed else REASONS[(x + y) % len(REASONS)]
            verdict = ArtifactVerified(name, path, digest, ("failed", "passed")[passed], reason, "")
            # New verifiers name the commit's attempt; old ones named none.
            return self.event(sid, "" if y % 5 == 4 else a.attempt_id, verdict, at)
        if not live:
            return None
        a = live[-1] if x % 3 else live[x % len(live)]  # mostly the latest, sometimes older
        jitter = -1_000 if y % 7 == 6 else 0  # a job clock that stepped back
        if kind == "hb":
            return self.event(sid, a.attempt_id, Heartbeat(x, 0.5, {}), at)
        if kind == "ckpt":
            payload = CheckpointSaved(x, f"/ck/{sid}", 1, "c" * 64, write_us=(0, 3, 70)[y % 3])
            return self.event(sid, a.attempt_id, payload, at)
        if kind == "fail":
            return self.event(sid, a.attempt_id, AttemptFailed(TAGS[y % 6], "x"), at, jitter)
        names = shard.expected or ("a", "b")
        name = next((n for n in names if n not in a.outputs), names[y % len(names)])
        path = f"/o/{sid}/{name}" + ("" if y % 4 else f".{a.attempt_id}")
        digest = "abc"[x % 3] * 64
        payload = ArtifactCommitted(name, path, 10, digest, "")
        return self.event(sid, a.attempt_id, payload, at, jitter)


class FakeClock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


@contextlib.contextmanager
def service() -> Iterator[tuple[LedgerService, FakeClock]]:
    with tempfile.TemporaryDirectory(prefix="field-model-") as tmp:
        store = SqliteStore(Path(tmp) / "ledger.db")
        store.execute_raw("PRAGMA synchronous=OFF")  # durability is not under test
        clock = FakeClock()
        ledger = LedgerService(store, clock=clock)
        try:
            yield ledger, clock
        finally:
            ledger.close()
            store.close()


def _flat(costs: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in costs.items() if not isinstance(v, dict)}
    for key in ("lost_gpu_s", "attempts", "clock"):
        out.update({f"{key}.{k}": v for k, v in costs[key].items()})
    return out


def check(ledger: LedgerService, model: Model, now: int) -> None:
    """Asserts served == model, and incremental counters == replayed ones."""
    served = ledger.report("", RUN, now=now)
    costs = served["costs"]
    expected = model.costs(now)
    assert _flat({k: costs[k] for k in expected}) == pytest.approx(_flat(expected))
    assert costs["not_counted_gpu_s"] == pytest.approx(sum(expected["lost_gpu_s"].values()))
    assert served["checkpoint_advice"] == pytest.approx(model.advice())
    table = {g["value"]: g for g in ledger.compare("", [RUN], LABEL, now=now)}
    mine = model.table(now)
    assert set(table) == {k for k, g in mine.items() if g["shards"] or any(_nonzero(g))}
    for value, g in table.items():
        assert g["gpu_s_by_bucket"] == pytest.approx(mine[value].pop("gpu_s_by_bucket")), value
        assert {k: g[k] for k in mine[value]} == mine[value], value
    # Incremental == replay: the writer's f. counters, and the report a replay gives.
    events = list(ledger.iter_events("", RUN))
    fresh = replay_run(events)
    run = ledger.run("", RUN)
    stored = {
        k: n for k, n in ledger.store.read().counters(run.run_pk).items() if k.startswith("f.")
    }
    replayed = {k: n for k, n in fresh.counters().items() if k.startswith("f.") and n}
    assert stored == replayed
    # The server adds the open parts of its running shards (docs/metrics.md).
    running = [r for r in fresh.records.values() if base_state(r)[0] == ShardState.RUNNING]
    parts = [p for r in running if (p := figures.open_part(r, now)) is not None]
    labels = next(iter(fresh.ordered())).labels
    report = figures.run_report(Counter(stored), parts, labels=labels)
    assert {k: served[k] for k in report} == report


def _nonzero(g: dict[str, Any]) -> Iterator[bool]:
    # A value that nothing was counted for is no group (a shard always counts).
    yield from (v > 0 for v in g["gpu_s_by_bucket"].values())
    yield g["missing"] > 0 or g["hangs"] > 0 or g["truncations"] > 0 or bool(g["loud_failures"])
    yield g["fingerprints"] > 0


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    outputs=st.lists(st.sampled_from(OUTPUT_SETS), min_size=3, max_size=3),
    plan_labels=st.lists(st.sampled_from(range(len(PLAN_LABELS))), min_size=3, max_size=3),
    ops=st.lists(OP, min_size=10, max_size=60),
    later=st.sampled_from((0, 20, 1000)),
)
def test_served_field_figures_equal_the_reference_model_and_a_replay(
    outputs: list[tuple[str, ...]], plan_labels: list[int], ops: list[Any], later: int
) -> None:
    with service() as (ledger, clock):
        model = Model()
        plans = [
            Event(
                f"p{i}",
                "",
                RUN,
                sid,
                "",
                0,
                ShardPlanned(
                    f"/in/{sid}",
                    1,
                    "",
                    "{}",
                    outputs[i],
                    "",
                    i,
                    labels=PLAN_LABELS[plan_labels[i]],
                ),
            )
            for i, sid in enumerate(SHARDS)
        ]
        ledger.append(plans, timeout=10)
        for e in plans:
            model.apply(e, T0)
        builder = Builder(model)
        for op in ops:
            clock.now += op[4]
            event = builder.build(op, clock.now)
            if event is None:
                continue
            ledger.append([event], timeout=10)  # every event the builder makes is legal
            model.apply(event, clock.now)
        for shard, a in model.attempts():
            label(f"bucket:{bucket(shard, a, clock.now + later)}")
            label(f"clock:{span(a)[1]}")
            label(f"gpus_known:{gpus(a)[1]}")
        for value, g in model.table(clock.now).items():
            label(f"table:{value}")
            for key in ("silent_errors", "truncations", "hangs", "reclaims", "fingerprint_drift"):
                if g[key]:
                    label(f"table:{key}")
        check(ledger, model, clock.now)
        check(ledger, model, clock.now + later)
