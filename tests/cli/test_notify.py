"""`shardledger notify`: a run's report posted to a real HTTP receiver on loopback, with retries."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from tests.builders import DIGEST_A, committed, event, planned, run_cli, started

RUN = "night-1"

pytestmark = pytest.mark.usefixtures("quiet_logs")


@dataclass
class Receiver:
    """A webhook receiver: answers the scripted statuses in turn, then 200; keeps every POST."""

    url: str
    statuses: list[int] = field(default_factory=list)
    posts: list[tuple[dict[str, str], dict[str, Any]]] = field(default_factory=list)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    box: list[Receiver] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers["Content-Length"])
            got = box[0]
            got.posts.append((dict(self.headers), json.loads(self.rfile.read(length))))
            status = got.statuses.pop(0) if got.statuses else 200
            self.send_response(status)
            if status == 429:
                self.send_header("Retry-After", "0")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    box.append(Receiver(f"http://127.0.0.1:{httpd.server_address[1]}/hooks/secret-token"))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield box[0]
    httpd.shutdown()
    httpd.server_close()


def settled_run(client: LedgerClient) -> None:
    """Four shards: two verified, one failed, one never started; the submission closed."""
    client.append([planned(RUN, f"s{i}", i) for i in range(4)])
    client.append([started(RUN, f"s{i}", f"a{i}") for i in range(3)])
    client.append([committed(RUN, "s0", "a0"), committed(RUN, "s1", "a1")])
    client.append(
        [
            event(
                RUN,
                shard,
                verified=pb.ArtifactVerified(
                    name="out",
                    path="/out/x",
                    blake3_hex=DIGEST_A,
                    result=pb.VERIFICATION_RESULT_PASSED,
                ),
            )
            for shard in ("s0", "s1")
        ]
    )
    client.append([event(RUN, "s2", "a2", failed=pb.AttemptFailed(tag=pb.FAILURE_TAG_OOM))])
    client.close_submission(RUN, reason="all planned")


def test_notify_posts_the_settled_runs_report_after_retrying_a_flaky_receiver(
    capsys: pytest.CaptureFixture[str], client: LedgerClient, target: str, receiver: Receiver
) -> None:
    settled_run(client)
    receiver.statuses = [503, 429]
    code, out, err = run_cli(
        capsys, "notify", RUN, "--url", receiver.url, "--server", target, "--backoff", "0.05"
    )
    assert code == 0, err
    assert "secret-token" not in out + err  # the URL's path is the receiver's secret
    assert f"run {RUN} (settled): report posted to http://127.0.0.1:" in out
    assert "(HTTP 200, 3 tries)" in out
    assert err.count("retrying in") == 2

    keys = {headers["Idempotency-Key"] for headers, _ in receiver.posts}
    assert len(receiver.posts) == 3 and len(keys) == 1  # one delivery, tried three times
    body = receiver.posts[-1][1]
    assert body["kind"] == "shardledger.run_report"
    assert (body["submitted"], body["verified"], body["failed"], body["missing"]) == (4, 2, 1, 1)
    assert body["resume_count"] == 2
    assert body["lifecycle"]["state"] == "settled"
    assert body["first_pass"]["reconciliation_rate"] == 0.5
    assert body["text"].startswith(f"{RUN} settled at ")
    assert "2 of 4 shards verified (50.0%), 1 failed, 1 missing" in body["text"]
    assert "2 shards to resume (`shardledger resume night-1`)" in body["text"]


def test_notify_of_an_open_run_posts_and_exits_1(
    capsys: pytest.CaptureFixture[str], client: LedgerClient, target: str, receiver: Receiver
) -> None:
    client.append([planned(RUN, "s0"), started(RUN, "s0", "a0")])
    code, out, _ = run_cli(
        capsys, "notify", RUN, "--url", receiver.url, "--server", target, "--json"
    )
    assert code == 1
    answer = json.loads(out)
    assert answer["posted"] is True and answer["state"] == "open"
    body = receiver.posts[0][1]
    assert body["text"] == (
        f"{RUN} open: 0 of 1 shard verified (0.0%), 0 failed, 0 missing, 1 still running;"
        " first pass 0.0% reconciled; 1 shard to resume (`shardledger resume night-1`)"
    )


def test_wait_posts_once_the_run_settles(
    capsys: pytest.CaptureFixture[str], client: LedgerClient, target: str, receiver: Receiver
) -> None:
    client.append([planned(RUN, "s0"), started(RUN, "s0", "a0")])
    ended = event(RUN, "s0", "a0", failed=pb.AttemptFailed(tag=pb.FAILURE_TAG_KILLED))
    # The job ends and the planner closes the run while notify waits.
    timer = threading.Timer(0.5, lambda: (client.append([ended]), client.close_submission(RUN)))
    timer.start()
    try:
        code, out, err = run_cli(
            capsys,
            "notify",
            RUN,
            "--url",
            receiver.url,
            "--server",
            target,
            "--wait",
            "30",
            "--poll",
            "0.1",
            "--json",
        )
    finally:
        timer.join()
    assert code == 0, err
    assert json.loads(out)["state"] == "settled"
    (only,) = receiver.posts
    assert only[1]["lifecycle"]["settled"] is True and only[1]["failed"] == 1


def test_a_receiver_that_refuses_is_not_retried_and_exits_5(
    capsys: pytest.CaptureFixture[str], client: LedgerClient, target: str, receiver: Receiver
) -> None:
    settled_run(client)
    receiver.statuses = [400]
    code, _, err = run_cli(capsys, "notify", RUN, "--url", receiver.url, "--server", target)
    assert code == 5
    assert "refused the report: HTTP 400" in err
    assert len(receiver.posts) == 1


def test_an_unreachable_receiver_is_retried_then_exits_5(
    capsys: pytest.CaptureFixture[str], client: LedgerClient, target: str
) -> None:
    settled_run(client)
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/hook"
    code, _, err = run_cli(
        capsys,
        "notify",
        RUN,
        "--url",
        url,
        "--server",
        target,
        "--retries",
        "2",
        "--backoff",
        "0.01",
    )
    assert code == 5
    assert "was not delivered to http://127.0.0.1:" in err and "after 3 tries" in err


def test_dry_run_prints_the_report_and_posts_nothing(
    capsys: pytest.CaptureFixture[str], client: LedgerClient, target: str, receiver: Receiver
) -> None:
    settled_run(client)
    code, out, _ = run_cli(capsys, "notify", RUN, "--dry-run", "--server", target)
    assert code == 0
    assert json.loads(out)["verified"] == 2
    assert receiver.posts == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ((), "no webhook URL: give --url or set $SHARDLEDGER_NOTIFY_URL"),
        (("--url", "ftp://x/y"), "--url must be an http:// or https:// URL"),
    ],
)
def test_notify_usage_errors(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    target: str,
    argv: tuple[str, ...],
    message: str,
) -> None:
    monkeypatch.delenv("SHARDLEDGER_NOTIFY_URL", raising=False)
    code, _, err = run_cli(capsys, "notify", RUN, *argv, "--server", target)
    assert code == 2
    assert message in err


def test_notify_of_an_unknown_run_exits_4(
    capsys: pytest.CaptureFixture[str], target: str, receiver: Receiver
) -> None:
    code, _, err = run_cli(capsys, "notify", "nope", "--url", receiver.url, "--server", target)
    assert code == 4
    assert "RUN_NOT_FOUND" in err
    assert receiver.posts == []
