"""shard_client.ray without a Ray cluster: batch plans, the map_batches class, ray never imported.

`ShardBatches` is called here as Ray Data calls it (a numpy batch of plan-line rows),
against a real ledger; tests/contract/test_ray_night.py runs it inside Ray.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shard_client import LedgerClient
from shard_client.canonical import canonical_json
from shard_client.ray import ShardBatches, batch_manifest, plan_line_of, shard_task
from shard_client.scheduler import SchedulerIdentity, ray_identity
from shardledger_cli.commands.shards import scheduler_label
from tests.builders import run_cli

np = pytest.importorskip("numpy")

pytestmark = pytest.mark.usefixtures("spool_in_tmp")

ITEMS = [{"id": f"i{n}", "text": "word " * n} for n in range(5)]


def _plan(capsys: pytest.CaptureFixture[str], tmp_path: Path, target: str) -> list[str]:
    manifest = tmp_path / "batches.jsonl"
    manifest.write_text("".join(json.dumps(m) + "\n" for m in batch_manifest(ITEMS, batch_size=2)))
    assert run_cli(capsys, "plan", "r", "--manifest", str(manifest), "--server", target)[0] == 0
    code, out, _ = run_cli(capsys, "plan", "r", "--manifest", str(manifest), "--dry-run")
    assert code == 0
    return out.splitlines()


def _as_ray_data(lines: list[str]) -> dict[str, Any]:
    """Returns plan lines as Ray Data's numpy batch format hands them over (object columns)."""
    rows = [json.loads(line) for line in lines]
    out = {}
    for name in rows[0]:
        column = np.empty(len(rows), dtype=object)
        column[:] = [r[name] for r in rows]
        out[name] = column
    return out


def _length(batch: dict[str, Any]) -> dict[str, Any]:
    return {"id": batch["id"], "n": np.array([len(str(t).split()) for t in batch["text"]])}


@pytest.fixture
def views(client: LedgerClient) -> Iterator[Any]:
    yield lambda: {v.shard_id: json.loads(v.view_json) for v in client.shards("r")}


def test_batch_manifest_groups_rows_in_order_with_their_ids_and_digest() -> None:
    lines = list(batch_manifest(ITEMS, batch_size=2))
    assert [line["params"]["input_ids"] for line in lines] == [["i0", "i1"], ["i2", "i3"], ["i4"]]
    first = lines[0]
    assert first["rows"] == ITEMS[:2]
    assert first["params"]["keyed_outputs"] == {"results": "id"}
    assert first["expected_outputs"] == ["results"]
    assert first["input"] == "rows:i0..i1"
    text = canonical_json({"rows": ITEMS[:2]}).encode()
    assert first["input_bytes"] == len(text)
    # The same rows make the same line (and so the same shard id); other rows another.
    again, shifted = (
        next(batch_manifest(ITEMS, batch_size=2)),
        next(batch_manifest(ITEMS[1:], batch_size=2)),
    )
    assert again == first
    assert shifted["input_blake3"] != first["input_blake3"]


def test_batch_manifest_refuses_a_row_without_an_id_and_a_batch_size_below_one() -> None:
    with pytest.raises(ValueError, match="no string or integer 'id'"):
        list(batch_manifest([{"text": "x"}], batch_size=1))
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        list(batch_manifest(ITEMS, batch_size=0))


def test_plan_line_of_takes_text_dicts_and_numpy_rows_and_refuses_no_shard_id() -> None:
    assert plan_line_of('{"shard_id": "s", "input": "x"}') == {"shard_id": "s", "input": "x"}
    assert plan_line_of({"shard_id": "s", "ids": np.array(["a", "b"])}) == {
        "shard_id": "s",
        "ids": ["a", "b"],
    }
    with pytest.raises(ValueError, match="string shard_id"):
        plan_line_of('{"input": "x"}')


def test_each_plan_line_of_a_batch_is_one_shard_committed_as_keyed_results(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, target: str, views: Any
) -> None:
    lines = _plan(capsys, tmp_path, target)
    batches = ShardBatches(_length, run_id="r", server=target, output_dir=str(tmp_path / "out"))
    result = batches(_as_ray_data(lines))
    assert list(result["id"]) == [f"i{n}" for n in range(5)]
    assert list(result["n"]) == [0, 1, 2, 3, 4]
    assert batches.ledger.flush(10)
    assert (
        run_cli(capsys, "verify", "r", "--root", str(tmp_path / "out"), "--server", target)[0] == 0
    )
    assert {v["state"] for v in views().values()} == {"verified"}
    first = json.loads(lines[0])
    committed = (tmp_path / "out" / f"{first['shard_id']}.jsonl").read_text().splitlines()
    assert [json.loads(t) for t in committed] == [{"id": "i0", "n": 0}, {"id": "i1", "n": 1}]


