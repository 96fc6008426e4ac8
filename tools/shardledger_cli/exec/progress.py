"""The progress protocol of `shardledger exec`: a line a child prints, or a file it rewrites.

A line on the child's stdout or stderr of the form::

    SHARDLEDGER_PROGRESS step=120 progress=0.4 loss=0.31 fps=24

is a progress report: ``step`` (a whole number, required), ``progress`` (a
fraction in [0, 1], optional) and any other ``key=number`` pairs as metrics of
the heartbeat. Anything else on the line, or a line that breaks these rules, is
ordinary output. A child that cannot print (its output goes elsewhere) rewrites
the file ``$SHARDLEDGER_PROGRESS_FILE`` instead, with the same ``key=value``
pairs on one line (the ``SHARDLEDGER_PROGRESS`` word optional); the wrapper
reads it whenever its modification time changes. Write it atomically
(``echo ... > f.tmp && mv f.tmp f``) so a half-written line is never read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Final

__all__ = ["MARKER", "PROGRESS_FILE_ENV", "Progress", "parse_progress", "parse_progress_file"]

MARKER: Final = "SHARDLEDGER_PROGRESS"
PROGRESS_FILE_ENV: Final = "SHARDLEDGER_PROGRESS_FILE"
# Metric names as the heartbeat accepts them; at most this many per report.
_KEY: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_.:/-]{0,63}")
_MAX_METRICS: Final = 32
_LINE: Final = re.compile(rf"^\s*{MARKER}(?:\s+(.*?))?\s*$")


@dataclass(frozen=True, slots=True)
class Progress:
    """One progress report: step, progress fraction, metrics."""

    step: int
    progress: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


def _pairs(text: str) -> Progress | None:
    values: dict[str, str] = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if not sep or not _KEY.fullmatch(key) or key in values:
            return None
        values[key] = value
    step_text = values.pop("step", None)
    if step_text is None or not step_text.isdigit():
        return None
    try:
        fraction = float(values.pop("progress", "0"))
        metrics = {k: float(v) for k, v in values.items()}
    except ValueError:
        return None
    if not 0.0 <= fraction <= 1.0 or len(metrics) > _MAX_METRICS:
        return None
    # Non-finite metrics are the heartbeat's to report (nonfinite_metrics): they pass here.
    return Progress(step=int(step_text), progress=fraction, metrics=metrics)


def parse_progress(line: str) -> Progress | None:
    """Returns the progress report a line of output carries, or None for ordinary output."""
    if MARKER not in line:
        return None
    match = _LINE.match(line)
    if match is None:
        return None
    return _pairs(match.group(1) or "")


def parse_progress_file(text: str) -> Progress | None:
    """Returns the report in a progress file's last non-blank line, or None when it holds none."""
    lines = [t for t in text.splitlines() if t.strip()]
    if not lines:
        return None
    last = lines[-1].strip()
    if last.startswith(MARKER):
        return parse_progress(last)
    return _pairs(last)
