"""Behaviour of the durable spool: ordering, acks, torn tails, crashes, locking."""

from __future__ import annotations

import logging
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shard_client.spool import DAMAGED_SUFFIX, Spool, SpoolLockedError

REPO = Path(__file__).resolve().parents[2]


def subprocess_env() -> dict[str, str]:
    """Returns an environment in which a child imports shard_client from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def segments(directory: Path) -> list[Path]:
    """Returns the spool's segment files in order."""
    return sorted(directory.glob("seg-*.log"))


def encode_record(payload: bytes, *, end_of_batch: bool) -> bytes:
    """Returns one record in the documented on-disk format, written independently of the code."""
    prefix = struct.pack("<IB", len(payload), 1 if end_of_batch else 0)
    return prefix + struct.pack("<I", zlib.crc32(prefix + payload)) + payload


def test_append_pending_ack_round_trip_survives_reopen(tmp_path: Path) -> None:
    with Spool(tmp_path) as spool:
        spool.append([b"a", b"b"])
        spool.append([b"c"])
        spool.append([b""])
        assert spool.pending() == [b"a", b"b", b"c", b""]
        spool.ack(2)
        assert spool.pending() == [b"c", b""]
        assert len(spool) == spool.pending_count() == 2

    with Spool(tmp_path) as reopened:
        assert reopened.pending() == [b"c", b""]
        assert reopened.pending(limit=1) == [b"c"]


def test_acking_everything_deletes_segments_and_numbering_continues(tmp_path: Path) -> None:
    with Spool(tmp_path) as spool:
        spool.append([b"x" * 100, b"y"])
        spool.ack(2)
        assert segments(tmp_path) == []
        assert spool.size_bytes() == 0
        spool.append([b"z"])

    with Spool(tmp_path) as reopened:
        assert reopened.pending() == [b"z"]
        assert segments(tmp_path)[0].name == f"seg-{2:020d}.log"


def test_small_segments_roll_over_and_partial_acks_drop_only_spent_ones(tmp_path: Path) -> None:
    records = [bytes([i]) * 40 for i in range(20)]
    with Spool(tmp_path, max_segment_bytes=128) as spool:
        for record in records:
            spool.append([record])
        rolled = len(segments(tmp_path))
        spool.ack(9)
        assert spool.pending() == records[9:]

    assert rolled > 5
    assert len(segments(tmp_path)) < rolled
    with Spool(tmp_path, max_segment_bytes=128) as reopened:
        assert reopened.pending() == records[9:]


def test_successive_partial_acks_within_one_segment_advance_one_by_one(tmp_path: Path) -> None:
    with Spool(tmp_path) as spool:
        spool.append([b"a", b"b", b"c", b"d"])
        spool.ack(1)
        spool.ack(1)
        assert spool.pending() == [b"c", b"d"]
    with Spool(tmp_path) as reopened:
        reopened.ack(1)
        assert reopened.pending() == [b"d"]


def test_ack_beyond_pending_is_rejected_and_ack_zero_does_nothing(tmp_path: Path) -> None:
    with Spool(tmp_path) as spool:
        spool.append([b"one"])
        with pytest.raises(ValueError, match="cannot ack 2 of 1"):
            spool.ack(2)
        spool.ack(0)
        assert spool.pending() == [b"one"]


def test_non_bytes_records_are_rejected_before_anything_is_written(tmp_path: Path) -> None:
    with Spool(tmp_path) as spool:
        with pytest.raises(TypeError, match="bytes"):
            spool.append([b"ok", "text"])  # type: ignore[list-item]
        with pytest.raises(TypeError):
            spool.append([3])  # type: ignore[list-item]
        assert spool.pending() == []


@pytest.mark.parametrize("cut", [1, 5, 9, 12])
def test_torn_tail_is_dropped_and_later_appends_stay_readable(tmp_path: Path, cut: int) -> None:
    with Spool(tmp_path) as spool:
        spool.append([b"first"])
        spool.append([b"torn-payload"])
    last = segments(tmp_path)[-1]
    os.truncate(last, last.stat().st_size - cut)

    with Spool(tmp_path) as reopened:
        assert reopened.pending() == [b"first"]
        reopened.append([b"after"])
    with Spool(tmp_path) as again:
        assert again.pending() == [b"first", b"after"]