def test_results_missing_an_id_fail_the_shard_as_data_and_the_others_go_on(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, target: str, views: Any
) -> None:
    lines = _plan(capsys, tmp_path, target)

    def drops_i3(batch: dict[str, Any]) -> dict[str, Any]:
        out = _length(batch)
        keep = np.array([i != "i3" for i in out["id"]])
        return {k: v[keep] for k, v in out.items()}

    batches = ShardBatches(drops_i3, run_id="r", server=target, output_dir=str(tmp_path / "out"))
    result = batches(_as_ray_data(lines))
    assert list(result["id"]) == ["i0", "i1", "i4"]  # the failed batch's rows are left out
    assert batches.ledger.flush(10)
    bad = json.loads(lines[1])["shard_id"]
    assert {s: (v["state"], v["detail"]) for s, v in views().items()}[bad] == ("failed", "data")
    assert not (tmp_path / "out" / f"{bad}.jsonl").exists()
    strict = ShardBatches(
        drops_i3, run_id="r", server=target, output_dir=str(tmp_path / "out"), on_failure="raise"
    )
    with pytest.raises(Exception, match=r"1 missing \(i3\)"):
        strict(_as_ray_data(lines[1:2]))


def test_shard_batches_refuses_no_output_dir_and_an_unknown_on_failure(target: str) -> None:
    with pytest.raises(ValueError, match="needs output_dir="):
        ShardBatches(_length, run_id="r", server=target)
    with pytest.raises(ValueError, match="on_failure"):
        ShardBatches(_length, run_id="r", server=target, output_dir="o", on_failure="retry")


def test_shard_task_runs_the_function_inside_the_lines_shard_with_its_arguments(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, target: str
) -> None:
    data = tmp_path / "in.txt"
    data.write_text("a b c\n")
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"shard_id": "t1", "input": str(data)}) + "\n")
    assert run_cli(capsys, "plan", "r", "--manifest", str(manifest), "--server", target)[0] == 0
    line = run_cli(capsys, "plan", "r", "--manifest", str(manifest), "--dry-run")[1].strip()

    @shard_task("r", server=target, fingerprint=False)
    def work(shard: Any, plan_line: dict[str, Any], out: Path) -> str:
        shard.commit(data, name="copy")
        return f"{plan_line['shard_id']} -> {out}"

    assert work(line, tmp_path) == f"t1 -> {tmp_path}"
    # Outside a Ray worker the attempt has no scheduler identity.
    code, out, _ = run_cli(capsys, "shards", "r", "--attempts", "--json", "--server", target)
    assert code == 0
    assert [json.loads(t)["scheduler"] for t in out.splitlines()] == [{}]


def test_importing_the_sdk_and_its_ray_module_never_imports_ray() -> None:
    code = (
        "import sys, shard_client, shard_client.ray, shard_client.scheduler as s;"
        " assert s.detect({}) is None and s.ray_identity() is None;"
        " assert 'ray' not in sys.modules, 'ray was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_ray_identity_is_read_from_the_runtime_context_of_a_task_only() -> None:
    class Context:
        namespace = "ns"

        def __init__(self, mode: int, task: str | None) -> None:
            self.worker = type("W", (), {"mode": mode, "core_worker": CoreWorker()})()
            self.task = task

        def get_job_id(self) -> str:
            return "02000000"

        def get_task_id(self) -> str | None:
            return self.task

        def get_node_id(self) -> str:
            return "ab" * 28

        def get_actor_id(self) -> str | None:
            return None

    class CoreWorker:
        def get_current_task_attempt_number(self) -> int:
            return 2

    def fake_ray(mode: int, task: str | None) -> Any:
        return type(
            "Ray",
            (),
            {
                "WORKER_MODE": 1,
                "is_initialized": staticmethod(lambda: True),
                "get_runtime_context": staticmethod(lambda: Context(mode, task)),
            },
        )

    found = ray_identity(fake_ray(1, "t" * 48))
    assert found == SchedulerIdentity(
        "ray", job_id="02000000", node="ab" * 28, namespace="ns", task_id="t" * 48, task_attempt="2"
    )
    assert found is not None
    assert scheduler_label(found.fields()) == f"ray:02000000/{'t' * 48}#2@{'ab' * 6}"
    assert ray_identity(fake_ray(0, "t" * 48)) is None  # a driver
    assert ray_identity(fake_ray(1, None)) is None
