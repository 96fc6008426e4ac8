"""The field figures as the server computes them: one run's report, and runs by a label.

`report`, `status --costs` and `report --html` render what the GetRunReport RPC
answers, and `report --by` what CompareRuns answers; nothing here downloads a
run's events (ledger_server.field defines the figures, docs/metrics.md in words).
"""

from __future__ import annotations

import json
from typing import Any, Final

from google.protobuf import json_format
from google.protobuf.message import Message

__all__ = ["compare_runs", "message_json", "run_report"]

# The advice's inputs and outputs that are unset when unknown: None in the JSON.
_ADVICE_OPTIONAL: Final = (
    "shard_duration_s",
    "checkpoint_write_s",
    "reclaim_probability",
    "interval_s",
    "interval_steps",
    "expected_waste_s",
)


def message_json(message: Message) -> dict[str, Any]:
    """Returns a message as JSON with the proto's field names and every scalar, zeros too."""
    return json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def run_report(client: Any, run_id: str, *, namespace: str = "") -> dict[str, Any]:
    """Returns the one-run report `report RUN --json` prints: the summary and the figures."""
    summary: dict[str, Any] = json.loads(client.summary(run_id, namespace=namespace))
    response = client.run_report(run_id, namespace=namespace)
    report = message_json(response.report)
    advice = report["checkpoint_advice"]
    for key in _ADVICE_OPTIONAL:
        advice.setdefault(key, None)
    return {
        "run_id": report["run_id"],
        "namespace": report["namespace"],
        "labels": dict(sorted(report["labels"].items())),
        "summary": summary,
        "costs": report["costs"],
        "checkpoint_advice": advice,
        "first_pass_silent_forms": report["first_pass_silent_forms"],
        "first_pass_loud_failures": report["first_pass_loud_failures"],
        "as_of": response.as_of_time.ToJsonString(),
    }


def compare_runs(
    client: Any, run_ids: list[str], label: str, *, namespace: str = ""
) -> list[dict[str, Any]]:
    """Returns the platform table by label over the runs: one JSON object per label value."""
    response = client.compare_runs(run_ids, label, namespace=namespace)
    return [message_json(g) for g in response.groups]
