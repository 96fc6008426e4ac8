"""`shardledger events`: print a run's events as text, plain rows or JSON lines, or follow them.

Each event is shown at its sequence in its run (`run_sequence`: 1, 2, ... for every
run), the number `--after` takes; `--json` carries the global `sequence` too.
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any, Final

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from shardledger_cli.cli import EXIT_OK, EXIT_REJECTED, EXIT_USAGE, CommandError, client_from
from shardledger_cli.commands.shards import scheduler_label
from shardledger_cli.output import iso_us, ts_us, tsv_cell
from shardledger_cli.parsing import output_format

# The plain form's header: SEQ is the event's sequence in its run (run_sequence); TIME
# the ledger's receive time, JOB TIME the job's own clock when it made the event (an
# event drained from a spool arrives long after it was made).
COLUMNS: Final = ("SEQ", "TIME", "SHARD", "ATTEMPT", "KIND", "DETAIL", "JOB TIME")


def run_events(args: argparse.Namespace) -> int:
    """Prints the run's events, following new ones with --follow until Ctrl-C."""
    client = client_from(args)
    ns, after, out = args.namespace, args.after, sys.stdout
    shard = getattr(args, "shard", "")
    if shard:
        shard = resolve_shard(client, args.run, shard, namespace=ns)
    fmt = output_format(args)

    def wanted(event: Any) -> bool:
        # --after counts in the run's own sequence, as the output shows it. The server
        # filters on the global one, never smaller for the same event (every event
        # before it in its run was stored before it), so asking the server for events
        # after the same number leaves out only events the filter drops anyway.
        position = event.run_sequence or event.sequence
        return position > after and (not shard or event.shard_id == shard)

    if not args.follow:
        events = client.list_events(args.run, namespace=ns, after_sequence=after)
        # The first page is read before anything is printed: an unknown run or an
        # unreachable server leaves stdout empty, not a header.
        first = next(events, None)
        if fmt == "plain":
            out.write("\t".join(COLUMNS) + "\n")
        for event in itertools.chain([first] if first is not None else [], events):
            if wanted(event):
                out.write(_event_text(event, fmt) + "\n")
        return EXIT_OK
    tail = client.tail(args.run, namespace=ns, after_sequence=after)
    # Ctrl-C cancels the stream from another thread instead of raising inside gRPC.
    previous = signal.signal(
        signal.SIGINT, lambda *_: threading.Thread(target=tail.cancel, daemon=True).start()
    )
    header = fmt == "plain"
    try:
        for event in tail:
            if not wanted(event):
                continue
            if header:  # with the first event: a stream that fails at once printed nothing
                out.write("\t".join(COLUMNS) + "\n")
                header = False
            out.write(_event_text(event, fmt) + "\n")
            out.flush()
    finally:
        signal.signal(signal.SIGINT, previous)
        client.close()
    return EXIT_OK


def resolve_shard(
    client: LedgerClient, run_id: str, given: str, *, namespace: str = "", what: str = "--shard"
) -> str:
    """Returns the run's shard id that `given` names: the id, or a unique prefix of it.

    The CLI prints ids cut (``s-3c52ba9ca020…``); such a form, ellipsis and all, names
    the shard it starts. Several matches are a usage error that lists them; none is
    an error too (exit 4), never an empty answer that looks like a quiet shard.
    """
    prefix = given.rstrip("…").removesuffix("...")
    matches: list[str] = []
    ids: list[str] = []
    for view in client.shards(run_id, namespace=namespace):
        if view.shard_id == prefix:
            return prefix
        if view.shard_id.startswith(prefix):
            matches.append(view.shard_id)
        ids.append(view.shard_id)
    if len(matches) == 1:
        return matches[0]
    if matches:
        shown = ", ".join(matches[:5]) + (
            f" and {len(matches) - 5} more" if len(matches) > 5 else ""
        )
        raise CommandError(
            f"{what} {given} matches {len(matches)} shards of run {run_id}: {shown}; give more"
            " of the id",
            EXIT_USAGE,
        )
    raise CommandError(
        f"run {run_id} has no shard {given} (neither an id nor the start of one"
        f"{_shard_hint(prefix, ids)}; `shardledger shards {run_id}` lists them)",
        EXIT_REJECTED,
    )


