# Over 450 lines on purpose: the one channel per process, the append stream on it and every RPC method share its lock, its fork hooks and its retry loop.
"""The low-level ledger client: one channel per process, deadlines, retries, typed errors."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

import grpc

from shard_client import backoff
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.api.shardledger.v1 import ledger_pb2_grpc as pb_grpc
from shard_client.errors import (
    LedgerClientError,
    LedgerRejected,
    LedgerUnavailable,
    NotFound,
    Overloaded,
    from_rpc_error,
)

DEFAULT_TARGET: Final = "127.0.0.1:50551"
ENV_TARGET: Final = "SHARDLEDGER_SERVER"
# "0" sends every append as a unary AppendEvents call instead of on a stream.
ENV_APPEND_STREAM: Final = "SHARDLEDGER_APPEND_STREAM"
# After a ledger refused the stream (UNIMPLEMENTED: an older server; STREAMS_EXHAUSTED: it
# holds its most), appends go unary for this long, then the stream is tried again.
STREAM_RECHECK_S: Final = 300.0
# Keepalive every 30 s; the server permits pings every 10 s without calls.
CHANNEL_OPTIONS: Final = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
    ("grpc.enable_retries", 0),
    # gRPC's default reconnect backoff grows to 120 s; a job whose ledger blinked should
    # drain its spool within seconds of the ledger coming back.
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5000),
    # Several replicas behind one DNS name (or a list of addresses) share the load.
    ("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})),
)

if TYPE_CHECKING:
    from datetime import datetime

    from shard_client.stream import AppendStream

T = TypeVar("T")


def channel_target(target: str | Sequence[str]) -> str:
    """Returns a gRPC target for one address, a comma-separated list, or a list of replicas.

    Several HOST:PORT addresses become one ``ipv4:``/``ipv6:`` target that gRPC
    balances round-robin; use ``dns:///name:port`` for replicas behind one DNS name.
    """
    targets = [
        t.strip() for t in (target.split(",") if isinstance(target, str) else target) if t.strip()
    ]
    if len(targets) == 1:
        return targets[0]
    if not targets:
        raise ValueError("no ledger address given")
    scheme = "ipv6:" if all(t.startswith("[") for t in targets) else "ipv4:"
    return scheme + ",".join(targets)


def target_addresses(target: str) -> list[tuple[int, Any]] | None:
    """Returns the socket addresses a gRPC target dials, or None for a form not probed here.

    ``host:port``, ``[v6]:port``, ``ipv4:``/``ipv6:`` lists, ``dns:///host:port`` and
    ``unix:path``; a name resolves as gRPC would (every address it has). A name that
    does not resolve gives no address.
    """
    if target.startswith(("unix:", "unix-abstract:")):
        path = target.split(":", 1)[1].removeprefix("//")
        return [(socket.AF_UNIX, path)] if not target.startswith("unix-abstract:") else None
    body = target
    for prefix in ("ipv4:", "ipv6:", "dns:///", "dns:"):
        if body.startswith(prefix):
            body = body[len(prefix) :]
            break
    found: list[tuple[int, Any]] = []
    for part in body.split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not port.isdigit() or "/" in host:
            return None
        host = host.removeprefix("[").removesuffix("]") or "localhost"
        try:
            # Bytes for an ASCII name: a str would load the IDNA codec first.
            infos = socket.getaddrinfo(
                host.encode("ascii") if host.isascii() else host,
                int(port),
                type=socket.SOCK_STREAM,
            )
        except (socket.gaierror, UnicodeError):
            continue
        found += [(family, address) for family, _, _, _, address in infos]
    return found


def nothing_listens(target: str, *, timeout_s: float = 1.0) -> bool:
    """Returns True only when no address of the target accepts a connection right now.

    A refused connection or a name that does not resolve is "nothing listens"; an
    address that accepts, or does not answer within ``timeout_s`` (maybe slow), or a
    target form this cannot probe, is not. gRPC alone cannot tell: for a while after
    the ledger comes back, a channel in its reconnect backoff still fails calls at once.
    """
    addresses = target_addresses(target)
    if addresses is None:
        return False
    for family, address in addresses:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.settimeout(timeout_s)
            try:
                probe.connect(address)
            except (ConnectionRefusedError, FileNotFoundError):
                continue
            except OSError:
                return False  # unreachable network, a timeout: not known to be absent
            return False  # something accepted
    return True


def default_target() -> str:
    """Returns $SHARDLEDGER_SERVER or the loopback default."""
    return os.environ.get(ENV_TARGET) or DEFAULT_TARGET


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as fh:
        return fh.read()


def channel_credentials(
    *,
    token: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> grpc.ChannelCredentials | None:
    """Returns credentials for the options (PEM file paths), or None for a plain channel.

    Unset options fall back to $SHARDLEDGER_TOKEN, $SHARDLEDGER_TLS_CA,
    $SHARDLEDGER_TLS_CERT and $SHARDLEDGER_TLS_KEY. A token without TLS uses
    gRPC local credentials, which only connect to loopback addresses: gRPC
    refuses to send a token over a plain channel, and so do we.
    """
    token = token or os.environ.get("SHARDLEDGER_TOKEN") or None
    tls_ca = tls_ca or os.environ.get("SHARDLEDGER_TLS_CA") or None
    tls_cert = tls_cert or os.environ.get("SHARDLEDGER_TLS_CERT") or None
    tls_key = tls_key or os.environ.get("SHARDLEDGER_TLS_KEY") or None
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("a client certificate needs both tls_cert and tls_key")
    base: grpc.ChannelCredentials | None = None
    if tls_ca or tls_cert:
        base = grpc.ssl_channel_credentials(
            root_certificates=_read(tls_ca),
            private_key=_read(tls_key),
            certificate_chain=_read(tls_cert),
        )
    elif token:
        base = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    if base is not None and token:
        return grpc.composite_channel_credentials(base, grpc.access_token_call_credentials(token))
    return base


def _retryable(error: LedgerClientError) -> bool:
    """Returns whether a failed call may be sent again as it is."""
    # A refusal past capacity says when the ledger expects room; gRPC's own limits
    # (message size, calls in flight) say nothing of the kind and are not retried here.
    return isinstance(error, LedgerUnavailable) or (
        isinstance(error, Overloaded) and error.retry_after_s is not None
    )


class LedgerClient:
    """Talks to one ledger; safe across threads and forks.

    A gRPC channel must never cross a fork, so the channel is created lazily
    and recreated whenever the process id changes (DataLoader workers,
    launcher pools, torchrun ranks each get their own).
    """

    def __init__(
        self,
        target: str | Sequence[str] | None = None,
        *,
        timeout_s: float = 10.0,
        retry_deadline_s: float = 30.0,
        max_backoff_s: float = backoff.CLIENT_MAX_DELAY_S,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        sleep: Callable[[float], None] = time.sleep,
        stream_appends: bool | None = None,
    ) -> None:
        self.target = channel_target(target or default_target())
        if credentials is None:
            credentials = channel_credentials(
                token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key
            )
        self.timeout_s = timeout_s
        self.retry_deadline_s = retry_deadline_s
        self.max_backoff_s = max_backoff_s
        # How call() waits between tries (a test records the waits instead).
        self.sleep = sleep
        self._credentials = credentials
        self._lock = threading.Lock()
        self._pid = -1
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.LedgerServiceStub | None = None
        if stream_appends is None:
            stream_appends = os.environ.get(ENV_APPEND_STREAM, "1").strip().lower() not in (
                "0",
                "false",
                "no",
                "off",
            )
        # Appends go on one StreamAppendEvents stream per process (shard_client.stream).
        self.stream_appends = stream_appends
        self._stream: AppendStream | None = None
        self._unary_until = 0.0
        _CLIENTS.add(self)

    @property
    def stub(self) -> pb_grpc.LedgerServiceStub:
        """Returns this process's stub, creating the channel after a fork."""
        pid = os.getpid()
        if self._stub is None or self._pid != pid:
            with self._lock:
                if self._stub is None or self._pid != pid:
                    # The parent's channel object is abandoned, not closed: closing
                    # it from the child would touch the parent's gRPC state.
                    if self._credentials is not None:
                        channel = grpc.secure_channel(
                            self.target, self._credentials, options=CHANNEL_OPTIONS
                        )
                    else:
                        channel = grpc.insecure_channel(self.target, options=CHANNEL_OPTIONS)
                    self._channel = channel
                    self._stub = pb_grpc.LedgerServiceStub(channel)
                    self._pid = pid
        assert self._stub is not None
        return self._stub

    def close(self) -> None:
        """Closes this process's append stream and channel."""
        self.end_stream()
        with self._lock:
            if self._channel is not None and self._pid == os.getpid():
                self._channel.close()
            self._channel = None
            self._stub = None

    def call(
        self, fn: Callable[[float], T], *, retry: bool = True, deadline_s: float | None = None
    ) -> T:
        """Runs fn(timeout), retrying UNAVAILABLE, DEADLINE_EXCEEDED and an OVERLOADED refusal.

        Between tries it waits the ledger's RetryInfo delay when the refusal has one,
        else a capped exponential step (backoff.retry_wait); it gives up when the next
        wait would end past the retry deadline.
        """
        give_up = time.monotonic() + (self.retry_deadline_s if deadline_s is None else deadline_s)
        delay = backoff.FIRST_DELAY_S
        while True:
            try:
                return fn(self.timeout_s)
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
            except LedgerClientError as exc:  # a batch's answer on the append stream
                error = exc
            wait = backoff.retry_wait(error.retry_after_s, delay, cap_s=self.max_backoff_s)
            if not retry or not _retryable(error) or time.monotonic() + wait > give_up:
                raise error from None
            self.sleep(wait)
            delay = backoff.grown(delay, self.max_backoff_s)

    # --- the contract, one method per RPC -----------------------------------

    def append(
        self,
        events: Sequence[pb.ShardEvent],
        *,
        retry: bool = True,
        deadline_s: float | None = None,
    ) -> list[pb.AppendResult]:
        """Appends a batch atomically; retries reuse the same event ids, so they are idempotent.

        The batch goes on this process's append stream, or as a unary AppendEvents call
        when streaming is off or the ledger lacks the stream (UNIMPLEMENTED).
        """
        if self.stream_appends and time.monotonic() >= self._unary_until:
            try:
                return self.call(
                    lambda t: self._append_stream().append(events, t),
                    retry=retry,
                    deadline_s=deadline_s,
                )
            except LedgerRejected as exc:
                if exc.code != grpc.StatusCode.UNIMPLEMENTED and exc.reason != "STREAMS_EXHAUSTED":
                    raise
                # An older ledger, or one holding its most streams: nothing was stored, the
                # same batch goes unary, and so do the next ones for a while.
                self._unary_until = time.monotonic() + STREAM_RECHECK_S
                self.end_stream()
        request = pb.AppendEventsRequest(events=list(events))
        response = self.call(
            lambda t: self.stub.AppendEvents(request, timeout=t), retry=retry, deadline_s=deadline_s
        )
        return list(response.results)

    def _append_stream(self) -> AppendStream:
        """Returns this process's open append stream, opening one if there is none."""
        stream = self._stream
        if stream is not None and not stream.ended and self._pid == os.getpid():
            return stream
        stub = self.stub  # (re)creates the channel after a fork
        from shard_client.stream import AppendStream  # only a process that appends pays for it

        with self._lock:
            stream = self._stream
            if stream is None or stream.ended or stream.pid != os.getpid():
                stream = self._stream = AppendStream(stub)
        return stream

    def end_stream(self) -> None:
        """Ends this process's append stream, if open (the next append opens another)."""
        with self._lock:
            stream, self._stream = self._stream, None
        if stream is not None and stream.pid == os.getpid():
            stream.close()

    def _pages(self, rpc: Callable[..., Any], request: Any, field: str) -> Iterator[Any]:
        """Yields the items of every page of a paginated RPC (AIP-158 page tokens)."""
        while True:
            response = self.call(lambda t: rpc(request, timeout=t))
            yield from getattr(response, field)
            if not response.next_page_token:
                return
            request.page_token = response.next_page_token

    def list_events(
        self, run_id: str, *, namespace: str = "", after_sequence: int = 0, page_size: int = 1000
    ) -> Iterator[pb.ShardEvent]:
        """Yields every event of the run after a sequence, page by page."""
        request = pb.ListEventsRequest(
            namespace=namespace, run_id=run_id, after_sequence=after_sequence, page_size=page_size
        )
        return self._pages(self.stub.ListEvents, request, "events")

    def tail(self, run_id: str, *, namespace: str = "", after_sequence: int = 0) -> EventTail:
        """Returns the run's events, then new ones as they commit, until cancelled."""
        request = pb.TailEventsRequest(
            namespace=namespace, run_id=run_id, after_sequence=after_sequence
        )
        return EventTail(self.stub.TailEvents(request))

    def list_runs(self, *, namespace: str = "", page_size: int = 100) -> list[pb.RunInfo]:
        """Returns the namespace's runs, most recently updated first."""
        request = pb.ListRunsRequest(namespace=namespace, page_size=page_size)
        return list(self.call(lambda t: self.stub.ListRuns(request, timeout=t)).runs)

    def close_submission(
        self,
        run_id: str,
        *,
        namespace: str = "",
        reason: str = "",
        expected_shards: int = 0,
        submitted_until: datetime | None = None,
    ) -> pb.AppendResult:
        """Declares that no job of the run will start any more (idempotent).

        Close once every wave was submitted and the scheduler is done with them, or
        give submitted_until (an aware datetime: the end of the night's window).
        Once its planned shards have all ended or never started the run is settled:
        the summary's lifecycle says so, and the alerts about ended runs can fire.
        A closed run refuses new shards (RUN_CLOSED) until reopen_submission.
        """
        life = self._lifecycle(run_id, namespace)
        from shard_client.ids import submission_closed_event  # plan ids: canonical JSON, blake3

        event = submission_closed_event(
            run_id,
            namespace=namespace,
            reason=reason,
            expected_shards=expected_shards,
            submitted_until=submitted_until,
            reopened_at_sequence=life.reopened_at_sequence if life is not None else 0,
        )
        return self.append([event])[0]

    def reopen_submission(
        self, run_id: str, *, namespace: str = "", reason: str = ""
    ) -> pb.AppendResult:
        """Undoes the run's submission close, so that new shards can be planned (idempotent).

        The run is open again until the next close_submission; its lifecycle stops
        saying settled. A run with no close that stands is refused (LifecycleError,
        reason RUN_NOT_CLOSED); a retry of the same reopen is DUPLICATE.
        """
        life = self._lifecycle(run_id, namespace)
        from shard_client.ids import run_reopened_event

        event = run_reopened_event(
            run_id,
            namespace=namespace,
            reason=reason,
            closed_at_sequence=life.submission_closed_at_sequence if life is not None else 0,
            reopened_at_sequence=life.reopened_at_sequence if life is not None else 0,
        )
        return self.append([event])[0]

    def _lifecycle(self, run_id: str, namespace: str) -> pb.RunLifecycle | None:
        """Returns the run's lifecycle, or None for a run the ledger does not have."""
        request = pb.GetRunSummaryRequest(namespace=namespace, run_id=run_id)
        try:
            response = self.call(lambda t: self.stub.GetRunSummary(request, timeout=t))
        except NotFound:
            return None  # the append that follows is refused with RUN_NOT_FOUND
        life: pb.RunLifecycle = response.summary.lifecycle
        return life

    def summary(self, run_id: str, *, namespace: str = "") -> str:
        """Returns the run summary as a JSON text."""
        request = pb.GetRunSummaryRequest(namespace=namespace, run_id=run_id)
        response = self.call(lambda t: self.stub.GetRunSummary(request, timeout=t))
        return str(response.summary_json)

    def run_report(self, run_id: str, *, namespace: str = "") -> pb.GetRunReportResponse:
        """Returns the run's field figures (GPU time, what failures cost, checkpoint advice)."""
        request = pb.GetRunReportRequest(namespace=namespace, run_id=run_id)
        response: pb.GetRunReportResponse = self.call(
            lambda t: self.stub.GetRunReport(request, timeout=t)
        )
        return response

    def compare_runs(
        self, run_ids: list[str], label: str, *, namespace: str = ""
    ) -> pb.CompareRunsResponse:
        """Returns the platform table: the runs' shards grouped by one label's values (docs/metrics.md)."""
        request = pb.CompareRunsRequest(namespace=namespace, run_ids=run_ids, label=label)
        response: pb.CompareRunsResponse = self.call(
            lambda t: self.stub.CompareRuns(request, timeout=t)
        )
        return response

    def shards(
        self, run_id: str, *, namespace: str = "", state: str = "", page_size: int = 1000
    ) -> Iterator[pb.ShardView]:
        """Yields the run's shards (optionally one state) in plan order."""
        request = pb.ListShardsRequest(
            namespace=namespace, run_id=run_id, state=state, page_size=page_size
        )
        return self._pages(self.stub.ListShards, request, "shards")

    def resume(self, run_id: str, *, namespace: str = "") -> Iterator[pb.ResumeEntry]:
        """Yields exactly the planned shards without a confirmed artifact, in plan order."""
        request = pb.StreamResumeListRequest(namespace=namespace, run_id=run_id)
        try:
            for chunk in self.stub.StreamResumeList(request, timeout=max(self.timeout_s, 600)):
                yield from chunk.entries
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Blocks until the channel connects or raises LedgerUnavailable."""
        self.stub  # noqa: B018 - creates the channel
        assert self._channel is not None
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise LedgerUnavailable(
                f"no ledger answered at {self.target} within {timeout_s:g}s"
            ) from None


class EventTail:
    """A run's events as they commit: iterate it; cancel() (any thread) ends the iteration.

    Iteration stops quietly after cancel(); any other end of the stream raises the
    ledger's error. Cancel rather than interrupt: a KeyboardInterrupt raised inside
    gRPC's iterator can leave the channel unable to shut down.
    """

    def __init__(self, call: Any) -> None:
        self._call = call
        self._cancelled = threading.Event()

    def __iter__(self) -> Iterator[pb.ShardEvent]:
        try:
            for response in self._call:
                yield response.event
        except grpc.RpcError as exc:
            if self._cancelled.is_set() and exc.code() == grpc.StatusCode.CANCELLED:
                return
            raise from_rpc_error(exc) from None

    def cancel(self) -> None:
        """Ends the stream; iteration then stops without an error. Idempotent."""
        self._cancelled.set()
        self._call.cancel()


_CLIENTS: weakref.WeakSet[LedgerClient] = weakref.WeakSet()


def _end_streams_before_fork() -> None:
    """Ends every append stream of this process: no gRPC call may be active across a fork."""
    for client in list(_CLIENTS):
        client.end_stream()


# Registered before the sender's hook (this module is imported first), so it runs after
# it: the sender has waited for its append in flight by then.
os.register_at_fork(before=_end_streams_before_fork)
