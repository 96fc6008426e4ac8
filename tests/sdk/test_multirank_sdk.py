"""The SDK side of multi-rank shards without torchrun: rank detection, the launch's attempt id,
per-rank outputs, Gloo errors, and the keyed merge of per-rank results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shard_client import Ledger, RankInfo, failure_tag, keyed
from shard_client.client import LedgerClient
from shard_client.failures import DataError, IncompleteShard
from shard_client.ranks import attempt_id_for, detect, own_outputs
from shard_client.vocabulary import FailureTag
from tests.builders import planned

TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "TORCHELASTIC_RUN_ID": "launch-7",
    "TORCHELASTIC_RESTART_COUNT": "2",
}


def test_torchrun_environment_names_the_rank_and_the_launch() -> None:
    assert detect(TORCHRUN) == RankInfo(1, 2, 1, "launch-7", 2)
    assert detect({"WORLD_SIZE": "1", "RANK": "0"}) is None
    assert detect({}) is None
    with pytest.raises(ValueError, match=r"\$RANK='x' is not an integer"):
        detect({**TORCHRUN, "RANK": "x"})


def test_ranks_of_one_launch_derive_one_attempt_id_and_a_restart_another() -> None:
    rank0 = RankInfo(0, 2, 0, "launch-7", 0)
    rank1 = RankInfo(1, 2, 1, "launch-7", 0)
    restarted = RankInfo(0, 2, 0, "launch-7", 1)
    first = attempt_id_for("run", "shard", rank0)
    assert first == attempt_id_for("run", "shard", rank1)
    assert first != attempt_id_for("run", "shard", restarted)
    assert first != attempt_id_for("run", "other-shard", rank0)
    with pytest.raises(ValueError, match="launch id"):
        attempt_id_for("run", "shard", RankInfo(0, 2))


def test_each_rank_owns_its_rank_outputs_and_rank0_the_shards() -> None:
    names = ("weights.rank{rank}", "model")
    assert own_outputs(names, RankInfo(0, 2, launch_id="x")) == ("weights.rank0", "model")
    assert own_outputs(names, RankInfo(1, 2, launch_id="x")) == ("weights.rank1",)


def test_gloo_and_torch_distributed_errors_are_tagged_nccl() -> None:
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed")
    assert failure_tag(gloo) == FailureTag.NCCL

    class DistBackendError(RuntimeError):
        pass

    assert failure_tag(DistBackendError("boom")) == FailureTag.NCCL
    assert failure_tag(RuntimeError("boom")) == FailureTag.UNKNOWN


def test_a_rank_missing_its_own_output_records_incomplete_for_the_attempt(
    client: LedgerClient, ledger: Ledger, tmp_path: Path
) -> None:
    client.append([planned("run-1", "shard-0", outputs=("weights.rank{rank}",))])
    info = RankInfo(1, 2, 1, "launch-1")
    with (
        pytest.raises(IncompleteShard, match=r"weights\.rank1"),
        ledger.shard(
            "run-1",
            "shard-0",
            ranks=info,
            expected_outputs=["weights.rank{rank}"],
            fingerprint=False,
            sigterm_grace=None,
        ) as shard,
    ):
        assert shard.attempt_id == attempt_id_for("run-1", "shard-0", info)
    (view,) = client.shards("run-1")
    seen = json.loads(view.view_json)
    assert (seen["state"], seen["detail"]) == ("failed", "incomplete")
    assert seen["ranks"][1]["failed_tag"] == "incomplete"
    assert seen["ranks"][0]["state"] == "not_started"


def test_ranks_false_keeps_one_process_per_attempt_under_torchrun(
    client: LedgerClient, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.append([planned("run-1", "shard-0")])
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    shard = ledger.shard("run-1", "shard-0", ranks=False, fingerprint=False)
    assert shard.rank_info is None
    assert ledger.shard("run-1", "shard-0", fingerprint=False).rank_info == RankInfo(
        1, 2, 1, "launch-7", 2
    )


def _write(path: Path, *ids: str) -> Path:
    path.write_text("".join(json.dumps({"id": i, "v": i.upper()}) + "\n" for i in ids))
    return path


def test_merge_orders_the_ranks_results_by_input_id_not_by_completion(tmp_path: Path) -> None:
    parts = [_write(tmp_path / "r1", "c", "a"), _write(tmp_path / "r0", "d", "b")]
    lines = keyed.merge(parts, input_ids=["a", "b", "c", "d"])
    assert [json.loads(line)["id"] for line in lines] == ["a", "b", "c", "d"]


def test_merge_refuses_missing_extra_and_repeated_ids_and_writes_nothing(tmp_path: Path) -> None:
    parts = [_write(tmp_path / "r0", "a", "x"), _write(tmp_path / "r1", "a")]
    out = tmp_path / "results.jsonl"
    with pytest.raises(keyed.KeyedMismatch) as info:
        keyed.assemble(parts, out, input_ids=["a", "b"])
    assert (info.value.report.missing, info.value.report.extra) == (("b",), ("x",))
    assert info.value.report.repeated == ("a",)
    assert "1 missing (b); 1 extra (x); 1 repeated (a)" in str(info.value)
    assert failure_tag(info.value) == FailureTag.DATA
    assert not out.exists()


def test_assemble_writes_the_merged_file_atomically(tmp_path: Path) -> None:
    parts = [_write(tmp_path / "r0", "b"), _write(tmp_path / "r1", "a")]
    info = keyed.assemble(parts, tmp_path / "out.jsonl", input_ids=["a", "b"])
    assert info.size_bytes == (tmp_path / "out.jsonl").stat().st_size
    bad = tmp_path / "bad"
    bad.write_text('{"key": 1}\n')
    with pytest.raises(DataError, match="bad:1: no string 'id' field"):
        keyed.read_keyed(bad)
