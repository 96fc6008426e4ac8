# Over 450 lines on purpose: one method per RPC of the contract, each a thin decode, call and encode around the same scope and status helpers.
"""The gRPC servicer: decode, call the ledger, encode; errors become statuses in rpc_status."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future
from typing import Any, Final, TypeVar

import grpc
import structlog
from google.protobuf import any_pb2, json_format
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status as grpc_rpc_status

from ledger_server import codec
from ledger_server.audit_rpc import AuditRpcMixin
from ledger_server.auth import APPEND, READ, Forbidden, authorize, effective_namespace
from ledger_server.batch import AppendResult
from ledger_server.errors import EventRejected, InvalidEvent, LedgerError
from ledger_server.interceptor import CURRENT_METHOD, CURRENT_PRINCIPAL, RequestInterceptor
from ledger_server.metrics import LedgerMetrics
from ledger_server.rpc_status import ERROR_DOMAIN, abort_on_error
from ledger_server.service import LedgerService
from ledger_server.signing import SigningKey
from ledger_server.validation import check_id, check_nanos
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.api.shardledger.v1 import ledger_pb2_grpc as pb_grpc
from shard_client.canonical import legacy_json

MAX_PAGE_SIZE: Final = 5000
RESUME_CHUNK: Final = 1000
# CompareRuns names at most this many runs (report --by reads --last N, default 20).
MAX_COMPARED_RUNS: Final = 1000
# Bytes of entries in one read response or stream message: a quarter of the 16 MiB message
# limit, so a page of maximal events (64 KiB each) ends early instead of failing the call.
READ_BUDGET_BYTES: Final = 4 * 1024 * 1024
# Events read from the store per step while a ListEvents page fills: a page that stops at
# the byte budget never holds thousands of large rows in memory.
_EVENTS_PER_READ: Final = 256
TAIL_POLL_S: Final = 1.0
# The field path json_format names, one "Failed to parse X field" per level.
_PARSE_FIELD: Final = re.compile(r"Failed to parse (\w+) field")

log = structlog.get_logger("shardledger.server")
_Built = TypeVar("_Built")


def _token(value: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).decode()


def _untoken(token: str) -> Any:
    try:
        return json.loads(base64.urlsafe_b64decode(token.encode()))
    except (ValueError, UnicodeError, RecursionError):
        raise InvalidEvent("page_token", "is not a token this server issued") from None


def _int64(value: Any) -> int:
    """Returns a token's number as an int SQLite can bind, or raises ValueError/TypeError."""
    # Tokens come back from clients: 1e400 (OverflowError) or 2**64 would reach SQLite as UNKNOWN.
    try:
        number = int(value)
    except OverflowError:
        raise ValueError("not a finite number") from None
    if not -(2**63) <= number < 2**63:
        raise ValueError("outside the 64-bit range")
    return number


def built(
    context: grpc.ServicerContext,
    message: str,
    build: Callable[[dict[str, Any]], _Built],
    value: dict[str, Any],
) -> _Built:
    """Returns build(value), or ends the call INTERNAL, naming the field that cannot hold its value.

    A stored value wider than the response field it is copied to (validation should have
    refused it at the door) makes protobuf raise; uncaught, that is an UNKNOWN with no name.
    """
    try:
        return build(value)
    except (json_format.ParseError, ValueError, TypeError) as exc:
        field = ".".join([message, *_PARSE_FIELD.findall(str(exc))])
        log.error("response_field_out_of_range", field=field, error=str(exc))
        info = any_pb2.Any()
        info.Pack(
            error_details_pb2.ErrorInfo(
                reason="RESPONSE_FIELD_OUT_OF_RANGE", domain=ERROR_DOMAIN, metadata={"field": field}
            )
        )
        text = f"{field}: a recorded value does not fit this response field ({exc})"
        status = status_pb2.Status(code=code_pb2.INTERNAL, message=text, details=[info])
        context.abort_with_status(grpc_rpc_status.to_status(status))
        raise AssertionError("unreachable") from exc  # abort_with_status always raises


def entry_bytes(message: Any) -> int:
    """Returns the bytes a message takes as one element of a repeated field: tag, length, body."""
    size = int(message.ByteSize())
    return size + 1 + (size.bit_length() + 6) // 7


