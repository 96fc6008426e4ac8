"""A night whose inputs other pipelines rewrite, on local files and on the local S3 endpoint.

Six shards, planned with the CLI. Before its job, one input is replaced with other
bytes and one is copied over itself (new identity, same bytes); one is replaced
while its job runs, one after its job was verified. The truth the test keeps:
exactly the three rewritten shards must end in `resume` as input_changed (the
first stopped before computing, the two others caught by `verify --inputs`), and
after `plan --refresh-inputs` a rerun of the resume list on the current inputs
verifies them, leaving `resume` empty.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import pytest

from ledger_server.server import RunningServer
from shard_client import InputChanged, Ledger, LedgerClient
from tests.builders import run_cli
from tests.storage.conftest import BUCKET

RUN = "rewritten-01"
NAMES = ("before", "copied", "during", "after", "plain-1", "plain-2")

pytestmark = pytest.mark.usefixtures("spool_in_tmp")


class Inputs(Protocol):
    """Where the night's inputs live, and how another pipeline rewrites them."""

    def ref(self, name: str) -> str: ...
    def write(self, name: str, data: bytes) -> None: ...
    def read(self, name: str) -> bytes: ...
    def plan_args(self) -> list[str]: ...


class LocalInputs:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()

    def ref(self, name: str) -> str:
        return str(self.root / f"{name}.bin")

    def write(self, name: str, data: bytes) -> None:
        # As a pipeline publishes: a new file renamed over the old one.
        fresh = self.root / f".{name}.tmp"
        fresh.write_bytes(data)
        os.replace(fresh, self.ref(name))

    def read(self, name: str) -> bytes:
        return Path(self.ref(name)).read_bytes()

    def plan_args(self) -> list[str]:
        return ["--inputs", str(self.root), "--glob", "*.bin"]


class S3Inputs:
    def __init__(self, client: Any) -> None:
        self.client = client

    def ref(self, name: str) -> str:
        return f"s3://{BUCKET}/inputs/{name}.bin"

    def write(self, name: str, data: bytes) -> None:
        self.client.put_object(Bucket=BUCKET, Key=f"inputs/{name}.bin", Body=data)

    def read(self, name: str) -> bytes:
        body = self.client.get_object(Bucket=BUCKET, Key=f"inputs/{name}.bin")["Body"]
        return bytes(body.read())

    def plan_args(self) -> list[str]:
        return ["--inputs", f"s3://{BUCKET}/inputs/", "--glob", "*.bin"]


def resume(client: LedgerClient) -> dict[str, tuple[dict[str, Any], str]]:
    """Returns the resume list: shard id -> (its plan line, why it must run)."""
    out = {}
    for entry in client.resume(RUN):
        line = json.loads(entry.plan_line)
        out[line["shard_id"]] = (line, entry.reason)
    return out


def night(
    inputs: Inputs,
    server: RunningServer,
    client: LedgerClient,
    ledger: Ledger,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    address = ["--server", f"127.0.0.1:{server.port}"]
    for name in NAMES:
        inputs.write(name, f"{name}: first version\n".encode() * 40)
    code, _, err = run_cli(
        capsys, "plan", RUN, *address, *inputs.plan_args(), "--expected-outputs", "out"
    )
    assert code == 0, err
    by_name = {Path(line["input"]).stem: sid for sid, (line, _) in resume(client).items()}
    assert sorted(by_name) == sorted(NAMES)
    out = tmp_path / "out"

    def job(line: dict[str, Any], during: Callable[[], None] = lambda: None) -> None:
        with ledger.shard(RUN, line["shard_id"], input=line, output_dir=out) as shard:
            during()
            name = Path(line["input"]).stem
            data = inputs.read(name)
            with shard.atomic_write(out / f"{name}.out", name="out") as f:
                f.write(data.upper())

    # Before their jobs: one input rewritten, one copied over itself (same bytes).
    inputs.write("before", b"rewritten before its job\n" * 41)
    inputs.write("copied", inputs.read("copied"))
    first = resume(client)
    with pytest.raises(InputChanged):
        job(first[by_name["before"]][0])
    for name in ("copied", "after", "plain-1", "plain-2"):
        job(first[by_name[name]][0])
    job(
        first[by_name["during"]][0],
        during=lambda: inputs.write("during", b"rewritten while its job ran\n" * 39),
    )
    code, _, err = run_cli(capsys, "verify", RUN, *address, "--root", str(out))
    assert code == 0, err
    inputs.write("after", b"rewritten after its job was verified\n" * 7)

    code, stdout, err = run_cli(
        capsys, "verify", RUN, *address, "--root", str(out), "--inputs", "--json"
    )
    assert code == 1, err
    report = json.loads(stdout)
    assert sorted(f["shard_id"] for f in report["failures"]) == sorted(
        [by_name["during"], by_name["after"]]
    )
    assert {f["reason"] for f in report["failures"]} == {"input_changed"}
    assert resume(client).keys() == {by_name[n] for n in ("before", "during", "after")}
    assert {sid: why for sid, (_, why) in resume(client).items()} == {
        by_name["before"]: "failed:input_changed",
        by_name["during"]: "verify_failed:input_changed",
        by_name["after"]: "verify_failed:input_changed",
    }

    # The inputs as they are now become the plan; the rerun of the resume list converges.
    code, stdout, err = run_cli(capsys, "plan", RUN, *address, "--refresh-inputs", "--json")
    assert code == 0, err
    refreshed = json.loads(stdout)
    assert (refreshed["changed"], refreshed["revised"]) == (3, 3 + refreshed["touched"])
    assert {i["shard_id"] for i in refreshed["inputs"] if i["status"] == "changed"} == {
        by_name[n] for n in ("before", "during", "after")
    }
    for line, _ in resume(client).values():
        job(line)
    code, _, err = run_cli(capsys, "verify", RUN, *address, "--root", str(out), "--inputs")
    assert code == 0, err
    assert resume(client) == {}


def test_a_night_of_rewritten_local_inputs_ends_with_exactly_those_shards_to_rerun(
    server: RunningServer,
    client: LedgerClient,
    ledger: Ledger,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    night(LocalInputs(tmp_path / "in"), server, client, ledger, tmp_path, capsys)


@pytest.mark.s3
def test_a_night_of_rewritten_object_inputs_ends_with_exactly_those_shards_to_rerun(
    s3: Any,
    server: RunningServer,
    client: LedgerClient,
    ledger: Ledger,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    night(S3Inputs(s3), server, client, ledger, tmp_path, capsys)