def _shard_hint(prefix: str, ids: Sequence[str]) -> str:
    """Returns "; did you mean ID?" for the ids whose start is closest to a mistyped prefix."""
    import difflib  # only a mistake pays for it

    starts: dict[str, list[str]] = {}
    for shard_id in ids:
        starts.setdefault(shard_id[: len(prefix)], []).append(shard_id)
    close = difflib.get_close_matches(prefix, list(starts), n=3, cutoff=0.75)
    named = [i for start in close for i in starts[start]][:3]
    return f"; did you mean {' or '.join(named)}?" if named else ""


def _event_text(event: Any, fmt: str) -> str:
    """Returns one event as a JSON line (the protobuf JSON mapping), a plain row or a text line."""
    if fmt == "json":
        from google.protobuf.json_format import MessageToDict

        return _compact(MessageToDict(event, preserving_proto_field_name=True))
    if fmt == "plain":
        return "\t".join(tsv_cell(c) for c in event_cells(event))
    return event_line(event)


def _compact(data: dict[str, Any]) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def event_cells(event: Any) -> list[str]:
    """Returns a ShardEvent as the text of the COLUMNS: its run sequence first ("-" for none)."""
    kind = event.WhichOneof("payload")
    return [
        str(event.run_sequence or event.sequence),
        iso_us(ts_us(event.receive_time)),
        event.shard_id or "-",
        event.attempt_id or "-",
        kind,
        short_payload(event, kind) or "-",
        iso_us(ts_us(event.client_time)) if event.HasField("client_time") else "-",
    ]


def event_line(event: Any) -> str:
    """Returns the one-line text form of a ShardEvent (the table form: a person reads it).

    The job's clock is shown beside the receive time where the two differ by a second
    or more: a spool's drain, or a job host whose clock is off.
    """
    seq, when, shard, attempt, kind, payload, made = event_cells(event)
    job = f" (job clock {made})" if made not in ("-", when) else ""
    return f"{seq:>8} {when}{job} {shard} {attempt} {kind} {payload.removeprefix('-')}".rstrip()


def short_payload(event: Any, kind: str) -> str:
    """Returns a few key fields of the event's payload."""
    p = getattr(event, kind)
    if kind == "planned":
        return f"index={p.plan_index} input={p.input_ref} outputs={','.join(p.expected_outputs)}"
    if kind == "started":
        timeout = ts_us(p.heartbeat_timeout) / 1e6
        text = f"host={p.host} pid={p.pid} timeout={timeout:g}s fp={p.fingerprint_digest[:12]}"
        if not p.HasField("scheduler"):
            return text
        fields = p.scheduler.DESCRIPTOR.fields
        return (
            text + f" job={scheduler_label({f.name: getattr(p.scheduler, f.name) for f in fields})}"
        )
    if kind == "heartbeat":
        return f"step={p.step} progress={p.progress:.3f}"
    if kind in ("checkpoint", "artifact_committed"):
        name = "" if kind == "checkpoint" else f"{p.name} "
        return f"{name}{p.path} {p.size_bytes}B blake3={p.blake3_hex[:12]}"
    if kind == "verified":
        result = "PASSED" if p.result == pb.VERIFICATION_RESULT_PASSED else "FAILED"
        return f"{result} {p.name} {p.path}" + (f" reason={p.reason}" if p.reason else "")
    if kind == "submission_closed":
        expected = f" expected={p.expected_shards}" if p.expected_shards else ""
        return f"run{expected}" + (f" reason={p.reason[:80]}" if p.reason else "")
    if kind == "run_reopened":
        return "run" + (f" reason={p.reason[:80]}" if p.reason else "")
    tag = pb.FailureTag.Name(p.tag).removeprefix("FAILURE_TAG_").lower()
    return f"tag={tag} {p.message[:80]}"
