"""The plan's entries: manifest lines or a directory's files parsed, hashed and checked."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

from shard_client.canonical import canonical_json
from shard_client.ids import (
    PlanEntry,
    check_digest,
    duplicate_ids,
    hash_input,
    plan_events,
    shard_id_for,
)
from shard_client.inputs import IDENTITY_KEY, line_identity, local_identity
from shard_client.storage import ObjectInfo, is_remote, store_for
from shardledger_cli.cli import EXIT_PROBLEMS, EXIT_USAGE, CommandError
from shardledger_cli.output import progress

MAX_ERRORS_SHOWN: Final = 20
# path -> the identity _hash_one read of a local input (one plan per process).
_IDENTITIES: dict[str, dict[str, int]] = {}
_RULES_RUN: Final = "plan-check"  # any valid run id: the rules checked do not depend on it
# The server refuses events whose canonical content exceeds 64 KiB; keep room for the envelope.
MAX_ENTRY_CHARS: Final = 60 * 1024


def _parse_line(text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError("must be a JSON object")
    if not isinstance(obj.get("input"), str) or not obj["input"]:
        raise ValueError('needs "input": a non-empty string (a path or a reference)')
    if not isinstance(obj.get("params", {}), dict):
        raise ValueError('"params" must be a JSON object')
    outputs = obj.get("expected_outputs", [])
    if not isinstance(outputs, list) or not all(isinstance(n, str) for n in outputs):
        raise ValueError('"expected_outputs" must be a list of names')
    for key in ("shard_id", "input_blake3"):
        if key in obj and not isinstance(obj[key], str):
            raise ValueError(f'"{key}" must be a string')
    size = obj.get("input_bytes", 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError('"input_bytes" must be a non-negative integer')
    return obj


def _entry(
    obj: dict[str, Any], index: int, digest: tuple[int, str] | None, found: ObjectInfo | None = None
) -> PlanEntry:
    """Returns the entry for a parsed line; digest is (size, blake3) when the input was hashed.

    ``found`` is what the object store said of an object-storage input. The input's
    identity (docs/concepts.md, "Input identity") goes into the event and, as
    ``input_identity``, into the plan line a job is handed back.
    """
    given = obj.get("input_blake3", "")
    if digest is not None:
        if given and given != digest[1]:
            raise ValueError(f"input_blake3 {given} does not match the file ({digest[1]})")
        size, blake = digest
    elif given:
        check_digest("input_blake3", given)
        size, blake = (found.size_bytes if found else obj.get("input_bytes", 0)), given
    elif os.path.isdir(obj["input"]):
        raise ValueError(f"input {obj['input']!r} is a directory: a shard's input is one file")
    else:
        raise ValueError(
            f"input {obj['input']!r} does not exist here and the line has no input_blake3"
        )
    params = obj.get("params", {})
    shard_id = obj.get("shard_id") or shard_id_for(input_blake3=blake, params=params)
    local = _IDENTITIES.get(obj["input"], {}) if digest is not None and not found else {}
    identity = _line_identity(size, blake, local, found)
    if identity:
        obj = {**obj, IDENTITY_KEY: identity}  # what plan measured, over a line's own
    entry = PlanEntry(
        shard_id=shard_id,
        input_ref=obj["input"],
        input_bytes=size,
        input_blake3=blake,
        params=params,
        expected_outputs=tuple(obj.get("expected_outputs", [])),
        plan_line=canonical_json({**obj, "shard_id": shard_id}),
        plan_index=index,
        input_version_id=found.version_id if found else "",
        input_etag=found.etag if found else "",
        input_mtime_ns=local.get("mtime_ns", 0),
        input_inode=local.get("inode", 0),
        input_device=local.get("device", 0),
    )
    entry.check()
    if len(entry.plan_line) + len(canonical_json(entry.definition())) > MAX_ENTRY_CHARS:
        raise ValueError(f"the line is too large (the limit is {MAX_ENTRY_CHARS} characters)")
    _check_server_rules(entry)
    return entry


def _line_identity(
    size: int, blake: str, local: dict[str, int], found: ObjectInfo | None
) -> dict[str, Any]:
    """Returns the identity a plan line carries; empty when plan read nothing of the input."""
    if not local and found is None:
        return {}
    cheap: dict[str, Any] = dict(local)
    if found is not None:
        cheap.update(version_id=found.version_id, etag=found.etag)
    return line_identity(size, blake, cheap)


def _check_server_rules(entry: PlanEntry) -> None:
    """Raises ValueError when the ledger would refuse the entry's planned event.

    The server's own validation runs here, so a line it would refuse stops the
    whole plan before anything is sent instead of leaving a hole in it.
    """
    from ledger_server.codec import decode_event
    from ledger_server.errors import LedgerError
    from ledger_server.validation import validate

    try:
        validate(decode_event(plan_events(_RULES_RUN, [entry])[0]))
    except LedgerError as exc:
        raise ValueError(str(exc)) from None


def _read_manifest(path: str) -> list[tuple[int, str]]:
    try:
        if path == "-":
            lines = sys.stdin.read().splitlines()
        else:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise CommandError(f"cannot read manifest {path}: {exc}") from None
    return [(number, text) for number, text in enumerate(lines, 1) if text.strip()]


def entries_from_manifest(path: str, *, workers: int) -> list[PlanEntry]:
    """Parses, hashes and checks every manifest line; raises CommandError listing the bad ones."""
    errors: list[str] = []
    parsed: list[tuple[int, dict[str, Any]]] = []
    for number, text in _read_manifest(path):
        try:
            parsed.append((number, _parse_line(text)))
        except ValueError as exc:
            errors.append(f"line {number}: {exc}")
    local = [
        obj["input"]
        for _, obj in parsed
        if not is_remote(obj["input"]) and os.path.isfile(obj["input"])
    ]
    unreadable: dict[str, str] = {}
    digests = _hash_all(local, workers=workers, unreadable=unreadable)
    # An object whose line gives input_blake3 is taken at its word, as before: the
    # store is read only for the objects the plan must hash.
    unhashed = [
        obj["input"] for _, obj in parsed if is_remote(obj["input"]) and not obj.get("input_blake3")
    ]
    objects, remote_digests, problems = _read_objects(
        unhashed, hashed=set(unhashed), workers=workers
    )
    digests.update(remote_digests)
    entries: list[PlanEntry] = []
    for index, (number, obj) in enumerate(parsed):
        if obj["input"] in problems:
            errors.append(f"line {number}: input {obj['input']}: {problems[obj['input']]}")
            continue
        if obj["input"] in unreadable:
            errors.append(f"line {number}: {unreadable[obj['input']]}")
            continue
        try:
            entries.append(_entry(obj, index, digests.get(obj["input"]), objects.get(obj["input"])))
        except (ValueError, TypeError) as exc:
            errors.append(f"line {number}: {exc}")
    numbers = [number for number, _ in parsed]
    for shard_id, indexes in duplicate_ids(entries).items():
        lines = ", ".join(str(numbers[i]) for i in indexes)
        errors.append(f"lines {lines}: shard id {shard_id} appears more than once")
    _raise_errors(path, errors)
    return entries


def _read_objects(
    urls: Sequence[str], *, hashed: set[str], workers: int
) -> tuple[dict[str, ObjectInfo], dict[str, tuple[int, str]], dict[str, str]]:
    """Returns what the store says of each object input, (size, blake3) of those in ``hashed``,
    and why each object that could not be read was not.

    Objects are streamed, never held in memory. Any error of the store (no backend,
    no credentials, unreachable, no such object) makes the input bad: nothing is sent.
    """
    infos: dict[str, ObjectInfo] = {}
    digests: dict[str, tuple[int, str]] = {}
    problems: dict[str, str] = {}

    def read(url: str) -> tuple[ObjectInfo | None, tuple[int, str] | None]:
        store = store_for(url)
        info = store.info(url)
        if info is None or url not in hashed:
            return info, None
        return info, store.digest(url, version_id=info.version_id)

    unique = sorted(set(urls))
    with (
        progress("reading object inputs", len(unique)) as advance,
        ThreadPoolExecutor(max(1, workers)) as pool,
    ):
        for url, future in [(u, pool.submit(read, u)) for u in unique]:
            try:
                info, digest = future.result()
            except Exception as exc:  # botocore's errors are no OSError; each is reported
                problems[url] = f"cannot be read: {exc}"
                continue
            finally:
                advance(1)
            if info is None:
                problems[url] = "no such object"
                continue
            infos[url] = info
            if digest is not None:
                digests[url] = digest
    return infos, digests, problems


def _entries_from_prefix(
    args: argparse.Namespace, params: dict[str, Any], outputs: list[str]
) -> list[PlanEntry]:
    """Plans one shard per object under the --inputs prefix whose key matches --glob."""
    _glob_pattern(args.glob)
    try:
        listed = store_for(args.inputs).list(args.inputs, args.glob.replace("**/", "*"))
    except Exception as exc:  # botocore's errors are no OSError
        raise CommandError(f"--inputs {args.inputs} cannot be listed: {exc}") from None
    urls = [info.url for info in listed]
    objects, digests, problems = _read_objects(urls, hashed=set(urls), workers=args.workers)
    errors = [f"{url}: {why}" for url, why in problems.items()]
    entries = []
    for index, url in enumerate(u for u in urls if u in objects):
        obj = {"input": url, "params": params, "expected_outputs": outputs}
        try:
            entries.append(_entry(obj, index, digests[url], objects[url]))
        except ValueError as exc:
            errors.append(f"{url}: {exc}")
    for shard_id, indexes in duplicate_ids(entries).items():
        same = ", ".join(urls[i] for i in indexes)
        errors.append(f"{same}: identical content and params give one shard id {shard_id}")
    _raise_errors(args.inputs, errors)
    return entries


def entries_from_dir(args: argparse.Namespace) -> list[PlanEntry]:
    """Plans one shard per file under --inputs (a directory or an object-store prefix) matching --glob."""
    root = Path(args.inputs)
    try:
        params = json.loads(args.params) if args.params else {}
    except json.JSONDecodeError as exc:
        raise CommandError(f"--params is not valid JSON: {exc}", EXIT_USAGE) from None
    if not isinstance(params, dict):
        raise CommandError("--params must be a JSON object", EXIT_USAGE)
    outputs = [n.strip() for n in (args.expected_outputs or "").split(",") if n.strip()]
    if is_remote(args.inputs):
        return _entries_from_prefix(args, params, outputs)
    if not root.is_dir():
        raise CommandError(f"--inputs {args.inputs} is not a directory")
    matched, broken, closed = _glob(root, args.glob)
    if closed:
        # A directory the planner may not list hides its files: never a silent gap.
        shown = "\n  ".join(closed[:MAX_ERRORS_SHOWN])
        raise CommandError(
            f"--inputs {args.inputs}: {len(closed)} director{'y' if len(closed) == 1 else 'ies'}"
            f" cannot be read, nothing was sent:\n  {shown}"
        )
    if broken and not getattr(args, "skip_broken_links", False):
        shown = "\n  ".join(broken[:MAX_ERRORS_SHOWN])
        more = (
            f"\n  ... and {len(broken) - MAX_ERRORS_SHOWN} more"
            if len(broken) > MAX_ERRORS_SHOWN
            else ""
        )
        raise CommandError(
            f"--inputs {args.inputs}: {len(broken)} matching link(s) lead nowhere, nothing was"
            f" sent (--skip-broken-links plans without them):\n  {shown}{more}",
            EXIT_PROBLEMS,
        )
    if broken:
        print(
            f"shardledger: skipped {len(broken)} broken link(s) under {args.inputs}"
            " (--skip-broken-links)",
            file=sys.stderr,
        )
    files = sorted(str(p.resolve()) for p in matched)
    unreadable: dict[str, str] = {}
    digests = _hash_all(files, workers=args.workers, unreadable=unreadable)
    entries, errors = [], [unreadable[path] for path in files if path in unreadable]
    files = [path for path in files if path not in unreadable]
    for index, path in enumerate(files):
        obj = {"input": path, "params": params, "expected_outputs": outputs}
        try:
            entries.append(_entry(obj, index, digests[path]))
        except ValueError as exc:
            errors.append(f"{path}: {exc}")
    for shard_id, indexes in duplicate_ids(entries).items():
        same = ", ".join(files[i] for i in indexes)
        errors.append(f"{same}: identical content and params give one shard id {shard_id}")
    _raise_errors(args.inputs, errors)
    return entries


def _glob(root: Path, pattern: str) -> tuple[list[Path], list[str], list[str]]:
    """Returns what pattern (relative, inside root) matches under root.

    (files, broken links, unreadable directories): a matching symlink that leads nowhere
    (dangling, or a loop) is broken, and a directory that cannot be listed (pathlib's
    glob skips it in silence) is named, each with why.
    """
    _glob_pattern(pattern)
    closed: list[str] = []
    try:
        with os.scandir(root):
            pass
    except OSError as exc:
        closed.append(f"{root}: {exc.strerror or exc}")
    if "**" in pattern or "/" in pattern:
        for _, _, _ in os.walk(
            root, onerror=lambda e: closed.append(f"{e.filename}: {e.strerror or e}")
        ):
            pass
    files, broken = [], []
    for path in root.glob(pattern):
        try:
            os.stat(path)
        except FileNotFoundError:
            broken.append(f"{path}: a dangling link (to {os.readlink(path)})")
            continue
        except OSError as exc:
            broken.append(f"{path}: {exc.strerror or exc}")  # a loop: too many levels of links
            continue
        if path.is_file():
            files.append(path)
    return files, broken, sorted(set(closed))


def _glob_pattern(pattern: str) -> None:
    if not pattern or Path(pattern).is_absolute() or ".." in Path(pattern).parts:
        raise CommandError(
            f"--glob {pattern!r} must be a non-empty pattern relative to --inputs, without '..'",
            EXIT_USAGE,
        )


def _raise_errors(source: str, errors: Sequence[str]) -> None:
    if not errors:
        return
    shown = "\n  ".join(errors[:MAX_ERRORS_SHOWN])
    more = (
        f"\n  ... and {len(errors) - MAX_ERRORS_SHOWN} more"
        if len(errors) > MAX_ERRORS_SHOWN
        else ""
    )
    raise CommandError(f"{source}: {len(errors)} bad line(s), nothing was sent:\n  {shown}{more}")


def _hash_one(path: str) -> tuple[int, str] | str:
    """Returns (size, blake3) of a file, or why it cannot be read.

    The file's identity is read before and after its bytes (and kept in
    _IDENTITIES): a file another pipeline rewrote meanwhile is no input to plan.
    """
    try:
        before = os.stat(path)
        digest = hash_input(path)
        after = os.stat(path)
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    identity = local_identity(after)
    if local_identity(before) != identity or before.st_size != after.st_size:
        return f"{path} changed while it was read: plan again once it is written"
    _IDENTITIES[path] = identity
    return digest


def _hash_all(
    paths: Sequence[str], *, workers: int, unreadable: dict[str, str] | None = None
) -> dict[str, tuple[int, str]]:
    """Hashes the files; one that cannot be read goes into unreadable (path -> why)."""
    unique = sorted(set(paths))
    out: dict[str, tuple[int, str]] = {}
    with (
        progress("hashing inputs", len(unique)) as advance,
        ThreadPoolExecutor(max(1, workers)) as pool,
    ):
        for path, digest in zip(unique, pool.map(_hash_one, unique), strict=True):
            if isinstance(digest, str):
                if unreadable is None:
                    raise CommandError(digest)
                unreadable[path] = digest
            else:
                out[path] = digest
            advance(1)
    return out
