"""AppendStream: a process's batches as messages on one StreamAppendEvents stream.

A unary AppendEvents pays for a whole gRPC call per batch (setup, headers,
teardown, on the client and on the ledger); a message on an open stream pays
for the message. ``LedgerClient.append`` sends over one stream per process and
falls back to AppendEvents when the ledger lacks the method (UNIMPLEMENTED).

- Each batch gets a ``batch_id``; a reader thread files the answers by it, so
  threads sharing the client (the sender, the orphan drain) each wait for their own.
- An answer that carries an error raises what AppendEvents' status would have
  (``errors.from_status``): the same classes, reasons and ``retry_after_s``.
- No answer within the call's timeout ends the stream: its batch may still commit,
  and the caller's resend on a new stream is idempotent (every event has its id).
  Waiting on a stream that does not answer never sends the same batch twice on it.
- The stream ending (the ledger stopping or gone, a broken connection) fails every
  batch waiting on it with ``LedgerUnavailable``; the next append opens a new one.
- A batch answered UNAVAILABLE or with a store fault (this replica cannot write) ends
  the stream too: the retry's new stream goes through the channel's balancer, which
  may pick another replica, as a unary call's retry would. An OVERLOADED answer keeps it.
- A fork ends the stream first (``LedgerClient``'s fork hook): no gRPC call is
  active across a fork, and each process opens its own.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Final

import grpc

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.errors import (
    LedgerClientError,
    LedgerUnavailable,
    StoreFault,
    from_rpc_error,
    from_status,
    status_code,
)

__all__ = ["AppendStream"]

_CLOSE: Final = object()


class AppendStream:
    """One open StreamAppendEvents call; ``append`` is safe from several threads."""

    def __init__(self, stub: Any) -> None:
        self.pid = os.getpid()
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._answers: dict[int, pb.StreamAppendEventsResponse] = {}
        self._ended: LedgerClientError | None = None
        self._call = stub.StreamAppendEvents(self._outgoing())
        self._reader = threading.Thread(target=self._read, name="shard_client-stream", daemon=True)
        self._reader.start()

    @property
    def ended(self) -> bool:
        """Whether the stream has ended: a new one must be opened."""
        return self._ended is not None

    def _outgoing(self) -> Iterator[pb.StreamAppendEventsRequest]:
        while True:
            request = self._requests.get()
            if request is _CLOSE:
                return
            yield request

    def _read(self) -> None:
        error: LedgerClientError
        try:
            for response in self._call:
                with self._cond:
                    self._answers[response.batch_id] = response
                    self._cond.notify_all()
            error = LedgerUnavailable("UNAVAILABLE: the ledger ended the append stream")
        except grpc.RpcError as exc:
            error = from_rpc_error(exc)
        with self._cond:
            if self._ended is None:
                self._ended = error
            self._cond.notify_all()

    def append(self, events: Sequence[pb.ShardEvent], timeout_s: float) -> list[pb.AppendResult]:
        """Appends a batch atomically; returns its results or raises what the ledger answered."""
        batch_id = next(self._ids)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if self._ended is not None:
                raise self._ended
            self._requests.put(pb.StreamAppendEventsRequest(batch_id=batch_id, events=events))
            while (answer := self._answers.pop(batch_id, None)) is None:
                if self._ended is not None:
                    raise self._ended
                left = deadline - time.monotonic()
                if left <= 0:
                    self._end_locked(
                        LedgerUnavailable(
                            f"DEADLINE_EXCEEDED: no answer on the append stream in {timeout_s:g} s"
                        )
                    )
                    raise self._ended  # type: ignore[misc]
                self._cond.wait(left)
        if answer.HasField("error"):
            status = answer.error
            error = from_status(status_code(status.code), status.message, list(status.details))
            if isinstance(error, (LedgerUnavailable, StoreFault)):
                # This replica cannot write now (its store away, cut off, read-only): the
                # retry opens a new stream, which the channel's balancer may give to another
                # replica, as it would a unary call.
                with self._cond:
                    self._end_locked(error)
            raise error
        return list(answer.appended.results)

    def _end_locked(self, error: LedgerClientError) -> None:
        if self._ended is None:
            self._ended = error
        self._requests.put(_CLOSE)
        self._call.cancel()
        self._cond.notify_all()

    def close(self, join_s: float = 1.0) -> None:
        """Ends the stream: half-closes it (the ledger answers what it read, then ends it OK),
        cancels it if the ledger has not ended it within join_s; waits for its reader."""
        with self._cond:
            if self._ended is None:
                self._ended = LedgerUnavailable("UNAVAILABLE: the append stream was closed")
                self._requests.put(_CLOSE)
            self._cond.notify_all()
        if threading.current_thread() is self._reader:
            return
        self._reader.join(join_s)
        if self._reader.is_alive():  # the ledger did not end it: gone, or too slow
            self._call.cancel()
            self._reader.join(join_s)
