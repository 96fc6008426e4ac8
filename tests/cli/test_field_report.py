"""`shardledger report`: labels from flags, env and the SDK; the platform table by label; costs; advice."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from shard_client import Ledger, LedgerClient, checkpoint_advice
from shard_client.errors import LedgerRejected
from shardledger_cli.cli import EXIT_OK, EXIT_REJECTED, EXIT_USAGE
from tests.builders import planned, run_cli
from tests.nights import play_night

pytestmark = pytest.mark.usefixtures("spool_in_tmp")


@pytest.fixture(autouse=True)
def quiet_server_logs() -> Iterator[None]:
    """Keeps the in-process server's log lines out of the CLI's captured stdout."""
    with structlog.testing.capture_logs():
        yield


@pytest.fixture
def platforms(
    capsys: pytest.CaptureFixture[str],
    target: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Path:
    """Provider A's night (labels from the SDK) and two of D's (labels from the environment)."""
    root = tmp_path / "out"
    play_night(
        capsys, target, root, "night-a", ["ok", "ok", "ok", "missing"], labels={"provider": "A"}
    )
    monkeypatch.setenv("SHARDLEDGER_LABEL_PROVIDER", "D")
    monkeypatch.setenv("SHARDLEDGER_LABEL_POOL", "spot")
    play_night(
        capsys,
        target,
        root,
        "night-d",
        ["ok", "empty", "truncated", "preempted", "hang"],
        run_labels={"provider": "D"},
    )
    # The driver changed under D between nights: a second fingerprint group.
    play_night(capsys, target, root, "night-d2", ["ok"], run_labels={"provider": "D"}, driver="560")
    monkeypatch.delenv("SHARDLEDGER_LABEL_PROVIDER")
    monkeypatch.delenv("SHARDLEDGER_LABEL_POOL")
    return root


def report(capsys: pytest.CaptureFixture[str], target: str, *argv: str) -> tuple[int, str, str]:
    """Runs `shardledger report` against the fixture server."""
    return run_cli(capsys, "report", *argv, "--server", target)


def test_report_by_provider_reproduces_report_1s_table(
    platforms: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    code, out, err = report(
        capsys, target, "night-a", "night-d", "night-d2", "--by", "provider", "--json"
    )

    assert code == EXIT_OK, err
    groups = {g["value"]: g for g in map(json.loads, out.splitlines())}
    assert set(groups) == {"A", "D"}
    a, d = groups["A"], groups["D"]
    assert (a["shards"], a["missing"], a["missing_rate"]) == (4, 1, 0.25)
    assert (a["silent_empty"], a["truncations"], a["reclaims"], a["hangs"]) == (0, 0, 0, 0)
    assert (a["fingerprint_drift"], a["first_pass_reconciliation_rate"]) == (0, 0.75)
    assert d["runs"] == ["night-d", "night-d2"] and d["shards"] == 6
    assert (d["missing"], d["silent_empty"], d["truncations"]) == (1, 1, 1)  # the hang is stale
    assert (d["reclaims"], d["hangs"], d["fingerprint_drift"]) == (1, 1, 1)
    assert d["first_attempt_verified"] == 2  # s0 of each night; s3 was preempted first


def test_report_by_pool_groups_attempts_by_their_own_labels_over_the_runs(
    platforms: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    code, out, _ = report(capsys, target, "night-a", "night-d", "--by", "pool")

    assert code == EXIT_OK
    assert "spot" in out and "(none)" in out
    for row in (
        "shard missing rate",
        "silent empty-output share",
        "output truncations",
        "preemptions / reclaims",
        "hangs needing intervention",
        "fingerprint drift",
        "first-pass reconciliation rate",
    ):
        assert row in out


def test_the_first_pass_reconciliation_rate_is_the_summarys(
    platforms: Path, capsys: pytest.CaptureFixture[str], target: str, client: LedgerClient
) -> None:
    code, out, _ = report(capsys, target, "night-d", "--by", "region", "--json")

    [group] = map(json.loads, out.splitlines())
    summary = json.loads(client.summary("night-d"))
    assert code == EXIT_OK and group["value"] == "(none)"
    assert group["first_attempt_verified"] == summary["first_pass"]["first_attempt_verified"]
    assert group["first_pass_reconciliation_rate"] == summary["first_pass"]["reconciliation_rate"]


def test_the_run_report_prices_failures_and_advises_the_checkpoint_interval(
    platforms: Path, capsys: pytest.CaptureFixture[str], target: str, client: LedgerClient
) -> None:
    code, out, err = report(capsys, target, "night-d", "--json")

    assert code == EXIT_OK, err
    r = json.loads(out)
    c, a = r["costs"], r["checkpoint_advice"]
    assert r["labels"] == {"provider": "D"}
    assert c["gpu_s"] > c["counted_gpu_s"] > 0
    assert c["lost_gpu_s"]["reruns"] > 0 and c["lost_gpu_s"]["silent"] > 0
    # The SIGKILLed job is stale: hung, its GPU time up to the last event it sent (it
    # died there), the work lost is since its start (it saved no checkpoint).
    assert c["attempts"]["hung"] == 1 and c["hangs"] == 1 and c["hang_lost_s"] > 0
    assert 0 < c["not_counted_share"] < 1
    assert math.isclose(
        c["not_counted_gpu_s"], c["gpu_s"] - c["counted_gpu_s"] - c["running_gpu_s"]
    )
    # Five attempts ended (four committed, one preempted); the killed job never ended.
    assert (a["attempts"], a["reclaim_probability"]) == (5, 0.2)
    T, w, p = a["shard_duration_s"], a["checkpoint_write_s"], a["reclaim_probability"]
    assert T > 0 and w > 0
    assert math.isclose(a["interval_s"], min(math.sqrt(2 * T * w / p), T))
    assert math.isclose(a["expected_waste_s"], p * a["interval_s"] / 2 + T / a["interval_s"] * w)
    assert checkpoint_advice("night-d", client=client).as_json() == a  # the SDK's own answer

    code, text, _ = report(capsys, target, "night-d", "--format", "table")
    assert code == EXIT_OK
    assert "what failures cost" in text and "checkpoint every" in text
    assert "did not count" in text


def test_a_run_without_reclaims_gets_no_interval_and_says_why(
    platforms: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    code, out, _ = report(capsys, target, "night-a", "--json")

    advice = json.loads(out)["checkpoint_advice"]
    assert code == EXIT_OK
    assert advice["interval_s"] is None and "no attempt was reclaimed" in advice["reason"]


def test_plan_labels_from_flags_and_env_reach_the_run(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    target: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(
        '{"shard_id": "x0", "input": "ref:x0", "input_bytes": 1, "input_blake3": "abababababababababababababababababababababababababababababababab"}\n'
    )
    monkeypatch.setenv("SHARDLEDGER_LABEL_REGION", "eu-1")
    code, _, err = run_cli(
        capsys,
        "plan",
        "night-b",
        "--manifest",
        str(manifest),
        "--label",
        "provider=B",
        "--label",
        "pool=on-demand",
        "--server",
        target,
    )
    assert code == EXIT_OK, err

    code, out, _ = report(capsys, target, "night-b", "--json")

    assert json.loads(out)["labels"] == {"pool": "on-demand", "provider": "B", "region": "eu-1"}


def test_bad_labels_are_refused_everywhere_with_the_rule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str, client: LedgerClient
) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(
        '{"shard_id": "x0", "input": "ref:x0", "input_bytes": 1, "input_blake3": "abababababababababababababababababababababababababababababababab"}\n'
    )
    code, _, err = run_cli(
        capsys,
        "plan",
        "night-c",
        "--manifest",
        str(manifest),
        "--label",
        "Provider=B",
        "--server",
        target,
    )
    assert code == EXIT_USAGE and "must match [a-z][a-z0-9_.-]*" in err
    code, _, err = run_cli(capsys, "report", "night-c", "--server", target)
    assert code == EXIT_REJECTED  # nothing was planned
    with pytest.raises(ValueError, match="label key 'bad key'"):
        Ledger(target, labels={"bad key": "x"})
    event = planned("night-c", "x0")
    event.planned.labels["x" * 64] = "too long a key"
    with pytest.raises(LedgerRejected) as caught:
        client.append([event])
    assert caught.value.reason == "INVALID_FIELD" and "planned.labels" in str(caught.value)


def test_report_usage_errors(capsys: pytest.CaptureFixture[str], target: str) -> None:
    code, _, err = report(capsys, target)
    assert code == EXIT_USAGE and "name one RUN" in err
    code, _, err = report(capsys, target, "a", "b")
    assert code == EXIT_USAGE


def test_status_costs_adds_the_reports_figures_under_new_keys(
    platforms: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    _, out, _ = report(capsys, target, "night-d", "--json")
    expected = json.loads(out)

    code, out, _ = run_cli(capsys, "status", "night-d", "--costs", "--json", "--server", target)

    status = json.loads(out)
    assert code == 1  # not every shard is verified
    assert status["costs"] == expected["costs"]
    assert status["checkpoint_advice"] == expected["checkpoint_advice"]
    assert status["submitted"] == 5  # the summary's own keys are unchanged
    code, text, _ = run_cli(
        capsys, "status", "night-d", "--costs", "--format", "table", "--server", target
    )
    assert "what failures cost" in text and "submitted 5 =" in text
