"""Artifact integrity checks: containment, size, blake3 digest and content sanity."""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import math
import os
import stat
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import blake3

from shard_client.checks_registry import (
    CONTENT_CHECKS,
    CheckResult,
    ContentCheck,
    Validator,
    content_check,
)
from shard_client.vocabulary import VERIFIER_REASONS

__all__ = [
    "CONTENT_CHECKS",
    "VERIFIER_REASONS",
    "CheckResult",
    "ContentCheck",
    "PathOutsideRoot",
    "Validator",
    "content_check",
    "content_verdict",
    "load_entry_point_validators",
    "resolve_within_root",
    "verify_artifact",
]


# VERIFIER_REASONS (shard_client.vocabulary) are failures that describe the verifier
# (where it looked, what it may read), not the artifact's bytes: `shardledger verify`
# records none of them, because a verdict from a verifier pointed at the wrong place
# would condemn a good artifact. Every other reason (missing, size_mismatch,
# digest_mismatch, empty, truncated, ...) is about the artifact and is recorded.


class PathOutsideRoot(ValueError):
    """Raised when an artifact path resolves outside the verification root."""

    def __init__(self, *, path: str, resolved: Path, root: Path) -> None:
        super().__init__(f"{path!r} resolves to {str(resolved)!r}, outside root {str(root)!r}")
        self.path = path
        self.resolved = resolved
        self.root = root


_MMAP_THRESHOLD = 1 << 20


def _fail(reason: str, detail: str) -> CheckResult:
    return CheckResult(passed=False, reason=reason, detail=detail)


def resolve_within_root(root: str | os.PathLike[str], path: str) -> Path:
    """Resolves an artifact path against root and refuses any that lands outside it."""
    base = Path(root).resolve()
    candidate = Path(path)
    # Resolving follows every symlink, so a link inside root that points outside is refused too.
    target = (candidate if candidate.is_absolute() else base / candidate).resolve(strict=False)
    if not target.is_relative_to(base):
        raise PathOutsideRoot(path=path, resolved=target, root=base)
    return target


def verify_artifact(
    *,
    root: str | os.PathLike[str],
    path: str,
    expected_size: int,
    expected_blake3: str,
    media_type: str = "",
    validators: Mapping[str, Validator] | None = None,
) -> CheckResult:
    """Checks one committed artifact against its ledger record, its content rules and validators."""
    try:
        resolved = resolve_within_root(root, path)
    except PathOutsideRoot as exc:
        return _fail("outside_root", str(exc))
    except (OSError, ValueError, RuntimeError) as exc:
        # Embedded NUL bytes raise ValueError; symlink loops raise RuntimeError on 3.11.
        return _fail("not_a_file", f"cannot resolve {path!r}: {exc}")
    try:
        record = _check_record(resolved, size=expected_size, blake3_hex=expected_blake3)
        return record or _check_content(
            resolved, suffix=Path(path).suffix, media_type=media_type, validators=validators or {}
        )
    except PermissionError as exc:
        return _fail("permission_denied", f"the verifier may not read {str(resolved)!r}: {exc}")
    except OSError as exc:
        # Found and then unreadable: an I/O error, or the file was swapped mid-verification.
        return _fail("not_a_file", f"cannot read {str(resolved)!r}: {exc}")


def content_verdict(
    path: Path,
    *,
    size: int,
    suffix: str = "",
    media_type: str = "",
    validators: Mapping[str, Validator] | None = None,
) -> CheckResult:
    """Returns what verify's content checks say about a file of ``size`` bytes, before any commit.

    The checks `verify_artifact` runs after its size and digest match (zero bytes
    is "empty", then the checks for ``suffix`` or ``media_type``), for a writer
    that wants to refuse an output before it reaches its final path
    (`shardledger exec`). Raises OSError when the file cannot be read.
    """
    if size == 0:
        return _fail("empty", "artifact is zero bytes long")
    return _check_content(path, suffix=suffix, media_type=media_type, validators=validators or {})


