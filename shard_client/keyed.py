"""Results keyed by id across ranks: per-rank JSON Lines files assembled into one output by id.

Ranks finish in any order and each holds a slice of the shard's inputs, so
results concatenated in completion order end up misaligned with their inputs
(results gathered in finishing order, matched to the wrong inputs). Each rank writes its results keyed by input
id (one JSON object a line, the id under ``key``); `assemble` reads every
rank's file, checks that together they hold exactly the shard's input ids (none
missing, none extra, none twice, within a file or across two) and writes one
file ordered as the inputs are.

`check_keyed_ids` is the key-set check on its own; the comparison is
`shard_client.checks_keyed.compare_id_sets`, the one `verify` applies to keyed outputs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from shard_client.atomic import CommitInfo, atomic_write
from shard_client.checks_keyed import compare_id_sets
from shard_client.failures import DataError

__all__ = [
    "KeySetReport",
    "KeyedMismatch",
    "assemble",
    "check_keyed_ids",
    "merge",
    "read_keyed",
]


@dataclass(frozen=True, slots=True)
class KeySetReport:
    """How a set of result ids differs from the input ids (sorted, at most 20 of each named)."""

    missing: tuple[str, ...]
    extra: tuple[str, ...]
    repeated: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """Returns whether the results hold exactly the input ids, each once."""
        return not (self.missing or self.extra or self.repeated)

    def describe(self) -> str:
        """Returns one line naming what differs (empty when nothing does)."""
        parts = []
        for what, ids in (("missing", self.missing), ("extra", self.extra)):
            if ids:
                parts.append(f"{len(ids)} {what} ({', '.join(ids[:20])})")
        if self.repeated:
            parts.append(f"{len(self.repeated)} repeated ({', '.join(self.repeated[:20])})")
        return "; ".join(parts)


class KeyedMismatch(DataError):
    """The ranks' results do not hold exactly the shard's input ids (tagged ``data``)."""

    def __init__(self, report: KeySetReport) -> None:
        super().__init__(f"keyed results differ from the inputs: {report.describe()}")
        self.report = report


def check_keyed_ids(result_ids: Iterable[str], input_ids: Iterable[str]) -> KeySetReport:
    """Returns how the result ids differ from the input ids: missing, extra, repeated."""
    found = compare_id_sets(input_ids, result_ids)
    return KeySetReport(missing=found.missing, extra=found.extra, repeated=found.duplicated)


def read_keyed(path: str | os.PathLike[str], *, key: str = "id") -> list[tuple[str, Any]]:
    """Returns a JSON Lines file's records as (id, record), in file order; raises DataError."""
    out: list[tuple[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{os.fspath(path)}:{number}: not JSON: {exc}") from None
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                raise DataError(f"{os.fspath(path)}:{number}: no string {key!r} field")
            out.append((record[key], record))
    return out


def merge(
    parts: Sequence[str | os.PathLike[str]], *, input_ids: Sequence[str], key: str = "id"
) -> list[str]:
    """Returns the ranks' keyed results as JSON Lines in input order; raises KeyedMismatch.

    The parts together must hold exactly ``input_ids``, each once. Write the
    lines through the shard so the output is committed::

        lines = keyed.merge(parts, input_ids=ids)
        with shard.atomic_write(path, name="results.jsonl", mode="w") as f:
            f.writelines(lines)
    """
    records: dict[str, Any] = {}
    ids: list[str] = []
    for part in parts:
        for record_id, record in read_keyed(part, key=key):
            ids.append(record_id)
            records.setdefault(record_id, record)
    report = check_keyed_ids(ids, input_ids)
    if not report.ok:
        raise KeyedMismatch(report)
    return [json.dumps(records[i], sort_keys=True, ensure_ascii=False) + "\n" for i in input_ids]


def assemble(
    parts: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    input_ids: Sequence[str],
    key: str = "id",
) -> CommitInfo:
    """Writes `merge`'s lines to ``output`` atomically (nothing written on a mismatch)."""
    lines = merge(parts, input_ids=input_ids, key=key)
    result: list[CommitInfo] = []
    with atomic_write(output, mode="w", on_commit=result.append) as f:
        f.writelines(lines)
    return result[0]
