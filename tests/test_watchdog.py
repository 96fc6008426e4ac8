"""The watchdog: a hung attempt is diagnosed, stopped and recorded as failed(timeout)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ledger_server.server import RunningServer
from shard_client.client import LedgerClient
from tests.conftest import planned
from tools.cli import main


def test_watch_kill_stale_dumps_stack_kills_and_records_timeout(
    server: RunningServer, client: LedgerClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client.append([planned()])
    diag = tmp_path / "diag"
    proc = subprocess.Popen(
        [
            sys.executable,
            "tests/helpers/hung_job.py",
            client.target,
            "run-1",
            "shard-0",
            "att-hung",
            str(diag),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 20
        while next(iter(client.shards("run-1", state="stale")), None) is None:
            assert time.monotonic() < deadline, "the attempt never went stale"
            time.sleep(0.2)
        code = main(
            [
                "watch",
                "run-1",
                "--kill-stale",
                "--server",
                client.target,
                "--grace",
                "1",
                "--diag-dir",
                str(diag),
                "--json",
            ]
        )
        assert code == 0
        actions = json.loads(capsys.readouterr().out)
        # The watchdog reaps its own children, so the exit status may already be collected.
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [a["shard_id"] for a in actions] == ["shard-0"]
    assert actions[0]["steps"][:2] == ["diagnostics", "SIGTERM"]
    report = Path(actions[0]["diagnostics"]).read_text()
    assert "stuck_in_data_loader" in report
    views = [json.loads(v.view_json) for v in client.shards("run-1")]
    assert (views[0]["state"], views[0]["detail"]) == ("failed", "timeout")
    assert [(e.shard_id, e.reason) for e in client.resume("run-1")] == [
        ("shard-0", "failed:timeout")
    ]
    # A second pass finds nothing left to do.
    assert main(["watch", "run-1", "--server", client.target, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
