"""A faulted night of 500 shards and one resume pass converge, and the first pass stays history.

The loop a user runs, through the SDK and the CLI against a real server on real
files: the night runs with every failure form (post-commit corruption, 0-element
arrays, NaN weights, NaN losses, swallowed errors, crashes, shards never started,
jobs that end while the ledger is down), a verify with the wrong --root first,
the right verify, status, the resume list, exactly one rerun of it, verify again.
The night must end 100 % verified with an empty resume list, and the first-pass
figures must read the same before and after the rerun.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ledger_server.config import ServerConfig
from ledger_server.server import RunningServer, create_server
from shard_client import DataError, IncompleteShard, Ledger, LedgerClient, PlanEntry, plan_events
from tests.builders import run_cli

np = pytest.importorskip("numpy")

RUN = "night-500"
SHARDS = 500
# Each failure form hits every FORMS-th shard at its own offset; the others run clean.
FORMS = 25
TRUNCATED, FLIPPED, EMPTY, NAN_WEIGHTS, NAN_LOSS, INCOMPLETE, CRASH, NEVER, OUTAGE = range(1, 10)
BROKEN = {TRUNCATED, FLIPPED, EMPTY, NAN_WEIGHTS, INCOMPLETE, CRASH, NEVER}


class Ledgerd:
    """A real server over one SQLite file that the test can stop and start on the same port."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.port = 0
        self.running: RunningServer | None = None

    def start(self) -> None:
        listen = f"127.0.0.1:{self.port}"
        self.running = create_server(ServerConfig(database=str(self.db), listen=listen))
        self.port = self.running.port

    def stop(self) -> None:
        if self.running is not None:
            self.running.stop(0)
            self.running = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture
def ledgerd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Ledgerd]:
    monkeypatch.setenv("SHARDLEDGER_SPOOL_DIR", str(tmp_path / "spool"))
    monkeypatch.setenv("SHARDLEDGER_EXIT_WAIT", "20")
    server = Ledgerd(tmp_path / "ledger.db")
    server.start()
    yield server
    server.stop()


def shard_id(i: int) -> str:
    return f"s{i:04d}"


def form(i: int) -> int:
    return i % FORMS


def weights(i: int, *, fault: int = 0) -> bytes:
    """Returns a deterministic job's output: the same bytes every run, unless a fault bends it."""
    if fault == EMPTY:
        array = np.zeros((0, 8), dtype=np.float32)  # a swallowed error wrote an empty result
    else:
        array = np.arange(32, dtype=np.float32).reshape(4, 8) + i
        if fault == NAN_WEIGHTS:
            array[1, 2] = np.nan  # the run diverged
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def run_job(ledger: Ledger, root: Path, i: int, *, first_pass: bool) -> None:
    """Runs one attempt of shard i; in the first pass its failure form applies."""
    fault = form(i) if first_pass else 0
    path = root / shard_id(i) / "weights.npy"
    try:
        with ledger.shard(RUN, shard_id(i), fingerprint=False, output_dir=path.parent) as shard:
            shard.progress(1, loss=float("nan") if fault == NAN_LOSS else 0.5)
            if fault == CRASH:
                raise DataError("a corrupt input record")
            if fault == INCOMPLETE:
                return  # an exception swallowed upstream: exit 0 with nothing written
            with shard.atomic_write(path, name="weights") as fh:
                fh.write(weights(i, fault=fault))
    except (DataError, IncompleteShard):
        pass  # the ledger recorded failed(data) / failed(incomplete): that is the point
    if fault == TRUNCATED:
        path.write_bytes(path.read_bytes()[:-7])  # the disk lost the tail after the commit
    elif fault == FLIPPED:
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x40  # bit rot
        path.write_bytes(bytes(data))


def cli(capsys: pytest.CaptureFixture[str], target: str, *argv: str) -> tuple[int, str]:
    code, out, _ = run_cli(capsys, *argv, "--server", target)
    return code, out


