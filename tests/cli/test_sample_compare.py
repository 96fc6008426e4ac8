"""`shardledger sample` and `compare`: a reference sample re-computed through the SDK, output by output."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from ledger_server.reference import wilson_interval
from shard_client import LedgerClient
from shardledger_cli.cli import EXIT_OK, EXIT_PROBLEMS, EXIT_REJECTED, EXIT_USAGE
from tests.builders import run_cli
from tests.nights import play_night

pytestmark = pytest.mark.usefixtures("spool_in_tmp")
DRIVERS = ["550"] * 25 + ["560"] * 5  # two fingerprint groups in one night


@pytest.fixture(autouse=True)
def quiet_server_logs() -> Iterator[None]:
    """Keeps the in-process server's log lines out of the CLI's captured stdout."""
    with structlog.testing.capture_logs():
        yield


@pytest.fixture
def night(capsys: pytest.CaptureFixture[str], target: str, tmp_path: Path) -> Path:
    """A 30-shard night in two fingerprint groups, every shard verified."""
    root = tmp_path / "out"
    play_night(
        capsys, target, root, "night-01", ["ok"] * 30, drivers=DRIVERS, labels={"provider": "D"}
    )
    return root


def sample(capsys: pytest.CaptureFixture[str], target: str, *argv: str) -> dict[str, Any]:
    """Runs `shardledger sample night-01 ... --json` and returns its answer."""
    code, out, err = run_cli(capsys, "sample", "night-01", *argv, "--server", target, "--json")
    assert code == EXIT_OK, err
    answer: dict[str, Any] = json.loads(out)
    return answer


def test_the_sample_is_seeded_stratified_and_planned_as_a_linked_run(
    night: Path, capsys: pytest.CaptureFixture[str], target: str, client: LedgerClient
) -> None:
    dry = sample(
        capsys,
        target,
        "--as",
        "night-01-ref",
        "--fraction",
        "0.2",
        "--min",
        "4",
        "--seed",
        "7",
        "--dry-run",
    )
    again = sample(
        capsys, target, "--as", "night-01-ref", "--fraction", "0.2", "--min", "4", "--seed", "7"
    )
    other = sample(
        capsys, target, "--as", "x", "--fraction", "0.2", "--min", "4", "--seed", "8", "--dry-run"
    )

    assert dry["shards"] == again["shards"] != other["shards"]
    assert (dry["verified"], dry["sampled"]) == (30, 6)  # ceil(0.2 x 30)
    assert sorted(g["sampled"] for g in dry["groups"].values()) == [1, 5]  # 25:5 in proportion
    assert not dry["planned"] and again["planned"]
    [first] = [e for e in client.list_events("night-01-ref", page_size=1)][:1]
    assert dict(first.planned.labels) == {
        "provider": "D",
        "sample_of": "night-01",
        "sample_seed": "7",
        "sample_fraction": "0.2",
    }
    resume = [r.shard_id for r in client.resume("night-01-ref")]
    assert sorted(resume) == sorted(again["shards"])
    # --min wins over a small fraction; the run id must be new and valid.
    assert sample(capsys, target, "--as", "y", "--min", "20", "--dry-run")["sampled"] == 20
    code, _, err = run_cli(capsys, "sample", "night-01", "--as", "night-01", "--server", target)
    assert code == EXIT_USAGE
    code, _, err = run_cli(
        capsys, "sample", "night-01", "--as", "night-01-ref", "--seed", "9", "--server", target
    )
    assert code == EXIT_REJECTED and "pick another --as" in err


def reference(
    capsys: pytest.CaptureFixture[str],
    target: str,
    root: Path,
    values: dict[str, float] | None = None,
    drivers: dict[str, str] | None = None,
) -> list[str]:
    """Samples night-01 (seed 1) as night-01-ref and re-computes it through the SDK."""
    picked = sample(
        capsys, target, "--as", "night-01-ref", "--fraction", "0.2", "--min", "4", "--seed", "1"
    )["shards"]
    index = {sid: int(sid[1:]) for sid in picked}
    play_night(
        capsys,
        target,
        root,
        "night-01-ref",
        ["ok"] * len(picked),
        shard_ids=picked,
        values=[(values or {}).get(s, float(index[s])) for s in picked],
        drivers=[(drivers or {}).get(s, DRIVERS[index[s]]) for s in picked],
    )
    return list(picked)


def compare(
    capsys: pytest.CaptureFixture[str], target: str, *argv: str
) -> tuple[int, dict[str, Any]]:
    """Runs `shardledger compare night-01 night-01-ref ... --json`."""
    code, out, err = run_cli(
        capsys, "compare", "night-01", "night-01-ref", *argv, "--server", target, "--json"
    )
    assert code in (EXIT_OK, EXIT_PROBLEMS), err
    report: dict[str, Any] = json.loads(out)
    return code, report


def test_an_identical_reference_agrees_everywhere_and_exits_0(
    night: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    reference(capsys, target, night)

    code, report = compare(capsys, target)

    assert code == EXIT_OK
    assert (report["compared_outputs"], report["agreed"], report["agreement_rate"]) == (6, 6, 1.0)
    assert report["silent_error_rate"] == 0.0 and report["sample_of"] == "night-01"
    assert report["interval"]["low"] == 0.0 and 0 < report["interval"]["high"] < 0.5


def test_a_wrong_result_is_a_disagreement_with_its_numbers_and_an_interval(
    night: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    picked = reference(capsys, target, night)
    wrong = picked[0]
    # The night's result for `wrong` was silently off by 0.25: a second reference attempt
    # re-computes it (its verified commit is now the reference's result).
    right = float(int(wrong[1:])) + 0.25
    play_night(
        capsys,
        target,
        night,
        "night-01-ref",
        ["ok"],
        shard_ids=[wrong],
        values=[right],
        drivers=[DRIVERS[int(wrong[1:])]],
    )

    code, report = compare(capsys, target)
    [d] = report["disagreements"]
    assert code == EXIT_PROBLEMS and d["shard_id"] == wrong and d["output"] == "out"
    assert report["silent_error_rate"] == pytest.approx(1 / 6)
    low, high = wilson_interval(1, 6, 0.95)
    assert (report["interval"]["low"], report["interval"]["high"]) == (low, high)
    z = statistics.NormalDist().inv_cdf(0.975)
    assert math.isclose(
        high, (1 / 6 + z * z / 12 + z * math.sqrt(5 / 216 + z * z / 144)) / (1 + z * z / 6)
    )

    code, report = compare(capsys, target, "--tolerance", "out=max_abs:0.3")
    assert code == EXIT_OK and report["disagreements"] == []
    code, report = compare(capsys, target, "--tolerance", "out=max_abs:0.1")
    [d] = report["disagreements"]
    assert d["max_abs"] == pytest.approx(0.25) and d["tolerance"] == "max_abs"
    code, text, _ = run_cli(
        capsys, "compare", "night-01", "night-01-ref", "--format", "table", "--server", target
    )
    assert code == EXIT_PROBLEMS and "DISAGREES" in text and "Wilson interval" in text


def test_across_fingerprint_groups_only_structure_is_compared(
    night: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    picked = sample(
        capsys, target, "--as", "night-01-ref", "--fraction", "0.2", "--min", "4", "--seed", "1"
    )["shards"]
    play_night(
        capsys,
        target,
        night,
        "night-01-ref",
        ["ok"] * len(picked),
        shard_ids=picked,
        values=[99.0] * len(picked),
        drivers=["999"] * len(picked),
    )

    code, report = compare(capsys, target)

    assert report["structure_only"] == 6 and report["compared_outputs"] == 0
    assert code == EXIT_PROBLEMS  # nothing compared strictly: no estimate to trust


def test_bad_tolerances_are_usage_errors(capsys: pytest.CaptureFixture[str], target: str) -> None:
    for spec in ("out", "out=fuzzy:1", "out=max_abs:-1", "out=allclose:bogus=1"):
        code, _, err = run_cli(capsys, "compare", "a", "b", "--tolerance", spec, "--server", target)
        assert code == EXIT_USAGE and "bad --tolerance" in err, spec
