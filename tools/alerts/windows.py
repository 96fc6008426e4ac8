"""Rewrites the time windows of an alert rule file by a factor: tests and demos in seconds.

    python -m tools.alerts.windows --scale 0.01 deploy/prometheus/alerts.yml -o fast.yml

Every window in deploy/prometheus/alerts.yml is written in one of three forms,
and each is multiplied by --scale (never below one second):

- ``for: 5m`` and ``keep_firing_for: 15m`` (rule fields);
- range selectors in expressions, ``rate(x[5m])``;
- time thresholds written ``time() - SERIES > SECONDS``.

Thresholds that are not times (ratios, counts) are left alone. The output is
what Prometheus loads; the shipped file stays the one to deploy.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Final

__all__ = ["format_duration", "parse_duration", "scale_rules"]

_UNITS: Final = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
_DURATION: Final = r"(?:\d+(?:ms|[smhdwy]))+"
_FIELD: Final = re.compile(rf"^(\s*(?:for|keep_firing_for):\s*)({_DURATION})\s*$", re.MULTILINE)
_RANGE: Final = re.compile(rf"\[({_DURATION})(:{_DURATION})?\]")
_SINCE: Final = re.compile(r"(time\(\)\s*-\s*[A-Za-z_:][A-Za-z0-9_:]*(?:\{[^}]*\})?\s*>\s*)(\d+)")


def parse_duration(text: str) -> float:
    """Returns a Prometheus duration ("1h30m", "500ms") in seconds."""
    parts = re.findall(r"(\d+)(ms|[smhdwy])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return sum(int(n) * _UNITS[u] for n, u in parts)


def format_duration(seconds: float) -> str:
    """Returns whole seconds as the shortest Prometheus duration ("90s" stays "90s")."""
    whole = max(1, round(seconds))
    for unit, size in (("h", 3600), ("m", 60)):
        if whole % size == 0:
            return f"{whole // size}{unit}"
    return f"{whole}s"


def scale_rules(text: str, scale: float) -> str:
    """Returns the rule file with every window multiplied by scale (at least 1 s each)."""
    if not scale > 0:
        raise ValueError("--scale must be a positive number")

    def duration(d: str) -> str:
        return format_duration(parse_duration(d) * scale)

    text = _FIELD.sub(lambda m: m.group(1) + duration(m.group(2)), text)
    text = _RANGE.sub(
        lambda m: (
            f"[{duration(m.group(1))}"
            + (f":{duration(m.group(2)[1:])}" if m.group(2) else "")
            + "]"
        ),
        text,
    )
    return _SINCE.sub(lambda m: m.group(1) + str(max(1, round(int(m.group(2)) * scale))), text)


def main(argv: list[str] | None = None) -> int:
    """Writes the scaled rule file to -o (or stdout)."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.alerts.windows",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("rules", type=Path, help="rule file, e.g. deploy/prometheus/alerts.yml")
    parser.add_argument("--scale", type=float, required=True, help="factor, e.g. 0.01")
    parser.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    args = parser.parse_args(argv)
    try:
        out = scale_rules(args.rules.read_text(), args.scale)
    except (OSError, ValueError) as exc:
        print(f"alert_windows: {exc}", file=sys.stderr)
        return 2
    if args.output is None:
        sys.stdout.write(out)
    else:
        args.output.write_text(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