def test_garbage_after_the_last_record_is_ignored(tmp_path: Path) -> None:
    with Spool(tmp_path) as spool:
        spool.append([b"kept"])
    with open(segments(tmp_path)[-1], "ab") as f:
        f.write(os.urandom(3) + b"\xff" * 40)

    with Spool(tmp_path) as reopened:
        assert reopened.pending() == [b"kept"]
        reopened.append([b"next"])
        assert reopened.pending() == [b"kept", b"next"]


def test_flipped_byte_in_last_batch_drops_that_batch_only(tmp_path: Path) -> None:
    with Spool(tmp_path) as spool:
        spool.append([b"good"])
        spool.append([b"will-rot"])
    last = segments(tmp_path)[-1]
    data = bytearray(last.read_bytes())
    data[-3] ^= 0x01
    last.write_bytes(bytes(data))

    with Spool(tmp_path) as reopened:
        assert reopened.pending() == [b"good"]


def test_damage_before_intact_batches_is_kept_in_a_copy_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with Spool(tmp_path) as spool:
        for batch in range(5):
            spool.append([f"batch{batch}-{i}".encode() for i in range(3)])
    last = segments(tmp_path)[-1]
    data = bytearray(last.read_bytes())
    data[len(data) // 5 + 12] ^= 0xFF  # inside batch 1; batches 2-4 stay intact
    last.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="shard_client"), Spool(tmp_path) as reopened:
        assert reopened.pending() == [f"batch0-{i}".encode() for i in range(3)]
    [copy] = tmp_path.glob(f"seg-*.log{DAMAGED_SUFFIX}-*")
    assert copy.read_bytes() == bytes(data)  # every byte, for an operator to recover from
    assert "spool_segment_damaged" in caplog.text and str(copy) in caplog.text


def test_a_torn_tail_is_trimmed_with_a_warning_and_no_copy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with Spool(tmp_path) as spool:
        spool.append([b"first"])
        spool.append([b"torn-payload"])
    last = segments(tmp_path)[-1]
    os.truncate(last, last.stat().st_size - 4)
    with caplog.at_level(logging.WARNING, logger="shard_client"), Spool(tmp_path) as reopened:
        assert reopened.pending() == [b"first"]
    assert "spool_torn_tail_trimmed" in caplog.text
    assert not list(tmp_path.glob(f"*{DAMAGED_SUFFIX}*"))


def test_batch_cut_after_its_first_record_is_dropped_whole(tmp_path: Path) -> None:
    with Spool(tmp_path) as spool:
        spool.append([b"a"])
    # A crash mid-append can leave complete records of an unfinished batch.
    with open(segments(tmp_path)[-1], "ab") as f:
        f.write(
            encode_record(b"b1", end_of_batch=False) + encode_record(b"b2", end_of_batch=True)[:7]
        )

    with Spool(tmp_path) as reopened:
        assert reopened.pending() == [b"a"]


def test_file_size_limit_failure_mid_append_loses_only_that_batch(tmp_path: Path) -> None:
    # RLIMIT_FSIZE makes a real write() fail with EFBIG part-way; done in a child so
    # the limit cannot hit pytest's own files.
    code = """
import resource, signal, sys
from shard_client.spool import Spool
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
spool = Spool(sys.argv[1])
spool.append([b"before"])
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    spool.append([b"x" * 3000, b"y" * 3000])
except OSError as exc:
    print("failed", exc.errno)
spool.append([b"after"])
print(spool.pending())
"""
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        check=True,
    )

    assert out.stdout.splitlines() == ["failed 27", "[b'before', b'after']"]
    with Spool(tmp_path) as reopened:
        assert reopened.pending() == [b"before", b"after"]


def test_second_spool_on_a_locked_directory_fails_fast(tmp_path: Path) -> None:
    with Spool(tmp_path), pytest.raises(SpoolLockedError, match=str(os.getpid())):
        Spool(tmp_path)

    with Spool(tmp_path) as after_close:
        assert after_close.pending() == []