def status(capsys: pytest.CaptureFixture[str], target: str) -> dict[str, Any]:
    code, out = cli(capsys, target, "status", RUN, "--json")
    report = dict(json.loads(out))
    # status exits 1 while the run has shards that are not verified, 0 once all are.
    assert code == (0 if report["verified"] == report["submitted"] else 1), out
    return report


@pytest.mark.slow
def test_a_faulted_night_and_one_resume_pass_converge_and_keep_the_first_pass(
    ledgerd: Ledgerd, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "out"
    root.mkdir()
    client = LedgerClient(ledgerd.target)
    entries = [
        PlanEntry(
            shard_id=shard_id(i),
            input_ref=f"/in/{i}",
            input_bytes=1,
            input_blake3="ab" * 32,
            expected_outputs=("weights",),
            plan_index=i,
        )
        for i in range(SHARDS)
    ]
    client.append(plan_events(RUN, entries))

    # The night. Jobs of the OUTAGE form run while the ledger is down: their events wait
    # in the spool and arrive when it is back.
    ledger = Ledger(ledgerd.target, unavailable_after_s=0.2)
    for i in range(SHARDS):
        if form(i) not in (NEVER, OUTAGE):
            run_job(ledger, root, i, first_pass=True)
    ledgerd.stop()
    for i in range(SHARDS):
        if form(i) == OUTAGE:
            run_job(ledger, root, i, first_pass=True)
    ledgerd.start()
    ledger.close()  # waits for the spooled events to be acknowledged

    # A verifier pointed at the wrong directory records nothing.
    wrong = tmp_path / "elsewhere"
    wrong.mkdir()
    code, _ = cli(capsys, ledgerd.target, "verify", RUN, "--root", str(wrong))
    assert code == 5
    assert not [e for e in client.list_events(RUN) if e.HasField("verified")]

    code, _ = cli(capsys, ledgerd.target, "verify", RUN, "--root", str(root))
    assert code == 1  # the night has failures: verify says so
    night = status(capsys, ledgerd.target)
    per_form = SHARDS // FORMS
    broken = per_form * len(BROKEN)
    assert night["submitted"] == SHARDS
    assert night["verified"] == SHARDS - broken
    assert night["missing"] == per_form
    assert night["verify_failures"] == {
        "digest_mismatch": per_form,
        "empty": per_form,
        "nan_or_inf": per_form,
        "size_mismatch": per_form,
    }
    assert night["failure_tags"] == {"data": per_form, "incomplete": per_form}
    assert night["numeric"] == per_form  # NaN losses are flagged, and those jobs still verified
    first = night["first_pass"]
    assert first["closed"]
    assert first["verified"] == SHARDS - broken
    assert first["missing"] == per_form
    # Reported success wrongly: corrupted, empty, NaN weights, and the swallowed error.
    assert first["silent_errors"] == per_form * 5
    assert first["reconciliation_rate"] == (SHARDS - broken) / SHARDS

    # The resume list is exactly the broken shards; one rerun of it converges.
    code, out = cli(capsys, ledgerd.target, "resume", RUN, "--format", "ids")
    assert code == 1  # something must run again
    resumed = out.split()
    assert resumed == [shard_id(i) for i in range(SHARDS) if form(i) in BROKEN]
    rerun = Ledger(ledgerd.target)
    for sid in resumed:
        run_job(rerun, root, int(sid[1:]), first_pass=False)
    rerun.close()
    code, _ = cli(capsys, ledgerd.target, "verify", RUN, "--root", str(root))
    assert code == 0

    after = status(capsys, ledgerd.target)
    assert after["verified"] == SHARDS
    assert after["completion_rate"] == 1.0
    assert after["silent_errors"] == 0
    code, out = cli(capsys, ledgerd.target, "resume", RUN, "--format", "ids")
    assert (code, out.split()) == (0, [])
    # Repairs are not duplicates; nothing was computed twice that had a result.
    assert after["duplicate_shards"] == 0
    assert after["repairs"] == per_form * (len(BROKEN) - 1)  # never-started shards ran once
    assert after["recomputed"] == len(resumed)
    # The first pass is history: the rerun changed none of it.
    assert after["first_pass"] == first
