"""Domain errors as gRPC statuses: the one code table, the rich status, the one guard."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from ledger_server.auth import Forbidden, Unauthenticated
from ledger_server.errors import (
    ConflictError,
    EventNotFound,
    EventRejected,
    InvalidEvent,
    LedgerCorrupt,
    LedgerError,
    LifecycleViolation,
    LimitExceeded,
    Overloaded,
    RunNotFound,
    SigningKeyMissing,
    StreamsExhausted,
)
from ledger_server.store.base import StoreError

ERROR_DOMAIN: Final = "shardledger.dev"

# The one table from domain errors to gRPC codes (checked in order: subclasses first).
ERROR_CODES: Final[list[tuple[type[Exception], grpc.StatusCode]]] = [
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (Forbidden, grpc.StatusCode.PERMISSION_DENIED),
    (InvalidEvent, grpc.StatusCode.INVALID_ARGUMENT),
    (LimitExceeded, grpc.StatusCode.INVALID_ARGUMENT),
    (RunNotFound, grpc.StatusCode.NOT_FOUND),
    (EventNotFound, grpc.StatusCode.NOT_FOUND),
    (LedgerCorrupt, grpc.StatusCode.DATA_LOSS),
    (SigningKeyMissing, grpc.StatusCode.FAILED_PRECONDITION),
    (ConflictError, grpc.StatusCode.ALREADY_EXISTS),
    (LifecycleViolation, grpc.StatusCode.FAILED_PRECONDITION),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StreamsExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StoreError, grpc.StatusCode.UNAVAILABLE),
    (LedgerError, grpc.StatusCode.UNAVAILABLE),
]


def code_for(exc: Exception) -> grpc.StatusCode:
    """Returns the gRPC code of a domain error."""
    cause = exc.cause if isinstance(exc, EventRejected) else exc
    if isinstance(cause, StoreError) and cause.permanent:
        # Waiting cannot fix a read-only or damaged file: clients stop retrying and keep
        # their events (the SDK spools them) until an operator acts.
        return grpc.StatusCode.FAILED_PRECONDITION
    for cls, code in ERROR_CODES:
        if isinstance(cause, cls):
            return code
    return grpc.StatusCode.INTERNAL


def rich_status(exc: LedgerError | StoreError) -> grpc.Status:
    """Returns a google.rpc.Status with ErrorInfo (and BadRequest for a bad field)."""
    code = code_for(exc)
    reason = exc.reason
    metadata = exc.metadata if isinstance(exc, LedgerError) else {}
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=metadata))
    details = [info]
    retry_after_s = _retry_after_s(exc)
    if retry_after_s is not None:
        # AIP-193: how long to wait before resending (a store fault: how often its probe
        # retries; an overload: when the committer's queue leaves room, admission.py).
        delay = any_pb2.Any()
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromNanoseconds(int(retry_after_s * 1e9))
        delay.Pack(retry)
        details.append(delay)
    field = metadata.get("field")
    if field:
        bad = any_pb2.Any()
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=str(exc))
        bad.Pack(error_details_pb2.BadRequest(field_violations=[violation]))
        details.append(bad)
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=str(exc), details=details)
    return rpc_status.to_status(status)


def _retry_after_s(exc: LedgerError | StoreError) -> float | None:
    """Returns the delay a refusal advises before a resend, or None when waiting cannot help."""
    if isinstance(exc, StoreError):
        return None if exc.permanent else exc.retry_after_s
    return exc.retry_after_s if isinstance(exc, Overloaded) else None


@contextmanager
def abort_on_error(context: grpc.ServicerContext) -> Iterator[None]:
    """Ends the call with the rich status of any domain or store error raised inside."""
    try:
        yield
    except (LedgerError, StoreError) as exc:
        context.abort_with_status(rich_status(exc))
        raise AssertionError("unreachable") from exc  # abort_with_status always raises
