"""Nightly coverage-guided fuzzing of the in-process decode and validate path with atheris.

    pip install atheris                      # Linux, CPython 3.11+
    python -m tools.campaign.fuzz_atheris -atheris_runs=500000 [CORPUS_DIR ...] [libFuzzer flags]

Each input's first byte picks the shape and the rest is parsed as protobuf:

    even  a ShardEvent:          codec.decode_event -> validation.validate -> LedgerService.append([event])
    odd   an AppendEventsRequest: codec.decode_event per event -> LedgerService.append(events)

LedgerService.append runs on a SQLite store in a temporary directory, where a shard
is planned and an attempt started, so mutated events reach the life-cycle
checks and the commit, not only validation. Bytes that do not parse are
skipped (the server answers them MALFORMED_REQUEST before any of this code
runs). A LedgerError is the domain's answer to bad input; any other exception,
or an acknowledged append that did not store its events, is a crash: atheris
stops and writes the input to crash-<sha1>.

Without a corpus directory the run starts from valid events of every kind
(written to a temporary corpus), so mutations begin from well-formed messages.
Exit codes: 0 when the runs finish clean, 2 when atheris is not installed,
and libFuzzer's own non-zero code on a crash.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

try:
    import atheris
except ImportError:  # the harness imports (and its target runs) without atheris
    atheris = None

INSTALL_HINT: Final = (
    "tools.campaign.fuzz_atheris needs atheris, which is not installed.\n"
    "  pip install atheris        # Linux, CPython 3.11+\n"
    "  python -m tools.campaign.fuzz_atheris -atheris_runs=100000"
)
EXIT_NO_ATHERIS: Final = 2
RUN_ID: Final = "fuzz-run"
SHARD_ID: Final = "fuzz-shard"
ATTEMPT_ID: Final = "fuzz-attempt"


def seed_inputs() -> list[bytes]:
    """Returns valid inputs of every event kind, and one batch, in the harness's framing."""
    from google.protobuf.duration_pb2 import Duration

    from shard_client.api.shardledger.v1 import ledger_pb2 as pb

    digest = "a" * 64
    base = {"run_id": RUN_ID, "shard_id": SHARD_ID, "attempt_id": ATTEMPT_ID}
    payloads: list[dict[str, Any]] = [
        {
            "planned": pb.ShardPlanned(
                input_ref="/in/x", input_bytes=1, input_blake3=digest, expected_outputs=["out"]
            ),
            "attempt_id": "",
            "shard_id": "fuzz-new-shard",
        },
        {"started": pb.AttemptStarted(host="n", pid=1, heartbeat_timeout=Duration(seconds=60))},
        {"heartbeat": pb.Heartbeat(step=1, progress=0.5, metrics={"loss": 0.25})},
        {
            "checkpoint": pb.CheckpointSaved(
                step=1, path="/ck/1.pt", size_bytes=5, blake3_hex=digest
            )
        },
        {
            "artifact_committed": pb.ArtifactCommitted(
                name="out", path="/out/x", size_bytes=5, blake3_hex=digest
            )
        },
        {
            "verified": pb.ArtifactVerified(
                name="out", path="/out/x", blake3_hex=digest, result=pb.VERIFICATION_RESULT_PASSED
            )
        },
        {"failed": pb.AttemptFailed(tag=pb.FAILURE_TAG_OOM, message="CUDA out of memory")},
    ]
    events = []
    for i, payload in enumerate(payloads):
        fields = {**base, "event_id": f"seed-{i}", **payload}
        events.append(pb.ShardEvent(**fields))
    seeds = [b"\x00" + e.SerializeToString() for e in events]
    seeds.append(b"\x01" + pb.AppendEventsRequest(events=events[:3]).SerializeToString())
    return seeds


def make_target(directory: str) -> Callable[[bytes], None]:
    """Returns the function atheris calls per input, appending to a store in directory."""
    from google.protobuf.message import DecodeError

    from ledger_server import codec, validation
    from ledger_server.errors import LedgerError
    from ledger_server.service import LedgerService
    from ledger_server.store.sqlite import SqliteStore
    from shard_client.api.shardledger.v1 import ledger_pb2 as pb

    ledger = LedgerService(SqliteStore(os.path.join(directory, "fuzz.db")))
    # A planned shard with a running attempt: mutated events of the attempt reach the commit.
    start = [pb.ShardEvent.FromString(seed[1:]) for seed in seed_inputs()[:2]]
    start[0].shard_id = SHARD_ID
    for i, msg in enumerate(start):
        msg.event_id = f"setup-{i}"  # the seeds keep their own ids, so they append too
    ledger.append([codec.decode_event(m) for m in start])

    def one_input(data: bytes) -> None:
        if not data:
            return
        try:
            if data[0] % 2 == 0:
                messages = [pb.ShardEvent.FromString(data[1:])]
            else:
                messages = list(pb.AppendEventsRequest.FromString(data[1:]).events)
        except DecodeError:
            return
        try:
            decoded = [codec.decode_event(m) for m in messages]
            if len(decoded) == 1:
                validation.validate(decoded[0])
            before = ledger.last_sequence
            results = ledger.append(decoded, timeout=60)
        except LedgerError:
            return
        appended = sum(r.outcome == "appended" for r in results)
        if len(results) != len(decoded) or ledger.last_sequence < before + appended:
            raise AssertionError(
                f"append acknowledged {len(results)} results for {len(decoded)} events,"
                f" {appended} appended, sequence {before} -> {ledger.last_sequence}"
            )

    return one_input


def _has_corpus(argv: Sequence[str]) -> bool:
    return any(not arg.startswith("-") and os.path.isdir(arg) for arg in argv[1:])


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the fuzzer with libFuzzer arguments (argv[0] is the program name)."""
    args = list(sys.argv if argv is None else argv)
    if atheris is None:
        print(INSTALL_HINT, file=sys.stderr)
        return EXIT_NO_ATHERIS
    work = tempfile.mkdtemp(prefix="shardledger-fuzz-")
    # The code under test is imported here first, so atheris instruments it for coverage.
    with atheris.instrument_imports(include=["ledger_server", "shard_client"]):
        target = make_target(work)
    if not _has_corpus(args):
        corpus = Path(work) / "corpus"
        corpus.mkdir()
        for i, seed in enumerate(seed_inputs()):
            (corpus / f"seed-{i}").write_bytes(seed)
        args.append(str(corpus))
    print(f"fuzzing codec/events/ledger; store and corpus under {work}", file=sys.stderr)
    atheris.Setup(args, target)
    atheris.Fuzz()  # returns only when -atheris_runs is exhausted; a crash exits the process
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
