"""The exceptions with which an attempt ends badly (their tags: `shard_client.classify`).

BaseException
├── Preempted          the SIGTERM grace period ended (not an Exception, like KeyboardInterrupt)
└── Exception
    ├── IncompleteShard    the block ended cleanly without every expected artifact
    ├── InputChanged       the input is not the one planned; tagged "input_changed"
    └── ValueError
        └── DataError      bad input data; tagged "data"
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["DataError", "IncompleteShard", "InputChanged", "Preempted"]


class DataError(ValueError):
    """Bad input data; a shard that fails with it is tagged "data"."""


class IncompleteShard(RuntimeError):
    """A shard block ended cleanly without committing every expected artifact."""

    def __init__(self, message: str, *, run_id: str, shard_id: str, missing: Sequence[str]) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.shard_id = shard_id
        self.missing = tuple(missing)


class InputChanged(RuntimeError):
    """The input is not the one planned (docs/concepts.md, "Input identity").

    Raised on entering a shard whose input differs from its plan (failed(input_changed)
    is recorded first, and nothing was computed); a job that checks again later may
    raise it itself, and its attempt is tagged input_changed.
    """

    def __init__(self, message: str, *, run_id: str, shard_id: str, difference: str) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.shard_id = shard_id
        self.difference = difference


class Preempted(BaseException):
    """Raised in the main thread when the SIGTERM grace period ends.

    A BaseException, like KeyboardInterrupt, so that ``except Exception`` in a
    training loop does not swallow the preemption.
    """
