"""`shardledger events`: print a run's events as text or JSON lines, or follow them."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from typing import Any

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from shardledger_cli.cli import EXIT_OK, EXIT_REJECTED, EXIT_USAGE, CommandError, client_from
from shardledger_cli.commands.shards import scheduler_label
from shardledger_cli.output import iso_us, ts_us


def run_events(args: argparse.Namespace) -> int:
    """Prints the run's events, following new ones with --follow until Ctrl-C."""
    client = client_from(args)
    ns, after, out = args.namespace, args.after, sys.stdout
    shard = getattr(args, "shard", "")
    if shard:
        shard = resolve_shard(client, args.run, shard, namespace=ns)
    if not args.follow:
        for event in client.list_events(args.run, namespace=ns, after_sequence=after):
            if not shard or event.shard_id == shard:
                out.write(_event_text(event, args.json) + "\n")
        return EXIT_OK
    tail = client.tail(args.run, namespace=ns, after_sequence=after)
    # Ctrl-C cancels the stream from another thread instead of raising inside gRPC.
    previous = signal.signal(
        signal.SIGINT, lambda *_: threading.Thread(target=tail.cancel, daemon=True).start()
    )
    try:
        for event in tail:
            if shard and event.shard_id != shard:
                continue
            out.write(_event_text(event, args.json) + "\n")
            out.flush()
    finally:
        signal.signal(signal.SIGINT, previous)
        client.close()
    return EXIT_OK


def resolve_shard(client: LedgerClient, run_id: str, given: str, *, namespace: str = "") -> str:
    """Returns the run's shard id that `given` names: the id, or a unique prefix of it.

    The CLI prints ids cut (``s-3c52ba9ca020…``); such a form, ellipsis and all, names
    the shard it starts. Several matches are a usage error that lists them; none is
    an error too (exit 4), never an empty answer that looks like a quiet shard.
    """
    prefix = given.rstrip("…").removesuffix("...")
    matches: list[str] = []
    for view in client.shards(run_id, namespace=namespace):
        if view.shard_id == prefix:
            return prefix
        if view.shard_id.startswith(prefix):
            matches.append(view.shard_id)
    if len(matches) == 1:
        return matches[0]
    if matches:
        shown = ", ".join(matches[:5]) + (
            f" and {len(matches) - 5} more" if len(matches) > 5 else ""
        )
        raise CommandError(
            f"--shard {given} matches {len(matches)} shards of run {run_id}: {shown}; give more"
            " of the id",
            EXIT_USAGE,
        )
    raise CommandError(
        f"run {run_id} has no shard {given} (neither an id nor the start of one; `shardledger"
        f" shards {run_id}` lists them)",
        EXIT_REJECTED,
    )


def _event_text(event: Any, as_json: bool) -> str:
    """Returns one event as a JSON line (the protobuf JSON mapping) or a text line."""
    if as_json:
        from google.protobuf.json_format import MessageToDict

        return _compact(MessageToDict(event, preserving_proto_field_name=True))
    return event_line(event)


def _compact(data: dict[str, Any]) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def event_line(event: Any) -> str:
    """Returns the one-line text form of a ShardEvent."""
    when = iso_us(ts_us(event.receive_time))
    kind = event.WhichOneof("payload")
    return (
        f"{event.sequence:>8} {when} {event.shard_id or '-'} {event.attempt_id or '-'} {kind} "
        f"{short_payload(event, kind)}"
    ).rstrip()


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
