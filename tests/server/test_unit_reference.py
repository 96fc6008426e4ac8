"""The figures behind sample, compare, trend and accept, as pure functions of shard views and summaries."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ledger_server.acceptance import AcceptanceRun, Thresholds, accept
from ledger_server.drift import (
    ShardArtifacts,
    compare_rulers,
    consistency_of,
    consistency_pairs,
    outputs_digest,
)
from ledger_server.reference import (
    UnreadableNumbers,
    compare_outputs,
    parse_tolerance,
    stratified_sample,
    verified_groups,
    wilson_interval,
)


def arts(fingerprint: str = "fp1", state: str = "verified", **digests: str) -> ShardArtifacts:
    return ShardArtifacts(state=state, fingerprint=fingerprint, digests=digests)


# --- drift and consistency -----------------------------------------------------------


def test_a_changed_digest_is_drift_in_one_group_expected_across_groups_unattributed_unknown() -> (
    None
):
    before = {"a": arts(out="1"), "b": arts(out="1"), "c": arts("", out="1"), "gone": arts(out="1")}
    after = {
        "a": arts(out="2"),
        "b": arts("fp2", out="2"),
        "c": arts(out="2"),
        "new": arts(out="1"),
    }
    result = compare_rulers(before, after)
    assert [d["shard_id"] for d in result["drift"]] == ["a"]
    assert [d["shard_id"] for d in result["across_groups"]] == ["b"]
    assert [d["shard_id"] for d in result["unattributed"]] == ["c"]
    assert (result["compared_outputs"], result["unchanged"]) == (3, 0)
    assert (result["only_in_previous"], result["only_in_current"]) == (["gone"], ["new"])


def test_consistency_counts_only_verified_outputs_in_the_same_group() -> None:
    before = {"a": arts(out="1"), "b": arts(out="1"), "c": arts(out="1"), "d": arts(out="1")}
    after = {
        "a": arts(out="1"),
        "b": arts(out="2"),
        "c": arts("fp2", out="9"),
        "d": arts(state="failed", out="9"),
    }
    assert consistency_of(before, after) == {
        "compared_outputs": 2,
        "consistent": 1,
        "consistency_rate": 0.5,
    }
    assert consistency_of({}, after)["consistency_rate"] is None


def test_each_run_is_paired_with_the_latest_earlier_run_sharing_shards() -> None:
    runs = {
        "r1": {"a": arts(out="1")},
        "other": {"z": arts(out="1")},
        "r2": {"a": arts(out="2")},
    }
    pairs = consistency_pairs(["r1", "other", "r2"], runs)
    assert [(p["run_id"], p["previous_run_id"], p["consistent"]) for p in pairs] == [
        ("r2", "r1", 0)
    ]


def test_the_outputs_digest_changes_with_any_digest_and_not_with_order() -> None:
    one = outputs_digest({"a": arts(x="1", y="2"), "b": arts(x="3")})
    assert one == outputs_digest({"b": arts(x="3"), "a": arts(y="2", x="1")})
    assert one["outputs"] == 3
    assert one != outputs_digest({"a": arts(x="1", y="2"), "b": arts(x="4")})


# --- acceptance ----------------------------------------------------------------------


def summary(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "submitted": 10,
        "verified": 10,
        "completion_rate": 1.0,
        "silent_error_rate": 0.0,
        "duplicates": {"wasted": 0},
        "fingerprint_groups": {"fp1": 10},
        "verify_failures": {},
    }
    return base | over


def rounds(n: int, **over: Any) -> list[AcceptanceRun]:
    shards = {"a": arts(out="1")}
    return [AcceptanceRun(f"r{i}", summary(**over), shards) for i in range(n)]


def test_good_rounds_pass_and_steps_not_given_are_skipped() -> None:
    steps = accept(rounds(3), Thresholds())
    assert [s.status for s in steps] == ["pass", "pass", "skipped", "skipped", "skipped"]
    assert steps[2].reasons == ["no --interruption run"]


def test_each_threshold_and_step_fails_with_its_reason() -> None:
    low = rounds(2, completion_rate=0.5)
    steps = accept(
        low,
        Thresholds(min_rounds=3),
        interruption=AcceptanceRun("kill", summary(duplicates={"wasted": 1}, verified=9), {}),
        reference=AcceptanceRun("ref", summary(fingerprint_groups={"fp0": 1}), {}),
        multi_gpu=AcceptanceRun("gpu", summary(verify_failures={"id_set_mismatch": 2}), {}),
    )
    assert [s.status for s in steps] == ["fail"] * 5
    assert steps[0].reasons == ["2 rounds, fewer than 3"]
    assert "r0: completion 50.00 % < 99.00 %" in steps[1].reasons
    assert steps[2].reasons == [
        "1 shard with a second result (duplicated work)",
        "1 shard with no verified result after the resume (gaps)",
    ]
    assert steps[3].details["new_fingerprints"] == ["fp1"]
    assert steps[4].reasons == ["2 result sets do not hold exactly their input ids"]


# --- the reference sample ---------------------------------------------------------------


def test_the_sample_is_proportional_per_group_at_least_the_minimum_and_seeded() -> None:
    groups = {"fp1": [f"a{i}" for i in range(90)], "fp2": [f"b{i}" for i in range(10)]}
    picked = stratified_sample(groups, fraction=0.05, minimum=20, seed="7")
    assert {g: len(ids) for g, ids in picked.items()} == {"fp1": 18, "fp2": 2}
    assert picked == stratified_sample(groups, fraction=0.05, minimum=20, seed="7")
    assert picked != stratified_sample(groups, fraction=0.05, minimum=20, seed="8")
    everything = stratified_sample(groups, fraction=0.05, minimum=500, seed="7")
    assert sum(map(len, everything.values())) == 100


def test_only_verified_shards_are_grouped_by_fingerprint() -> None:
    views = [
        {"shard_id": "a", "state": "verified", "fingerprint": "fp1"},
        {"shard_id": "b", "state": "failed", "fingerprint": "fp1"},
        {"shard_id": "c", "state": "verified", "fingerprint": ""},
    ]
    assert verified_groups(views) == {"fp1": ["a"], "(none)": ["c"]}


def test_the_wilson_interval_of_no_failures_is_not_zero_wide() -> None:
    assert wilson_interval(0, 0) == (0.0, 1.0)
    low, high = wilson_interval(0, 10, 0.95)
    assert low == pytest.approx(0.0, abs=1e-12)
    assert high == pytest.approx(0.2775, abs=1e-4)


def test_a_bad_tolerance_says_what_is_wrong() -> None:
    assert parse_tolerance("x=max_abs:1e-6")[1].max_abs == 1e-6
    with pytest.raises(ValueError, match="not NAME=KIND:VALUE"):
        parse_tolerance("x")
    with pytest.raises(ValueError, match="not a finite number"):
        parse_tolerance("x=rel:-1")
    with pytest.raises(ValueError, match="unknown allclose option"):
        parse_tolerance("x=allclose:rtol=1,eps=2")


def view(state: str, fingerprint: str, digest: str, path: str = "/o") -> dict[str, Any]:
    return {
        "state": state,
        "fingerprint": fingerprint,
        "artifacts": {"out": {"blake3": digest, "path": path}},
    }


def test_outputs_compare_by_digest_or_within_a_tolerance_and_name_what_was_not_compared(
    tmp_path: Path,
) -> None:
    for side, last in (("run", 2.0), ("ref", 2.0000001)):
        (tmp_path / side).mkdir()
        (tmp_path / side / "n.json").write_text(json.dumps({"values": [1.0, last]}))
    runs = {
        "same": view("verified", "fp", "d1"),
        "near": view("verified", "fp", "d2", "/n.json"),
        "other-group": view("verified", "fp9", "d4"),
        "failed": view("failed", "fp", "d5"),
    }
    refs = {
        "same": view("verified", "fp", "d1"),
        "near": view("verified", "fp", "x2", "/n.json"),
        "other-group": view("verified", "fp", "x4"),
        "failed": view("verified", "fp", "d5"),
        "missing": view("verified", "fp", "d6"),
        "ref-failed": view("failed", "fp", "d7"),
    }
    roots = {"root": str(tmp_path / "run"), "ref_root": str(tmp_path / "ref")}
    tolerances = {"out": parse_tolerance("out=max_abs:1e-3")[1]}
    result = compare_outputs(
        runs, refs, tolerances=tolerances, threshold=0.005, confidence=0.95, **roots
    )
    assert (result["compared_outputs"], result["agreed"], result["structure_only"]) == (2, 2, 1)
    assert result["not_compared"] == {
        "reference_not_verified": 1,
        "run_not_verified": 1,
        "not_in_run": 1,
    }
    assert (result["silent_error_rate"], result["above_threshold"]) == (0.0, False)
    strict = {"out": parse_tolerance("out=max_abs:1e-9")[1]}
    result = compare_outputs(
        runs, refs, tolerances=strict, threshold=0.005, confidence=0.95, **roots
    )
    assert result["disagreements"][0]["shard_id"] == "near"
    assert result["disagreements"][0]["max_abs"] == pytest.approx(1e-7)
    runs["wrong"], refs["wrong"] = view("verified", "fp", "d3"), view("verified", "fp", "x3")
    with pytest.raises(UnreadableNumbers, match="cannot read numbers from"):
        compare_outputs(
            runs, refs, tolerances=tolerances, threshold=0.005, confidence=0.95, **roots
        )


def test_a_disagreement_without_a_tolerance_counts_toward_the_silent_error_rate() -> None:
    runs = {"a": view("verified", "fp", "d1"), "b": view("verified", "fp", "d2")}
    refs = {"a": view("verified", "fp", "d1"), "b": view("verified", "fp", "x2")}
    result = compare_outputs(runs, refs, tolerances={}, threshold=0.005, confidence=0.95)
    assert (result["compared_outputs"], result["agreed"]) == (2, 1)
    assert result["silent_error_rate"] == 0.5
    assert result["above_threshold"] is True
    assert [d["shard_id"] for d in result["disagreements"]] == ["b"]
    low, high = result["interval"]["low"], result["interval"]["high"]
    assert (low, high) == wilson_interval(1, 2, 0.95)
