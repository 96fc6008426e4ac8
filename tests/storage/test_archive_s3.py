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
from tests.pg import pg_cluster, pg_url
from tests.server.test_archive import RUN, database, rows, serve, settled_night, state_of
from tests.storage.conftest import BUCKET

__all__ = ["database", "pg_cluster", "pg_url"]

pytestmark = [pytest.mark.s3, pytest.mark.usefixtures("quiet_logs")]
ARCHIVE = f"s3://{BUCKET}/ledger-archive"


@pytest.fixture
def night(database: str, tmp_path: Path) -> Iterator[dict[str, str]]:
    """A ledger (SQLite, or PostgreSQL where there is one) with one settled night, its server stopped."""
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


def moto_auth_after(endpoint: dict[str, str], requests: str) -> None:
    """Sets after how many requests moto's server checks credentials ("0": now, "inf": never).

    moto checks them (against its IAM, where the dummy keys do not exist) only after
    INITIAL_NO_AUTH_ACTION_COUNT requests; /moto-api/reset-auth sets that count and is
    not itself checked.
    """
    import urllib.request

    request = urllib.request.Request(
        endpoint["AWS_ENDPOINT_URL"] + "/moto-api/reset-auth",
        data=requests.encode(),
        headers={"Content-Type": "text/plain"},  # not a form: moto reads the raw body
        method="POST",
    )
    urllib.request.urlopen(request, timeout=10).close()


@pytest.fixture
def refusing_s3(s3: Any, s3_endpoint: dict[str, str]) -> Iterator[Any]:
    """The endpoint with authentication on for one test: the dummy keys are refused."""
    moto_auth_after(s3_endpoint, "0")
    try:
        yield s3
    finally:
        moto_auth_after(s3_endpoint, "inf")


def test_an_object_store_that_refuses_the_credentials_leaves_the_run_hot_and_says_why(
    refusing_s3: Any, night: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = archive(capsys, night, ARCHIVE)
    assert code == 1 and "cannot write" in err and "stays hot" in err, err
    assert "InvalidAccessKeyId" in err or "Access Key Id you provided does not exist" in err, err
    assert state_of(night["db"], RUN) == "hot"


@pytest.mark.parametrize("fault", ["down", "credentials"])
def test_the_servers_retention_keeps_the_run_hot_logs_and_counts_an_object_store_fault(
    fault: str,
    s3: Any,
    s3_endpoint: dict[str, str],
    database: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bundle is built and uploaded in the server's child process, which inherits the env."""
    import s3fs
    import structlog

    from ledger_server.config import ServerConfig
    from ledger_server.server import create_server
    from tests.server.test_archive import metric, wait_for

    if fault == "down":
        with socket.socket() as sock:  # a port just freed: nothing listens there
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        s3fs.S3FileSystem.clear_instance_cache()
    else:
        moto_auth_after(s3_endpoint, "0")
    config = ServerConfig(
        database=database,
        listen="127.0.0.1:0",
        signing_key=str(tmp_path / "ledger.key.pem"),
        metrics_listen="127.0.0.1:0",
        archive_to=ARCHIVE,
        archive_after_s=0.0,
        archive_every_s=0.05,
    )
    try:
        with structlog.testing.capture_logs() as logs:
            running = create_server(config)
            client = LedgerClient(f"127.0.0.1:{running.port}", timeout_s=10)
            try:
                settled_night(client, RUN)
                wait_for(
                    lambda: metric(running, "shardledger_archive_failures_total") >= 1,
                    "the failure counted",
                )
                assert metric(running, "shardledger_archive_runs_total") == 0
                (info,) = client.list_runs()
                assert not info.archived
            finally:
                client.close()
                running.stop(0.5)
    finally:
        if fault == "credentials":
            moto_auth_after(s3_endpoint, "inf")
    failed = [e for e in logs if e["event"] == "run_archive_failed"]
    assert failed and failed[0]["run_id"] == RUN and failed[0]["action"] == "failed", logs
    assert "cannot write" in failed[0]["reason"] and "stays hot" in failed[0]["reason"]
    assert state_of(database, RUN) == "hot"
