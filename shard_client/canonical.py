"""The project's canonical JSON encodings, each behind one named function.

Two encodings exist because stored bytes and digests depend on them; changing
either would change shard ids, row hashes or fingerprint digests already on disk.

- `canonical_json`: sorted keys, no spaces, UTF-8 kept (not escaped), NaN refused.
  Shard ids, plan lines, event rows and signed tree heads are computed over it.
- `fingerprint_json`: sorted keys, no spaces, non-ASCII escaped (`\\u00c4`).
  Fingerprint digests (schema 2) are computed over it.

Pure: standard library only, so the SDK and the server share it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Final

__all__ = ["canonical_json", "canonical_json_bytes", "fingerprint_json"]

# Built once: json.dumps with options builds a new encoder per call, which costs more
# than encoding an event. check_circular=False: every value encoded here is a tree.
_CANONICAL: Final = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False, check_circular=False
)
_FINGERPRINT: Final = json.JSONEncoder(sort_keys=True, separators=(",", ":"))


def _fast_encoder() -> Callable[[Any], str] | None:
    """Returns CPython's C encoder with the canonical options, built once, if it is there.

    JSONEncoder.encode builds this object on every call; building it once halves the
    cost of encoding an event. It is used only if it encodes a probe exactly as the
    public encoder does.
    """
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return None
    try:
        c_encode = make(
            None,
            _CANONICAL.default,
            json.encoder.encode_basestring,
            None,
            ":",
            ",",
            True,
            False,
            False,
        )

        def encode(value: Any) -> str:
            return "".join(c_encode(value, 0))

        probe = {"b": [1, 2.5, None, True], "a": {"é": 'x\n"y'}, "c": -1e300}
        return encode if encode(probe) == _CANONICAL.encode(probe) else None
    except TypeError:  # a different C signature: the public encoder serves instead
        return None


_ENCODE: Final = _fast_encoder() or _CANONICAL.encode


def canonical_json(value: Any) -> str:
    """Returns the one JSON text of a value: sorted keys, no spaces, UTF-8 kept.

    Raises ValueError for NaN or infinity, which JSON cannot hold.
    """
    return _ENCODE(value)


def canonical_json_bytes(value: Any) -> bytes:
    """Returns `canonical_json(value)` encoded as UTF-8."""
    return _ENCODE(value).encode("utf-8")


def fingerprint_json(fields: Mapping[str, str]) -> bytes:
    """Returns the fingerprint-digest encoding: sorted keys, no spaces, non-ASCII escaped."""
    return _FINGERPRINT.encode(dict(fields)).encode("utf-8")
