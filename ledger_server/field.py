# Over 400 lines on purpose: every field figure beside the attempt rules they share (span, GPUs, bucket), each defined once in docs/metrics.md.
"""The field figures: GPU time and what failures cost, first pass by label, checkpoint advice.

Failures are priced in GPU time, providers compared with seven first-pass figures,
and checkpoints sized by p·t/2 + (T/t)·w. Each figure is defined
once in docs/metrics.md, in the words used here. They are pure functions of shard
records (and so of events), in two parts:

* `contributions(record)`: the integer counters one shard adds to its run, for
  everything that no longer changes with the clock (attempts that ended). The
  writer keeps them summed per run in the same transaction as the append, exactly
  as the summary's counters (ledger_server.summary), and a replay sums the same.
* `open_part(record, now_us)`: what the shard's latest attempt adds while it still
  runs (its span so far; stale ones are hung). The writer keeps them summed as if
  running, and a report moves the stale ones at the moment asked
  (ledger_server.open_attempts, `add_opens`): the same figures, no record read.

`run_report` and `compare` turn the summed counters (plus the open parts) into
the figures the `GetRunReport` and `CompareRuns` RPCs serve. No grpc, no SQL, the
time passed in.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from ledger_server import ranks
from ledger_server.projections import (
    deadline_us,
    is_complete,
    required_outputs,
    verdicts_of,
)
from ledger_server.record import Attempt, ShardRecord
from shard_client.vocabulary import FailureTag

__all__ = [
    "COST_BUCKETS",
    "FIELD_PREFIX",
    "SILENT_FORMS",
    "OpenPart",
    "OpenSum",
    "add_opens",
    "attempt_bucket",
    "attempt_gpus",
    "attempt_span",
    "compare",
    "contributions",
    "open_part",
    "open_part_of",
    "run_report",
    "silent_form",
    "span_of",
]

# Every field counter starts with this, so the run summary's prefixes never see them.
FIELD_PREFIX: Final = "f."
# The cost buckets, in precedence order: an attempt is in the first that applies.
COST_BUCKETS: Final = (
    "running",
    "hung",
    "counted",
    "zombies",
    "silent",
    "duplicates",
    "reruns",
)
# The forms a silent error takes, from the verdict's reason (docs/metrics.md).
SILENT_FORMS: Final = ("empty", "truncated", "nan", "digest", "other")
_FORM_OF_REASON: Final[dict[str, str]] = {
    "empty": "empty",
    "missing": "empty",
    "not_a_file": "empty",
    "truncated": "truncated",
    "size_mismatch": "truncated",
    "nan_or_inf": "nan",
    "digest_mismatch": "digest",
}
TRUNCATED_REASONS: Final = frozenset({"truncated", "size_mismatch"})
RECLAIM_TAGS: Final = frozenset({FailureTag.PREEMPTED, FailureTag.KILLED})
GPUS_LABEL: Final = "gpus"
# Medians (T, w, steps per second) come from log-spaced buckets 2**(1/32) wide: a
# median is off by at most half a bucket, 1.1 %.
_BUCKETS_PER_OCTAVE: Final = 32


def _k(*parts: str) -> str:
    return FIELD_PREFIX + ":".join(parts)


def _by(label: str, figure: str, value: str) -> str:
    # The value comes last: it may hold ':' (a label key may not).
    return f"{FIELD_PREFIX}by:{label}:{figure}:{value}"


# The same figures summed over every shard or attempt of the run, labelled or not: a
# group's "(none)" column is this less the label's values.
_ALL: Final = FIELD_PREFIX + "all:"


def _add(out: Counter[str], labels: Mapping[str, str], figure: str, n: int = 1) -> None:
    """Adds n to a group figure: for each label the shard or attempt has, and to the total."""
    if not n:
        return
    out[_ALL + figure] += n
    for key, value in labels.items():
        out[_by(key, figure, value)] += n


def _log_bucket(x: float) -> int:
    return round(_BUCKETS_PER_OCTAVE * math.log2(max(x, 1e-9)))


def _bucket_value(b: int) -> float:
    return float(2 ** (b / _BUCKETS_PER_OCTAVE))


# --- one attempt --------------------------------------------------------------


def is_open(record: ShardRecord, attempt: Attempt) -> bool:
    """Returns whether the attempt may still be running: the latest, with no end on record.

    Superseded attempts have ended (the ledger reruns a shard only once it gave up on
    the attempt before), and so has one that failed, committed all its outputs, or
    whose every rank left its block.
    """
    return (
        attempt.attempt_id == record.latest_attempt
        and not attempt.failed_tag
        and not is_complete(record, attempt)
        and not ranks.all_finished(attempt)
    )


def span_of(
    *,
    started_us: int,
    last_us: int,
    ended_us: int,
    client_started_us: int,
    client_ended_us: int,
    one_process: bool,
) -> tuple[int, str]:
    """attempt_span's rule on plain numbers (the export's attempts table uses it too)."""
    if ended_us:
        job = client_ended_us - client_started_us
        if client_started_us and client_ended_us and job >= 0 and one_process:
            return job, "job"
        return max(0, ended_us - started_us), "ledger"
    return max(0, last_us - started_us), "ledger"


def attempt_span(attempt: Attempt) -> tuple[int, str]:
    """Returns the attempt's span in µs and the clock it was read on ("job" or "ledger").

    From its started event to its own end: the failed event, else its latest commit;
    an attempt with neither (it vanished, or still runs) ends at the last event the
    ledger had from it (a heartbeat, a checkpoint). Never a verdict, a reader's event
    or the receive time of a late spool drain: where both ends carry the job's own
    clock (one process: skew between hosts cancels) the job's clock is used.
    """
    return span_of(
        started_us=attempt.started_us,
        last_us=attempt.last_seen_us,
        ended_us=attempt.ended_us,
        client_started_us=attempt.client_started_us,
        client_ended_us=attempt.client_ended_us,
        one_process=attempt.world_size <= 1,
    )


def attempt_gpus(record: ShardRecord, attempt: Attempt) -> tuple[int, bool]:
    """Returns the GPUs the attempt held and whether that is known (else one is counted).

    A ``gpus`` label (the attempt's over the plan's) wins; then what its started
    events said (gpu_count, summed over the ranks of a multi-rank attempt).
    """
    return _gpus_of(attempt, record.labels)


def _gpus_of(attempt: Attempt, plan_labels: Mapping[str, str]) -> tuple[int, bool]:
    raw = (dict(plan_labels) | attempt.labels).get(GPUS_LABEL, "")
    if raw.isdigit() and int(raw) > 0:
        return int(raw), True
    if attempt.gpus > 0:
        return attempt.gpus, True
    return max(attempt.world_size, 1), False


def _passed(record: ShardRecord, attempt: Attempt) -> bool:
    return is_complete(record, attempt) and all(
        v is not None and v[0] == "passed" for v in verdicts_of(record, attempt)
    )


def _failed_verdicts(record: ShardRecord, attempt: Attempt) -> list[str]:
    return [v[1] for v in verdicts_of(record, attempt) if v is not None and v[0] == "failed"]


def _sound(record: ShardRecord, attempt: Attempt) -> bool:
    return is_complete(record, attempt) and not _failed_verdicts(record, attempt)


def _by_start(record: ShardRecord) -> list[Attempt]:
    return sorted(record.attempts.values(), key=lambda a: a.started_seq)


def counted_attempt(record: ShardRecord) -> str:
    """Returns the attempt whose result counts for the shard ("" when none).

    The earliest attempt whose every output passed verification; else the earliest
    that committed them all with no failed verdict (a result not yet verified).
    """
    attempts = _by_start(record)
    for attempt in attempts:
        if not attempt.failed_tag and _passed(record, attempt):
            return attempt.attempt_id
    for attempt in attempts:
        if not attempt.failed_tag and _sound(record, attempt):
            return attempt.attempt_id
    return ""


def attempt_bucket(record: ShardRecord, attempt: Attempt, counted: str) -> str:
    """Returns the cost bucket of an attempt that ended (docs/metrics.md, in this order).

    hung: stopped for a hang (failed: timeout); counted: the shard's counted attempt;
    zombies: committed after a newer attempt started; silent: it believed it succeeded
    and was wrong (failed: incomplete, or a failed verdict on its commit); duplicates:
    a second result (complete, no failed verdict) beside the counted one; reruns:
    everything else that ended: a loud failure, or an attempt that vanished.
    """
    if attempt.failed_tag == FailureTag.TIMEOUT:
        return "hung"
    if attempt.attempt_id == counted:
        return "counted"
    if attempt.zombie:
        return "zombies"
    if attempt.failed_tag == FailureTag.INCOMPLETE or _failed_verdicts(record, attempt):
        return "silent"
    if not attempt.failed_tag and _sound(record, attempt):
        return "duplicates"
    return "reruns"


def silent_form(record: ShardRecord, attempt: Attempt) -> str:
    """Returns the form of a silent error: empty, truncated, nan, digest or other."""
    reasons = _failed_verdicts(record, attempt)
    if not reasons:
        return "empty"  # failed: incomplete, it left its outputs out
    return _FORM_OF_REASON.get(reasons[0], "other")


def _labels(record: ShardRecord, attempt: Attempt | None) -> dict[str, str]:
    return record.labels | (attempt.labels if attempt is not None else {})


# --- what one shard adds --------------------------------------------------------


def contributions(
    record: ShardRecord,
    *,
    first_outcome: str,
    first_attempt_verified: bool,
    first_silent: Attempt | None,
) -> Counter[str]:
    """Returns the field counters one shard adds to its run (time-independent).

    The summary judges the first pass (ledger_server.summary): the shard's outcome,
    whether its first attempt was verified, and its first silent first-pass attempt
    are passed in, so the run's figures and each label's add up to the same.
    """
    out: Counter[str] = Counter()
    attempts = _by_start(record)
    counted = counted_attempt(record)
    shard_labels = _labels(record, attempts[0] if attempts else None)
    _add(out, shard_labels, "shards")
    _add(out, shard_labels, "first_verified", first_outcome == "verified")
    _add(out, shard_labels, "first_attempt_verified", first_attempt_verified)
    _add(out, shard_labels, "missing", first_outcome == "missing")
    if first_outcome == "silent":
        form = silent_form(record, first_silent) if first_silent is not None else "other"
        _add(out, shard_labels, "silent")
        _add(out, shard_labels, f"silent.{form}")
        out[_k("first", f"silent.{form}")] += 1
    for attempt in attempts:
        labels = _labels(record, attempt)
        if attempt.first_pass:
            _fingerprint(out, attempt, labels)
        if is_open(record, attempt):
            continue  # open_part() counts it when asked
        span_us, clock = attempt_span(attempt)
        gpus, known = attempt_gpus(record, attempt)
        gpu_us = span_us * gpus
        bucket = attempt_bucket(record, attempt, counted)
        out[_k("gpu", bucket)] += gpu_us
        out[_k("attempts", bucket)] += 1
        out[_k("clock", clock)] += 1
        out[_k("gpus_unknown")] += not known
        _add(out, labels, f"gpu.{bucket}", gpu_us)
        if attempt.failed_tag == FailureTag.TIMEOUT:
            out[_k("hangs")] += 1
            out[_k("hang_lost")] += max(
                0, attempt.ended_us - (attempt.saved_us or attempt.started_us)
            )
        _advice_inputs(out, record, attempt, span_us)
        if attempt.first_pass:
            _first_pass_attempt(out, record, attempt, labels)
    return +out


def _fingerprint(out: Counter[str], attempt: Attempt, labels: Mapping[str, str]) -> None:
    if attempt.fingerprint_digest:
        _add(out, labels, f"fp={attempt.fingerprint_digest}")


def _first_pass_attempt(
    out: Counter[str], record: ShardRecord, attempt: Attempt, labels: Mapping[str, str]
) -> None:
    """Counts what a first-pass attempt that ended says: loud tags, truncated commits."""
    tag = attempt.failed_tag if not attempt.failed_after_pass else ""
    truncated = sum(
        1
        for name in (required_outputs(record, attempt) or tuple(attempt.artifacts))
        if name not in attempt.after_pass  # a commit the first pass never saw
        and (v := attempt.verdicts.get(name)) is not None
        and v[0] == "failed"
        and v[1] in TRUNCATED_REASONS
    )
    if tag and tag != FailureTag.INCOMPLETE:
        _add(out, labels, f"loud.{tag}")
    _add(out, labels, "truncations", truncated)
    if tag and tag != FailureTag.INCOMPLETE:
        out[_k("first", f"loud.{tag}")] += 1


def _advice_inputs(out: Counter[str], record: ShardRecord, attempt: Attempt, span_us: int) -> None:
    """Counts the checkpoint advice's inputs an ended attempt gives (docs/metrics.md)."""
    if attempt.failed_tag or attempt.artifacts:  # p: of the attempts that failed or committed
        out[_k("adv", "ended")] += 1
        out[_k("adv", "reclaimed")] += attempt.failed_tag in RECLAIM_TAGS
    for write_us in attempt.checkpoint_writes:
        out[_k("adv", "w", str(_log_bucket(write_us)))] += 1
    if not attempt.failed_tag and is_complete(record, attempt) and span_us > 0:
        out[_k("adv", "T", str(_log_bucket(span_us)))] += 1
        if attempt.last_step > 0:
            steps_per_s = attempt.last_step / (span_us / 1e6)
            out[_k("adv", "sps", str(_log_bucket(steps_per_s * 1e6)))] += 1


