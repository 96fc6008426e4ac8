"""The declared outputs of an exec'd child: their temp paths, their checks and their commit.

Each declared output gets a temp path beside its final one (same directory, so the
rename is atomic; named with the SDK's ``TEMP_PREFIX`` so `atomic.cleanup_orphans`
reclaims it after a crash). A child that can take that path (``{tmp:NAME}``,
``$SHARDLEDGER_OUTPUT_<NAME>``) writes it, and after a clean exit the file is fsynced and
renamed over its final path: the final path never holds a half-written file.

A program that cannot be told another path (the README's promise: no code changes)
writes its final path directly. That file counts as written by the child when the path
did not exist before the child started or now names another file, size or time
(`FileStamp`); after a clean exit it is fsynced where it lies. A file left there
unchanged (a previous run's) is no output of this attempt.

Either way the commit is recorded only after a clean exit, and only when every output
is present and passes the same content checks `verify` runs.
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
    "FileStamp",
    "OutputProblem",
    "check_outputs",
    "commit_outputs",
    "discard_temps",
    "env_name",
    "parse_output",
    "prepare_outputs",
    "stamp",
    "written_path",
]

# A temp file younger than this may belong to a live attempt of the same shard.
ORPHAN_AGE_S: Final = 300.0
_ENV_CHARS: Final = re.compile(r"[^A-Z0-9_]")


# (device, inode, size, mtime_ns, ctime_ns): any write, truncation or replacement changes one.
FileStamp = tuple[int, int, int, int, int]


def stamp(path: str) -> FileStamp | None:
    """Returns the identity and times of the file at ``path`` (None: nothing there)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


@dataclass(frozen=True, slots=True)
class DeclaredOutput:
    """One ``--output NAME=PATH``: the artifact name, its final path and the child's temp path."""

    name: str
    final: str
    temp: str = ""
    # The final path as it was before the child started (None: absent).
    before: FileStamp | None = None

    def fix(self) -> str:
        """Returns the two ways a command can write this output, for refusal messages."""
        return (
            f"the command must write {self.final} itself, or ${env_name(self.name)}"
            f" ({{tmp:{self.name}}} in its words) for an atomic commit"
        )


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
        prepared.append(DeclaredOutput(output.name, output.final, temp, stamp(output.final)))
    return prepared


def written_path(output: DeclaredOutput) -> str | None:
    """Returns the path the child wrote the output to: its temp path, else its final path.

    The temp path wins when both were written (the child took the path it was given).
    None: the child wrote neither (a final file unchanged since before it ran is not its).
    """
    if os.path.lexists(output.temp):
        return output.temp
    now = stamp(output.final)
    if now is not None and now != output.before:
        return output.final
    return None


def check_outputs(outputs: Iterable[DeclaredOutput]) -> list[OutputProblem]:
    """Returns what keeps each output from being committed (empty: all may be committed)."""
    problems = []
    for output in outputs:
        problem = _check_one(output)
        if problem is not None:
            problems.append(problem)
    return problems


def _check_one(output: DeclaredOutput) -> OutputProblem | None:
    path = written_path(output)
    if path is None:
        held = " (it still holds what it held before)" if output.before is not None else ""
        return OutputProblem(
            output.name, "missing", f"the command wrote no {output.final}{held}: {output.fix()}"
        )
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        return OutputProblem(
            output.name, "not_a_file", f"{path} is not a regular file: {output.fix()}"
        )
    try:
        verdict = content_verdict(Path(path), size=info.st_size, suffix=Path(output.final).suffix)
    except OSError as exc:
        return OutputProblem(output.name, "unreadable", f"cannot read {path}: {exc}")
    if verdict.passed:
        return None
    return OutputProblem(
        output.name,
        verdict.reason,
        f"{verdict.detail}, in {path}: fix the job, then rerun the shard",
    )


def commit_outputs(
    outputs: Iterable[DeclaredOutput], record: Callable[[str, atomic.CommitInfo], None]
) -> list[atomic.CommitInfo]:
    """Fsyncs, renames (a temp file) and records each checked output in turn; returns their commits."""
    done = []
    for output in outputs:
        if written_path(output) == output.final:
            # Written in place: made durable where it lies; there is nothing to rename.
            info = atomic.commit_file(output.final)
        else:
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
