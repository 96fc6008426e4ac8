"""`shardledger archive --to s3://...`: bundles in a real S3 endpoint (moto), read back, tampered, restored."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ledger_server.store import open_store
from shard_client.client import LedgerClient
from tests.builders import run_cli
from tests.server.test_archive import RUN, rows, serve, settled_night, state_of
from tests.storage.conftest import BUCKET

pytestmark = [pytest.mark.s3, pytest.mark.usefixtures("quiet_logs")]
ARCHIVE = f"s3://{BUCKET}/ledger-archive"


@pytest.fixture
def night(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A SQLite ledger with one settled night, its server stopped."""
    database = str(tmp_path / "ledger.db")
    running = serve(database, tmp_path)
    client = LedgerClient(f"127.0.0.1:{running.port}", timeout_s=10)
    try:
        settled_night(client, RUN)
    finally:
        client.close()
        running.stop(0.5)
    yield {"db": database, "key": str(tmp_path / "ledger.key.pem")}


def archive(
    capsys: pytest.CaptureFixture[str], night: dict[str, str], to: str
) -> tuple[int, str, str]:
    return run_cli(
        capsys, "archive", RUN, "--to", to, "--db", night["db"], "--signing-key", night["key"]
    )


def test_a_run_archived_to_s3_verifies_fails_on_a_flipped_byte_and_restores_identical(
    s3: Any, night: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    store = open_store(night["db"])
    original = rows(store, RUN)
    store.close()
    code, _, err = archive(capsys, night, ARCHIVE)
    assert code == 0, err
    assert state_of(night["db"], RUN) == "archived"
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"])
    prefix = f"ledger-archive/default/{RUN}/"
    assert keys == [prefix + name for name in ("events.jsonl", "head.json", "manifest.json")]

    code, out, err = run_cli(capsys, "audit", "verify", RUN, "--db", night["db"], "--json")
    assert code == 0, out + err

    key = prefix + "events.jsonl"
    pristine = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    tampered = bytearray(pristine)
    at = tampered.index(b'"step":1') + len(b'"step":')
    tampered[at] = ord("7")
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(tampered))
    code, out, err = run_cli(capsys, "audit", "verify", RUN, "--db", night["db"], "--json")
    assert code == 1 and "events.jsonl" in out + err

    s3.delete_object(Bucket=BUCKET, Key=key)
    code, out, err = run_cli(capsys, "audit", "verify", RUN, "--db", night["db"], "--json")
    assert code == 1 and "has no" in out + err and "events.jsonl" in out + err

    s3.put_object(Bucket=BUCKET, Key=key, Body=pristine)
    code, _, err = run_cli(capsys, "restore", RUN, "--db", night["db"])
    assert code == 0, err
    store = open_store(night["db"])
    assert rows(store, RUN) == original
    store.close()


def test_an_object_store_that_is_down_leaves_the_run_hot_and_says_why(
    s3: Any,
    night: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import s3fs

    with socket.socket() as sock:  # a port just freed: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    s3fs.S3FileSystem.clear_instance_cache()
    code, _, err = archive(capsys, night, ARCHIVE)
    assert code == 1 and "cannot write" in err and "stays hot" in err, err
    assert state_of(night["db"], RUN) == "hot"
    outcome = json.loads(
        run_cli(
            capsys,
            "archive",
            RUN,
            "--to",
            ARCHIVE,
            "--db",
            night["db"],
            "--signing-key",
            night["key"],
            "--json",
        )[1]
    )
    assert outcome["action"] == "failed" and outcome["events"] > 0