@dataclass(slots=True)
class OpenPart:
    """What a shard's still-open latest attempt adds at a moment: its span so far, stale or not."""

    bucket: str  # "running", or "hung" once it is past its deadline (stale)
    gpu_us: int
    gpus_known: bool
    labels: dict[str, str]
    first_pass: bool
    hang_lost_us: int
    # The shard's labels (its first attempt's over the plan's): shard figures go there.
    shard_labels: dict[str, str] = field(default_factory=dict)


def open_part(record: ShardRecord, now_us: int) -> OpenPart | None:
    """Returns what the shard's open latest attempt adds at now_us, or None when none is open."""
    attempt = record.attempts.get(record.latest_attempt)
    if attempt is None or not is_open(record, attempt):
        return None
    attempts = _by_start(record)
    return open_part_of(
        attempt,
        record.labels,
        deadline_us(record),
        now_us,
        shard_labels=_labels(record, attempts[0]),
    )


def open_part_of(
    attempt: Attempt,
    plan_labels: Mapping[str, str],
    deadline: int | None,
    now_us: int,
    *,
    shard_labels: Mapping[str, str] | None = None,
) -> OpenPart:
    """open_part for an attempt known to be open, its plan's labels and the shard's deadline.

    The reference read of a running shard's row (service.open_parts: a shard whose
    stored state is running has an open latest attempt, and its deadline is a stored
    column), which builds the latest attempt alone instead of the whole record.
    """
    # Open, it has no end yet (a commit of some outputs is none): to its last event, as
    # the report reads it from the row (latest_attempt_from_row builds no ended_us).
    span_us = max(0, attempt.last_seen_us - attempt.started_us)
    gpus, known = _gpus_of(attempt, plan_labels)
    stale = deadline is not None and deadline < now_us
    lost = (deadline or now_us) - (attempt.saved_us or attempt.started_us) if stale else 0
    return OpenPart(
        bucket="hung" if stale else "running",
        gpu_us=span_us * gpus,
        gpus_known=known,
        labels=dict(plan_labels) | attempt.labels,
        first_pass=attempt.first_pass,
        hang_lost_us=max(0, lost),
        shard_labels=dict(shard_labels if shard_labels is not None else plan_labels),
    )