def _check_record(path: Path, *, size: int, blake3_hex: str) -> CheckResult | None:
    try:
        info = path.stat()
    except (FileNotFoundError, NotADirectoryError) as exc:
        return _fail("missing", f"{exc.strerror}: {str(path)!r}")
    except PermissionError as exc:
        return _fail("permission_denied", f"the verifier may not stat {str(path)!r}: {exc}")
    except OSError as exc:
        return _fail("not_a_file", f"cannot stat {str(path)!r}: {exc}")
    if not stat.S_ISREG(info.st_mode):
        return _fail("not_a_file", f"{str(path)!r} is not a regular file")
    if info.st_size != size:
        return _fail("size_mismatch", f"expected {size} bytes, found {info.st_size}")
    digest = _blake3_hex(path, size=info.st_size)
    if digest != blake3_hex.strip().lower():
        return _fail("digest_mismatch", f"expected blake3 {blake3_hex}, found {digest}")
    if info.st_size == 0:
        # A zero-byte artifact is almost always a writer that died before its first flush.
        return _fail("empty", "artifact is zero bytes long")
    return None


def _blake3_hex(path: Path, *, size: int) -> str:
    # Mapping an empty file fails, and for small files the mmap setup costs more than a read.
    if size < _MMAP_THRESHOLD:
        return blake3.blake3(path.read_bytes()).hexdigest()
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    hasher.update_mmap(path)
    return hasher.hexdigest()


def _check_content(
    path: Path, *, suffix: str, media_type: str, validators: Mapping[str, Validator]
) -> CheckResult:
    with path.open("rb") as fh:
        head = fh.read(16)
    selected = _select_checks(suffix=suffix, media_type=media_type, head=head)
    # User validators run last, so a built-in failure is reported before any opinion of theirs.
    selected += [
        ContentCheck(f"validator:{n}", run, f"validator:{n}") for n, run in validators.items()
    ]
    ran, notes = ["size", "blake3"], []
    for check in selected:
        result = _guarded(check, path) or CheckResult(True, "ok", "")
        if not result.passed:
            return result
        ran.append(check.name)
        notes.append(result.detail)
    return CheckResult(True, "ok", "; ".join(["checked " + ", ".join(ran), *filter(None, notes)]))


def _select_checks(*, suffix: str, media_type: str, head: bytes) -> list[ContentCheck]:
    media = media_type.split(";", 1)[0].strip().lower()
    # A known media type is the committer's explicit word, so it overrides the extension.
    by_media = any(_media_matches(media, check.media_types) for check in CONTENT_CHECKS)
    return [
        check
        for check in CONTENT_CHECKS
        if (
            _media_matches(media, check.media_types)
            if by_media
            else suffix.lower() in check.extensions
        )
        or any(head.startswith(magic) for magic in check.magic)
    ]


def _media_matches(media: str, patterns: frozenset[str]) -> bool:
    return media in patterns or any(
        p.endswith("/*") and media.startswith(p[:-1]) for p in patterns if media
    )


def _guarded(check: ContentCheck, path: Path) -> CheckResult | None:
    try:
        result = check.run(path)
    except Exception as exc:
        # A raising check fails the artifact loudly; it never passes it silently.
        return _fail(check.failure_reason, f"raised {type(exc).__name__}: {exc}")
    if result is not None and not isinstance(result, CheckResult):
        return _fail(check.failure_reason, f"returned {result!r}, expected CheckResult or None")
    if result is not None and not result.passed and check.name.startswith("validator:"):
        # User validators report under their own name, keeping their slug in the detail.
        return _fail(check.failure_reason, f"{result.reason}: {result.detail}")
    return result


class _NonFinite(Exception):
    """A JSON number that is NaN or infinite (Python's json accepts NaN and Infinity)."""


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 overflows to inf
        raise _NonFinite(text)
    return value


