"""The field figures checked against ground truth: a night whose jobs ran known durations.

tests/truth_night.py plays the night once for this module (two runs, providers A/B/C,
31 attempts over 19 shards, every kind of failure) and records, for each attempt, the
bracket its span must lie in on the clock the ledger reads: from inside the block to
before its end was sent (lo), and from before its started event was sent to after its
end was acknowledged (hi). Those ms overheads of sending and acknowledging are the
only slack, measured, not guessed; a figure extended by a verdict (3 s later), a
deadline (0.5 s) or a wait is far outside it.

Tolerances, stated once:

* GPU time (per bucket, per provider, per run): within [Σ lo·GPUs, Σ hi·GPUs] widened
  by the issue's ±5 %, plus 1 ms per attempt for µs rounding and, for an attempt with
  no end event (the SIGKILLed job, read on the ledger's clock), 50 ms: a heartbeat it
  sent just before the kill may be handled just after.
* T and w (medians): within the lower medians of the brackets, widened by 5 % and by
  the 1.1 % of the log-spaced buckets the server reads medians from.
* Every count, p, and every first-pass figure per provider: exact.

Stages: "first" after the first verify (the hang stale, nothing rerun), "final" after
the resume list's reruns and a second verify, "late" after an idle wait of 3 s and
`verify --recheck`: it must equal "final" in every figure.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest
import structlog.testing

from ledger_server.config import ServerConfig
from ledger_server.server import create_server
from tests.truth_night import (
    BUCKETS,
    GPUS,
    HANG_TIMEOUT_S,
    IDLE_S,
    NIGHT,
    PROVIDERS,
    RUNS,
    STAGES,
    Played,
    Span,
    Truth,
    exact_counts,
    play_truth_night,
    truth_counts,
)

TOLERANCE: Final = 0.05  # the issue's ±5 %
ROUNDING_S: Final = 0.001  # per attempt: spans and brackets are whole microseconds
LEDGER_CLOCK_SLACK_S: Final = 0.05  # per attempt read on the ledger's clock (no end event)
MEDIAN_BUCKET: Final = 2 ** (1 / 64)  # half a 2**(1/32)-wide bucket: a median's rounding


@pytest.fixture(scope="module")
def night() -> Iterator[Played]:
    """Plays the truth night once on a server of its own (stopped once every answer is read)."""
    with (
        tempfile.TemporaryDirectory(prefix="truth-night-") as tmp,
        pytest.MonkeyPatch.context() as env,
        structlog.testing.capture_logs(),
    ):
        env.setenv("SHARDLEDGER_SPOOL_DIR", str(Path(tmp) / "spool"))
        env.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # A's GPUs come from its fingerprint
        running = create_server(ServerConfig(database=f"{tmp}/ledger.db", listen="127.0.0.1:0"))
        try:
            played = play_truth_night(f"127.0.0.1:{running.port}", Path(tmp) / "out")
        finally:
            running.stop(0.5)
    yield played


@pytest.fixture(scope="module")
def truth(night: Played) -> Truth:
    return Truth(night.attempts)


def truth_stage(stage: str) -> str:
    """The late recheck runs nothing: its truth is the final one."""
    return "first" if stage == "first" else "final"


def assert_within(server: float, span: Span, what: str) -> None:
    lo = span.lo * (1 - TOLERANCE) - ROUNDING_S * span.attempts
    hi = (
        span.hi * (1 + TOLERANCE)
        + ROUNDING_S * span.attempts
        + LEDGER_CLOCK_SLACK_S * span.ledger_clock
    )
    assert lo <= server <= hi, (
        f"{what}: served {server:.4f} GPU-s, truth {span.measured:.4f} "
        f"(bracket {span.lo:.4f}..{span.hi:.4f} over {span.attempts} attempts)"
    )


def bucket_gpu_s(costs: dict[str, Any], bucket: str) -> float:
    if bucket == "counted":
        return float(costs["counted_gpu_s"])
    if bucket == "running":
        return float(costs["running_gpu_s"])
    return float(costs["lost_gpu_s"][bucket])


# --- the night itself -------------------------------------------------------------------


def test_the_night_ran_its_known_durations_and_its_resume_list(night: Played) -> None:
    for m in night.attempts:
        # Each block really ran its duration: the bracket starts no shorter.
        assert m.lo_us >= m.job.seconds * 1e6 - 1_000, (m.plan.shard_id, m.lo_us)
        assert m.lo_us <= m.measured_us <= m.hi_us
    assert len(night.attempts) == sum(len(p.first) + (p.rerun is not None) for p in NIGHT)
    # The resume list after the first verify is exactly the shards the night reruns.
    for run in RUNS:
        expected = [p.shard_id for p in NIGHT if p.run_id == run and p.rerun is not None]
        assert sorted(night.resume_ids[run]) == sorted(expected)
        assert night.resume_after[run] == 0  # every shard verified after the reruns
    assert night.wall_s < 60


# --- GPU time ---------------------------------------------------------------------------


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("run", RUNS)
def test_gpu_time_per_bucket_is_each_attempts_span_times_its_gpus(
    night: Played, truth: Truth, stage: str, run: str
) -> None:
    costs = night.snapshots[stage].reports[run]["costs"]
    spans = truth.gpu(truth_stage(stage), [run])

    for bucket in BUCKETS:
        assert_within(bucket_gpu_s(costs, bucket), spans[bucket], f"{run} {stage} {bucket}")
        assert costs["attempts"][bucket] == spans[bucket].attempts, bucket
    assert_within(costs["gpu_s"], truth.total(truth_stage(stage), [run]), f"{run} gpu_s")
    lost = sum(costs["lost_gpu_s"].values())
    assert math.isclose(costs["not_counted_gpu_s"], lost)
    assert math.isclose(costs["gpu_s"], lost + costs["counted_gpu_s"] + costs["running_gpu_s"])


@pytest.mark.parametrize("stage", STAGES)
def test_gpu_time_per_provider_follows_each_attempts_labels(
    night: Played, truth: Truth, stage: str
) -> None:
    groups = night.snapshots[stage].by_provider

    assert set(groups) == set(PROVIDERS)
    for provider in PROVIDERS:
        spans = truth.gpu(truth_stage(stage), RUNS, provider)
        for bucket in BUCKETS:
            served = groups[provider]["gpu_s_by_bucket"][bucket]
            assert_within(served, spans[bucket], f"{provider} {stage} {bucket}")
        total = truth.total(truth_stage(stage), RUNS, provider)
        assert_within(groups[provider]["gpu_s"], total, f"{provider} {stage} gpu_s")


def test_a_rerun_on_another_provider_bills_that_provider(night: Played, truth: Truth) -> None:
    # a-oom is A's shard (its first attempt's); its rerun ran on B with 2 GPUs.
    [rerun] = [m for m in night.attempts if m.plan.shard_id == "a-oom" and m.rerun]
    b_counted = truth.gpu("final", RUNS, "B")["counted"]
    without = Span(b_counted.lo - rerun.lo_us * 2 / 1e6, b_counted.hi - rerun.hi_us * 2 / 1e6)

    served = night.snapshots["final"].by_provider["B"]["gpu_s_by_bucket"]["counted"]

    assert rerun.job.provider == "B" and GPUS["B"] == (2, True)
    assert_within(served, b_counted, "B counted")
    assert served > without.hi * (1 + TOLERANCE) + 0.1  # the rerun's 2 x 0.55 s are in it
    assert night.snapshots["final"].by_provider["A"]["shards"] == 7  # the shard stays A's


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("run", RUNS)
def test_gpus_unknown_and_the_clock_each_span_was_read_on(
    night: Played, truth: Truth, stage: str, run: str
) -> None:
    costs = night.snapshots[stage].reports[run]["costs"]
    seen = truth.seen(truth_stage(stage), [run])

    assert costs["gpus_unknown_attempts"] == sum(not m.gpus_known for m in seen)
    # Every attempt but the SIGKILLed one ended by an event of its own process: job clock.
    assert costs["clock"] == {
        "job": sum(not m.ledger_clock for m in seen),
        "ledger": sum(m.ledger_clock for m in seen),
    }


def test_a_stale_hang_is_billed_up_to_its_last_event_not_its_deadline(
    night: Played, truth: Truth
) -> None:
    costs = night.snapshots["first"].reports["truth-1"]["costs"]
    [hang] = [m for m in night.attempts if m.job.kind == "hang"]

    assert costs["attempts"]["hung"] == 1 and costs["hangs"] == 1
    assert_within(costs["lost_gpu_s"]["hung"], truth.gpu("first", ["truth-1"])["hung"], "hung")
    # Up to the deadline it would be at least 0.5 s more than its measured bracket allows.
    assert costs["lost_gpu_s"]["hung"] < hang.hi_us / 1e6 + HANG_TIMEOUT_S / 2
    # The work a hang throws away runs from its last checkpoint to its deadline.
    lo, hi = hang.hang_lost_us
    assert lo / 1e6 - ROUNDING_S <= costs["hang_lost_s"] <= hi / 1e6 + LEDGER_CLOCK_SLACK_S


# --- first pass per provider --------------------------------------------------------------


@pytest.mark.parametrize("stage", STAGES)
def test_report_1s_table_per_provider_is_exact(night: Played, truth: Truth, stage: str) -> None:
    groups = night.snapshots[stage].by_provider
    expected = truth.by_provider(truth_stage(stage))

    for provider in PROVIDERS:
        g = groups[provider]
        assert exact_counts(g) == truth_counts(expected[provider]), provider
        shards = expected[provider]["shards"]
        assert g["silent_empty_share"] == expected[provider]["silent_by_form"]["empty"] / shards
        assert g["first_pass_reconciliation_rate"] == (
            expected[provider]["first_attempt_verified"] / shards
        )
        assert g["first_pass_completion_rate"] == expected[provider]["first_pass_verified"] / shards


def test_the_table_per_provider_states_the_nights_numbers(night: Played) -> None:
    # The truth spelled out for the first pass, so a reader sees what the night is.
    g = night.snapshots["late"].by_provider
    a, b, c = g["A"], g["B"], g["C"]
    assert (a["shards"], b["shards"], c["shards"]) == (7, 6, 6)
    assert (a["first_pass_verified"], a["first_attempt_verified"]) == (3, 3)
    assert (b["first_pass_verified"], b["first_attempt_verified"]) == (3, 1)
    assert (c["first_pass_verified"], c["first_attempt_verified"]) == (2, 2)
    assert a["silent_by_form"] == {"empty": 1, "truncated": 1, "nan": 0, "digest": 0, "other": 0}
    assert b["silent_by_form"] == {"empty": 1, "truncated": 0, "nan": 1, "digest": 0, "other": 0}
    assert c["silent_by_form"] == {"empty": 1, "truncated": 1, "nan": 0, "digest": 0, "other": 0}
    assert (a["loud_failures"], b["loud_failures"], c["loud_failures"]) == (
        {"oom": 1},
        {"data": 1, "preempted": 1},
        {"preempted": 1},
    )
    assert (a["truncations"], b["truncations"], c["truncations"]) == (1, 0, 1)
    assert (a["reclaims"], b["reclaims"], c["reclaims"]) == (0, 1, 1)
    assert (a["fingerprint_drift"], b["fingerprint_drift"], c["fingerprint_drift"]) == (0, 0, 1)
    assert (a["missing"], c["missing"]) == (0, 1)  # c-missing never ran in the first pass


def test_a_stale_shard_is_missing_and_a_hang_only_while_it_is_stale(night: Played) -> None:
    # docs/metrics.md: "plus shards now stale". Once rerun, the SIGKILLed attempt is no
    # longer stale; it never failed `timeout`, so the first pass's table no longer counts it.
    first, final = (
        night.snapshots["first"].by_provider["A"],
        night.snapshots["final"].by_provider["A"],
    )
    assert (first["missing"], first["hangs"]) == (1, 1)
    assert (final["missing"], final["hangs"]) == (0, 0)


# --- checkpoint advice ------------------------------------------------------------------


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("run", RUNS)
def test_checkpoint_advice_measures_T_w_and_p(
    night: Played, truth: Truth, stage: str, run: str
) -> None:
    advice = night.snapshots[stage].reports[run]["checkpoint_advice"]
    t_lo, t_hi = truth.durations(truth_stage(stage), run)
    w_lo, w_hi = truth.writes(truth_stage(stage), run)
    reclaimed, ended = truth.reclaim(truth_stage(stage), run)
    widen = (1 - TOLERANCE) / MEDIAN_BUCKET, (1 + TOLERANCE) * MEDIAN_BUCKET

    T, w = advice["shard_duration_s"], advice["checkpoint_write_s"]
    assert t_lo / 1e6 * widen[0] <= T <= t_hi / 1e6 * widen[1], (T, t_lo, t_hi)
    assert w_lo / 1e6 * widen[0] <= w <= w_hi / 1e6 * widen[1], (w, w_lo, w_hi)
    assert advice["attempts"] == ended
    if reclaimed:
        p = advice["reclaim_probability"]
        assert p == reclaimed / ended
        assert math.isclose(advice["interval_s"], min(math.sqrt(2 * T * w / p), T))
    else:
        assert advice["reclaim_probability"] == 0 and advice["interval_s"] is None


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("run", RUNS)
def test_status_costs_shows_the_reports_figures(night: Played, stage: str, run: str) -> None:
    snapshot = night.snapshots[stage]
    assert snapshot.status[run]["costs"] == snapshot.reports[run]["costs"]
    assert snapshot.status[run]["checkpoint_advice"] == snapshot.reports[run]["checkpoint_advice"]


# --- regressions: each defect the issue lists ------------------------------------------


@pytest.mark.parametrize("run", RUNS)
def test_a_gpu_time_never_includes_the_wait_until_verify(
    night: Played, truth: Truth, run: str
) -> None:
    # (a) 3 s of idle and a --recheck later, every figure is what it was: 31 attempts
    # extended to their late verdicts would add over 3 GPU-s each.
    final, late = night.snapshots["final"].reports[run], night.snapshots["late"].reports[run]
    assert IDLE_S >= 3
    assert late["costs"] == final["costs"]
    assert late["checkpoint_advice"] == final["checkpoint_advice"]
    assert late["first_pass_silent_forms"] == final["first_pass_silent_forms"]
    assert late["first_pass_loud_failures"] == final["first_pass_loud_failures"]
    assert_within(late["costs"]["gpu_s"], truth.total("final", [run]), f"{run} late gpu_s")
    assert night.snapshots["late"].by_provider == night.snapshots["final"].by_provider


@pytest.mark.parametrize("stage", ["final", "late"])
def test_b_repaired_silent_errors_are_billed_as_silent_not_duplicates(
    night: Played, truth: Truth, stage: str
) -> None:
    for run in RUNS:
        costs = night.snapshots[stage].reports[run]["costs"]
        spans = truth.gpu("final", [run])
        assert_within(costs["lost_gpu_s"]["silent"], spans["silent"], f"{run} silent")
        assert_within(costs["lost_gpu_s"]["duplicates"], spans["duplicates"], f"{run} dup")
    # Three repaired silent errors per run; the one duplicate is a-dup's second attempt.
    one, two = (night.snapshots[stage].reports[r]["costs"]["attempts"] for r in RUNS)
    assert (one["silent"], one["duplicates"], two["silent"], two["duplicates"]) == (3, 1, 3, 0)


def test_c_silent_empty_share_and_truncations_keep_their_first_pass_values(
    night: Played, truth: Truth
) -> None:
    first = truth.by_provider("first")
    for provider in PROVIDERS:
        served = [night.snapshots[s].by_provider[provider] for s in STAGES]
        shards = first[provider]["shards"]
        empty = first[provider]["silent_by_form"]["empty"]
        assert [g["silent_empty_share"] for g in served] == [empty / shards] * 3, provider
        assert [g["silent_empty"] for g in served] == [empty] * 3, provider
        assert [g["truncations"] for g in served] == [first[provider]["truncations"]] * 3
        assert [g["silent_by_form"] for g in served] == [served[0]["silent_by_form"]] * 3
    # Every silent error of the first pass was repaired: the shards are verified now.
    assert all(night.resume_after[r] == 0 for r in RUNS)


@pytest.mark.parametrize("stage", STAGES)
def test_d_first_attempt_reconciliation_credits_the_attempt_the_verdict_names(
    night: Played, stage: str
) -> None:
    # Of B's shards the passing verdicts of b-preempt and b-zombie name their second
    # attempts, and the repaired shards' name their reruns: none of them is B's first
    # attempt's. Only b-ok1 was reconciled at its first attempt.
    b = night.snapshots[stage].by_provider["B"]
    assert (b["first_attempt_verified"], b["first_pass_verified"]) == (1, 3)
    assert b["first_pass_reconciliation_rate"] == 1 / 6
    a = night.snapshots[stage].by_provider["A"]
    # a-dup: both attempts committed the same bytes at one path; each has its own verdict.
    assert (a["first_attempt_verified"], a["first_pass_reconciliation_rate"]) == (3, 3 / 7)


def test_e_a_recheck_does_not_count_a_truncated_commit_twice(night: Played) -> None:
    late = night.snapshots["late"]
    # The recheck read the two truncated commits again and failed them again ...
    for run, shard in (("truth-1", "a-trunc"), ("truth-2", "c-trunc")):
        assert night.snapshots["final"].failed_verdicts[(run, shard, "size_mismatch")] == 1
        assert late.failed_verdicts[(run, shard, "size_mismatch")] == 2
    # ... and each is still one truncated commit.
    assert [late.by_provider[p]["truncations"] for p in PROVIDERS] == [1, 0, 1]
    assert [late.reports[r]["first_pass_silent_forms"]["truncated"] for r in RUNS] == [1, 1]


def test_f_a_sigkilled_attempt_is_a_rerun_once_its_shard_is_rerun(
    night: Played, truth: Truth
) -> None:
    for stage in ("final", "late"):
        costs = night.snapshots[stage].reports["truth-1"]["costs"]
        spans = truth.gpu("final", ["truth-1"])
        assert costs["running_gpu_s"] == 0 and costs["attempts"]["running"] == 0
        assert costs["lost_gpu_s"]["hung"] == 0 and costs["hangs"] == 0
        # reruns: a-oom's failed attempt and the SIGKILLed a-hang's, up to its last event.
        assert costs["attempts"]["reruns"] == 2
        assert_within(costs["lost_gpu_s"]["reruns"], spans["reruns"], f"{stage} reruns")


def test_g_checkpoint_advice_T_is_the_median_completed_span_not_a_verdicts_wait(
    night: Played, truth: Truth
) -> None:
    for run in RUNS:
        T = night.snapshots["late"].reports[run]["checkpoint_advice"]["shard_duration_s"]
        measured = truth.measured_duration("final", run) / 1e6
        t_lo, t_hi = truth.durations("final", run)
        assert t_lo / 1e6 / MEDIAN_BUCKET * (1 - TOLERANCE) <= T, (run, T, measured)
        assert t_hi / 1e6 * MEDIAN_BUCKET * (1 + TOLERANCE) >= T, (run, T, measured)
        assert T < 1.3  # no job ran longer than 1.2 s; the idle wait before it was 3 s
