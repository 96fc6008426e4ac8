"""What failures cost (report 1, §4.3) and the checkpoint advice (§3.2), from one run's rows.

GPU time is an attempt's wall time on the ledger's clock (started to its last
event) times its ``gpus`` label (1 when unset). docs/metrics.md defines each figure.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, Final

from ledger_server.analysis import HANG_TAG, AttemptRow
from shard_client.advice import AttemptSpan, CheckpointAdvice, advice_from
from shardledger_cli.run_data import RunData

__all__ = ["checkpoint_advice_of", "run_costs"]

GPUS_LABEL: Final = "gpus"


def _gpus(attempt: AttemptRow, run_labels: dict[str, str]) -> int:
    raw = (run_labels | attempt.labels).get(GPUS_LABEL, "1")
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1


def _counted(data: RunData) -> dict[str, str]:
    """Returns shard -> the attempt whose result counts: its outputs passed, else committed whole.

    The earliest such attempt counts; every other attempt's time was spent on work
    that did not count (a rerun, a duplicate, a result that failed verification).
    """
    t = data.tables
    latest: dict[tuple[str, str], str] = {}
    for v in t.verdicts:
        if v["attempt_id"]:
            latest[(v["attempt_id"], v["name"])] = v["result"]
    names: dict[str, set[str]] = defaultdict(set)
    for a in t.artifacts:
        names[a["attempt_id"]].add(a["name"])
    out: dict[str, str] = {}
    fallback: dict[str, str] = {}
    for attempt in sorted(t.attempts.values(), key=lambda a: a.started_sequence):
        plan = t.plans.get(attempt.shard_id)
        expected = set(json.loads(plan["expected_outputs"])) if plan else set()
        made = names[attempt.attempt_id]
        if attempt.failed_tag or not made or not expected <= made:
            continue
        results = [latest.get((attempt.attempt_id, n)) for n in (expected or made)]
        if all(r == "passed" for r in results):
            out.setdefault(attempt.shard_id, attempt.attempt_id)
        elif "failed" not in results:
            fallback.setdefault(attempt.shard_id, attempt.attempt_id)
    return fallback | out


def run_costs(data: RunData) -> dict[str, Any]:
    """Returns the run's GPU time, what of it did not count and why, and time lost to hangs."""
    t = data.tables
    counted = _counted(data)
    stale = {v["shard_id"] for v in data.views if v["state"] == "stale"}
    latest_attempt = {v["shard_id"]: v["latest_attempt"] for v in data.views}
    lost: dict[str, float] = defaultdict(float)
    total = counted_s = running = hang_s = 0.0
    hangs = 0
    for a in t.attempts.values():
        hung = a.shard_id in stale and latest_attempt.get(a.shard_id) == a.attempt_id
        # A silent attempt held its GPU until the ledger called it stale, its deadline.
        end_us = a.last_us + (a.timeout_us if hung else 0)
        gpu_s = (end_us - a.started_us) / 1e6 * _gpus(a, t.labels)
        total += gpu_s
        if counted.get(a.shard_id) == a.attempt_id:
            counted_s += gpu_s
        elif a.failed_tag:
            lost["reruns"] += gpu_s
            if a.failed_us is not None and a.last_us > a.failed_us:
                lost["zombies"] += (a.last_us - a.failed_us) / 1e6 * _gpus(a, t.labels)
        elif hung:
            lost["hung"] += gpu_s
        elif a.commits and a.shard_id in counted:
            lost["duplicates"] += gpu_s
        elif a.commits:
            lost["silent"] += gpu_s
        else:
            running += gpu_s
        if a.failed_tag == HANG_TAG and a.failed_us is not None:
            hangs += 1
            hang_s += (a.failed_us - a.progress_us) / 1e6
        elif hung:
            hangs += 1
            hang_s += (end_us - a.progress_us) / 1e6
    not_counted = total - counted_s - running
    return {
        "gpu_s": total,
        "counted_gpu_s": counted_s,
        "running_gpu_s": running,
        "recomputed_gpu_s": sum(lost[k] for k in ("reruns", "duplicates", "silent", "hung")),
        "lost_gpu_s": {k: lost.get(k, 0.0) for k in ("reruns", "duplicates", "silent", "hung")},
        "zombie_gpu_s": lost.get("zombies", 0.0),
        "hangs": hangs,
        "hang_lost_s": hang_s,
        "not_counted_gpu_s": not_counted,
        "not_counted_share": not_counted / total if total else 0.0,
    }


def checkpoint_advice_of(data: RunData) -> CheckpointAdvice:
    """Returns the checkpoint interval advice measured from the run's rows."""
    spans = [
        AttemptSpan(a.started_us, a.last_us, a.last_step, a.failed_tag, a.commits)
        for a in data.tables.attempts.values()
    ]
    writes = [c["write_s"] for c in data.tables.checkpoints if c["write_s"]]
    return advice_from(spans, writes)