def add_open(counters: Counter[str], part: OpenPart, *, by_label: bool = True) -> None:
    """Adds an open part to summed counters as if it had ended at this moment."""
    add_opens(
        counters,
        OpenSum(
            part.bucket,
            attempts=1,
            gpu_us=part.gpu_us,
            gpus_unknown=int(not part.gpus_known),
            hang_lost_us=part.hang_lost_us,
            labels=part.labels,
            shard_labels=part.shard_labels,
            first_pass=part.first_pass,
        ),
        by_label=by_label,
    )


@dataclass(frozen=True, slots=True)
class OpenSum:
    """Open parts of one bucket that share labels and pass, summed (ledger_server.open_attempts)."""

    bucket: str
    attempts: int
    gpu_us: int
    gpus_unknown: int
    hang_lost_us: int
    labels: Mapping[str, str]
    shard_labels: Mapping[str, str]
    first_pass: bool


def add_opens(counters: Counter[str], opens: OpenSum, *, by_label: bool = True) -> None:
    """Adds summed open parts to counters: what add_open adds for each of them, at once."""
    n = opens.attempts
    counters[_k("gpu", opens.bucket)] += opens.gpu_us
    counters[_k("attempts", opens.bucket)] += n
    counters[_k("clock", "ledger")] += n
    counters[_k("gpus_unknown")] += opens.gpus_unknown
    if opens.bucket == "hung":
        counters[_k("hangs")] += n
        counters[_k("hang_lost")] += opens.hang_lost_us
    if not by_label:
        return
    _add(counters, opens.labels, f"gpu.{opens.bucket}", opens.gpu_us)
    if opens.bucket == "hung" and opens.first_pass:
        # Stale is a hang of the attempt (its labels) and a missing shard (the shard's).
        _add(counters, opens.labels, "stale", n)
        _add(counters, opens.shard_labels, "stale_shard", n)


