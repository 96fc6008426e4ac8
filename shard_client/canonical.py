"""The project's canonical JSON encodings, each behind one named function.

docs/contract.md specifies every byte; tests/data/contract_vectors.json pins them.

- `canonical_json`: RFC 8785, the JSON Canonicalization Scheme (JCS). Shard ids, plan
  events, plan lines, params, fingerprint digests and event rows of row format 2 are
  computed over it. Integers beyond +-(2**53 - 1) are refused (JCS numbers are IEEE
  doubles); the event layer writes such integers as decimal strings instead.
- `legacy_json`: row format 1, Python's `json` with sorted keys, no spaces, UTF-8 kept
  and Python's float repr. Rows written before RFC 8785 was adopted re-derive their
  bytes with it; stored caches (shard records) and deprecated JSON fields keep it.
- `legacy_fingerprint_json`: the digest encoding of fingerprint schema 2 before RFC
  8785 (non-ASCII escaped), accepted from clients that still send it.

RFC 8785 comes from the `rfc8785` package, which is pure Python and slow; a value
that holds no integer past 2**53 and no key whose UTF-16 order could differ from its
code-point order is encoded by the C json encoder instead, its floats written as
ECMAScript does (integral ones as ints, the others repr() prints otherwise through
placeholders), whose output is then the same bytes (tests/sdk/test_canonical.py
checks that property against rfc8785.dumps).
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Callable, Mapping
from typing import Any, Final

import blake3
import rfc8785

__all__ = [
    "MAX_SAFE_INTEGER",
    "canonical_json",
    "canonical_json_bytes",
    "digest_fields",
    "fingerprint_digest",
    "fingerprint_json",
    "jcs_number",
    "legacy_fingerprint_json",
    "legacy_json",
]

# The largest integer every IEEE double holds exactly: the edge of the JCS number domain.
MAX_SAFE_INTEGER: Final = 2**53 - 1

# Built once: json.dumps with options builds a new encoder per call, which costs more
# than encoding an event. check_circular=False: every value encoded here is a tree.
_LEGACY: Final = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False, check_circular=False
)
_LEGACY_FINGERPRINT: Final = json.JSONEncoder(sort_keys=True, separators=(",", ":"))


def _fast_encoder() -> Callable[[Any], str] | None:
    """Returns CPython's C encoder with the legacy options, built once, if it is there.

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
            _LEGACY.default,
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
        return encode if encode(probe) == _LEGACY.encode(probe) else None
    except TypeError:  # a different C signature: the public encoder serves instead
        return None


_ENCODE: Final = _fast_encoder() or _LEGACY.encode


class _NeedsJcs(Exception):
    """The value holds something only the full RFC 8785 encoder formats right."""


# Keys made only of characters below the surrogate block sort the same by code point
# (Python) and by UTF-16 code unit (RFC 8785); a key with a character at or above
# U+D800 may not, and a lone surrogate is refused by RFC 8785.
_FIRST_UNSAFE_KEY_CHAR: Final = "\ud800"
# Non-integral floats of at least this magnitude (and below 2**53, past which every
# float is integral) have no exponent in repr() nor in ECMAScript's
# Number.prototype.toString, and both print the same shortest digits.
_MIN_PLAIN_FLOAT: Final = 1e-4
# A float printed otherwise is encoded as a placeholder string, replaced afterwards by
# its ECMAScript text; the prefix is random per process, and a text in which it is
# left over (a string value that held it) is encoded by the rfc8785 package instead.
_TOKEN: Final = "\ue000" + secrets.token_hex(8) + ":"


def es6_number(value: float) -> str:
    """Returns ECMAScript's Number.prototype.toString of a finite float (RFC 8785 3.2.2.3)."""
    if value == 0:
        return "0"
    sign = "-" if value < 0 else ""
    mantissa, _, exponent = repr(abs(value)).partition("e")  # shortest round-trip digits
    whole, _, fraction = mantissa.partition(".")
    if fraction == "0":
        fraction = ""
    all_digits = whole + fraction
    digits = all_digits.lstrip("0")
    # value = 0.DIGITS x 10**n
    n = len(whole) + (int(exponent) if exponent else 0) - (len(all_digits) - len(digits))
    digits = digits.rstrip("0")
    k = len(digits)
    if k <= n <= 21:
        return sign + digits + "0" * (n - k)
    if 0 < n <= 21:
        return sign + digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return sign + "0." + "0" * -n + digits
    e = n - 1
    tail = f"e{'+' if e >= 0 else '-'}{abs(e)}"
    return sign + (digits if k == 1 else digits[0] + "." + digits[1:]) + tail


def jcs_number(value: float) -> str:
    """Returns the RFC 8785 text of a finite float, as canonical_json writes it in a value.

    Integral floats as integers, the others as repr() prints them where that is
    ECMAScript's text too (the cases _plain_float leaves to the C encoder), else
    es6_number. NaN and infinity raise ValueError.
    """
    if value.is_integer():
        if -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER:
            return str(int(value))
    elif _MIN_PLAIN_FLOAT <= abs(value) < math.inf:
        return repr(value)
    elif not math.isfinite(value):
        raise ValueError(f"{value!r} is not a JSON number (RFC 8785 refuses NaN and infinity)")
    return es6_number(value)


def _plain_float(value: float, numbers: list[str]) -> Any:
    """Returns a float as the C encoder writes it like ECMAScript, or raises _NeedsJcs."""
    if value.is_integer():
        if -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER:
            return int(value)  # 1.0 -> 1, -0.0 -> 0, as ECMAScript prints them
    elif abs(value) >= _MIN_PLAIN_FLOAT:
        return value
    elif value != value:  # NaN: refused by the rfc8785 package, with its reason
        raise _NeedsJcs
    if value in (math.inf, -math.inf):
        raise _NeedsJcs
    numbers.append(es6_number(value))
    return f"{_TOKEN}{len(numbers) - 1}"


