"""A mistyped run id or shard-id prefix gets "did you mean", as a mistyped flag or command does.

The suggestions come from what the same ledger holds in the same namespace
(the runs `shardledger runs` lists, the shards of the run), never from
another tenant's.
"""

from __future__ import annotations

import pytest

from shard_client import LedgerClient
from tests.builders import planned, run_cli


def test_a_mistyped_run_id_suggests_the_run_meant(
    client: LedgerClient, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    client.append([planned("night-01", "s-1"), planned("day-07", "s-1")])
    code, _, err = run_cli(capsys, "status", "nigth-01", "--server", target)
    assert code == 4
    assert "RUN_NOT_FOUND" in err
    assert "did you mean night-01? (`shardledger runs` lists them)" in err
    assert "day-07" not in err


def test_a_run_id_like_nothing_says_where_the_runs_are_listed(
    client: LedgerClient, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    client.append([planned("night-01", "s-1")])
    code, _, err = run_cli(capsys, "resume", "zzzzzz", "--server", target)
    assert code == 4
    assert "did you mean" not in err and "`shardledger runs` lists them" in err


def test_runs_of_another_namespace_are_never_suggested(
    client: LedgerClient, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    event = planned("night-01", "s-1")
    event.namespace = "team-b"
    client.append([event])
    code, _, err = run_cli(capsys, "status", "nigth-01", "--server", target)
    assert code == 4
    assert "night-01" not in err.split("does not exist", 1)[1]


def test_a_mistyped_shard_prefix_suggests_the_shard_meant(
    client: LedgerClient, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    client.append([planned("night-01", "s-3c52ba9ca020"), planned("night-01", "s-77aa01")])
    code, _, err = run_cli(
        capsys, "events", "night-01", "--shard", "s-3c25ba9c", "--server", target
    )
    assert code == 4
    assert "run night-01 has no shard s-3c25ba9c" in err
    assert "did you mean s-3c52ba9ca020?" in err
    assert "s-77aa01" not in err
