"""Keyed result sets: files with exactly the shard's input ids, checked by `verify` and directly."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import structlog

from shard_client import Ledger, LedgerClient, PlanEntry, plan_events
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.checks_keyed import check_id_set, compare_id_sets
from shardledger_cli.cli import EXIT_OK, EXIT_PROBLEMS
from tests.builders import run_cli
from tests.nights import fingerprint

pytestmark = pytest.mark.usefixtures("spool_in_tmp")
IDS = [f"sample-{i:03d}" for i in range(8)]


@pytest.fixture(autouse=True)
def quiet_server_logs() -> Iterator[None]:
    """Keeps the in-process server's log lines out of the CLI's captured stdout."""
    with structlog.testing.capture_logs():
        yield


def keyed_run(client: LedgerClient, run_id: str, params: dict[str, object]) -> None:
    """Plans one shard whose output "results" is a keyed result set."""
    entry = PlanEntry(
        shard_id="s0",
        input_ref="/in/s0",
        input_bytes=1,
        input_blake3="ab" * 32,
        params=params,
        expected_outputs=("results",),
    )
    client.append(plan_events(run_id, [entry]))


def write_results(target: str, root: Path, run_id: str, ids: list[str]) -> None:
    """Runs the shard through the SDK: gathers its ranks' rows in completion order."""
    with (
        Ledger(target, spool_dir=str(root / ".spool")) as ledger,
        ledger.shard(
            run_id, "s0", fingerprint=fingerprint(), watchdog=False, output_dir=root / run_id
        ) as shard,
        shard.atomic_write(root / run_id / "results.jsonl", name="results") as f,
    ):
        for i in ids:
            f.write(json.dumps({"id": i, "label": "cat"}).encode() + b"\n")


def verdict(client: LedgerClient, run_id: str) -> tuple[int, str, str]:
    """Returns the run's one verdict as (result, reason, detail)."""
    [v] = [e.verified for e in client.list_events(run_id) if e.HasField("verified")]
    return v.result, v.reason, v.detail


def test_a_result_set_with_an_id_missing_and_one_twice_fails_with_counts(
    capsys: pytest.CaptureFixture[str], target: str, client: LedgerClient, tmp_path: Path
) -> None:
    keyed_run(client, "gather-1", {"keyed_outputs": {"results": "id"}, "input_ids": IDS})
    # Rank 2's rows arrived twice and rank 5's never: still eight rows, the right count.
    rows = [i for i in IDS if i != "sample-005"] + ["sample-002"]
    write_results(target, tmp_path, "gather-1", rows)

    code, out, _ = run_cli(
        capsys, "verify", "gather-1", "--root", str(tmp_path), "--server", target
    )

    assert code == EXIT_PROBLEMS and "id_set_mismatch" in out
    result, reason, detail = verdict(client, "gather-1")
    assert (result, reason) == (pb.VERIFICATION_RESULT_FAILED, "id_set_mismatch")
    assert detail.startswith(
        "missing 1, extra 0, duplicated 1, without id 0 of 8 input ids (8 results)"
    )
    assert "missing: sample-005" in detail and "duplicated: sample-002" in detail
    summary = json.loads(client.summary("gather-1"))
    assert summary["verify_failures"] == {"id_set_mismatch": 1}


def test_the_exact_ids_in_any_order_pass_and_ids_can_come_from_a_file(
    capsys: pytest.CaptureFixture[str], target: str, client: LedgerClient, tmp_path: Path
) -> None:
    (tmp_path / "ids.tsv").write_text("".join(f"{i}\t/data/{i}.png\n" for i in IDS))
    keyed_run(client, "gather-2", {"keyed_outputs": {"results": "id"}, "input_ids_file": "ids.tsv"})
    write_results(target, tmp_path, "gather-2", list(reversed(IDS)))

    code, _, err = run_cli(
        capsys, "verify", "gather-2", "--root", str(tmp_path), "--server", target
    )

    assert code == EXIT_OK, err
    result, reason, _ = verdict(client, "gather-2")
    assert (result, reason) == (pb.VERIFICATION_RESULT_PASSED, "") and json.loads(
        client.summary("gather-2")
    )["verified"] == 1


def test_npz_id_arrays_and_records_without_ids(tmp_path: Path) -> None:
    arrays = tmp_path / "emb.npz"
    np.savez(arrays, id=np.array([*IDS[:6], "stray"]), emb=np.zeros((7, 4)))
    lines = tmp_path / "r.jsonl"
    lines.write_text('{"id": "a"}\n{"value": 1}\n{"id": "b"}\n')

    npz = check_id_set(arrays, IDS)
    jsonl = check_id_set(lines, ["a", "b"])

    assert (npz.passed, npz.reason) == (False, "id_set_mismatch")
    assert npz.detail.startswith("missing 2, extra 1, duplicated 0, without id 0 of 8 input ids")
    assert jsonl.detail.startswith("missing 0, extra 0, duplicated 0, without id 1 of 2")
    unreadable = check_id_set(arrays, IDS, id_field="key")
    assert unreadable.reason == "id_set_unreadable" and "no array 'key'" in unreadable.detail


def test_compare_id_sets_counts_for_a_launcher_that_gathers_ranks() -> None:
    report = compare_id_sets(["a", "b", "c"], ["c", "a", "a", "d"])

    assert not report.ok
    assert report.counts() == {
        "expected": 3,
        "found": 4,
        "missing": 1,
        "extra": 1,
        "duplicated": 1,
        "without_id": 0,
    }
    assert compare_id_sets(["a", "b"], ["b", "a"]).ok


@pytest.mark.skipif(
    importlib.util.find_spec("pyarrow") is None,
    reason="pyarrow is not installed (the test extra brings it)",
)
def test_parquet_id_columns(tmp_path: Path) -> None:
    import pyarrow as pa  # type: ignore[import-not-found, unused-ignore]
    import pyarrow.parquet as pq  # type: ignore[import-not-found, unused-ignore]

    path = tmp_path / "r.parquet"
    pq.write_table(pa.table({"id": IDS[:-1]}), path)

    assert check_id_set(path, IDS).detail.startswith("missing 1, extra 0")
