"""`shardledger export` and `import`: a run moves between databases intact, or not at all."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from ledger_server.chain import chain_hash
from ledger_server.config import ServerConfig
from ledger_server.server import RunningServer, create_server
from ledger_server.service import LedgerService
from ledger_server.signing import SigningKey, public_key_id
from ledger_server.store.sqlite import SqliteStore
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from tests.builders import DIGEST_A, committed, event, planned, run_cli, started

RUN = "run-1"
NOW_US = 1_900_000_000_000_000


pytestmark = pytest.mark.usefixtures("quiet_logs")


cli = run_cli


def fill(client: LedgerClient) -> None:
    """Appends a run with every kind of event: verified, failed, stale-able and duplicate shards."""
    passed, failed = pb.VERIFICATION_RESULT_PASSED, pb.VERIFICATION_RESULT_FAILED

    def verdict(shard: str, result: pb.VerificationResult, reason: str = "") -> pb.ShardEvent:
        check = pb.ArtifactVerified(
            name="out", path="/out/x", blake3_hex=DIGEST_A, result=result, reason=reason
        )
        return event(RUN, shard, verified=check)

    client.append([planned(shard_id=f"s{i}", index=i) for i in range(6)])
    client.append([started(shard_id=f"s{i}", attempt_id=f"a{i}") for i in range(5)])
    client.append(
        [
            event(RUN, "s0", "a0", heartbeat=pb.Heartbeat(step=1, progress=0.5, metrics={"l": 1})),
            committed(shard_id="s0", attempt_id="a0"),
            committed(shard_id="s1", attempt_id="a1"),
            committed(shard_id="s1", attempt_id="a1"),
            event(RUN, "s2", "a2", failed=pb.AttemptFailed(tag=pb.FAILURE_TAG_OOM, message="o")),
            committed(shard_id="s3", attempt_id="a3"),
        ]
    )
    client.append([verdict("s0", passed), verdict("s3", failed, "empty")])
    # The run-level kind: no shard, and the counters it sets travel with the run.
    client.close_submission(RUN, reason="all planned", expected_shards=6)


def export(capsys: pytest.CaptureFixture[str], client: LedgerClient, path: Path) -> list[str]:
    code, _, err = cli(capsys, "export", RUN, "--server", client.target, "-o", str(path))
    assert code == 0, err
    return path.read_text().splitlines(keepends=True)


def rows_of(db: Path) -> list[tuple[int, bytes, bytes]]:
    with sqlite3.connect(db) as conn:
        query = "SELECT run_seq, row, hash FROM events JOIN runs USING (run_pk) WHERE run_id = ? ORDER BY seq"
        return [(r[0], bytes(r[1]), bytes(r[2])) for r in conn.execute(query, (RUN,))]


def test_export_then_import_round_trips_rows_and_projections(
    server: RunningServer,
    client: LedgerClient,
    db_path: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fill(client)
    lines = export(capsys, client, tmp_path / "run.jsonl")
    assert [json.loads(line)["type"] for line in (lines[0], lines[1], lines[-1])] == [
        "header",
        "event",
        "trailer",
    ]
    target = tmp_path / "target.db"
    code, _, err = cli(capsys, "import", str(tmp_path / "run.jsonl"), "--db", str(target))
    assert code == 0, err

    assert rows_of(target) == rows_of(db_path)
    code, out, _ = cli(capsys, "audit", "verify", "--db", str(target), "--json")
    trailer = json.loads(lines[-1])["tree_head"]
    assert code == 0 and json.loads(out)["runs"][0]["root_hex"] == trailer["root_hex"]

    copy = create_server(ServerConfig(database=str(target), listen="127.0.0.1:0"))
    try:
        views = {}
        for name, where in (("source", client.target), ("target", f"127.0.0.1:{copy.port}")):
            code, out, _ = cli(capsys, "status", RUN, "--server", where, "--json")
            views[name] = json.loads(out)
            views[name].pop("as_of_us")
        assert views["source"] == views["target"]
        assert views["target"]["submitted"] == 6 and views["target"]["event_count"] == 20
        # The clock-dependent splits (stale, resume reasons) agree at any one instant too.
        source, target_ledger = server.ledger, copy.ledger
        for query in (LedgerService.summary, LedgerService.shards):
            assert query(source, "default", RUN, now=NOW_US) == query(
                target_ledger, "default", RUN, now=NOW_US
            )
        assert list(source.resume("default", RUN, now=NOW_US)) == list(
            target_ledger.resume("default", RUN, now=NOW_US)
        )
    finally:
        copy.stop(0.1)


# --- broken files ------------------------------------------------------------


def edit_a_byte(lines: list[str]) -> int:
    lines[7] = lines[7].replace("node-1", "node-2", 1)
    return 8


def delete_a_line(lines: list[str]) -> int:
    del lines[4]
    return 5


def swap_two_lines(lines: list[str]) -> int:
    lines[3], lines[4] = lines[4], lines[3]
    return 4


def drop_the_trailer(lines: list[str]) -> int:
    lines.pop()
    return len(lines) + 1


def break_the_signature(lines: list[str]) -> int:
    trailer = json.loads(lines[-1])
    sig = trailer["tree_head"]["signature_hex"]
    trailer["tree_head"]["signature_hex"] = ("0" if sig[0] != "0" else "1") + sig[1:]
    lines[-1] = json.dumps(trailer) + "\n"
    return len(lines)


def swap_the_header_key(lines: list[str]) -> int:
    header = json.loads(lines[0])
    # A careful forger names its own key consistently: the signed head still refuses it.
    header["public_key_pem"] = SigningKey.generate().public_key_pem()
    header["key_id"] = public_key_id(header["public_key_pem"])
    lines[0] = json.dumps(header) + "\n"
    return len(lines)


def change_the_header_key_id(lines: list[str]) -> int:
    header = json.loads(lines[0])
    header["key_id"] = "0" * len(header["key_id"])
    lines[0] = json.dumps(header) + "\n"
    return 1


def append_a_forged_event(lines: list[str]) -> int:
    # A forger can extend the hash chain (it has no key), but not the signed head.
    last = json.loads(lines[-2])
    row = dict(last["row"])
    row["run_sequence"] += 1
    row["event"] = {**row["event"], "event_id": "forged"}
    body = json.dumps(row, sort_keys=True, separators=(",", ":")).encode()
    forged = {
        **last,
        "run_sequence": row["run_sequence"],
        "row": row,
        "row_hash": chain_hash(bytes.fromhex(last["row_hash"]), body).hex(),
    }
    lines.insert(len(lines) - 1, json.dumps(forged) + "\n")
    return len(lines)


def forge_a_lone_surrogate(lines: list[str]) -> int:
    # Valid JSON, a chain the forger extended, but text no UTF-8 row can carry.
    last = json.loads(lines[-2])
    row = dict(last["row"])
    row["run_sequence"] += 1
    payload = {"tag": "oom", "message": "x\ud800"}
    row["event"] = {**row["event"], "event_id": "forged", "kind": "failed", "payload": payload}
    body = json.dumps(row, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    forged = {
        **last,
        "run_sequence": row["run_sequence"],
        "row": row,
        "row_hash": chain_hash(
            bytes.fromhex(last["row_hash"]), body.encode("utf-8", "surrogatepass")
        ).hex(),
    }
    lines.insert(len(lines) - 1, json.dumps(forged) + "\n")
    return len(lines) - 1


@pytest.mark.parametrize(
    "damage",
    [
        edit_a_byte,
        delete_a_line,
        swap_two_lines,
        drop_the_trailer,
        break_the_signature,
        swap_the_header_key,
        change_the_header_key_id,
        append_a_forged_event,
        forge_a_lone_surrogate,
    ],
)
def test_a_broken_file_is_refused_naming_the_line_and_nothing_is_written(
    client: LedgerClient,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    damage: Callable[[list[str]], int],
) -> None:
    fill(client)
    lines = export(capsys, client, tmp_path / "run.jsonl")
    bad_line = damage(lines)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("".join(lines))
    target = tmp_path / "target.db"
    code, _, err = cli(capsys, "import", str(broken), "--db", str(target))
    assert code == 1
    assert f"line {bad_line}:" in err and "nothing was written" in err
    assert not target.exists()


def _exported_run(capsys: pytest.CaptureFixture[str], client: LedgerClient, tmp_path: Path) -> Path:
    """Fills the run through the server and exports it; returns the export file."""
    fill(client)
    path = tmp_path / "run.jsonl"
    export(capsys, client, path)
    return path


def _import(capsys: pytest.CaptureFixture[str], path: Path, target: Path) -> tuple[int, str, str]:
    return cli(capsys, "import", str(path), "--db", str(target))


def test_importing_a_run_that_exists_is_refused_and_changes_nothing(
    client: LedgerClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    exported, target = _exported_run(capsys, client, tmp_path), tmp_path / "target.db"
    assert _import(capsys, exported, target)[0] == 0
    before = rows_of(target)
    code, _, err = _import(capsys, exported, target)
    assert code == 4 and "RUN_EXISTS" in err
    # A local command's words: no ledger refused anything.
    assert f"cannot import {exported} into {target}" in err and "refused" not in err
    assert rows_of(target) == before


def test_importing_into_a_file_a_server_is_writing_is_refused_and_changes_nothing(
    client: LedgerClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    exported, target = _exported_run(capsys, client, tmp_path), tmp_path / "target.db"
    live = create_server(ServerConfig(database=str(target), listen="127.0.0.1:0"))
    try:
        code, _, err = _import(capsys, exported, target)
        assert code == 5
        assert "is being written by another process" in err and "nothing was written" in err
        assert rows_of(target) == []
    finally:
        live.stop(0.5)
    assert _import(capsys, exported, target)[0] == 0


def test_import_with_a_pinned_key_refuses_a_file_signed_by_another(
    client: LedgerClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fill(client)
    export(capsys, client, tmp_path / "run.jsonl")
    other = tmp_path / "other.pem"
    other.write_text(SigningKey.generate().public_key_pem())
    target = tmp_path / "target.db"
    args = ["import", str(tmp_path / "run.jsonl"), "--db", str(target), "--public-key", str(other)]
    code, _, err = cli(capsys, *args)
    assert code == 1 and "pinned" in err and not target.exists()


def test_export_of_a_tampered_run_is_refused_and_leaves_no_file(
    client: LedgerClient, db_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fill(client)
    with sqlite3.connect(db_path) as conn:
        conn.execute("DROP TRIGGER events_no_update")
        conn.execute("UPDATE events SET row = replace(row, 'node-1', 'node-2') WHERE seq = 9")
    out = tmp_path / "run.jsonl"
    code, _, err = cli(capsys, "export", RUN, "--server", client.target, "-o", str(out))
    assert code == 1 and "sequence 9" in err
    assert not out.exists() and not list(tmp_path.glob(".run.jsonl.*"))


@pytest.mark.parametrize("deleted", ["the tail", "every row"])
def test_export_of_a_run_whose_rows_were_deleted_is_refused(
    client: LedgerClient,
    db_path: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    deleted: str,
) -> None:
    fill(client)
    keep = 3 if deleted == "the tail" else 0
    with sqlite3.connect(db_path) as conn:
        conn.execute("DROP TRIGGER events_no_delete")
        conn.execute("DELETE FROM events WHERE run_seq > ?", (keep,))
    out = tmp_path / "run.jsonl"
    code, _, err = cli(capsys, "export", RUN, "--server", client.target, "-o", str(out))
    assert code == 1 and "refusing to export" in err and "disagree" in err
    assert "Traceback" not in err and not out.exists()


def test_importer_folds_projections_like_the_live_ledger(tmp_path: Path) -> None:
    """Guards the fold itself: the imported store's records equal the source's, shard by shard."""
    source = SqliteStore(tmp_path / "a.db")
    ledger = LedgerService(source)
    try:
        from ledger_server.codec import decode_event
        from ledger_server.importer import ImportRow, import_run

        for batch in ([planned(shard_id="s0")], [started(shard_id="s0"), committed(shard_id="s0")]):
            ledger.append([decode_event(e) for e in batch])
        run = ledger.run("default", RUN)
        rows = [
            ImportRow(r.run_sequence, r.row, r.row_hash)
            for r in source.read().iter_events(run.run_pk)
        ]
        target = SqliteStore(tmp_path / "b.db")
        result = import_run(target, namespace="default", run_id=RUN, rows=rows)
        assert (result.events, result.shards) == (3, 1)
        copied = target.read().get_run("default", RUN)
        assert copied is not None and copied.head_hash == run.head_hash
        assert target.read().counters(copied.run_pk) == source.read().counters(run.run_pk)
        target.close()
    finally:
        ledger.close()
        source.close()