# --- the figures -------------------------------------------------------------------


def _median(counters: Mapping[str, int], prefix: str) -> float | None:
    buckets = sorted(
        (int(k[len(prefix) :]), n) for k, n in counters.items() if k.startswith(prefix) and n > 0
    )
    total = sum(n for _, n in buckets)
    if not total:
        return None
    seen = 0
    for b, n in buckets:
        seen += n
        if 2 * seen >= total:
            return _bucket_value(b)
    return _bucket_value(buckets[-1][0])  # pragma: no cover - the loop always returns


def costs(counters: Mapping[str, int]) -> dict[str, Any]:
    """Returns the run's GPU time by bucket (GPU-seconds) and the hangs, from summed counters."""
    gpu_s = {b: counters.get(_k("gpu", b), 0) / 1e6 for b in COST_BUCKETS}
    attempts = {b: counters.get(_k("attempts", b), 0) for b in COST_BUCKETS}
    total = sum(gpu_s.values())
    lost = {b: gpu_s[b] for b in COST_BUCKETS if b not in ("counted", "running")}
    not_counted = sum(lost.values())
    return {
        "gpu_s": total,
        "counted_gpu_s": gpu_s["counted"],
        "running_gpu_s": gpu_s["running"],
        "lost_gpu_s": lost,
        "not_counted_gpu_s": not_counted,
        "recomputed_gpu_s": not_counted,
        "not_counted_share": not_counted / total if total else 0.0,
        "attempts": attempts,
        "hangs": counters.get(_k("hangs"), 0),
        "hang_lost_s": counters.get(_k("hang_lost"), 0) / 1e6,
        "gpus_unknown_attempts": counters.get(_k("gpus_unknown"), 0),
        "clock": {
            "job": counters.get(_k("clock", "job"), 0),
            "ledger": counters.get(_k("clock", "ledger"), 0),
        },
    }


