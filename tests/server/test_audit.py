"""Audit RPCs and `shardledger audit`: signed heads, proofs, checkpoints, replay of the past."""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest

from ledger_server.audit_rpc import RunTreeCache
from ledger_server.codec import decode_event
from ledger_server.merkle import MerkleTree, verify_consistency
from ledger_server.server import RunningServer
from ledger_server.service import LedgerService
from ledger_server.servicer import LedgerServicer
from ledger_server.signing import SigningKey, TreeHead, verify_tree_head
from ledger_server.store.sqlite import SqliteStore
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.api.shardledger.v1 import ledger_pb2_grpc as pb_grpc
from shard_client.client import LedgerClient
from shard_client.errors import InvalidArgument, LedgerRejected, NotFound
from shardledger_cli.audit_replay import LIST_QUERIES
from shardledger_cli.cli import main
from tests.builders import DIGEST_A, DIGEST_B, committed, event, planned, run_cli, started

RUN = "run-1"
BASE_US = 1_700_000_000_000_000


pytestmark = pytest.mark.usefixtures("quiet_logs")


cli = run_cli


def tree_head(client: LedgerClient, size: int = 0, run_id: str = RUN) -> TreeHead:
    request = pb.GetTreeHeadRequest(run_id=run_id, tree_size=size)
    response = client.call(lambda t: client.stub.GetTreeHead(request, timeout=t))
    return TreeHead.from_json(json.loads(response.tree_head_json))


def public_key(client: LedgerClient) -> str:
    response = client.call(lambda t: client.stub.GetPublicKey(pb.GetPublicKeyRequest(), timeout=t))
    return str(response.public_key_pem)


def stored_rows(db_path: Path, run_id: str = RUN) -> list[bytes]:
    with sqlite3.connect(db_path) as conn:
        return [
            bytes(r[0])
            for r in conn.execute(
                "SELECT row FROM events JOIN runs USING (run_pk) WHERE run_id = ? ORDER BY seq",
                (run_id,),
            )
        ]


def some_run(client: LedgerClient, shards: int = 5) -> None:
    client.append([planned(shard_id=f"s{i}", index=i) for i in range(shards)])
    client.append([started(shard_id="s0"), committed(shard_id="s0")])


# --- the RPCs ---------------------------------------------------------------


def test_tree_head_is_signed_and_commits_to_every_stored_row(
    client: LedgerClient, db_path: Path
) -> None:
    some_run(client)
    head = tree_head(client)
    tree = MerkleTree()
    for row in stored_rows(db_path):
        tree.append(row)
    assert verify_tree_head(head, public_key(client))
    assert (head.namespace, head.run_id, head.tree_size) == ("default", RUN, 7)
    assert head.root_hex == tree.root().hex()
    assert tree_head(client, 3).root_hex == tree.root(3).hex()


def test_tree_head_beyond_the_current_size_is_refused_naming_the_field(
    client: LedgerClient,
) -> None:
    some_run(client)
    with pytest.raises(InvalidArgument) as info:
        tree_head(client, 8)
    assert info.value.field == "tree_size"
    assert info.value.reason == "INVALID_FIELD"


def test_inclusion_proof_for_an_unknown_event_is_not_found(client: LedgerClient) -> None:
    some_run(client)
    request = pb.GetInclusionProofRequest(run_id=RUN, event_id="no-such-event")
    with pytest.raises(NotFound) as info:
        client.call(lambda t: client.stub.GetInclusionProof(request, timeout=t))
    assert info.value.reason == "EVENT_NOT_FOUND"


