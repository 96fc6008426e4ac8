"""The registry of content checks and their result type, shared by every checks module.

`shard_client.checks` (verify_artifact and the file-format checks),
`checks_images` and `checks_tensors` register into `CONTENT_CHECKS` here; checks
run in registration order (checks.py first, then images, then tensors).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

__all__ = ["CONTENT_CHECKS", "CheckResult", "ContentCheck", "Validator", "content_check"]


@dataclass(frozen=True, slots=True)
class CheckResult:
    """The outcome of one check: a pass flag, a machine-readable reason slug and a human detail."""

    passed: bool
    reason: str
    detail: str


Validator: TypeAlias = Callable[[Path], CheckResult | None]


@dataclass(frozen=True, slots=True)
class ContentCheck:
    """A content check and the media types, file extensions and magic numbers that select it.

    A media type ending in ``/*`` (``text/*``) selects every type under it.
    """

    name: str
    run: Validator
    # The reason reported when `run` raises: parsers of arbitrary bytes raise a zoo of types.
    failure_reason: str
    extensions: frozenset[str] = frozenset()
    media_types: frozenset[str] = frozenset()
    magic: tuple[bytes, ...] = ()


# Run in order; extend with `content_check` or by appending a ContentCheck.
CONTENT_CHECKS: list[ContentCheck] = []


def content_check(
    failure_reason: str, *, ext: str = "", media: str = "", magic: tuple[bytes, ...] = ()
) -> Callable[[Validator], Validator]:
    """Registers a function as a content check; ext and media are space-separated lists."""

    def register(run: Validator) -> Validator:
        name = getattr(run, "__name__", repr(run)).removeprefix("_check_")
        selectors = frozenset(ext.lower().split()), frozenset(media.lower().split()), magic
        CONTENT_CHECKS.append(ContentCheck(name, run, failure_reason, *selectors))
        return run

    return register
