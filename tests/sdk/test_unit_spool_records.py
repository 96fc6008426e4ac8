"""The spool's record framing: whole batches decode, a torn or damaged one does not."""

from __future__ import annotations

from shard_client.spool_records import decode_records, encode_batch, intact_record_after


def test_batches_round_trip_and_intact_data_ends_after_the_last() -> None:
    data = encode_batch([b"a", b"bc"]) + encode_batch([b""])
    assert decode_records(data) == ([b"a", b"bc", b""], len(data))


def test_a_batch_torn_before_its_last_record_is_lost_whole() -> None:
    first = encode_batch([b"kept"])
    torn = encode_batch([b"x" * 10, b"y" * 10])[:-3]
    assert decode_records(first + torn) == ([b"kept"], len(first))
    assert intact_record_after(first + torn, len(first)) is None


def test_a_flipped_byte_stops_decoding_and_a_later_intact_record_is_found() -> None:
    first, second = encode_batch([b"one"]), encode_batch([b"two"])
    damaged = bytearray(first + second)
    damaged[-len(second) - 1] ^= 0xFF  # the last payload byte of the first batch
    assert decode_records(bytes(damaged)) == ([], 0)
    assert intact_record_after(bytes(damaged), 0) == len(first)