def _refuse_constant(name: str) -> Any:
    raise _NonFinite(name)


def _strict_json(data: bytes) -> Any:
    """Parses JSON as the standard has it: NaN, Infinity and overflowing numbers raise _NonFinite."""
    return json.loads(data, parse_constant=_refuse_constant, parse_float=_finite_float)


@content_check("json_invalid", ext=".json", media="application/json")
def _check_json(path: Path) -> CheckResult | None:
    try:
        value = _strict_json(path.read_bytes())
    except _NonFinite as exc:
        return _fail("nan_or_inf", f"{exc} in the JSON (a diverged value written as a number)")
    # A job that wrote its result before computing any writes exactly these.
    if value is None or (isinstance(value, dict | list | str) and not value):
        return _fail("empty", f"the JSON document is {json.dumps(value)}: it holds nothing")
    return None


@content_check("json_invalid", ext=".jsonl .ndjson", media="application/jsonl application/x-ndjson")
def _check_jsonl(path: Path) -> CheckResult | None:
    records = 0
    with path.open("rb") as fh:
        for number, line in enumerate(fh, start=1):
            try:
                if line.strip():
                    _strict_json(line)
                    records += 1
            except _NonFinite as exc:
                return _fail("nan_or_inf", f"line {number}: {exc}")
            except ValueError as exc:
                return _fail("json_invalid", f"line {number}: {exc}")
    return None if records else _fail("empty", "no JSON records, only blank lines")


@content_check("unreadable", ext=".txt .csv .tsv .log", media="text/*")
def _check_text(path: Path) -> CheckResult | None:
    # Read in chunks: a log can be gigabytes, and the first visible byte settles it.
    with path.open("rb") as fh:
        chunk = fh.read(_MMAP_THRESHOLD).removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark
        while chunk:
            if chunk.strip():
                return None
            chunk = fh.read(_MMAP_THRESHOLD)
    return _fail("empty", "text of only whitespace")


@content_check("truncated", ext=".gz .tgz", media="application/gzip", magic=(b"\x1f\x8b",))
def _check_gzip(path: Path) -> CheckResult | None:
    # Reading to the end makes gzip verify the trailer's CRC32 and length.
    with gzip.open(path, "rb") as fh:
        while fh.read(_MMAP_THRESHOLD):
            pass
    return None


# Registered before the torch and numpy checks: .pt and .npz files are zip archives.
@content_check("truncated", ext=".zip", media="application/zip", magic=(b"PK\x03\x04",))
def _check_zip(path: Path) -> CheckResult | None:
    with zipfile.ZipFile(path) as archive:
        bad = archive.testzip()
    return None if bad is None else _fail("truncated", f"zip member {bad!r} fails its CRC")


def load_entry_point_validators(group: str = "shardledger.validators") -> dict[str, Validator]:
    """Loads the validators that installed distributions register under an entry-point group."""
    found: dict[str, Validator] = {}
    for point in sorted(importlib.metadata.entry_points(group=group), key=lambda p: p.value):
        # Two distributions claiming one name is a packaging bug; failing beats picking one.
        twice = _always_failing(f"entry point name {point.name!r} is registered twice")
        found[point.name] = twice if point.name in found else _load_validator(point)
    return found


def _load_validator(point: importlib.metadata.EntryPoint) -> Validator:
    # A validator that cannot be loaded fails every artifact rather than vanishing from the run.
    try:
        loaded = point.load()
    except Exception as exc:
        return _always_failing(f"cannot load {point.value}: {type(exc).__name__}: {exc}")
    return loaded if callable(loaded) else _always_failing(f"{point.value} is not callable")


def _always_failing(detail: str) -> Validator:
    return lambda path: _fail("validator_broken", detail)


# Imported last, for their registrations: the tensor checks follow the zip check above.
from shard_client import checks_images, checks_tensors  # noqa: E402, F401
