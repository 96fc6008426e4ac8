"""Every command that prints a table or a report, piped: plain text a script can cut, JSON that parses.

Piped (stdout not a terminal, as in a Slurm log, `| cut` or `| grep`) each command
prints its plain form: blocks of tab-separated lines, a header line then its rows,
a `# NAME` line before a block where there are several, other `#` lines notes, and
never a box-drawing character (docs/cli.md, tools/shardledger_cli/parsing.py). Each
case below runs a real command in process, stdout captured, against one small real
night played through the SDK (tests/nights.py) on a real server, and reads what a
script would.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog

from ledger_server.config import ServerConfig
from ledger_server.server import RunningServer, create_server
from shard_client.spool import Spool
from tests.builders import run_cli, started
from tests.nights import play_night

RUN = "night-01"
REF = "night-01-ref"
# One shard of each outcome: a rerun (preempted), a stale one (hang), verify failures.
OUTCOMES = ["ok", "ok", "empty", "truncated", "preempted", "hang", "missing"]
BOXES = re.compile("[\u2500-\u257f]")

pytestmark = pytest.mark.usefixtures("spool_in_tmp")


@dataclass(frozen=True, slots=True)
class Night:
    """Where the night is: the ledger's address and database, its outputs, a pending spool."""

    target: str
    db: Path
    root: Path
    ref_root: Path
    spools: Path


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Path]]:
    """A real server on a free port over a SQLite file, for the whole module."""
    base = tmp_path_factory.mktemp("piped")
    server = create_server(ServerConfig(database=str(base / "ledger.db"), listen="127.0.0.1:0"))
    yield server, base
    server.stop(0.5)


_played: dict[str, Night] = {}


@pytest.fixture
def night(ledger: tuple[RunningServer, Path], capsys: pytest.CaptureFixture[str]) -> Night:
    """The night, played once for the module (by the first test that asks for it).

    night-01 has one shard of each outcome; night-01-ref re-computes a sample of its
    verified shards (for compare); a token exists; a spool holds a pending event.
    """
    if RUN in _played:
        return _played[RUN]
    server, base = ledger
    target = f"127.0.0.1:{server.port}"
    with structlog.testing.capture_logs():
        played = _play(capsys, target, base)
    _played[RUN] = played
    return played


def _play(capsys: pytest.CaptureFixture[str], target: str, base: Path) -> Night:
    root, ref_root = base / "out", base / "ref-out"
    play_night(capsys, target, root, RUN, OUTCOMES, labels={"provider": "D"})
    code, out, err = run_cli(
        capsys,
        "sample",
        RUN,
        "--as",
        REF,
        "--min",
        "2",
        "--seed",
        "1",
        "--json",
        "--server",
        target,
    )
    assert code == 0, err
    picked = json.loads(out)["shards"]
    play_night(
        capsys,
        target,
        ref_root,
        REF,
        ["ok"] * len(picked),
        shard_ids=picked,
        labels={"provider": "E"},
    )
    db = base / "ledger.db"
    code, _, err = run_cli(capsys, "token", "create", "--role", "reader", "--db", str(db))
    assert code == 0, err
    spools = base / "spools"
    with Spool(spools / "host-1") as spool:
        spool.append([started(RUN, "s6", "a-spooled").SerializeToString()])
    (spools / "host-1" / "target").write_text(target + "\n")
    return Night(target=target, db=db, root=root, ref_root=ref_root, spools=spools)


