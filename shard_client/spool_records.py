"""The spool's record framing: batches of CRC-guarded records, the last flagged as the batch's end.

A record on disk is ``<u32 length><u8 flags><u32 crc32>`` followed by the
payload; the CRC covers length, flags and payload, so a torn or corrupt header
is caught as surely as a torn payload. The last record of each batch carries
the end-of-batch flag and a batch counts only once that record is intact.
Pure: bytes in, bytes out.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from typing import Final

__all__ = ["MAX_RECORD_BYTES", "decode_records", "encode_batch", "intact_record_after"]

MAX_RECORD_BYTES: Final = 64 * 1024 * 1024
_PREFIX: Final = struct.Struct("<IB")  # length, flags
_CRC: Final = struct.Struct("<I")
_HEADER: Final = struct.Struct("<IBI")
_END_OF_BATCH: Final = 0x01


def _checksum(length_and_flags: bytes, payload: bytes) -> int:
    """Returns the CRC32 that guards one record's header fields and payload."""
    return zlib.crc32(payload, zlib.crc32(length_and_flags))


def encode_batch(records: Sequence[bytes]) -> bytes:
    """Returns the on-disk bytes of one batch, the last record flagged as its end."""
    parts: list[bytes] = []
    for position, record in enumerate(records):
        flags = _END_OF_BATCH if position == len(records) - 1 else 0
        prefix = _PREFIX.pack(len(record), flags)
        parts += [prefix, _CRC.pack(_checksum(prefix, record)), record]
    return b"".join(parts)


def decode_records(data: bytes) -> tuple[list[bytes], int]:
    """Returns the records of complete batches and the offset where intact data ends."""
    records: list[bytes] = []
    batch: list[bytes] = []
    offset = intact_end = 0
    while offset + _HEADER.size <= len(data):
        length, flags, crc = _HEADER.unpack_from(data, offset)
        start = offset + _HEADER.size
        if length > MAX_RECORD_BYTES or start + length > len(data):
            break
        payload = data[start : start + length]
        if crc != _checksum(data[offset : offset + _PREFIX.size], payload):
            break
        batch.append(payload)
        offset = start + length
        if flags & _END_OF_BATCH:
            records += batch
            batch = []
            intact_end = offset
    return records, intact_end


def intact_record_after(data: bytes, offset: int) -> int | None:
    """Returns the offset of the first record after ``offset`` whose CRC holds, if any.

    A crash leaves at most an unfinished batch at a segment's end, with nothing intact
    after it; an intact record further on means the bytes in between were damaged.
    """
    for start in range(offset + 1, len(data) - _HEADER.size + 1):
        length, _, crc = _HEADER.unpack_from(data, start)
        end = start + _HEADER.size + length
        if end <= len(data) and crc == _checksum(
            data[start : start + _PREFIX.size], data[start + _HEADER.size : end]
        ):
            return start
    return None