def test_heads_taken_while_appends_race_all_extend_one_another(client: LedgerClient) -> None:
    some_run(client)
    pem = public_key(client)
    heads: list[TreeHead] = []
    errors: list[BaseException] = []

    def appender() -> None:
        for i in range(20):
            client.append([planned(shard_id=f"x{i}", index=100 + i)])

    def reader() -> None:
        try:
            for _ in range(20):
                heads.append(tree_head(client))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=appender)] + [
        threading.Thread(target=reader) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    final = tree_head(client)
    assert final.tree_size == 27
    for head in heads:
        assert verify_tree_head(head, pem)
        request = pb.GetConsistencyProofRequest(run_id=RUN, old_size=head.tree_size)
        response = client.call(lambda t, r=request: client.stub.GetConsistencyProof(r, timeout=t))  # type: ignore[misc]
        assert verify_consistency(
            old_size=head.tree_size,
            new_size=final.tree_size,
            old_root=bytes.fromhex(head.root_hex),
            new_root=bytes.fromhex(final.root_hex),
            proof=list(response.proof),
        )


def test_tree_cache_keeps_only_the_most_recently_used_runs(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "l.db")
    ledger = LedgerService(store)
    try:
        for run_id in ("a", "b", "c"):
            ledger.append([decode_event(planned(run_id=run_id))])
        cache = RunTreeCache(max_runs=2)
        runs = {r: ledger.run("default", r) for r in ("a", "b", "c")}
        for run_id in ("a", "b", "a", "c"):
            with cache.locked(store.read(), runs[run_id]) as entry:
                assert entry.tree.size == 1
        assert len(cache) == 2
        assert runs["a"].run_pk in cache and runs["b"].run_pk not in cache
    finally:
        ledger.close()
        store.close()


def test_server_refuses_to_sign_rows_that_break_the_chain(
    client: LedgerClient, db_path: Path
) -> None:
    some_run(client)
    with sqlite3.connect(db_path) as conn:
        conn.execute("DROP TRIGGER events_no_update")
        conn.execute("UPDATE events SET row = replace(row, 's3.bin', 's9.bin') WHERE seq = 4")
    with pytest.raises(LedgerRejected) as info:
        tree_head(client)
    assert info.value.code == grpc.StatusCode.DATA_LOSS
    assert info.value.reason == "LEDGER_CORRUPT"


def test_server_refuses_to_sign_once_its_run_went_back_in_time(
    client: LedgerClient, db_path: Path
) -> None:
    some_run(client)
    assert tree_head(client).tree_size == 7
    with sqlite3.connect(db_path) as conn:  # a tail cut with the run head rewound to match
        (head,) = conn.execute("SELECT hash FROM events WHERE seq = 5").fetchone()
        conn.execute("DROP TRIGGER events_no_delete")
        conn.execute("DELETE FROM events WHERE seq > 5")
        conn.execute("UPDATE runs SET event_count = 5, head_hash = ?", (head,))
    with pytest.raises(LedgerRejected) as info:
        tree_head(client)
    assert info.value.code == grpc.StatusCode.DATA_LOSS
    assert "truncated or restored" in str(info.value)


# --- the CLI ----------------------------------------------------------------


def test_inclusion_proof_checks_with_the_public_key_alone(
    server: RunningServer, client: LedgerClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    some_run(client)
    target = client.target
    event_id = list(client.list_events(RUN))[5].event_id
    proof, key = tmp_path / "proof.json", tmp_path / "key.pem"
    assert (
        cli(
            capsys, "audit", "prove", RUN, "--server", target, "--event", event_id, "-o", str(proof)
        )[0]
        == 0
    )
    assert cli(capsys, "audit", "public-key", "--server", target, "-o", str(key))[0] == 0
    server.stop(0.1)  # from here on no server exists

    code, out, _ = cli(capsys, "audit", "check-proof", str(proof), "--public-key", str(key))
    assert code == 0 and event_id in out and "leaf 5" in out

    bundle = json.loads(proof.read_text())
    leaf = bytes.fromhex(bundle["leaf_hex"]).replace(b"node-1", b"node-9")
    forged = tmp_path / "forged.json"
    forged.write_text(json.dumps({**bundle, "leaf_hex": leaf.hex()}))
    code, out, _ = cli(capsys, "audit", "check-proof", str(forged), "--public-key", str(key))
    assert code == 1 and "PROOF FAILS" in out

    other = tmp_path / "other.pem"
    other.write_text(SigningKey.generate().public_key_pem())
    assert cli(capsys, "audit", "check-proof", str(proof), "--public-key", str(other))[0] == 1


def test_public_key_with_json_prints_an_object_with_the_key_id(
    client: LedgerClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = cli(capsys, "audit", "public-key", "--server", client.target, "--json")
    doc = json.loads(out)
    served = client.call(lambda t: client.stub.GetPublicKey(pb.GetPublicKeyRequest(), timeout=t))
    assert code == 0 and doc == {"key_id": served.key_id, "public_key_pem": served.public_key_pem}
    written = tmp_path / "key.json"
    assert cli(
        capsys, "audit", "public-key", "--server", client.target, "--json", "-o", str(written)
    ) == (0, "", "")
    assert json.loads(written.read_text()) == doc


def test_verify_against_a_saved_head_passes_while_the_log_only_grows(
    client: LedgerClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    some_run(client)
    head = tmp_path / "head.json"
    assert (
        cli(capsys, "audit", "checkpoint", RUN, "--server", client.target, "-o", str(head))[0] == 0
    )
    saved = json.loads(head.read_text())
    assert saved["tree_head"]["tree_size"] == 7 and "BEGIN PUBLIC KEY" in saved["public_key_pem"]
    client.append([started(shard_id="s1"), committed(shard_id="s1")])

    code, out, _ = cli(
        capsys, "audit", "verify", RUN, "--server", client.target, "--against", str(head), "--json"
    )
    report = json.loads(out)["runs"][0]
    assert code == 0 and report["ok"] and report["events"] == 9
    assert {c["check"]: c["ok"] for c in report["checks"]} == {
        "chain": True,
        "signed_head": True,
        "checkpoint": True,
        "consistency_proof": True,
    }


def test_verify_with_a_pinned_key_the_server_does_not_hold_fails(
    client: LedgerClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    some_run(client)
    pinned = tmp_path / "pinned.pem"
    pinned.write_text(SigningKey.generate().public_key_pem())
    code, out, _ = cli(
        capsys,
        "audit",
        "verify",
        RUN,
        "--server",
        client.target,
        "--public-key",
        str(pinned),
        "--json",
    )
    failed = {c["check"] for c in json.loads(out)["runs"][0]["checks"] if not c["ok"]}
    assert code == 1 and failed == {"public_key", "signed_head"}


# --- replay -----------------------------------------------------------------


class ScriptedRun:
    """A ledger on a fake clock that records its live projections at chosen moments."""

    def __init__(self, db: Path) -> None:
        self.now = BASE_US
        self.store = SqliteStore(db)
        self.ledger = LedgerService(self.store, clock=lambda: self.now)
        self.moments: list[tuple[int, int, dict[str, Any]]] = []

    def at(self, seconds: int, *events: pb.ShardEvent) -> None:
        self.now = BASE_US + seconds * 1_000_000
        if events:
            self.ledger.append([decode_event(e) for e in events])

    def record(self) -> None:
        """Saves (last sequence, clock, what status/shards/resume showed) for now."""
        t, ledger = self.now, self.ledger
        live: dict[str, Any] = {"summary": ledger.summary("default", RUN, now=t)}
        for query in LIST_QUERIES:
            live[query] = ledger.shards("default", RUN, state=query, now=t)[0]
        live["resume"] = [
            {
                "shard_id": i.shard_id,
                "plan_index": i.plan_index,
                "plan_line": i.plan_line,
                "reason": i.reason,
            }
            for i in ledger.resume("default", RUN, now=t)
        ]
        self.moments.append((ledger.last_sequence, t, live))

    def close(self) -> None:
        self.ledger.close()
        self.store.close()


def _verified(
    shard: str, result: pb.VerificationResult, reason: str = "", digest: str = DIGEST_A
) -> pb.ShardEvent:
    return event(
        RUN,
        shard,
        verified=pb.ArtifactVerified(
            name="out", path="/out/x", blake3_hex=digest, result=result, reason=reason
        ),
    )


def _script(run: ScriptedRun) -> None:
    passed, failed = pb.VERIFICATION_RESULT_PASSED, pb.VERIFICATION_RESULT_FAILED
    run.at(0, *[planned(shard_id=f"s{i}", index=i) for i in range(6)])
    run.record()
    run.at(5, planned(run_id="other", shard_id="o1"))  # another run's rows between ours
    run.at(
        10,
        started(shard_id="s0", attempt_id="a"),
        started(shard_id="s1", attempt_id="b", timeout_s=30),
        started(shard_id="s2", attempt_id="c", timeout_s=30),
    )
    run.record()
    hb = event(RUN, "s0", "a", heartbeat=pb.Heartbeat(step=3, progress=0.5))
    oom = event(RUN, "s2", "c", failed=pb.AttemptFailed(tag=pb.FAILURE_TAG_OOM))
    run.at(20, hb, committed(shard_id="s0", attempt_id="a"), oom)
    run.record()
    run.at(
        30,
        _verified("s0", passed),
        started(shard_id="s2", attempt_id="c2", timeout_s=30),
        committed(shard_id="s1", attempt_id="b"),
    )
    run.record()
    run.at(
        40, _verified("s1", failed, "digest"), started(shard_id="s3", attempt_id="d", timeout_s=5)
    )
    run.record()
    run.at(100)  # no events: s2 and s3 went silent past their timeouts
    run.record()
    run.at(
        110,
        started(shard_id="s3", attempt_id="d2"),
        committed(shard_id="s3", attempt_id="d", digest=DIGEST_B),
    )
    run.at(
        120,
        started(shard_id="s4", attempt_id="e"),
        committed(shard_id="s4", attempt_id="e"),
        committed(shard_id="s4", attempt_id="e"),
    )
    run.record()


def _iso(us: int) -> str:
    return datetime.fromtimestamp(us / 1e6, tz=UTC).isoformat()


@contextmanager
def serving(ledger: LedgerService) -> Iterator[str]:
    """Serves a ledger over real gRPC on a loopback ephemeral port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = LedgerServicer(ledger, signing_key=SigningKey.generate())
    pb_grpc.add_LedgerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[ScriptedRun]:
    run = ScriptedRun(tmp_path / "replay.db")
    _script(run)
    yield run
    run.close()


def _replayed(capsys: pytest.CaptureFixture[str], source: list[str], until: str) -> dict[str, Any]:
    code, out, err = cli(capsys, "audit", "replay", RUN, *source, "--until", until, "--json")
    assert code == 0, err
    state: dict[str, Any] = json.loads(out)
    return state


def _assert_same(state: dict[str, Any], live: dict[str, Any]) -> None:
    assert state["summary"] == live["summary"]
    for key in (*LIST_QUERIES, "resume"):
        assert state[key] == live[key], key


@pytest.mark.parametrize("source", ["grpc", "db"])
def test_replay_at_a_past_sequence_equals_the_live_projections_then(
    scripted: ScriptedRun, tmp_path: Path, capsys: pytest.CaptureFixture[str], source: str
) -> None:
    with serving(scripted.ledger) as target:
        args = ["--server", target] if source == "grpc" else ["--db", str(tmp_path / "replay.db")]
        compared = 0
        for sequence, t, live in scripted.moments:
            state = _replayed(capsys, args, str(sequence))
            if state["summary"]["as_of_us"] != t:
                continue  # a moment with no new events: only a time point reaches its clock
            _assert_same(state, live)
            compared += 1
    assert compared == len(scripted.moments) - 1


def test_replay_at_a_past_time_equals_the_live_projections_then(
    scripted: ScriptedRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stale_seen = False
    for _sequence, t, live in scripted.moments:
        state = _replayed(capsys, ["--db", str(tmp_path / "replay.db")], _iso(t))
        _assert_same(state, live)
        stale_seen = stale_seen or live["summary"]["stale"] > 0
    assert stale_seen and len(scripted.moments) == 7


def test_diff_names_each_shard_whose_state_changed_between_two_points(
    scripted: ScriptedRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    start, end = _iso(BASE_US + 20_000_000), _iso(BASE_US + 100_000_000)
    db = str(tmp_path / "replay.db")
    code, out, _ = cli(
        capsys, "audit", "diff", RUN, "--db", db, "--from", start, "--to", end, "--json"
    )
    changed = {
        c["shard_id"]: (c["from"]["state"], c["to"]["state"]) for c in json.loads(out)["changed"]
    }
    assert code == 0
    assert changed == {
        "s0": ("unverified", "verified"),
        "s1": ("running", "verify_failed"),
        "s2": ("failed", "stale"),
        "s3": ("missing", "stale"),
    }


def test_replay_until_an_unparseable_point_is_a_usage_error(
    scripted: ScriptedRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["audit", "replay", RUN, "--db", str(tmp_path / "replay.db"), "--until", "yesterday"])
    assert info.value.code == 2
