"""Errors the SDK raises, keyed by the server's ErrorInfo reason (never by message text).

LedgerClientError
├── LedgerUnavailable          UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED: not reached in time (retryable)
└── LedgerRejected             the server refused the request; ``reason`` says why
    ├── InvalidArgument        INVALID_ARGUMENT: a malformed field (``field``)
    ├── NotFound               NOT_FOUND: e.g. RUN_NOT_FOUND
    ├── Conflict               ALREADY_EXISTS: EVENT_ID_REUSED, PLAN_CONFLICT
    ├── LifecycleError         FAILED_PRECONDITION: the shard's life cycle forbids it
    ├── StoreFault             FAILED_PRECONDITION STORE_*: the ledger cannot write (kept, not refused)
    ├── PermissionDenied       UNAUTHENTICATED / PERMISSION_DENIED
    └── Overloaded             RESOURCE_EXHAUSTED: OVERLOADED (past capacity) or a gRPC limit

A refusal that says when to come back (a ``google.rpc.RetryInfo`` detail: an
overloaded ledger, a store that is away) carries it as ``retry_after_s``.
"""

from __future__ import annotations

from typing import Any, Final

import grpc


class LedgerClientError(Exception):
    """Base of every SDK error."""

    # Seconds the ledger asked the caller to wait before sending again (None: it did not say).
    retry_after_s: float | None = None


class LedgerUnavailable(LedgerClientError):
    """The ledger could not be reached (after retries)."""

    # True when no ledger answered at all: the connection was refused or broken, the name
    # did not resolve (UNAVAILABLE with no ErrorInfo of the ledger's). False for a ledger
    # that answered UNAVAILABLE itself (its store away) or did not answer in time.
    unreachable: bool = False


class LedgerRejected(LedgerClientError):
    """The ledger refused the request."""

    def __init__(
        self, message: str, *, code: grpc.StatusCode, reason: str, metadata: dict[str, str]
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.metadata = metadata

    @property
    def field(self) -> str | None:
        """Returns the offending field for INVALID_ARGUMENT errors."""
        return self.metadata.get("field")


class InvalidArgument(LedgerRejected):
    """A field was malformed."""


class NotFound(LedgerRejected):
    """The run (or another object) does not exist."""


class Conflict(LedgerRejected):
    """The write conflicts with stored data."""


class LifecycleError(LedgerRejected):
    """The shard's life cycle does not allow the event."""


class StoreFault(LedgerRejected):
    """The ledger cannot write (a read-only or damaged store) until an operator acts.

    Says nothing about the events: the sender keeps them (spools) instead of recording
    them as refused, and does not retry in a tight loop.
    """


class PermissionDenied(LedgerRejected):
    """The caller is not authenticated or not allowed."""


class Overloaded(LedgerRejected):
    """The server refused for lack of capacity (reason OVERLOADED, with ``retry_after_s``) or a limit."""


_BY_CODE: Final[dict[grpc.StatusCode, type[LedgerRejected]]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: Conflict,
    grpc.StatusCode.FAILED_PRECONDITION: LifecycleError,
    grpc.StatusCode.UNAUTHENTICATED: PermissionDenied,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
}
# CANCELLED: the SDK cancels no unary call of its own, so the server's side did (a call
# an overloaded server's core dropped before handling it, a shutdown): nothing was
# stored, and every call the SDK sends again is idempotent.
RETRYABLE: Final = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)


def from_rpc_error(exc: grpc.RpcError) -> LedgerClientError:
    """Maps a grpc.RpcError to the SDK's hierarchy (the one place that does)."""
    # Only a failed call pays for the status protos: a read that succeeds never imports them.
    from grpc_status import rpc_status

    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    message = (exc.details() if hasattr(exc, "details") else str(exc)) or ""
    try:
        status = rpc_status.from_call(exc) if isinstance(exc, grpc.Call) else None
    except ValueError:  # a status whose details disagree with the call's own code
        status = None
    return from_status(code, message, list(status.details) if status is not None else [])


def from_status(code: grpc.StatusCode, message: str, details: list[Any]) -> LedgerClientError:
    """Maps a status (its code, message and google.protobuf.Any details) to the SDK's hierarchy.

    A failed call's status and a refused batch's on a StreamAppendEvents stream
    (AppendError, google.rpc.Status's fields) both come here.
    """
    from google.rpc import error_details_pb2

    reason, metadata, retry_after_s = code.name, dict[str, str](), None
    for detail in details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, metadata = info.reason, dict(info.metadata)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            # A negative delay asks for none; whoever waits caps a long one at its own maximum.
            retry_after_s = max(retry.retry_delay.ToNanoseconds() / 1e9, 0.0)
    error: LedgerClientError
    if code in RETRYABLE:
        error = LedgerUnavailable(f"{code.name}: {message}")
        error.unreachable = code == grpc.StatusCode.UNAVAILABLE and not details
    else:
        cls = _BY_CODE.get(code, LedgerRejected)
        if code == grpc.StatusCode.FAILED_PRECONDITION and reason.startswith("STORE_"):
            cls = StoreFault
        error = cls(message or code.name, code=code, reason=reason, metadata=metadata)
    error.retry_after_s = retry_after_s
    return error


def status_code(number: int) -> grpc.StatusCode:
    """Returns the gRPC status code of a google.rpc.Code number (UNKNOWN for one it lacks)."""
    return _CODES.get(number, grpc.StatusCode.UNKNOWN)


_CODES: Final = {code.value[0]: code for code in grpc.StatusCode}