def checkpoint_advice(counters: Mapping[str, int]) -> dict[str, Any]:
    """Returns the checkpoint advice's inputs as measured (T, w, p) and the advice itself."""
    from shard_client.advice import advise  # the formula lives with the SDK's own advice

    T_us = _median(counters, _k("adv", "T", ""))
    w_us = _median(counters, _k("adv", "w", ""))
    sps = _median(counters, _k("adv", "sps", ""))
    ended = counters.get(_k("adv", "ended"), 0)
    reclaimed = counters.get(_k("adv", "reclaimed"), 0)
    return advise(
        shard_duration_s=T_us / 1e6 if T_us is not None else None,
        checkpoint_write_s=w_us / 1e6 if w_us is not None else None,
        reclaim_probability=reclaimed / ended if ended else None,
        attempts=ended,
        steps_per_s=sps / 1e6 if sps is not None else None,
    ).as_json()


def run_report(
    counters: Mapping[str, int], open_parts: Iterable[OpenPart], *, labels: Mapping[str, str]
) -> dict[str, Any]:
    """Returns a run's field figures: costs, checkpoint advice, first pass by each label."""
    total = Counter(counters)
    for part in open_parts:
        add_open(total, part, by_label=False)  # the run's own figures: no label's
    return {
        "labels": dict(labels),
        "costs": costs(total),
        "checkpoint_advice": checkpoint_advice(total),
        "first_pass_silent_forms": {
            form: total.get(_k("first", f"silent.{form}"), 0) for form in SILENT_FORMS
        },
        "first_pass_loud_failures": {
            k[len(_k("first", "loud.")) :]: n
            for k, n in sorted(total.items())
            if k.startswith(_k("first", "loud.")) and n > 0
        },
    }


