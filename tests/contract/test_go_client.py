"""A second-language client: examples/go, built from proto/ with Debian's Go, against a live ledger.

The Go client derives shard ids, plan event ids and fingerprint digests from the
contract (docs/contract.md), reproduces the test vectors, and runs a night whose
`shardledger status --json` is the night the Python SDK writes. A shard planned by
one language and run by the other is one shard.

CI installs the toolchain (.ci/run); without `go` and `protoc` these tests are skipped.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from functools import partial
from pathlib import Path
from typing import Any

import blake3
import pytest

from shard_client import Ledger
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.canonical import fingerprint_digest
from shard_client.client import LedgerClient
from shard_client.failures import DataError
from shard_client.fingerprint import Fingerprint
from shard_client.ids import PlanEntry, plan_events, shard_id_for
from tests.builders import run_cli

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "tests" / "data" / "contract_vectors.json"
_MISSING = [tool for tool in ("go", "protoc") if shutil.which(tool) is None]
if not Path("/usr/include/google/protobuf/timestamp.proto").exists():
    _MISSING.append("protoc's well-known types")
pytestmark = pytest.mark.skipif(
    bool(_MISSING),
    reason=f"{' and '.join(_MISSING)} not installed (apt-get install golang-go protobuf-compiler"
    " libprotobuf-dev golang-google-protobuf-dev golang-google-grpc-dev golang-google-genproto-dev"
    " golang-lukechampine-blake3-dev; .ci/run does)",
)

# The night both languages write: two shards commit, one fails (data), one is only planned
# by whoever goes first and run by the other language.
NIGHT: list[dict[str, Any]] = [
    {"input": "frame-0", "params": {"frame": 0, "lr": 1.0, "eps": 1e-7}, "fate": "commit"},
    {"input": "frame-1", "params": {"frame": 1, "title": "Äpfel 🍎"}, "fate": "commit"},
    {
        "input": "frame-2",
        "params": {"frame": 2, "nested": {"\ufb01": 1, "😀": [2.5]}},
        "fate": "fail",
    },
    {"input": "frame-3", "params": {"frame": 3, "scale": 1e21}, "fate": "plan"},
]
# The environment both languages' attempts record: one fingerprint group.
FINGERPRINT = {"schema": "2", "gpu.0.name": "none", "gpu.0.uuid": "GPU-0", "host.label": "Zürich"}


@pytest.fixture(scope="session")
def go_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Builds examples/go once per test session (stubs generated from proto/ on the way)."""
    work = tmp_path_factory.mktemp("go-client")
    built = subprocess.run(
        ["bash", str(ROOT / "examples" / "go" / "build.sh"), str(work)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    return work / "bin" / "shardledger-go"


def _go(binary: Path, *args: str) -> tuple[int, list[dict[str, Any]], str]:
    done = subprocess.run(
        [str(binary), *args], capture_output=True, text=True, timeout=120, check=False
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    return done.returncode, lines, done.stderr


def _entries() -> list[PlanEntry]:
    """The night's plan as the Python SDK derives it."""
    out = []
    for index, shard in enumerate(NIGHT):
        data = shard["input"].encode()
        digest = blake3.blake3(data).hexdigest()
        out.append(
            PlanEntry(
                shard_id=shard_id_for(input_blake3=digest, params=shard["params"]),
                input_ref="/in/" + digest[:12],
                input_bytes=len(data),
                input_blake3=digest,
                params=shard["params"],
                expected_outputs=("weights",),
                plan_index=index,
            )
        )
    return out


def _run_in_python(target: str, run_id: str, out: Path, fates: tuple[str, ...]) -> None:
    """Runs the night's shards of the given fates with the Python SDK."""
    with Ledger(target) as ledger:
        for shard, entry in zip(NIGHT, _entries(), strict=True):
            if shard["fate"] not in fates:
                continue
            job_of = partial(
                ledger.shard,
                run_id,
                entry.shard_id,
                fingerprint=Fingerprint.from_fields(FINGERPRINT),
                expected_outputs=["weights"],
                output_dir=out,
            )
            if shard["fate"] == "fail":
                with pytest.raises(DataError), job_of():
                    raise DataError("bad frame")
                continue
            with job_of() as job:
                path = out / entry.shard_id / "weights.bin"
                path.parent.mkdir(parents=True, exist_ok=True)
                with job.atomic_write(path, name="weights") as f:
                    f.write(entry.shard_id.encode() * 64)


def _status(capsys: pytest.CaptureFixture[str], target: str, run_id: str) -> dict[str, Any]:
    code, out, err = run_cli(capsys, "status", run_id, "--server", target, "--json")
    assert code in (0, 1), err
    summary: dict[str, Any] = json.loads(out)
    # What differs between two runs of one night: their names, clocks and chains (each SDK
    # sends its own heartbeats); the rest is the night.
    for key in ("run_id", "as_of_us", "head_hash", "event_count"):
        summary.pop(key)
    return summary


def test_go_reproduces_the_contract_vectors(go_client: Path) -> None:
    code, lines, err = _go(go_client, "vectors", str(VECTORS))
    assert code == 0, err
    vectors = json.loads(VECTORS.read_text(encoding="utf-8"))
    expected = sum(
        len(vectors[k])
        for k in (
            "jcs",
            "jcs_refused",
            "shard_ids",
            "plan_events",
            "fingerprint_digests",
            "rows",
            "legacy_rows",
        )
    )
    assert lines == [{"check": "vectors", "passed": expected, "failed": []}]


def test_a_night_from_go_is_the_night_from_python_and_their_shards_are_one(
    go_client: Path,
    client: LedgerClient,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = tmp_path / "night.json"
    spec.write_text(json.dumps({"fingerprint": FINGERPRINT, "shards": NIGHT}), encoding="utf-8")
    entries = _entries()

    # Go plans and runs a night; Python runs the shard Go only planned.
    code, lines, err = _go(
        go_client, "night", "-target", client.target, "-run", "night-go",
        "-spec", str(spec), "-out", str(tmp_path / "go-out"),
    )  # fmt: skip
    assert code == 0, (lines, err)
    plans = [line for line in lines if line["step"] == "plan"]
    assert [p["shard_id"] for p in plans] == [e.shard_id for e in entries]
    assert {p["outcome"] for p in plans} == {"APPEND_OUTCOME_APPENDED"}
    resend = next(line for line in lines if line["step"] == "resend")
    assert resend["ok"] and resend["outcome"] == "APPEND_OUTCOME_DUPLICATE"
    error = next(line for line in lines if line["step"] == "error")
    assert error["code"] == "InvalidArgument"
    assert error["reason"] == "FINGERPRINT_DIGEST_MISMATCH"
    assert error["metadata"]["computed"] == fingerprint_digest({"gpu.0.name": "H100"})
    # Go reads the run summary as a typed message.
    summary = next(line for line in lines if line["step"] == "summary")
    assert summary == {
        "step": "summary",
        "submitted": 4,
        "unverified": 2,
        "failed": 1,
        "missing": 1,
        "fingerprint_groups": {fingerprint_digest(FINGERPRINT): 3},
    }
    # Python's plan of the same night is Go's, event for event.
    python_plans = plan_events("night-go", entries)
    assert [e.event_id for e in python_plans] == [p["event_id"] for p in plans]
    again = client.append(python_plans)
    assert {r.outcome for r in again} == {pb.APPEND_OUTCOME_DUPLICATE}
    _run_in_python(client.target, "night-go", tmp_path / "py-out", ("plan",))

    # The reverse: Python plans and runs that shard first; Go plans (duplicates) and runs the rest.
    client.append(plan_events("night-mixed", entries))
    _run_in_python(client.target, "night-mixed", tmp_path / "py-out", ("plan",))
    code, lines, err = _go(
        go_client, "night", "-target", client.target, "-run", "night-mixed",
        "-spec", str(spec), "-out", str(tmp_path / "go-out"),
    )  # fmt: skip
    assert code == 0, (lines, err)
    mixed_plans = [line["outcome"] for line in lines if line["step"] == "plan"]
    assert mixed_plans == ["APPEND_OUTCOME_DUPLICATE"] * len(NIGHT)

    # The same night, Python only.
    client.append(plan_events("night-py", entries))
    _run_in_python(client.target, "night-py", tmp_path / "py-out", ("commit", "fail", "plan"))

    for run_id in ("night-go", "night-mixed", "night-py"):
        states = {v.shard_id: v.state for v in client.shards(run_id)}
        assert states == {
            entries[0].shard_id: "unverified",
            entries[1].shard_id: "unverified",
            entries[2].shard_id: "failed",
            entries[3].shard_id: "unverified",
        }, run_id
    python_night = _status(capsys, client.target, "night-py")
    assert _status(capsys, client.target, "night-go") == python_night
    assert _status(capsys, client.target, "night-mixed") == python_night
    assert python_night["submitted"] == 4
    assert python_night["fingerprint_groups"] == {fingerprint_digest(FINGERPRINT): 4}
