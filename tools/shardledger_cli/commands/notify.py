"""`shardledger notify RUN --url URL`: post a run's morning report as JSON to a webhook.

Alertmanager already delivers alerts to webhooks (docs/alerts.md); what it cannot
do is send the numbers of a run that ended well. This posts the run's report
once (a cron line or the last step of the night's pipeline), retrying while the
receiver is unreachable or answers 5xx/429, with the same Idempotency-Key on
every try so a receiver can drop a repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from typing import Any, Final

from shardledger_cli.cli import (
    EXIT_LOCAL,
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    CommandError,
    at_least,
    client_from,
    positive_seconds,
)
from shardledger_cli.local_ledger import serve_db_option
from shardledger_cli.output import by_state, count_shards, print_json
from shardledger_cli.parsing import json_help

__all__ = ["deliver", "register", "report", "run_notify"]

URL_ENV: Final = "SHARDLEDGER_NOTIFY_URL"
REPORT_KIND: Final = "shardledger.run_report"
REPORT_VERSION: Final = 1
# Receivers answer these when a retry may succeed; any other 4xx is final.
_RETRY_STATUSES: Final = frozenset({408, 425, 429, 500, 502, 503, 504})
_MAX_BACKOFF_S: Final = 60.0

DESCRIPTION: Final = f"""\
Post the run's report as one JSON object to a webhook URL (--url, or
${URL_ENV}): lifecycle (open, submission_closed, settled and since when;
reopened_at_sequence once `plan --reopen` opened it again),
submitted / verified / failed / missing / running / stale / unverified (failed
counts verify_failed too, as in `status --json`; "by_state" has each state as
`shards --state` names it), the completion and silent-error rates, the
first-pass figures, the number of shards `shardledger resume` would hand back,
and a one-line "text" that chat webhooks (Slack, Mattermost) show as the message.

--wait SECONDS first waits for the run to settle (polling every --poll
seconds); the report is posted either way and says whether it is settled.
A refused connection, a timeout, 408, 425, 429 and 5xx are retried --retries
times with doubling backoff (Retry-After is honoured, capped at 60 s); any other
answer is final. Every try carries the same Idempotency-Key header.

Examples:
  shardledger notify night-01 --url https://chat.example/hooks/T0/B0/XXXX
  SHARDLEDGER_NOTIFY_URL=https://... shardledger notify night-01 --wait 3600
  shardledger notify night-01 --dry-run          # print the JSON, post nothing
  # 07:00 every day (cron): the report of last night's run
  0 7 * * * shardledger notify "night-$(date -d yesterday +\\%F)" --retries 10

exit codes: 0 posted, run settled; 1 posted, run not settled; 2 usage;
3 ledger unreachable; 4 refused (e.g. unknown run); 5 delivery failed
"""


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds the notify command."""
    p = sub.add_parser(
        "notify",
        parents=[common],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="post a run's report (verified / failed / missing, first pass) to a webhook",
        description=DESCRIPTION,
    )
    p.add_argument("run", help="run id")
    p.add_argument("--url", default=None, help=f"webhook URL (default: ${URL_ENV})")
    p.add_argument("--dry-run", action="store_true", help="print the report; post nothing")
    p.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait up to this long for the run to settle before posting (default 0)",
    )
    p.add_argument(
        "--poll", type=positive_seconds, default=5.0, help="with --wait: seconds between reads"
    )
    p.add_argument(
        "--retries", type=at_least(0), default=5, help="retries after the first try (default 5)"
    )
    p.add_argument(
        "--backoff",
        type=positive_seconds,
        default=1.0,
        metavar="SECONDS",
        help="first retry delay, doubled each time (default 1)",
    )
    p.add_argument(
        "--post-timeout",
        type=positive_seconds,
        default=10.0,
        metavar="SECONDS",
        help="deadline of one POST (default 10)",
    )
    json_help(p, single="what was posted (the report) and whether it was delivered")
    serve_db_option(p, run_notify)


def run_notify(args: argparse.Namespace) -> int:
    """Reads the run's summary (waiting for it to settle if asked) and posts its report."""
    url = args.url or os.environ.get(URL_ENV, "")
    if not args.dry_run:
        check_url(url)
    if args.wait < 0:
        raise CommandError("--wait must not be negative", EXIT_USAGE)
    client = client_from(args, probe=not args.wait)  # --wait outlives ledger restarts
    deadline = time.monotonic() + args.wait
    while True:
        summary: dict[str, Any] = json.loads(client.summary(args.run, namespace=args.namespace))
        if _settled(summary) or time.monotonic() + args.poll > deadline:
            break
        time.sleep(args.poll)
    body = report(summary)
    settled_code = EXIT_OK if _settled(summary) else EXIT_PROBLEMS
    if args.dry_run:
        print_json(body)
        return settled_code
    outcome = deliver(
        url,
        body,
        retries=args.retries,
        backoff_s=args.backoff,
        timeout_s=args.post_timeout,
    )
    if args.json:
        print_json({"run_id": args.run, "state": body["lifecycle"]["state"], **outcome})
    else:
        tries = f"{outcome['attempts']} tries" if outcome["attempts"] > 1 else "1 try"
        print(
            f"run {args.run} ({body['lifecycle']['state']}): report posted to"
            f" {outcome['url']} (HTTP {outcome['status']}, {tries})"
        )
    return settled_code