@dataclass(slots=True)
class Group:
    """One value of a label over the compared runs: its summed counters."""

    value: str
    runs: set[str] = field(default_factory=set)
    n: Counter[str] = field(default_factory=Counter)
    fingerprints: set[str] = field(default_factory=set)


def compare(
    runs: Iterable[tuple[str, Mapping[str, int], Iterable[OpenPart]]], label: str
) -> list[dict[str, Any]]:
    """Returns the platform table (docs/metrics.md) by one label's values, over several runs.

    Each run is (run_id, its summed counters, its open parts at the moment asked).
    Shards without the label are in the group "(none)".
    """
    prefix = f"{FIELD_PREFIX}by:{label}:"
    groups: dict[str, Group] = {}
    for run_id, counters, parts in runs:
        total = Counter(counters)
        for part in parts:
            add_open(total, part)
        # Whatever the run counted that no value of the label has is in "(none)".
        rest = Counter({k[len(_ALL) :]: n for k, n in total.items() if k.startswith(_ALL)})
        for key, n in total.items():
            if not key.startswith(prefix) or n <= 0:
                continue
            figure, value = key[len(prefix) :].split(":", 1)
            _group_count(groups, run_id, value, figure, n)
            rest[figure] -= n
        for figure, n in rest.items():
            if n > 0:
                _group_count(groups, run_id, NO_LABEL, figure, n)
    return [_group_json(label, groups[v]) for v in sorted(groups)]


NO_LABEL: Final = "(none)"


def _group_count(groups: dict[str, Group], run_id: str, value: str, figure: str, n: int) -> None:
    g = groups.setdefault(value, Group(value))
    g.runs.add(run_id)
    if figure.startswith("fp="):
        g.fingerprints.add(figure[3:])
    else:
        g.n[figure] += n


def _group_json(label: str, g: Group) -> dict[str, Any]:
    n = g.n
    shards = n["shards"]

    def share(x: int) -> float:
        return x / shards if shards else 0.0

    loud = {k[5:]: v for k, v in sorted(n.items()) if k.startswith("loud.") and v}
    reclaims = sum(loud.get(t, 0) for t in RECLAIM_TAGS)
    hangs = loud.get(FailureTag.TIMEOUT, 0) + n["stale"]
    missing = n["missing"] + n["stale_shard"]
    gpu = {b: n[f"gpu.{b}"] / 1e6 for b in COST_BUCKETS}
    return {
        "label": label,
        "value": g.value,
        "runs": sorted(g.runs),
        "shards": shards,
        "first_pass_verified": n["first_verified"],
        "first_pass_completion_rate": share(n["first_verified"]),
        "first_attempt_verified": n["first_attempt_verified"],
        "first_pass_reconciliation_rate": share(n["first_attempt_verified"]),
        "missing": missing,
        "missing_rate": share(missing),
        "silent_errors": n["silent"],
        "silent_error_rate": share(n["silent"]),
        "silent_by_form": {form: n[f"silent.{form}"] for form in SILENT_FORMS},
        "silent_empty": n["silent.empty"],
        "silent_empty_share": share(n["silent.empty"]),
        "truncations": n["truncations"],
        "loud_failures": loud,
        "reclaims": reclaims,
        "hangs": hangs,
        "fingerprints": len(g.fingerprints),
        "fingerprint_drift": max(len(g.fingerprints) - 1, 0),
        "gpu_s": sum(gpu.values()),
        "gpu_s_by_bucket": gpu,
        "lost_gpu_s": sum(v for b, v in gpu.items() if b not in ("counted", "running")),
    }