def _plain_item(item: Any, numbers: list[str]) -> Any:
    """Returns a container or float item as _plain does; other types raise _NeedsJcs."""
    kind = type(item)
    if kind is float:
        return _plain_float(item, numbers)
    if kind is dict:
        return _plain_dict(item, numbers)
    if kind is list or kind is tuple:
        return _plain_list(item, numbers)
    raise _NeedsJcs  # another type: RFC 8785's encoder accepts it or says why not


def _plain_dict(value: dict[Any, Any], numbers: list[str]) -> dict[Any, Any]:
    out: dict[Any, Any] | None = None
    for key, item in value.items():
        if type(key) is not str or (not key.isascii() and max(key) >= _FIRST_UNSAFE_KEY_CHAR):
            raise _NeedsJcs
        kind = type(item)
        # Scalars inline: an event is mostly strings and small ints.
        if kind is str or kind is bool or item is None:
            continue
        if kind is int:
            if -MAX_SAFE_INTEGER <= item <= MAX_SAFE_INTEGER:
                continue
            raise _NeedsJcs
        plain = _plain_item(item, numbers)
        if plain is not item:
            if out is None:
                out = dict(value)
            out[key] = plain
    return value if out is None else out


def _plain_list(value: list[Any] | tuple[Any, ...], numbers: list[str]) -> Any:
    items: list[Any] | None = None
    for index, item in enumerate(value):
        kind = type(item)
        if kind is str or kind is bool or item is None:
            continue
        if kind is int:
            if -MAX_SAFE_INTEGER <= item <= MAX_SAFE_INTEGER:
                continue
            raise _NeedsJcs
        plain = _plain_item(item, numbers)
        if plain is not item:
            if items is None:
                items = list(value)
            items[index] = plain
    return value if items is None else items


def _plain(value: Any, numbers: list[str]) -> Any:
    """Returns the value the C encoder writes as RFC 8785, or raises _NeedsJcs.

    Integral floats become ints; floats repr() prints otherwise than ECMAScript become
    placeholders, their text appended to `numbers`. The value is returned itself (not
    copied) when nothing in it changes.
    """
    kind = type(value)
    if kind is str or kind is bool or value is None:
        return value
    if kind is int:
        if -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER:
            return value
        raise _NeedsJcs
    return _plain_item(value, numbers)


def canonical_json(value: Any) -> str:
    """Returns the RFC 8785 (JCS) text of a value.

    Raises ValueError for NaN or infinity, integers beyond +-(2**53 - 1), lone
    surrogates and anything else JSON cannot hold.
    """
    numbers: list[str] = []
    try:
        plain = _plain(value, numbers)
    except _NeedsJcs:
        return _jcs(value)
    text = _ENCODE(plain)
    if not text.isascii():
        # A lone surrogate reaches the text from a string value; RFC 8785 refuses it, and
        # no UTF-8 row could hold it.
        text.encode("utf-8")  # UnicodeEncodeError, a ValueError, names the surrogate
    if numbers:
        for index, number in enumerate(numbers):
            text = text.replace(f'"{_TOKEN}{index}"', number, 1)
        if _TOKEN in text:  # a string value held the prefix: no placeholder is trusted
            return _jcs(value)
    return text


def canonical_json_bytes(value: Any) -> bytes:
    """Returns `canonical_json(value)` encoded as UTF-8."""
    return canonical_json(value).encode("utf-8")


def _jcs(value: Any) -> str:
    try:
        return rfc8785.dumps(value).decode("utf-8")
    except rfc8785.CanonicalizationError as exc:  # already a ValueError; say it plainly
        if "UTF-8" in str(exc):  # a lone surrogate, as the fast path reports it
            raise UnicodeEncodeError("utf-8", "", 0, 1, "surrogates not allowed") from None
        raise ValueError(str(exc)) from None


def legacy_json(value: Any) -> str:
    """Returns the row-format-1 JSON of a value: sorted keys, no spaces, UTF-8, Python repr."""
    return _ENCODE(value)


def fingerprint_json(fields: Mapping[str, str]) -> bytes:
    """Returns the fingerprint-digest encoding: the RFC 8785 bytes of the map."""
    return canonical_json_bytes(dict(fields))


def legacy_fingerprint_json(fields: Mapping[str, str]) -> bytes:
    """Returns the pre-RFC 8785 digest encoding: sorted keys, no spaces, non-ASCII escaped."""
    return _LEGACY_FINGERPRINT.encode(dict(fields)).encode("utf-8")


# gpu.<N>.uuid and gpu.<N>.ecc.<...>: which board it was and its health, not numerics.
_IDENTITY_KEY: Final = re.compile(r"gpu\.[0-9]+\.(uuid|ecc\..+)", re.DOTALL)


def digest_fields(fields: Mapping[str, str]) -> dict[str, str]:
    """Returns the fields a fingerprint digest covers: all but GPU identity and health."""
    return {k: v for k, v in fields.items() if not _IDENTITY_KEY.fullmatch(k)}


def fingerprint_digest(fields: Mapping[str, str], *, legacy: bool = False) -> str:
    """Returns the fingerprint digest: blake3 hex of the covered fields' RFC 8785 bytes.

    An empty map has no digest (""): an attempt that recorded no fingerprint is in no
    group. `legacy=True` gives the digest older SDKs computed (non-ASCII escaped).
    """
    if not fields:
        return ""
    kept = digest_fields(fields)
    material = legacy_fingerprint_json(kept) if legacy else fingerprint_json(kept)
    return blake3.blake3(material).hexdigest()