class BytePage:
    """Counts the entries of one response against the count limit and the byte budget."""

    __slots__ = ("bytes", "count", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0
        self.bytes = 0

    def admits(self, size: int) -> bool:
        """Returns whether an entry of size bytes fits; the first entry always does."""
        return self.count < self.limit and (
            not self.count or self.bytes + size <= READ_BUDGET_BYTES
        )

    def add(self, size: int) -> None:
        """Counts one entry of size bytes."""
        self.count += 1
        self.bytes += size


# The Timestamps and Durations of an event, by payload: decoding folds their nanos into µs.
_DURATIONS: Final = {"started": "heartbeat_timeout", "checkpoint": "write_duration"}
_TIMESTAMPS: Final = {"submission_closed": "submitted_until"}


def _check_time_parts(msg: pb.ShardEvent) -> None:
    """Raises InvalidEvent for a Timestamp or Duration whose nanos are not a fraction of a second."""
    check_nanos("client_time", msg.client_time.nanos)
    kind = msg.WhichOneof("payload")
    name = _DURATIONS.get(kind or "") or _TIMESTAMPS.get(kind or "")
    if kind and name:
        payload = getattr(msg, kind)
        check_nanos(f"{kind}.{name}", getattr(payload, name).nanos, duration=kind in _DURATIONS)


def _page_size(value: int) -> int:
    if value < 0:
        raise InvalidEvent("page_size", "must not be negative")
    return min(value or 1000, MAX_PAGE_SIZE)


AppendSteps = Generator["Future[list[AppendResult]]", list[AppendResult], pb.AppendEventsResponse]


def drive(steps: AppendSteps, future: Future[list[AppendResult]]) -> pb.AppendEventsResponse:
    """Runs append steps to their answer, waiting for the commit on this thread."""
    try:
        results = future.result()
    except BaseException as exc:  # the commit's error, raised where the steps map it to a status
        return finish(steps, error=exc)
    return finish(steps, results=results)


def finish(
    steps: AppendSteps,
    *,
    results: list[AppendResult] | None = None,
    error: BaseException | None = None,
) -> pb.AppendEventsResponse:
    """Sends the commit's results (or raises its error) into append steps; returns their answer."""
    try:
        if error is not None:
            steps.throw(error)
        else:
            assert results is not None
            steps.send(results)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    raise RuntimeError("append steps waited for a second commit")


class LedgerServicer(AuditRpcMixin, pb_grpc.LedgerServiceServicer):  # type: ignore[misc]
    """Thin adapter from the v1 contract to the LedgerService."""

    def __init__(
        self,
        ledger: LedgerService,
        *,
        signing_key: SigningKey | None = None,
        interceptor: RequestInterceptor | None = None,
        metrics: LedgerMetrics | None = None,
    ) -> None:
        self.ledger = ledger
        self.signing_key = signing_key
        self.interceptor = interceptor
        self.metrics = metrics or LedgerMetrics()

    def _scope(
        self, context: grpc.ServicerContext, action: str, namespace: str, run_id: str
    ) -> str:
        """Returns the namespace the request means, after checking the caller may act on it."""
        principal = CURRENT_PRINCIPAL.get()
        effective = effective_namespace(principal, namespace)
        try:
            authorize(principal, action, namespace=effective, run_id=run_id)
        except Forbidden as exc:
            if self.interceptor is not None:
                self.interceptor.record_denied(exc.reason, CURRENT_METHOD.get(), context.peer())
            raise
        return effective

    def AppendEvents(
        self, request: pb.AppendEventsRequest, context: grpc.ServicerContext
    ) -> pb.AppendEventsResponse:
        steps = self.append_steps(request, context)
        return drive(steps, next(steps))

    def append_steps(
        self, request: pb.AppendEventsRequest, context: grpc.ServicerContext
    ) -> AppendSteps:
        """AppendEvents as steps: yields the commit's future, is sent its results, returns the answer.

        The threaded server waits for the future on the call's thread (drive); the asyncio
        server awaits it on the event loop (ledger_server.aio), so both answer through
        this one path: admission, authorization, decoding, and errors become statuses.
        """
        count = len(request.events)
        # Admitted before anything is decoded: a refusal past capacity costs the least.
        with abort_on_error(context), self.metrics.timed_append(count), self.ledger.admitted(count):
            events = []
            # One authorization per (namespace, run) of the batch, not one per event.
            scopes: dict[tuple[str, str], str] = {}
            for index, msg in enumerate(request.events):
                try:
                    key = (msg.namespace, msg.run_id)
                    scope = scopes.get(key)
                    if scope is None:
                        scope = scopes[key] = self._scope(context, APPEND, *key)
                    msg.namespace = scope
                    _check_time_parts(msg)
                    events.append(codec.decode_event(msg))
                except LedgerError as exc:
                    raise EventRejected(index, exc) from None
            results = yield self.ledger.submit(events)
            response = pb.AppendEventsResponse()
            add, outcomes = response.results.add, codec.OUTCOMES
            # add() fills the repeated field in place: no message built and then copied in.
            for event_id, sequence, outcome, input_changed in results:
                add(
                    event_id=event_id,
                    sequence=sequence,
                    outcome=outcomes[outcome],
                    input_changed=input_changed,
                )
            return response

    def ListEvents(
        self, request: pb.ListEventsRequest, context: grpc.ServicerContext
    ) -> pb.ListEventsResponse:
        with abort_on_error(context):
            ns = self._scope(context, READ, request.namespace, request.run_id)
            after = request.after_sequence
            if request.page_token:
                try:
                    after = _int64(_untoken(request.page_token))
                except (TypeError, ValueError):
                    raise InvalidEvent("page_token", "is not a token this server issued") from None
            page = BytePage(_page_size(request.page_size))
            response = pb.ListEventsResponse()
            full = False
            while not full:
                want = min(page.limit - page.count, _EVENTS_PER_READ)
                rows = self.ledger.list_events(ns, request.run_id, after_sequence=after, limit=want)
                for rec in rows:
                    msg = codec.encode_recorded(rec)
                    size = entry_bytes(msg)
                    if not page.admits(size):
                        full = True
                        break
                    response.events.append(msg)
                    page.add(size)
                    after = rec.sequence
                # A short read is the end of the run; a full page may have more after it.
                if len(rows) < want:
                    break
                full = full or page.count >= page.limit
            if full:
                response.next_page_token = _token(after)
            return response

    def TailEvents(
        self, request: pb.TailEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.TailEventsResponse]:
        after = request.after_sequence
        with abort_on_error(context):
            ns = self._scope(context, READ, request.namespace, request.run_id)
            archived = self.ledger.run(ns, request.run_id).archived
        if archived:
            # An archived run takes no events: its bundle is streamed once, then the tail ends.
            with abort_on_error(context):
                for rec in self.ledger.iter_events(ns, request.run_id):
                    if rec.sequence > after:
                        yield pb.TailEventsResponse(event=codec.encode_recorded(rec))
            return
        while context.is_active():
            # Read the mark before the page, so a commit landing in between wakes us.
            mark = self.ledger.last_sequence
            with abort_on_error(context):
                page = self.ledger.list_events(ns, request.run_id, after_sequence=after, limit=1000)
            for rec in page:
                yield pb.TailEventsResponse(event=codec.encode_recorded(rec))
                after = rec.sequence
            if not page:
                self.ledger.wait_for_commit(mark, TAIL_POLL_S)

    def ListRuns(
        self, request: pb.ListRunsRequest, context: grpc.ServicerContext
    ) -> pb.ListRunsResponse:
        with abort_on_error(context):
            ns = self._scope(context, READ, request.namespace, "")
            rows = self.ledger.list_runs(ns, limit=_page_size(request.page_size))
            return pb.ListRunsResponse(
                runs=[
                    pb.RunInfo(
                        namespace=r.namespace,
                        run_id=r.run_id,
                        event_count=r.event_count,
                        head_hash=r.head_hash,
                        create_time=codec.us_timestamp(r.created_us),
                        update_time=codec.us_timestamp(r.updated_us),
                        archived=r.archived,
                        archive_location=self.ledger.archive_location(r),
                    )
                    for r in rows
                ]
            )

    def GetRunSummary(
        self, request: pb.GetRunSummaryRequest, context: grpc.ServicerContext
    ) -> pb.GetRunSummaryResponse:
        with abort_on_error(context):
            ns = self._scope(context, READ, request.namespace, request.run_id)
            summary = self.ledger.summary(ns, request.run_id)
            return pb.GetRunSummaryResponse(
                summary_json=legacy_json(summary),
                as_of_time=codec.us_timestamp(summary["as_of_us"]),
                summary=built(context, "RunSummary", codec.run_summary_pb, summary),
            )

    def GetRunReport(
        self, request: pb.GetRunReportRequest, context: grpc.ServicerContext
    ) -> pb.GetRunReportResponse:
        with abort_on_error(context):
            ns = self._scope(context, READ, request.namespace, request.run_id)
            report = self.ledger.report(ns, request.run_id)
            return pb.GetRunReportResponse(
                report=built(context, "RunReport", codec.run_report_pb, report),
                as_of_time=codec.us_timestamp(report["as_of_us"]),
            )

    def CompareRuns(
        self, request: pb.CompareRunsRequest, context: grpc.ServicerContext
    ) -> pb.CompareRunsResponse:
        with abort_on_error(context):
            run_ids = list(request.run_ids)
            if not 1 <= len(run_ids) <= MAX_COMPARED_RUNS:
                raise InvalidEvent("run_ids", f"must name 1 to {MAX_COMPARED_RUNS} runs")
            if len(set(run_ids)) < len(run_ids):
                raise InvalidEvent("run_ids", "names a run twice")
            ns = request.namespace
            for run_id in run_ids:
                check_id("run_ids", run_id)
                ns = self._scope(context, READ, request.namespace, run_id)
            at = self.ledger.clock()
            groups = self.ledger.compare(ns, run_ids, request.label, now=at)
            return pb.CompareRunsResponse(
                groups=[built(context, "LabelGroup", codec.label_group_pb, g) for g in groups],
                as_of_time=codec.us_timestamp(at),
            )

    def ListShards(
        self, request: pb.ListShardsRequest, context: grpc.ServicerContext
    ) -> pb.ListShardsResponse:
        with abort_on_error(context):
            after: tuple[int, str] | None = None
            if request.page_token:
                try:
                    index, shard_id = _untoken(request.page_token)
                    # The shard id comes back from the client: a NUL or a lone surrogate
                    # would reach the store (UNAVAILABLE on PostgreSQL, UNKNOWN on SQLite).
                    check_id("page_token", shard_id)
                    after = (_int64(index), shard_id)
                except (TypeError, ValueError, InvalidEvent):
                    raise InvalidEvent("page_token", "is not a token this server issued") from None
            ns = self._scope(context, READ, request.namespace, request.run_id)
            page = BytePage(_page_size(request.page_size))
            response = pb.ListShardsResponse()
            last: tuple[int, str] | None = None
            full = False
            for cursor, v in self.ledger.iter_shards(
                ns, request.run_id, state=request.state, after=after
            ):
                msg = pb.ShardView(
                    shard_id=v["shard_id"],
                    state=v["state"],
                    view_json=legacy_json(v),
                    view=built(context, "ShardDetails", codec.shard_details_pb, v),
                )
                size = entry_bytes(msg)
                if not page.admits(size):
                    full = True
                    break
                response.shards.append(msg)
                page.add(size)
                last = cursor
                if page.count >= page.limit:
                    full = True
                    break
            if full and last is not None:
                response.next_page_token = _token(list(last))
            return response

    def StreamResumeList(
        self, request: pb.StreamResumeListRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.StreamResumeListResponse]:
        with abort_on_error(context):
            ns = self._scope(context, READ, request.namespace, request.run_id)
            rows = self.ledger.resume_rows(ns, request.run_id)
        # Entries are added in place: building them separately and passing a list would
        # copy every message once more (a third of the cost per line at a million shards).
        response = pb.StreamResumeListResponse()
        entries = response.entries
        add = entries.add
        count = used = 0
        # The rows are read lazily: the database can go away mid-stream.
        with abort_on_error(context):
            for shard_id, plan_index, plan_line, reason in rows:
                # Measured once added, inline: a resume list can have a million entries.
                size = entry_bytes(
                    add(
                        shard_id=shard_id, plan_line=plan_line, reason=reason, plan_index=plan_index
                    )
                )
                if count and (count >= RESUME_CHUNK or used + size > READ_BUDGET_BYTES):
                    # The entry moves to the next message; the full one goes as it was.
                    del entries[-1]
                    yield response
                    response = pb.StreamResumeListResponse()
                    entries = response.entries
                    add = entries.add
                    add(
                        shard_id=shard_id, plan_line=plan_line, reason=reason, plan_index=plan_index
                    )
                    count = used = 0
                count += 1
                used += size
        if count:
            yield response
