"""Result sets keyed by id, not by order: exactly the shard's input ids, no missing, extra or twice.

A multi-GPU job that gathers its ranks' results in the order they finish
(whoever finishes first appends first) returns the right number of rows in the wrong
order, and a result matched to its input by line number is another sample's.
Results must carry their input's id, and the set of result ids must equal the
set of input ids. `compare_id_sets` is that check on any two collections of
ids (a launcher gathering ranks can call it directly); `check_id_set` reads a
result file first:

    .jsonl / .ndjson   one JSON object per line, the id in ``id_field``
    .npz               the array named ``id_field``
    .parquet           the column ``id_field`` (only where pyarrow is installed)
    anything else      one id per line, the first tab-separated column

A failure is reason ``id_set_mismatch`` with the counts in its detail
(``missing 3, extra 0, duplicated 1, without id 0 of 5000 input ids``), or
``id_set_unreadable`` when the ids cannot be read at all.
"""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from shard_client.checks_registry import CheckResult

__all__ = [
    "ID_SET_MISMATCH",
    "ID_SET_UNREADABLE",
    "IdSetReport",
    "check_id_set",
    "compare_id_sets",
    "read_ids",
]

ID_SET_MISMATCH: Final = "id_set_mismatch"
ID_SET_UNREADABLE: Final = "id_set_unreadable"
# How many ids of each kind a failure's detail names (the counts are always whole).
SHOWN: Final = 5


@dataclass(frozen=True, slots=True)
class IdSetReport:
    """How a result set's ids compare with the input's: counts, and the first ids of each kind."""

    expected: int
    found: int
    missing: tuple[str, ...]
    extra: tuple[str, ...]
    duplicated: tuple[str, ...]
    without_id: int = 0

    @property
    def ok(self) -> bool:
        """Returns whether the result ids are exactly the input ids, each once."""
        return not (self.missing or self.extra or self.duplicated or self.without_id)

    def counts(self) -> dict[str, int]:
        """Returns the counts as a dict (the detail's numbers)."""
        return {
            "expected": self.expected,
            "found": self.found,
            "missing": len(self.missing),
            "extra": len(self.extra),
            "duplicated": len(self.duplicated),
            "without_id": self.without_id,
        }

    def result(self) -> CheckResult:
        """Returns the report as a check result (reason id_set_mismatch with counts)."""
        if self.ok:
            return CheckResult(True, "", f"{self.expected} ids, exactly the input's")
        c = self.counts()
        detail = (
            f"missing {c['missing']}, extra {c['extra']}, duplicated {c['duplicated']},"
            f" without id {c['without_id']} of {c['expected']} input ids ({c['found']} results)"
        )
        for name, ids in (("missing", self.missing), ("extra", self.extra)):
            if ids:
                detail += f"; {name}: {', '.join(ids[:SHOWN])}" + (
                    " ..." if len(ids) > SHOWN else ""
                )
        if self.duplicated:
            detail += f"; duplicated: {', '.join(self.duplicated[:SHOWN])}"
        return CheckResult(False, ID_SET_MISMATCH, detail)


def compare_id_sets(expected: Iterable[str], found: Iterable[str | None]) -> IdSetReport:
    """Returns how the found ids (None: a result without an id) compare with the expected ones."""
    want = Counter(expected)
    results = list(found)
    got = Counter(i for i in results if i is not None)
    without = len(results) - sum(got.values())
    return IdSetReport(
        expected=len(want),
        found=len(results),
        missing=tuple(sorted(set(want) - set(got))),
        extra=tuple(sorted(set(got) - set(want))),
        duplicated=tuple(sorted(i for i, n in got.items() if n > 1)),
        without_id=without,
    )


def read_ids(path: str | Path, *, id_field: str = "id") -> list[str | None]:
    """Returns the ids of a result file in file order (None for a record without one).

    Raises ValueError (or OSError) when the file cannot be read as its kind.
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return _jsonl_ids(p, id_field)
    if suffix == ".npz":
        return _npz_ids(p, id_field)
    if suffix == ".parquet":
        return _parquet_ids(p, id_field)
    with p.open(encoding="utf-8") as fh:
        return [line.rstrip("\n").split("\t")[0] for line in fh if line.strip()]


def _jsonl_ids(path: Path, id_field: str) -> list[str | None]:
    out: list[str | None] = []
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"line {number} is not JSON: {exc}") from None
            value = record.get(id_field) if isinstance(record, dict) else None
            out.append(None if value is None else str(value))
    return out


def _npz_ids(path: Path, id_field: str) -> list[str | None]:
    if importlib.util.find_spec("numpy") is None:
        raise ValueError("reading .npz ids needs numpy (pip install numpy)")
    import numpy as np

    with np.load(path, allow_pickle=False) as data:
        if id_field not in data.files:
            raise ValueError(f"no array {id_field!r} (arrays: {', '.join(data.files)})")
        return [str(v) for v in data[id_field].tolist()]


def _parquet_ids(path: Path, id_field: str) -> list[str | None]:
    if importlib.util.find_spec("pyarrow") is None:
        raise ValueError("reading .parquet ids needs pyarrow, which is not installed")
    import pyarrow.parquet as pq  # type: ignore[import-not-found, unused-ignore]

    column = pq.read_table(path, columns=[id_field]).column(id_field).to_pylist()
    return [None if v is None else str(v) for v in column]


def check_id_set(
    path: str | Path, expected_ids: Iterable[str], *, id_field: str = "id"
) -> CheckResult:
    """Returns whether the result file holds exactly the expected ids, each once."""
    try:
        found = read_ids(path, id_field=id_field)
    except (OSError, ValueError, KeyError) as exc:
        return CheckResult(False, ID_SET_UNREADABLE, f"cannot read the ids of {path}: {exc}")
    return compare_id_sets(expected_ids, found).result()
