"""What a failed event says about an exception: its failure tag and a one-line message."""

from __future__ import annotations

import json
import re
import traceback
from typing import Final

from shard_client.failures import DataError, InputChanged, Preempted
from shard_client.vocabulary import FailureTag

__all__ = ["MAX_MESSAGE_CHARS", "describe", "failure_tag", "failure_tag_of_output"]

MAX_MESSAGE_CHARS: Final = 8000


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in out and len(out) < 16:
        out.append(current)
        current = current.__cause__ or current.__context__
    return out


def _is_oom(exc: BaseException) -> bool:
    # By class name, so that torch's OutOfMemoryError counts without importing torch.
    named = any(cls.__name__ == "OutOfMemoryError" for cls in type(exc).__mro__)
    return named or isinstance(exc, MemoryError) or "out of memory" in str(exc).lower()


# torch.distributed's own error types (by name: torch is never imported here).
_COLLECTIVE_ERRORS: Final = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")


def _is_collective(exc: BaseException) -> bool:
    # A collective that failed: NCCL's errors, Gloo's (CPU ranks; its messages name the
    # gloo sources, e.g. "gloo/transport/tcp/pair.cc: Connection closed by peer"), or
    # torch.distributed's error types. All of them are tagged nccl: a collective's failure.
    text = str(exc)
    if "NCCL" in text or "nccl" in type(exc).__name__.lower() or "gloo" in text.lower():
        return True
    return any(cls.__name__ in _COLLECTIVE_ERRORS for cls in type(exc).__mro__)


def failure_tag(exc: BaseException) -> FailureTag:
    """Returns an exception's failure tag: preempted, killed, input_changed, oom, data, nccl, unknown."""
    chain = _chain(exc)
    if any(isinstance(e, Preempted) for e in chain):
        return FailureTag.PREEMPTED
    if isinstance(exc, KeyboardInterrupt):
        return FailureTag.KILLED
    if any(isinstance(e, InputChanged) for e in chain):
        return FailureTag.INPUT_CHANGED
    if any(_is_oom(e) for e in chain):
        return FailureTag.OOM
    if any(isinstance(e, DataError | UnicodeDecodeError | json.JSONDecodeError) for e in chain):
        return FailureTag.DATA
    if any(_is_collective(e) for e in chain):
        return FailureTag.NCCL
    return FailureTag.UNKNOWN


# What a process that is not Python prints when it runs out of memory, or its
# collective fails: CUDA's and PyTorch's messages, glibc's, C++'s bad_alloc.
_OOM_TEXT: Final = re.compile(
    r"out of memory|MemoryError|OutOfMemoryError|std::bad_alloc|Cannot allocate memory"
    r"|CUBLAS_STATUS_ALLOC_FAILED|oom-kill",
    re.IGNORECASE,
)
_NCCL_TEXT: Final = re.compile(r"\bNCCL\b|ncclInternalError|ncclSystemError|ncclUnhandled")
_DATA_TEXT: Final = re.compile(r"\b(DataError|UnicodeDecodeError|JSONDecodeError)\b")


def failure_tag_of_output(text: str) -> FailureTag:
    """Returns the failure tag a failed process's last output lines point to: oom, nccl, data or unknown.

    The rules of `failure_tag`, read from text (a child process of `shardledger
    exec`, in any language, has no exception to look at): a traceback's
    exception name or the runtime's own message.
    """
    if _OOM_TEXT.search(text):
        return FailureTag.OOM
    if _DATA_TEXT.search(text):
        return FailureTag.DATA
    if _NCCL_TEXT.search(text):
        return FailureTag.NCCL
    return FailureTag.UNKNOWN


def describe(exc: BaseException) -> str:
    """Returns "Type: message (at file:line)" for a failed event, within the server's limit."""
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" (at {where[0].filename}:{where[0].lineno})" if where else ""
    return f"{type(exc).__name__}: {exc}{at}"[:MAX_MESSAGE_CHARS]
