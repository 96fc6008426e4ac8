"""Canonical JSON on the write path: RFC 8785 (fast path) against its same-run baselines.

    python -m tools.bench.canonical [-o bench-results/canonical.json]

For each event kind of a busy night (heartbeats most of all) it times the content's
encoding three ways in one run: Python's json (row format 1, the encoder before RFC
8785), `canonical_json` (RFC 8785 through the C-encoder fast path) and
`rfc8785.dumps` (the pure-Python package alone), and `validate()` of a heartbeat end
to end. It prints microseconds per event and ratios to the format-1 baseline.
No timing is asserted anywhere in the test suite.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import rfc8785

from ledger_server.events import (
    ArtifactCommitted,
    AttemptStarted,
    Event,
    Heartbeat,
    ShardPlanned,
    content_jcs,
)
from ledger_server.validation import validate
from shard_client.canonical import fingerprint_digest, legacy_json

DIGEST = "a" * 64
FINGERPRINT = {
    "schema": "2",
    "gpu.0.name": "NVIDIA H100 80GB HBM3",
    "gpu.0.uuid": "GPU-0",
    "driver": "550.54",
    "torch.version": "2.13.0",
    "platform": "Linux-6.1-x86_64",
}
PAYLOADS: dict[str, Any] = {
    "heartbeat": Heartbeat(step=1234, progress=0.4375, metrics={"loss": 0.0123, "lr": 3e-05}),
    "heartbeat_integral": Heartbeat(step=7, progress=1.0, metrics={"loss": 2.0}),
    "started": AttemptStarted(
        host="gpu-node-17",
        pid=48211,
        heartbeat_timeout_us=60_000_000,
        fingerprint=FINGERPRINT,
        fingerprint_digest=fingerprint_digest(FINGERPRINT),
    ),
    "artifact_committed": ArtifactCommitted(
        name="weights",
        path="/out/night/s-1/weights.bin",
        size_bytes=1 << 30,
        blake3_hex=DIGEST,
        media_type="application/octet-stream",
    ),
    "planned": ShardPlanned(
        input_ref="/data/frames/000017.exr",
        input_bytes=88_000_000,
        input_blake3=DIGEST,
        params_json='{"frame":17,"lr":0.001,"scale":2}',
        expected_outputs=("weights",),
        plan_line="",
        plan_index=17,
    ),
}


def _event(payload: Any) -> Event:
    attempt = "" if isinstance(payload, ShardPlanned) else "a0f3c2"
    return Event("e1b2c3d4-17", "default", "night-2026-12-01", "s-17", attempt, 1764, payload)


def _per_call_us(fn: Callable[[], object], seconds: float) -> float:
    calls, start = 0, time.perf_counter()
    while True:
        for _ in range(200):
            fn()
        calls += 200
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default="bench-results/canonical.json")
    parser.add_argument("--seconds", type=float, default=0.5, help="per measurement")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    print(f"{'kind':<20} {'format 1':>9} {'RFC 8785':>9} {'rfc8785':>9}   ratios to format 1")
    for kind, payload in PAYLOADS.items():
        content = _event(payload).content()
        legacy = _per_call_us(partial(legacy_json, content), args.seconds)
        fast = _per_call_us(partial(content_jcs, content), args.seconds)
        pure = _per_call_us(partial(rfc8785.dumps, content), args.seconds)
        results[kind] = {
            "format1_us": round(legacy, 3),
            "rfc8785_fast_path_us": round(fast, 3),
            "rfc8785_package_us": round(pure, 3),
            "fast_path_ratio": round(fast / legacy, 2),
            "package_ratio": round(pure / legacy, 2),
        }
        print(
            f"{kind:<20} {legacy:>8.2f}u {fast:>8.2f}u {pure:>8.2f}u"
            f"   fast path x{fast / legacy:.2f}, package alone x{pure / legacy:.2f}"
        )
    beat = _event(PAYLOADS["heartbeat"])
    results["validate_heartbeat_us"] = round(_per_call_us(lambda: validate(beat), args.seconds), 3)
    print(f"validate(heartbeat): {results['validate_heartbeat_us']:.2f} us per event")
    report = {"env": {"python": platform.python_version(), "machine": platform.machine()}}
    report["canonical"] = results
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