def check_url(url: str) -> None:
    """Raises CommandError (usage) unless url is an http(s) URL with a host."""
    if not url:
        raise CommandError(f"no webhook URL: give --url or set ${URL_ENV}", EXIT_USAGE)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise CommandError(f"--url must be an http:// or https:// URL, not {url!r}", EXIT_USAGE)


def _settled(summary: dict[str, Any]) -> bool:
    return bool((summary.get("lifecycle") or {}).get("settled"))


def _percent(rate: float) -> str:
    return f"{100 * rate:.1f}%"


def report(s: dict[str, Any]) -> dict[str, Any]:
    """Returns the webhook body for a run summary (the morning report)."""
    life = s.get("lifecycle") or {"state": "unknown", "settled": False, "settled_at": None}
    fp = s["first_pass"]
    resume = s["submitted"] - s["verified"]
    counts = by_state(s)  # "failed" as `shards --state failed`: verify_failed apart
    state = life["state"]
    if state == "open" and life.get("reopened_at_sequence"):
        state = f"reopened (at sequence {life['reopened_at_sequence']})"
    when = f" at {life['settled_at']}" if life.get("settled_at") else ""
    text = (
        f"{s['run_id']} {state.replace('_', ' ')}{when}: {s['verified']} of"
        f" {count_shards(s['submitted'])} verified ({_percent(s['completion_rate'])}),"
        f" {counts['failed']} failed"
        + (f", {counts['verify_failed']} verify_failed" if counts["verify_failed"] else "")
        + f", {s['missing']} missing"
        + (f", {s['running'] + s['stale']} still running" if s["running"] + s["stale"] else "")
        + f"; first pass {_percent(fp['reconciliation_rate'])} reconciled;"
        + (
            f" {count_shards(resume)} to resume (`shardledger resume {s['run_id']}`)"
            if resume
            else " nothing to resume"
        )
    )
    return {
        "kind": REPORT_KIND,
        "version": REPORT_VERSION,
        "namespace": s["namespace"],
        "run_id": s["run_id"],
        "as_of_us": s.get("as_of_us"),
        "lifecycle": life,
        "submitted": s["submitted"],
        "verified": s["verified"],
        "failed": s["failed"],
        "by_state": counts,
        "missing": s["missing"],
        "running": s["running"],
        "stale": s["stale"],
        "unverified": s["unverified"],
        "completion_rate": s["completion_rate"],
        "silent_errors": s["silent_errors"],
        "silent_error_rate": s["silent_error_rate"],
        "first_pass": fp,
        "repairs": s["repairs"],
        "resume_count": resume,
        "text": text,
    }


def redact(url: str) -> str:
    """Returns scheme://host of a URL: webhook paths and queries often hold their secret."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}/..."


def deliver(
    url: str,
    body: dict[str, Any],
    *,
    retries: int,
    backoff_s: float,
    timeout_s: float,
) -> dict[str, Any]:
    """POSTs body as JSON, retrying what may succeed later; returns status, attempts, url.

    Raises CommandError (exit 5) when the receiver refuses or every try failed.
    """
    data = json.dumps(body, sort_keys=True).encode()
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "shardledger-notify",
        "Idempotency-Key": uuid.uuid4().hex,
    }
    shown = redact(url)
    delay = backoff_s
    last = ""
    for attempt in range(1, retries + 2):
        request = urllib.request.Request(url, data=data, headers=headers, method="POST")
        wait = delay
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return {
                    "posted": True,
                    "status": response.status,
                    "attempts": attempt,
                    "url": shown,
                }
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code} {exc.reason}"
            if exc.code not in _RETRY_STATUSES:
                raise CommandError(
                    f"the webhook at {shown} refused the report: {last}", EXIT_LOCAL
                ) from None
            after = exc.headers.get("Retry-After", "") if exc.headers else ""
            if after.isdigit():
                wait = max(delay, float(after))
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            last = f"{type(reason).__name__}: {reason}"
        if attempt <= retries:
            print(
                f"shardledger: webhook try {attempt} failed ({last}); retrying in {wait:g} s",
                file=sys.stderr,
            )
            time.sleep(min(wait, _MAX_BACKOFF_S))
            delay = min(delay * 2, _MAX_BACKOFF_S)
    raise CommandError(
        f"the report was not delivered to {shown} after {retries + 1} tries: {last}", EXIT_LOCAL
    )
