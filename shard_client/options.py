"""The options of one shard context: their caller-facing types, and their defaults in one place.

`ShardOptionKwargs` is what `Ledger.shard(**options)` accepts (mypy checks each
keyword against it); `ShardOptions` holds the defaults and the normalized values
a `Shard` reads. A unit test keeps the two naming the same fields.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final, TypedDict, Unpack

from shard_client.fingerprint import Fingerprint
from shard_client.ids import check_id

__all__ = ["MAX_HEARTBEAT_TIMEOUT_S", "ShardOptionKwargs", "ShardOptions"]

MAX_HEARTBEAT_TIMEOUT_S: Final = 7 * 24 * 3600


class ShardOptionKwargs(TypedDict, total=False):
    """The keyword options of `Ledger.shard`, as a caller passes them; see `ShardOptions`."""

    heartbeat_timeout: float
    heartbeat_interval: float | None
    expected_outputs: Iterable[str] | None
    output_dir: str | os.PathLike[str] | None
    checkpoint_dir: str | os.PathLike[str] | None
    orphan_age_s: float
    sigterm_grace: float | None
    fingerprint: bool | Fingerprint
    progress_timeout: float | None


@dataclass(frozen=True, slots=True)
class ShardOptions:
    """How a shard context behaves; every default of `Ledger.shard` is here."""

    heartbeat_timeout: float = 60.0
    heartbeat_interval: float | None = None
    expected_outputs: tuple[str, ...] | None = None
    output_dir: str | None = None
    checkpoint_dir: str | None = None
    orphan_age_s: float = 300.0
    sigterm_grace: float | None = 30.0
    fingerprint: bool | Fingerprint = True
    progress_timeout: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_timeout <= MAX_HEARTBEAT_TIMEOUT_S:
            raise ValueError("heartbeat_timeout must be > 0 and at most 7 days")
        if self.progress_timeout is not None and not self.progress_timeout > 0:
            raise ValueError("progress_timeout must be > 0 (or None)")
        for name in self.expected_outputs or ():
            check_id("expected output", name)

    @classmethod
    def given(cls, **options: Unpack[ShardOptionKwargs]) -> ShardOptions:
        """Returns the options a caller passed, normalized (tuples, str paths), defaults elsewhere."""
        values: dict[str, Any] = dict(options)
        if values.get("expected_outputs") is not None:
            values["expected_outputs"] = tuple(values["expected_outputs"])
        for key in ("output_dir", "checkpoint_dir"):
            if values.get(key) is not None:
                values[key] = os.fspath(values[key])
        return cls(**values)

    @property
    def interval(self) -> float:
        """Returns the heartbeat interval: the given one, else a quarter of the timeout."""
        return self.heartbeat_interval or self.heartbeat_timeout / 4
