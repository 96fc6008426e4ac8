"""The declared outputs of an exec'd child: their temp paths, their checks and their atomic commit.

The child never writes a final path. Each declared output gets a temp path beside
its final one (same directory, so the rename is atomic; named with the SDK's
``TEMP_PREFIX`` so `atomic.cleanup_orphans` reclaims it after a crash), and only
after a clean exit, and only when every output is present and passes the same
content checks `verify` runs, is each one fsynced, renamed over its final path,
its directory fsynced and the commit recorded. Until then the final paths hold
whatever they held before (nothing, or a previous run's file).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from shard_client import atomic
from shard_client.checks import content_verdict
from shard_client.ids import check_id

__all__ = [
    "ORPHAN_AGE_S",
    "DeclaredOutput",
    "OutputProblem",
    "check_outputs",
    "commit_outputs",
    "discard_temps",
    "env_name",
    "parse_output",
    "prepare_outputs",
]

# A temp file younger than this may belong to a live attempt of the same shard.
ORPHAN_AGE_S: Final = 300.0
_ENV_CHARS: Final = re.compile(r"[^A-Z0-9_]")


@dataclass(frozen=True, slots=True)
class DeclaredOutput:
    """One ``--output NAME=PATH``: the artifact name, its final path and the child's temp path."""

    name: str
    final: str
    temp: str = ""


@dataclass(frozen=True, slots=True)
class OutputProblem:
    """Why an output cannot be committed: a verify-style reason slug and a detail."""

    name: str
    reason: str  # missing, not_a_file, empty, json_invalid, truncated, ...
    detail: str

    def __str__(self) -> str:
        return f"{self.name}: {self.reason} ({self.detail})"


def parse_output(text: str) -> DeclaredOutput:
    """Parses NAME=PATH; raises ValueError with a message for the user."""
    name, sep, path = text.partition("=")
    if not sep or not path:
        raise ValueError(f"--output {text!r}: expected NAME=PATH, e.g. weights=out/w.bin")
    check_id(f"--output {text!r}: the artifact name", name)
    if path.endswith("/"):
        raise ValueError(f"--output {text!r}: the path names a directory; an output is one file")
    return DeclaredOutput(name=name, final=os.path.abspath(path))


def env_name(name: str) -> str:
    """Returns the environment variable that holds an output's temp path: SHARDLEDGER_OUTPUT_<NAME>."""
    return "SHARDLEDGER_OUTPUT_" + _ENV_CHARS.sub("_", name.upper())


def _temp_path(final: str, attempt_id: str) -> str:
    # The final name's suffix stays last: tools that pick a format by extension
    # (and verify's content checks) see the same type in the temp file.
    base = os.path.basename(final)
    return os.path.join(os.path.dirname(final), f"{atomic.TEMP_PREFIX}{attempt_id[:12]}.{base}")


def prepare_outputs(outputs: Sequence[DeclaredOutput], *, attempt_id: str) -> list[DeclaredOutput]:
    """Creates each output's directory, removes old orphans there, returns outputs with temp paths."""
    names = [o.name for o in outputs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--output names must be unique: {', '.join(twice)} given twice")
    finals = [o.final for o in outputs]
    shared = sorted({f for f in finals if finals.count(f) > 1})
    if shared:
        raise ValueError(f"two --output names share the path {shared[0]}")
    prepared = []
    for output in outputs:
        directory = os.path.dirname(output.final)
        atomic.makedirs_durable(directory)
        # Files of killed attempts (this wrapper SIGKILLed, a node lost) older than
        # ORPHAN_AGE_S; younger ones may be a concurrent attempt's and stay.
        atomic.cleanup_orphans(directory, older_than_s=ORPHAN_AGE_S)
        temp = _temp_path(output.final, attempt_id)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)  # a rerun under the same --attempt-id starts from nothing
        prepared.append(DeclaredOutput(output.name, output.final, temp))
    return prepared


def check_outputs(outputs: Iterable[DeclaredOutput]) -> list[OutputProblem]:
    """Returns what keeps each output from being committed (empty: all may be committed)."""
    problems = []
    for output in outputs:
        problem = _check_one(output)
        if problem is not None:
            problems.append(problem)
    return problems


def _check_one(output: DeclaredOutput) -> OutputProblem | None:
    try:
        info = os.lstat(output.temp)
    except FileNotFoundError:
        return OutputProblem(output.name, "missing", f"the child never wrote {output.temp}")
    if not stat.S_ISREG(info.st_mode):
        return OutputProblem(output.name, "not_a_file", f"{output.temp} is not a regular file")
    try:
        verdict = content_verdict(
            Path(output.temp), size=info.st_size, suffix=Path(output.final).suffix
        )
    except OSError as exc:
        return OutputProblem(output.name, "unreadable", f"cannot read {output.temp}: {exc}")
    if verdict.passed:
        return None
    return OutputProblem(output.name, verdict.reason, verdict.detail)


def commit_outputs(
    outputs: Iterable[DeclaredOutput], record: Callable[[str, atomic.CommitInfo], None]
) -> list[atomic.CommitInfo]:
    """Fsyncs, renames and records each checked output in turn; returns their commits."""
    done = []
    for output in outputs:
        info = atomic.atomic_replace(output.temp, output.final)
        # Recorded once renamed and durable; a refusal here leaves the file unrecorded.
        record(output.name, info)
        done.append(info)
    return done


def discard_temps(outputs: Iterable[DeclaredOutput]) -> list[str]:
    """Removes the temp files of outputs that will not be committed; returns the removed paths."""
    removed = []
    for output in outputs:
        try:
            os.unlink(output.temp)
        except FileNotFoundError:
            continue
        except IsADirectoryError:
            continue  # the child made a directory there; never an artifact, left as it is
        removed.append(output.temp)
    return removed
