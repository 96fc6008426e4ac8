"""The options of one shard context: their caller-facing types, and their defaults in one place.

`ShardOptionKwargs` is what `Ledger.shard(**options)` accepts (mypy checks each
keyword against it); `ShardOptions` holds the defaults and the normalized values
a `Shard` reads. A unit test keeps the two naming the same fields.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypedDict, Unpack, overload

from shard_client.environment import Fingerprint
from shard_client.ids import check_id
from shard_client.inputs import INPUT_CHECKS, PlannedInput
from shard_client.labels import label_problem
from shard_client.ranks import RANK_PLACEHOLDER, RankInfo
from shard_client.ranks import detect as detect_ranks
from shard_client.watchdog import DEFAULT_HANG_GRACE_S, DEFAULT_KILL_GRACE_S, HangPolicy

__all__ = [
    "HANG_GRACE_ENV",
    "HANG_TIMEOUT_ENV",
    "KILL_GRACE_ENV",
    "LOG_FILE_ENV",
    "MAX_HEARTBEAT_TIMEOUT_S",
    "WATCHDOG_ENV",
    "ShardOptionKwargs",
    "ShardOptions",
]

MAX_HEARTBEAT_TIMEOUT_S: Final = 7 * 24 * 3600
# A cluster admin tunes the watchdog for every job without touching their code.
WATCHDOG_ENV: Final = "SHARDLEDGER_WATCHDOG"
HANG_TIMEOUT_ENV: Final = "SHARDLEDGER_HANG_TIMEOUT"
HANG_GRACE_ENV: Final = "SHARDLEDGER_HANG_GRACE"
KILL_GRACE_ENV: Final = "SHARDLEDGER_KILL_GRACE"
LOG_FILE_ENV: Final = "SHARDLEDGER_LOG_FILE"


@overload
def _env_seconds(name: str, default: float) -> float: ...
@overload
def _env_seconds(name: str, default: None) -> float | None: ...
def _env_seconds(name: str, default: float | None) -> float | None:
    """Returns a duration from the environment, else the default; a bad value is an error."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r} is not a number of seconds") from None
    if not value >= 0:
        raise ValueError(f"${name}={raw!r} must be >= 0")
    return value


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
    watchdog: bool
    hang_timeout: float | None
    hang_grace: float | None
    kill_grace: float | None
    log_file: str | os.PathLike[str] | None
    labels: Mapping[str, str] | None
    ranks: RankInfo | bool
    coalesce_progress: bool
    input: str | os.PathLike[str] | Mapping[str, Any] | None
    input_check: str


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
    watchdog: bool = True
    hang_timeout: float | None = None
    hang_grace: float | None = None
    kill_grace: float | None = None
    log_file: str | None = None
    labels: Mapping[str, str] | None = None
    # True: the rank torchrun set ($RANK, $WORLD_SIZE, ...), if any; False: one process.
    ranks: RankInfo | bool = True
    # progress() calls coalesced into at most one heartbeat per interval (shard_client.progress).
    coalesce_progress: bool = True
    # The input the job reads (a path or URL, or its plan line / resume entry, which
    # carries the plan's identity of it): checked at entry (shard_client.inputs).
    input: PlannedInput | None = None
    # "identity" (cheap; re-hash when it differs from a known plan) or "hash" (always).
    input_check: str = "identity"

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_timeout <= MAX_HEARTBEAT_TIMEOUT_S:
            raise ValueError("heartbeat_timeout must be > 0 and at most 7 days")
        for name in ("progress_timeout", "hang_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 (or None)")
        for name in ("hang_grace", "kill_grace"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be >= 0 (or None)")
        for name in self.expected_outputs or ():
            check_id("expected output", name.replace(RANK_PLACEHOLDER, "0"))
        problem = label_problem(self.labels or {})
        if problem:
            raise ValueError(f"labels: {problem}")
        if self.input_check not in INPUT_CHECKS:
            raise ValueError(f"input_check must be one of {', '.join(INPUT_CHECKS)}")

    @classmethod
    def given(cls, **options: Unpack[ShardOptionKwargs]) -> ShardOptions:
        """Returns the options a caller passed, normalized (tuples, str paths), defaults elsewhere."""
        values: dict[str, Any] = dict(options)
        if values.get("expected_outputs") is not None:
            values["expected_outputs"] = tuple(values["expected_outputs"])
        for key in ("output_dir", "checkpoint_dir", "log_file"):
            if values.get(key) is not None:
                values[key] = os.fspath(values[key])
        if values.get("input") is not None:
            values["input"] = PlannedInput.of(values["input"])
        return cls(**values)

    def rank_info(self) -> RankInfo | None:
        """Returns this process's rank in a multi-rank launch, None for a one-process shard."""
        if isinstance(self.ranks, RankInfo):
            info: RankInfo | None = self.ranks
        else:
            info = detect_ranks() if self.ranks else None
        return info if info is not None and info.multi else None

    @property
    def interval(self) -> float:
        """Returns the heartbeat interval: the given one, else a quarter of the timeout."""
        return self.heartbeat_interval or self.heartbeat_timeout / 4

    def hang_policy(self) -> HangPolicy | None:
        """Returns the watchdog's policy (options first, then $SHARDLEDGER_*), None when off."""
        off = os.environ.get(WATCHDOG_ENV, "").strip().lower() in ("0", "off", "false", "no")
        if not self.watchdog or off:
            return None
        grace, kill = self.hang_grace, self.kill_grace
        return HangPolicy(
            hang_timeout=self.hang_timeout or _env_seconds(HANG_TIMEOUT_ENV, None) or None,
            hang_grace=_env_seconds(HANG_GRACE_ENV, DEFAULT_HANG_GRACE_S)
            if grace is None
            else grace,
            kill_grace=_env_seconds(KILL_GRACE_ENV, DEFAULT_KILL_GRACE_S) if kill is None else kill,
            log_file=self.log_file or os.environ.get(LOG_FILE_ENV) or None,
        )
