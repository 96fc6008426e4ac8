"""A run of maximal events (over 16 MiB in all) reads back whole through every RPC and CLI command."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ledger_server import servicer
from ledger_server.config import ServerConfig
from ledger_server.server import RunningServer, create_server
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from tests import pg
from tests.builders import planned, run_cli, started

# The PostgreSQL fixtures, found by pytest under these names.
pg_cluster = pg.pg_cluster

RUN = "big"
PLANS = 300
# Each event is near the 64 KiB event limit; together they are over 16 MiB, one message's limit.
PAD = 60_000
IDS = [f"s{i:03d}" for i in range(PLANS)]
MESSAGE_LIMIT = 16 * 1024 * 1024


def big_plan(index: int) -> pb.ShardEvent:
    """Returns a planned event whose plan line is about 60 KB."""
    msg = planned(RUN, IDS[index], index=index)
    msg.planned.plan_line = json.dumps({"index": index, "pad": "x" * PAD})
    return msg


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def big_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LedgerClient]:
    """Serves a ledger holding one run of 300 maximal plans; returns a client of it."""
    tmp = tmp_path_factory.mktemp(f"big-{request.param}")
    if request.param == "sqlite":
        database, cluster = str(tmp / "ledger.db"), None
    else:
        cluster = request.getfixturevalue("pg_cluster")
        database = cluster.create_database()
    key = str(tmp / "signing-key.pem")
    server: RunningServer = create_server(
        ServerConfig(database=database, listen="127.0.0.1:0", signing_key=key)
    )
    client = LedgerClient(f"127.0.0.1:{server.port}", timeout_s=30, retry_deadline_s=5)
    try:
        events = [big_plan(i) for i in range(PLANS)]
        # Appends stay far under the message limit: 50 events are about 3 MB.
        for start in range(0, PLANS, 50):
            client.append(events[start : start + 50])
        assert sum(e.ByteSize() for e in events) > MESSAGE_LIMIT
        yield client
    finally:
        client.close()
        server.stop(0.5)
        if cluster is not None:
            cluster.drop_database(database)


def _pages(client: LedgerClient, rpc: str, request: Any) -> list[Any]:
    """Returns every response page of a paginated RPC, following its tokens."""
    pages = []
    while True:
        page = getattr(client.stub, rpc)(request, timeout=30)
        pages.append(page)
        if not page.next_page_token:
            return pages
        request.page_token = page.next_page_token


@pytest.mark.parametrize("page_size", [0, servicer.MAX_PAGE_SIZE])
def test_list_events_of_maximal_events_pages_by_bytes_and_returns_every_event(
    big_run: LedgerClient, page_size: int
) -> None:
    pages = _pages(big_run, "ListEvents", pb.ListEventsRequest(run_id=RUN, page_size=page_size))
    events = [e for page in pages for e in page.events]
    assert [e.shard_id for e in events] == IDS
    assert all(len(e.planned.plan_line) > PAD for e in events)
    assert len(pages) >= 5  # 18 MB in pages of at most 4 MiB
    assert all(page.ByteSize() <= servicer.READ_BUDGET_BYTES + 1024 for page in pages)


def test_list_shards_and_resume_stream_of_maximal_plans_return_every_shard(
    big_run: LedgerClient,
) -> None:
    request = pb.ListShardsRequest(run_id=RUN, page_size=servicer.MAX_PAGE_SIZE)
    shards = [s.shard_id for page in _pages(big_run, "ListShards", request) for s in page.shards]
    assert shards == IDS
    chunks = list(big_run.stub.StreamResumeList(pb.StreamResumeListRequest(run_id=RUN), timeout=30))
    entries = [e for chunk in chunks for e in chunk.entries]
    assert [(e.shard_id, e.plan_index) for e in entries] == list(
        zip(IDS, range(PLANS), strict=True)
    )
    assert [json.loads(e.plan_line)["index"] for e in entries] == list(range(PLANS))
    assert len(chunks) >= 5
    assert all(chunk.ByteSize() <= servicer.READ_BUDGET_BYTES for chunk in chunks)


def test_audit_rpcs_of_maximal_events_answer(big_run: LedgerClient) -> None:
    head = big_run.stub.GetTreeHead(pb.GetTreeHeadRequest(run_id=RUN), timeout=30)
    assert json.loads(head.tree_head_json)["tree_size"] == PLANS
    first = next(big_run.list_events(RUN, page_size=1))
    proof = big_run.stub.GetInclusionProof(
        pb.GetInclusionProofRequest(run_id=RUN, event_id=first.event_id), timeout=30
    )
    assert json.loads(proof.proof_bundle_json)["leaf_index"] == 0


@pytest.mark.usefixtures("quiet_logs")
def test_every_cli_read_of_maximal_events_exits_0_with_every_entry(
    big_run: LedgerClient, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    server = ("--server", big_run.target)

    def cli(*argv: str, code: int = 0) -> str:
        got, out, err = run_cli(capsys, *argv, *server)
        assert got == code, err
        return out

    events = [json.loads(line) for line in cli("events", RUN, "--json").splitlines()]
    assert [e["shard_id"] for e in events] == IDS
    assert [
        v["shard_id"] for v in map(json.loads, cli("shards", RUN, "--json").splitlines())
    ] == IDS
    # Exit 1: every planned shard must run (none committed).
    plan_lines = cli("resume", RUN, "--format", "jsonl", code=1).splitlines()
    assert [json.loads(line)["index"] for line in plan_lines] == list(range(PLANS))
    entries = [json.loads(line) for line in cli("resume", RUN, "--json", code=1).splitlines()]
    assert [e["shard_id"] for e in entries] == IDS
    assert cli("resume", RUN, "--format", "ids", code=1).split() == IDS
    assert cli("resume", RUN, "--format", "slurm-array", code=1).strip() == f"0-{PLANS - 1}"
    exported = tmp_path / "big.jsonl"
    cli("export", RUN, "-o", str(exported))
    kinds = [json.loads(line)["type"] for line in exported.read_text().splitlines()]
    assert kinds.count("event") == PLANS
    cli("audit", "verify", RUN)
    replayed = json.loads(cli("audit", "replay", RUN, "--until", str(10**9), "--json"))
    assert replayed["summary"]["submitted"] == PLANS


def test_list_shards_pages_end_at_the_byte_budget_and_resume_after_the_last_view_sent(
    client: LedgerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A small budget stands in for views near 64 KiB: each page must end at the budget and
    # its token must resume right after the last view sent, with a state filter too.
    client.append([planned(shard_id=f"s{i:02d}", index=i) for i in range(40)])
    client.append([started(shard_id=f"s{i:02d}", attempt_id=f"a{i}") for i in range(0, 40, 2)])
    monkeypatch.setattr(servicer, "READ_BUDGET_BYTES", 2000)
    for state, expected in [("", 40), ("running", 20), ("planned", 20)]:
        request = pb.ListShardsRequest(run_id="run-1", state=state, page_size=5000)
        pages = _pages(client, "ListShards", request)
        ids = [s.shard_id for page in pages for s in page.shards]
        assert len(ids) == expected and ids == sorted(set(ids))
        assert len(pages) > 1
        assert all(page.ByteSize() <= 2000 + 100 for page in pages)


def test_an_entry_over_the_whole_budget_is_still_sent_alone_in_every_read(
    client: LedgerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.append([planned(shard_id=f"s{i}", index=i) for i in range(5)])
    monkeypatch.setattr(servicer, "READ_BUDGET_BYTES", 1)
    events = _pages(client, "ListEvents", pb.ListEventsRequest(run_id="run-1"))
    shards = _pages(client, "ListShards", pb.ListShardsRequest(run_id="run-1"))
    resume = list(client.stub.StreamResumeList(pb.StreamResumeListRequest(run_id="run-1")))
    for messages, field in [(events, "events"), (shards, "shards"), (resume, "entries")]:
        # One entry per message, and no empty message after the last.
        assert [len(getattr(m, field)) for m in messages] == [1] * 5, field
