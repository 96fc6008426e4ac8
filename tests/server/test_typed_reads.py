"""Run summaries, tree heads and proof bundles come as proto messages (the JSON fields stay one version)."""

from __future__ import annotations

import json

import pytest
from google.protobuf.json_format import MessageToDict

from ledger_server import codec
from ledger_server.merkle import leaf_hash, verify_inclusion
from ledger_server.signing import InclusionProofBundle, TreeHead, verify_tree_head
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from tests.builders import committed, planned, started

pytestmark = pytest.mark.usefixtures("quiet_logs")


def _head(msg: pb.TreeHead) -> TreeHead:
    return TreeHead(
        msg.namespace,
        msg.run_id,
        msg.tree_size,
        msg.root_hex,
        msg.timestamp_ms,
        msg.key_id,
        msg.signature_hex,
    )


def test_a_typed_tree_head_is_the_signed_head_and_verifies_from_its_fields(
    client: LedgerClient,
) -> None:
    client.append([planned(), started(), committed()])
    response = client.call(
        lambda t: client.stub.GetTreeHead(pb.GetTreeHeadRequest(run_id="run-1"), timeout=t)
    )
    typed = response.tree_head
    assert typed.tree_size == 3 and typed.run_id == "run-1" and typed.namespace == "default"
    assert MessageToDict(typed, preserving_proto_field_name=True) | {
        "tree_size": typed.tree_size,
        "timestamp_ms": typed.timestamp_ms,
    } == json.loads(response.tree_head_json)
    key = client.call(lambda t: client.stub.GetPublicKey(pb.GetPublicKeyRequest(), timeout=t))
    assert verify_tree_head(_head(typed), key.public_key_pem)
    forged = pb.TreeHead()
    forged.CopyFrom(typed)
    forged.tree_size = 2
    assert not verify_tree_head(_head(forged), key.public_key_pem)


def test_a_typed_inclusion_bundle_proves_its_row(client: LedgerClient) -> None:
    client.append([planned(), started(), committed()])
    event_id = list(client.list_events("run-1"))[1].event_id
    request = pb.GetInclusionProofRequest(run_id="run-1", event_id=event_id)
    response = client.call(lambda t: client.stub.GetInclusionProof(request, timeout=t))
    bundle = response.bundle
    assert InclusionProofBundle.from_json(json.loads(response.proof_bundle_json)).to_json() == {
        "head": _head(bundle.head).to_json(),
        "leaf_index": bundle.leaf_index,
        "leaf_hex": bundle.leaf_hex,
        "proof_hex": list(bundle.proof_hex),
    }
    assert bundle.leaf_index == 1
    assert verify_inclusion(
        leaf_hash=leaf_hash(bytes.fromhex(bundle.leaf_hex)),
        index=bundle.leaf_index,
        size=bundle.head.tree_size,
        proof=[bytes.fromhex(h) for h in bundle.proof_hex],
        root=bytes.fromhex(bundle.head.root_hex),
    )


def test_a_consistency_proof_carries_the_typed_newer_head(client: LedgerClient) -> None:
    client.append([planned(), started(), committed()])
    request = pb.GetConsistencyProofRequest(run_id="run-1", old_size=1)
    response = client.call(lambda t: client.stub.GetConsistencyProof(request, timeout=t))
    assert response.tree_head.tree_size == 3
    assert json.loads(response.tree_head_json)["signature_hex"] == response.tree_head.signature_hex


def test_the_typed_run_summary_says_what_the_json_says_under_the_same_keys(
    client: LedgerClient,
) -> None:
    client.append([planned(shard_id=f"s{i}", index=i) for i in range(3)])
    client.append([started(shard_id="s0"), committed(shard_id="s0")])
    request = pb.GetRunSummaryRequest(run_id="run-1")
    response = client.call(lambda t: client.stub.GetRunSummary(request, timeout=t))
    legacy = json.loads(response.summary_json)
    typed = MessageToDict(
        response.summary,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
    )
    assert set(typed) == set(legacy)
    assert set(typed["first_pass"]) == set(legacy["first_pass"])
    summary = response.summary
    assert (summary.submitted, summary.missing, summary.unverified) == (3, 2, 1)
    assert summary.completion_rate == legacy["completion_rate"] == 0.0
    assert summary.event_count == legacy["event_count"] == 5
    assert summary.as_of_us == legacy["as_of_us"]
    assert summary.head_hash == legacy["head_hash"]
    assert dict(summary.duplicates) == legacy["duplicates"]
    assert summary.first_pass.closed is False and summary.first_pass.closed_at_sequence == 0


def test_a_summary_key_without_a_field_yet_is_left_out_not_refused() -> None:
    typed = codec.run_summary_pb({"submitted": 2, "a_key_added_later": {"x": 1}})
    assert typed.submitted == 2


def test_a_typed_shard_view_says_what_the_json_says_under_the_same_keys(
    client: LedgerClient,
) -> None:
    client.append([planned(shard_id="s0"), planned(shard_id="s1", index=1)])
    client.append([started(shard_id="s0"), committed(shard_id="s0")])
    views = {v.shard_id: v for v in client.shards("run-1")}
    done, fresh = views["s0"], views["s1"]
    legacy = json.loads(done.view_json)
    typed = MessageToDict(
        done.view, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    # A repeated field has no presence: a one-process attempt's view has no "ranks" key.
    assert typed.pop("ranks") == [] and "ranks" not in legacy
    assert set(typed) | {"numeric", "deadline_us"} == set(legacy)  # unset: null in the JSON
    assert done.view.state == legacy["state"] == "unverified"
    assert done.view.pid == legacy["pid"] == 123
    assert done.view.last_step == legacy["last_step"]
    assert dict(done.view.artifacts)["out"].blake3 == legacy["artifacts"]["out"]["blake3"]
    assert done.view.fingerprint == legacy["fingerprint"]
    assert not done.view.HasField("deadline_us") and legacy["deadline_us"] is None
    # Never started: no attempt, so no pid and no last heartbeat.
    assert not fresh.view.HasField("pid") and json.loads(fresh.view_json)["pid"] is None
    assert fresh.view.state == "missing" and fresh.view.plan_index == 1