def test_closed_spool_refuses_work(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.close()
    spool.close()

    with pytest.raises(ValueError, match="closed"):
        spool.append([b"x"])


CRASH_CHILD = """
import os, sys
from shard_client.spool import Spool
spool = Spool(sys.argv[1], max_segment_bytes=4096)
batch = int(sys.argv[2])
os.write(1, b"ready\\n")
while True:
    spool.append([f"b{batch}r{i}:".encode() + b"x" * ((batch * 7 + i) % 300) for i in range(1 + batch % 4)])
    os.write(1, f"{batch}\\n".encode())
    batch += 1
"""


def batch_records(batch: int) -> list[bytes]:
    """Returns the records the crash child appends as batch N."""
    return [
        f"b{batch}r{i}:".encode() + b"x" * ((batch * 7 + i) % 300) for i in range(1 + batch % 4)
    ]


@pytest.mark.slow
def test_sigkill_mid_append_keeps_every_returned_batch_exactly_once_in_order(
    tmp_path: Path,
) -> None:
    rng = random.Random()
    written: list[bytes] = []
    batches = acked = least = 0
    for _ in range(4):
        argv = [sys.executable, "-c", CRASH_CHILD, str(tmp_path), str(batches)]
        with subprocess.Popen(argv, stdout=subprocess.PIPE, env=subprocess_env()) as child:
            assert child.stdout is not None
            assert child.stdout.readline() == b"ready\n"
            with pytest.raises(SpoolLockedError, match=str(child.pid)):
                Spool(tmp_path)
            # A few batches are returned before the kill however slow the disk; then the
            # kill lands at a random moment.
            first = [int(child.stdout.readline()) for _ in range(rng.randint(2, 8))]
            least += len(first)
            time.sleep(rng.uniform(0.05, 0.25))
            child.kill()
            returned = first + [int(line) for line in child.stdout.read().split()]
            assert child.wait() == -signal.SIGKILL

        assert returned == list(range(batches, batches + len(returned)))
        confirmed = written + [r for b in returned for r in batch_records(b)]
        # The batch in flight at the kill may have become durable before its line was written.
        in_flight = confirmed + batch_records(batches + len(returned))
        with Spool(tmp_path) as spool:
            pending = spool.pending()
            if pending == confirmed[acked:]:
                written, batches = confirmed, batches + len(returned)
            else:
                assert pending == in_flight[acked:]
                written, batches = in_flight, batches + len(returned) + 1
            step = rng.randrange(len(pending) + 1)
            spool.ack(step)
            acked += step
    assert batches >= least


def frame_prefix(payload: bytes, keep: int) -> bytes:
    """Returns the first bytes of an encoded end-of-batch record, as a crash would leave them."""
    return encode_record(payload, end_of_batch=True)[:keep]


# Room for a few batches per segment, so acks land mid-segment as well as on boundaries.
SEGMENT_BYTES = 200
operations = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.lists(st.binary(max_size=40), max_size=4)),
        st.tuples(st.just("ack"), st.integers(min_value=0, max_value=4)),
        st.just(("reopen", None)),
        st.tuples(st.just("torn_append"), st.integers(min_value=1, max_value=20)),
    ),
    max_size=25,
)


@settings(max_examples=100, deadline=None)
@given(ops=operations)
def test_spool_matches_a_simple_queue_model_across_reopens_and_torn_writes(
    ops: list[tuple[str, object]],
) -> None:
    model: list[bytes] = []
    with tempfile.TemporaryDirectory() as directory:
        spool = Spool(directory, max_segment_bytes=SEGMENT_BYTES)
        try:
            for op, arg in ops:
                if op == "append":
                    assert isinstance(arg, list)
                    spool.append(arg)
                    model += arg
                elif op == "ack":
                    assert isinstance(arg, int)
                    count = min(arg, len(model))
                    spool.ack(count)
                    del model[:count]
                elif op == "reopen" or (op == "torn_append" and not segments(Path(directory))):
                    spool.close()
                    spool = Spool(directory, max_segment_bytes=SEGMENT_BYTES)
                else:
                    assert isinstance(arg, int)
                    spool.close()
                    with open(segments(Path(directory))[-1], "ab") as f:
                        f.write(frame_prefix(b"never-finished", arg))
                    spool = Spool(directory, max_segment_bytes=SEGMENT_BYTES)
                assert spool.pending() == model
                assert len(spool) == len(model)
        finally:
            spool.close()
