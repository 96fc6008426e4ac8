"""A second-language client: examples/go, built from proto/ with Debian's Go, against a live ledger.

The Go client derives shard ids, plan event ids and fingerprint digests from the
contract (docs/contract.md), reproduces the test vectors, and runs a night whose
`shardledger status --json` is the night the Python SDK writes. A shard planned by
one language and run by the other is one shard.

It also writes rows: a differential test feeds hypothesis-generated events of every
kind (tests/contract/event_strategies.py) to `shardledger-go rows` and to the server's
own path, and their rows and hashes must be equal byte for byte; and it sends every
event kind to a live ledger and re-derives each row hash from what ListEvents returns.

CI installs the toolchain (.ci/run); without `go` and `protoc` these tests are skipped.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import blake3
import pytest
from google.protobuf import json_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger_server.chain import GENESIS_HASH, chain_hash, encode_row, row_bytes
from ledger_server.codec import decode_event
from ledger_server.errors import LedgerError
from ledger_server.validation import MAX_TIMESTAMP_US, validate
from shard_client import Ledger
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.canonical import fingerprint_digest
from shard_client.client import LedgerClient
from shard_client.environment import Fingerprint
from shard_client.failures import DataError
from shard_client.ids import PlanEntry, plan_events, shard_id_for
from tests.builders import run_cli
from tests.contract.event_strategies import events

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
            "event_rows",
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


# --- rows, two implementations ------------------------------------------------------

# Enough to meet every rule many times, few enough for a CI run (a few seconds).
DIFFERENTIAL_EXAMPLES = 400


@pytest.fixture(scope="module")
def go_rows(go_client: Path) -> Iterator[Callable[[dict[str, Any]], dict[str, Any]]]:
    """Returns a function that asks one `shardledger-go rows` process for one row."""
    proc = subprocess.Popen(
        [str(go_client), "rows"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        encoding="utf-8",
    )
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout

    def ask(request: dict[str, Any]) -> dict[str, Any]:
        stdin.write(json.dumps(request, ensure_ascii=False) + "\n")
        stdin.flush()
        line = stdout.readline()
        assert line, f"shardledger-go rows exited with {proc.poll()}"
        answer: dict[str, Any] = json.loads(line)
        return answer

    yield ask
    stdin.close()
    assert proc.wait(timeout=30) == 0


@settings(
    max_examples=DIFFERENTIAL_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    msg=events(),
    run_sequence=st.sampled_from([1, 2**53 - 1, 2**53, 2**53 + 1, 2**63 - 1])
    | st.integers(1, 2**63 - 1),
    receive_time_us=st.integers(0, MAX_TIMESTAMP_US),
    prev=st.binary(min_size=32, max_size=32),
)
def test_go_and_python_write_the_same_row_for_any_event(
    go_rows: Callable[[dict[str, Any]], dict[str, Any]],
    msg: pb.ShardEvent,
    run_sequence: int,
    receive_time_us: int,
    prev: bytes,
) -> None:
    try:
        valid = validate(decode_event(msg))
    except LedgerError as exc:  # the strategies make valid events: a refusal is a bug in them
        raise AssertionError(f"the strategy made an invalid event: {exc}") from exc
    row = encode_row(valid.canonical, run_sequence=run_sequence, receive_time_us=receive_time_us)
    assert row == row_bytes(valid.event, run_sequence=run_sequence, receive_time_us=receive_time_us)
    answer = go_rows(
        {
            "event": json_format.MessageToDict(msg, preserving_proto_field_name=True),
            "run_sequence": run_sequence,
            "receive_time_us": receive_time_us,
            "prev_hash": prev.hex(),
        }
    )
    assert answer == {
        "content": valid.canonical,
        "row": row.decode(),
        "row_hash": chain_hash(prev, row).hex(),
        "read_back": row.decode(),  # Go decodes the row into its ShardEvent and back
    }


def test_go_refuses_a_digest_that_is_not_the_fingerprints(
    go_rows: Callable[[dict[str, Any]], dict[str, Any]],
) -> None:
    msg = pb.ShardEvent(event_id="e", run_id="r", shard_id="s", attempt_id="a")
    msg.started.heartbeat_timeout.seconds = 60
    msg.started.fingerprint["gpu.0.name"] = "H100"
    msg.started.fingerprint_digest = "0" * 64
    answer = go_rows({"event": json_format.MessageToDict(msg), "run_sequence": 1})
    assert "FINGERPRINT_DIGEST_MISMATCH" in answer["error"]


def test_go_sends_every_kind_and_rederives_every_row_hash(
    go_client: Path, client: LedgerClient
) -> None:
    done = subprocess.run(
        [str(go_client), "kinds", "-target", client.target, "-run", "kinds-go"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert done.returncode == 0, (lines, done.stderr)
    summary = lines[-1]
    assert summary["step"] == "kinds" and summary["ok"], lines
    oneof = pb.ShardEvent.DESCRIPTOR.oneofs_by_name["payload"]
    assert sorted(summary["sent"]) == sorted(f.name for f in oneof.fields)
    assert {line["outcome"] for line in lines if line["step"] == "append"} == {
        "APPEND_OUTCOME_APPENDED"
    }
    assert not any(line.get("input_changed") for line in lines if line["step"] == "append")
    # Python reads the same run and re-derives the same chain from the same events.
    events = list(client.list_events("kinds-go"))
    assert len(events) == summary["rows_verified"] == sum(summary["sent"].values())
    prev = GENESIS_HASH
    for event in events:
        row = row_bytes(
            decode_event(event),
            run_sequence=event.run_sequence,
            receive_time_us=event.receive_time.seconds * 1_000_000
            + event.receive_time.nanos // 1000,
        )
        prev = chain_hash(prev, row)
        assert prev == event.row_hash, event.event_id


def test_go_sends_every_kind_through_the_forced_codec(go_client: Path) -> None:
    # grpc 1.33's default codec (github.com/golang/protobuf 1.3 on Debian) panics on any
    # message with a oneof set; the client forces a protobuf API v2 codec on every call.
    code, lines, err = _go(go_client, "codecs")
    assert code == 0, (lines, err)
    forced = next(line for line in lines if line["codec"] == "forced")
    oneof = pb.ShardEvent.DESCRIPTOR.oneofs_by_name["payload"]
    assert set(forced["results"]) >= {f.name for f in oneof.fields}
    assert set(forced["results"].values()) == {"ok"}