# Each command that prints a table or a report, as a user types it ({root} etc. filled in).
# A case whose output is a table must print at least one block of two or more columns.
CASES: dict[str, tuple[list[str], bool]] = {
    "status": (["status", RUN], True),
    "status --costs": (["status", RUN, "--costs"], True),
    "shards": (["shards", RUN], True),
    "shards --attempts": (["shards", RUN, "--attempts"], True),
    "shards --state unconfirmed": (["shards", RUN, "--state", "unconfirmed"], True),
    "runs": (["runs"], True),
    "events": (["events", RUN], True),
    "events --shard": (["events", RUN, "--shard", "s4"], True),
    "report": (["report", RUN], True),
    "report --by": (["report", "--by", "provider", RUN, REF], True),
    "trend": (["trend"], True),
    "accept": (["accept", "--runs", RUN], True),
    "compare": (["compare", RUN, REF, "--root", "{root}", "--ref-root", "{ref_root}"], True),
    "sample --dry-run": (["sample", RUN, "--as", "x-ref", "--min", "2", "--dry-run"], True),
    "spool status": (["spool", "status", "--dir", "{spools}"], True),
    "token list": (["token", "list", "--db", "{db}"], True),
    "verify": (["verify", RUN, "--root", "{root}", "--recheck"], False),
    "resume": (["resume", RUN], False),
    "resume --reasons": (["resume", RUN, "--reasons"], False),
    "resume --format ids": (["resume", RUN, "--format", "ids"], False),
    "resume --format slurm-array": (["resume", RUN, "--format", "slurm-array"], False),
}
# The commands that open the database themselves take no --server.
LOCAL = ("token",)


def argv_of(night: Night, words: list[str]) -> list[str]:
    """Returns the command line of a case against the night."""
    places = {
        "{root}": str(night.root),
        "{ref_root}": str(night.ref_root),
        "{db}": str(night.db),
        "{spools}": str(night.spools),
    }
    argv = [places.get(w, w) for w in words]
    return argv if words[0] in LOCAL else [*argv, "--server", night.target]


def plain_problems(out: str, *, table: bool) -> list[str]:
    """Returns what keeps a command's piped output from being plain (empty when it is).

    A block is a run of lines that are neither blank nor `#` lines; its first line is
    its header, and every line of it has as many tab-separated fields as the header.
    """
    problems = [f"box drawing {m.group()!r} at {m.start()}" for m in BOXES.finditer(out)][:3]
    header: list[str] | None = None
    widest = 0
    for n, line in enumerate(out.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            header = None
            continue
        fields = line.split("\t")
        if header is None:
            header, widest = fields, max(widest, len(fields))
        elif len(fields) != len(header):
            problems.append(
                f"line {n} has {len(fields)} fields, its header {len(header)}: {line!r}"
            )
    if table and widest < 2:
        problems.append("no block of two or more tab-separated columns")
    return problems


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_piped_output_is_tab_separated_blocks_without_box_drawing(
    case: str, night: Night, capsys: pytest.CaptureFixture[str]
) -> None:
    words, table = CASES[case]
    code, out, err = run_cli(capsys, *argv_of(night, words))
    assert code in (0, 1), err
    assert out.strip(), f"{case} printed nothing"
    assert plain_problems(out, table=table) == [], out


# Every case above that has a JSON form: --format json, or --json where --format means
# another thing (resume) or is not offered (verify).
JSON_FLAG = {"resume": "--json", "resume --reasons": "", "verify": "--json"}


def _json_cases() -> list[str]:
    return [c for c in CASES if JSON_FLAG.get(c, "--format json") and not c.startswith("resume -")]


@pytest.mark.parametrize("case", _json_cases())
def test_json_output_parses_as_one_document_or_json_lines(
    case: str, night: Night, capsys: pytest.CaptureFixture[str]
) -> None:
    words, _ = CASES[case]
    flag = JSON_FLAG.get(case, "--format json").split()
    code, out, err = run_cli(capsys, *argv_of(night, [*words, *flag]))
    assert code in (0, 1), err
    assert out.strip(), f"{case} printed nothing"
    parsed = parse_json(out)
    assert parsed, out


def parse_json(out: str) -> list[Any]:
    """Returns the JSON values printed: one document, or one per line (JSON Lines)."""
    try:
        return [json.loads(out)]
    except json.JSONDecodeError:
        return [json.loads(line) for line in out.splitlines()]
