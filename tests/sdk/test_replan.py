"""The re-plan rules (shard_client.replan): stored indexes kept, other params found, differences named."""

from __future__ import annotations

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.ids import PlanEntry
from shard_client.replan import StoredPlan, other_params, plan_differences, renumbered


def entry(shard_id: str, index: int = 0, **params: object) -> PlanEntry:
    return PlanEntry(shard_id, f"/in/{shard_id}", 1, "b" * 64, params=params, plan_index=index)


def stored(params_json: str = '{"seed":1}', index: int = 0) -> StoredPlan:
    plan = pb.ShardPlanView(
        input_ref="/in/a", input_bytes=1, input_blake3="b" * 64, params_json=params_json
    )
    return StoredPlan(index, plan)


def test_a_replan_keeps_stored_indexes_and_numbers_new_shards_after_the_highest() -> None:
    listing = [entry("new-1", 0), entry("b", 1), entry("new-2", 2), entry("a", 3)]
    done = renumbered(listing, {"a": 0, "b": 7})
    assert [(e.shard_id, e.plan_index) for e in done.entries] == [
        ("new-1", 8),
        ("b", 7),
        ("new-2", 9),
        ("a", 0),
    ]
    assert (done.moved, done.new, done.following) == (4, 2, 8)


def test_a_first_plan_is_numbered_as_listed() -> None:
    listing = [entry("a", 0), entry("b", 1)]
    done = renumbered(listing, {})
    assert done.entries == listing
    assert (done.moved, done.new) == (0, 2)


def test_new_shards_with_params_no_stored_shard_has_are_found_and_same_params_are_not() -> None:
    have = {"a": stored('{"seed": 1}')}  # format 1 rows kept Python's spacing
    assert other_params([entry("a", seed=1), entry("b", seed=1)], have) is None
    found = other_params([entry("b", seed=2), entry("c", seed=2), entry("d", seed=1)], have)
    assert found is not None
    assert (found.stored, found.have, found.other, found.sent) == (
        1,
        ['{"seed":1}'],
        2,
        ['{"seed":2}'],
    )


def test_a_replan_names_each_field_that_differs_from_the_stored_plan() -> None:
    same = entry("a", seed=1)
    assert plan_differences(same, {}, stored()) == {}
    moved = PlanEntry("a", "/in/moved", 1, "b" * 64, params={"seed": 1})
    assert plan_differences(moved, {"team": "x"}, stored()) == {
        "input": {"stored": "/in/a", "sent": "/in/moved"},
        "labels": {"stored": {}, "sent": {"team": "x"}},
    }
    assert plan_differences(moved, {}, StoredPlan(0, None)) == {}
