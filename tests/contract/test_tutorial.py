"""The tutorial and README run as written: their code is the examples' code, their commands pass.

Rules the docs follow, so that this file can run them:

* ``<!-- include: PATH -->`` before a code block and ``<!-- end include -->``
  after it: the block is PATH's text, byte for byte (``python -m tools.gen.sync_docs``).
* ``<!-- not run: WHY -->`` on the line before a block: the test skips it.
* ``<!-- on a terminal -->`` on the line before a block: it runs with its output on a
  pseudo-terminal, 100 columns wide, as a reader's shell has it (tables drawn, colours
  stripped before matching); its ``text`` block is what the reader sees there.
* Every other ``bash`` block of docs/tutorial.md, README.md and examples/README.md runs, in order, in one temp
  directory that holds a copy of ``examples/``, against a fresh ledger whose
  address is in ``$SHARDLEDGER_SERVER``; exports carry from block to block as
  in a reader's shell. One command per line; a line ending in ``# exit N``
  must exit N, every other command 0.
* A ``text`` block right after a run block is output it must print: each line
  appears in one output line (whitespace runs count as one space, ``…`` as
  anything).
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import termios
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pytest

from ledger_server.server import RunningServer
from shard_client import Ledger, LedgerClient
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from tests.builders import run_cli
from tools.gen import sync_docs

REPO: Final = Path(__file__).resolve().parents[2]
TUTORIAL: Final = REPO / "docs" / "tutorial.md"
README: Final = REPO / "README.md"
EXAMPLES_README: Final = REPO / "examples" / "README.md"
SHELLS: Final = ("bash", "sh", "shell", "console")
NOT_RUN: Final = re.compile(r"<!-- not run: (?P<why>.+?) -->")
TERMINAL: Final = "<!-- on a terminal -->"
ANSI: Final = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")
TERMINAL_COLUMNS: Final = 100
INCLUDE: Final = re.compile(r"<!-- include: (?P<path>[^ ]+) -->")
EXIT: Final = re.compile(r"\s#\s*exit (?P<code>\d+)\b")


@dataclass(frozen=True, slots=True)
class Block:
    """One fenced code block of a document and what the lines around it say about it."""

    doc: str
    line: int  # 1-based line of the opening fence
    lang: str
    body: str
    not_run: str | None  # the reason given, when marked
    include: str | None  # the included path, when it is an include region
    expected: str | None  # the text block that follows it, if any
    terminal: bool = False  # its output goes to a pseudo-terminal

    def where(self) -> str:
        """Returns DOC:LINE for messages."""
        return f"{self.doc}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """Returns every fenced block of a markdown file, with its markers and its expected output."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[tuple[int, str, str, str]] = []  # (line index, lang, body, line before)
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang, start = lines[i][3:].strip(), i
            i += 1
            while not lines[i].startswith("```"):
                i += 1
            before = lines[start - 1] if start else ""
            found.append((start, lang, "\n".join(lines[start + 1 : i]) + "\n", before))
        i += 1
    result = []
    for n, (start, lang, body, before) in enumerate(found):
        following = found[n + 1] if n + 1 < len(found) else None
        end = start + body.count("\n") + 1  # the closing fence
        expected = None
        if (
            lang in SHELLS
            and following is not None
            and following[1] == "text"
            and all(not t.strip() for t in lines[end + 1 : following[0]])
        ):
            expected = following[2]
        not_run, include = NOT_RUN.fullmatch(before.strip()), INCLUDE.fullmatch(before.strip())
        result.append(
            Block(
                doc=path.name,
                line=start + 1,
                lang=lang,
                body=body,
                not_run=not_run["why"] if not_run else None,
                include=include["path"] if include else None,
                expected=expected,
                terminal=before.strip() == TERMINAL,
            )
        )
    return result


def runnable(path: Path) -> list[Block]:
    """Returns the shell blocks a reader is meant to run, in order."""
    return [b for b in blocks(path) if b.lang in SHELLS and b.not_run is None]


def script(block: Block, state: Path) -> str:
    """Returns the block as a bash script that checks every command's exit status."""
    out = [f'[ -f "{state}" ] && . "{state}"', f"trap 'export -p > \"{state}\"' EXIT"]
    for n, text in enumerate(block.body.splitlines(), block.line + 1):
        out.append(text)
        command = text.strip()
        if not command or command.startswith("#") or command.endswith("&"):
            continue
        code = EXIT.search(text)
        want = int(code["code"]) if code else 0
        out.append(
            f'__rc=$?; if [ "$__rc" -ne {want} ]; then'
            f' echo "{block.doc}:{n} exited $__rc, expected {want}" >&2; exit 99; fi'
        )
    return "\n".join(out) + "\n"


def missing_lines(expected: str, output: str) -> list[str]:
    """Returns the expected lines that no output line matches (… matches anything)."""
    seen = [" ".join(t.split()) for t in output.splitlines()]

    def matches(want: str, line: str) -> bool:
        at = 0
        for part in (p.strip() for p in want.split("…")):
            at = line.find(part, at)
            if at < 0:
                return False
            at += len(part)
        return True

    wanted = [" ".join(t.split()) for t in expected.splitlines() if t.strip()]
    return [w for w in wanted if not any(matches(w, line) for line in seen)]


@pytest.fixture
def reader_shell(tmp_path: Path, server: RunningServer, quiet_logs: None) -> Iterator[Path]:
    """A working directory like a checkout's root (examples/ copied in), its ledger running."""
    work = tmp_path / "work"
    shutil.copytree(REPO / "examples", work / "examples")
    yield work


def reader_env(tmp_path: Path, server: RunningServer) -> dict[str, str]:
    """Returns the environment of a reader's shell: this venv first on PATH, the fresh ledger set."""
    bin_dir = Path(sys.executable).parent
    assert (bin_dir / "shardledger").exists(), f"no shardledger next to {sys.executable}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLEDGER_")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["SHARDLEDGER_SERVER"] = f"127.0.0.1:{server.port}"  # what step 0 tells the reader to set
    env["SHARDLEDGER_SPOOL_DIR"] = str(tmp_path / "spool")  # keeps the test's spool its own
    env.pop("PYTHONPATH", None)
    return env


def test_the_tutorial_shows_the_example_job_byte_for_byte() -> None:
    for doc in (TUTORIAL, README):
        text = doc.read_text(encoding="utf-8")
        assert sync_docs.render(text) == text, (
            f"{doc.name} is stale: run python -m tools.gen.sync_docs"
        )
    shown = dict(sync_docs.includes(TUTORIAL.read_text(encoding="utf-8")))
    assert shown["examples/torch_train.py"] == (REPO / "examples/torch_train.py").read_text()


def test_every_code_block_a_reader_would_run_is_run_or_says_why_not() -> None:
    reasons = []
    for doc in (TUTORIAL, README, EXAMPLES_README):
        for block in blocks(doc):
            if block.lang == "python":
                assert block.include or block.not_run, (
                    f"{block.where()}: a python block must be an include region or say"
                    " <!-- not run: why -->"
                )
            assert block.lang, f"{block.where()}: say what the block is (bash, python, text)"
            if block.not_run:
                reasons.append(f"{block.where()}: {block.not_run}")
            if block.lang in SHELLS and block.not_run is None:
                assert not any(t.rstrip().endswith("\\") for t in block.body.splitlines()), (
                    f"{block.where()}: one command per line, so each exit status is checked"
                )
    # The blocks left out are few, and each says why (install, long-running, a sketch).
    assert len(reasons) <= 10, "\n".join(reasons)
    assert len(runnable(TUTORIAL)) >= 6
    assert len(runnable(README)) >= 1


def test_every_status_example_shows_what_a_reader_sees() -> None:
    """A status example quotes what the reader sees: on a terminal, from its first line.

    Piped, status prints FIELD/VALUE rows (`equation<TAB>submitted 2 = ...`): a quote of
    bare lines checked against that matched lines the reader never sees as such.
    """
    shown = [
        b
        for doc in (TUTORIAL, README, EXAMPLES_README)
        for b in runnable(doc)
        if b.expected is not None and "shardledger status" in b.body
    ]
    assert shown
    for block in shown:
        assert block.terminal, f"{block.where()}: mark it <!-- on a terminal -->"
        if block.body.strip().count("\n") == 0:  # a block of status alone
            assert (block.expected or "").startswith("run "), f"{block.where()}: quote line 1"


def test_the_tutorial_runs_through_a_hang_a_damaged_file_and_a_rerun_to_100_percent(
    reader_shell: Path, tmp_path: Path, server: RunningServer
) -> None:
    pytest.importorskip("torch")
    run_doc(TUTORIAL, reader_shell, reader_env(tmp_path, server), tmp_path)
    # The end state the tutorial promises, read from the ledger rather than from the text.
    views = [json.loads(v.view_json) for v in _shards(server)]
    assert [v["state"] for v in views] == ["verified", "verified"]
    assert list((reader_shell / "diag").glob("*.hang.txt")), "the hang left no diagnostics"


def test_the_examples_readme_runs_a_plain_night_and_a_training_night(
    reader_shell: Path, tmp_path: Path, server: RunningServer
) -> None:
    pytest.importorskip("torch")
    run_doc(EXAMPLES_README, reader_shell, reader_env(tmp_path, server), tmp_path)
    views = [json.loads(v.view_json) for v in _shards(server, "night-01")]
    assert [v["state"] for v in views] == ["verified"] * 4


def test_the_readmes_first_look_runs_a_plain_night_to_verified(
    reader_shell: Path, tmp_path: Path, server: RunningServer
) -> None:
    run_doc(README, reader_shell, reader_env(tmp_path, server), tmp_path)
    views = [json.loads(v.view_json) for v in _shards(server, "night-00")]
    assert [v["state"] for v in views] == ["verified"] * 4


def left_unignored(work: Path) -> list[str]:
    """Returns what a reader's commands left in `work` (a checkout's root) that git would list.

    Every file under `work` but the copied examples is checked against the checkout's
    .gitignore, as `git status` in a real checkout would: the tutorial runs from the
    repository root, so whatever it writes must be ignored there.
    """
    tracked = {
        p.relative_to(REPO).as_posix() for p in (REPO / "examples").rglob("*") if p.is_file()
    }
    written = sorted(
        rel
        for rel in (p.relative_to(work).as_posix() for p in work.rglob("*") if p.is_file())
        if rel not in tracked and "__pycache__" not in rel
    )
    if not written:
        return []
    proc = subprocess.run(
        ["git", "-C", str(REPO), "check-ignore", "--no-index", "--stdin"],
        input="\n".join(written) + "\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode in (0, 1), proc.stderr  # 1: none of them is ignored
    return sorted(set(written) - set(proc.stdout.splitlines()))


def on_a_terminal(
    command: list[str], *, cwd: Path, env: dict[str, str], timeout_s: float = 150
) -> tuple[int, str]:
    """Runs a command with stdout and stderr on a pseudo-terminal; returns (exit code, text).

    The text is what the reader's terminal shows, colours and carriage returns stripped.
    """
    parent, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 50, TERMINAL_COLUMNS, 0, 0))
    wide = {**env, "COLUMNS": str(TERMINAL_COLUMNS), "TERM": "xterm"}
    proc = subprocess.Popen(command, cwd=cwd, env=wide, stdout=child, stderr=child)
    os.close(child)
    chunks = []
    try:
        while True:
            try:
                data = os.read(parent, 65536)
            except OSError:  # EIO: every holder of the terminal's other side is gone
                break
            if not data:
                break
            chunks.append(data)
        code = proc.wait(timeout=timeout_s)
    finally:
        os.close(parent)
        if proc.poll() is None:
            proc.kill()
    return code, ANSI.sub("", b"".join(chunks).decode(errors="replace"))


def run_doc(
    doc: Path, cwd: Path, env: dict[str, str], tmp_path: Path, *, timeout_s: float = 150
) -> None:
    """Runs a document's shell blocks in order, as a reader's shell would; checks their output.

    Afterwards nothing the reader's commands wrote may show up as untracked in a checkout.
    """
    state = tmp_path / "shell-state.sh"
    transcript = []
    for block in runnable(doc):
        path = tmp_path / f"block-{block.line}.sh"
        path.write_text(script(block, state))
        command = ["bash", "--noprofile", "--norc", "-o", "pipefail", str(path)]
        if block.terminal:
            code, output = on_a_terminal(command, cwd=cwd, env=env, timeout_s=timeout_s)
        else:
            proc = subprocess.run(
                command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s
            )
            code, output = proc.returncode, proc.stdout + proc.stderr
        transcript.append(f"$ {block.where()}\n{block.body}{output}")
        assert code == 0, "\n".join(transcript)
        if block.expected is not None:
            missing = missing_lines(block.expected, output)
            assert not missing, f"{block.where()} did not print {missing}:\n{output}"
    left = left_unignored(cwd)
    assert not left, f"{doc.name} leaves files git would list as untracked: {left[:20]}"


def _shards(server: RunningServer, run_id: str = "night-01") -> list[pb.ShardView]:
    client = LedgerClient(f"127.0.0.1:{server.port}")
    try:
        return list(client.shards(run_id))
    finally:
        client.close()


def test_a_rerun_whose_checkpoint_is_the_last_step_commits_without_training(
    tmp_path: Path,
    server: RunningServer,
    quiet_logs: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The old tutorial's loop left `loss` unbound when a rerun started at the final step.
    torch = pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    import torch_train

    monkeypatch.setenv("SHARDLEDGER_SPOOL_DIR", str(tmp_path / "spool"))
    monkeypatch.chdir(REPO)
    params = {"steps": 20, "checkpoint_every": 10, "samples": 64, "hidden": 4, "lr": 0.01}
    line = {"input": "examples/data/alpha.txt", "params": params | {"seed": 0}}
    manifest = tmp_path / "one.jsonl"
    manifest.write_text(json.dumps(line | {"expected_outputs": ["weights", "metrics"]}) + "\n")
    address = f"127.0.0.1:{server.port}"
    code, _, err = run_cli(capsys, "plan", "last", "--manifest", str(manifest), "--server", address)
    assert code == 0, err
    code, out, err = run_cli(capsys, "plan", "last", "--manifest", str(manifest), "--dry-run")
    assert code == 0, err
    planned = json.loads(out.splitlines()[0])
    work = tmp_path / "out" / "last" / planned["shard_id"]
    with Ledger(address) as ledger:
        with (
            pytest.raises(RuntimeError),
            ledger.shard(
                "last", planned["shard_id"], checkpoint_dir=work / "checkpoints", output_dir=work
            ) as shard,
        ):
            model = torch.nn.Sequential(
                torch.nn.Linear(16, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1)
            )
            optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
            shard.save_checkpoint(20, model=model, optimizer=optimizer)
            raise RuntimeError("preempted right after the last step's checkpoint")
        torch_train.run_line(ledger, "last", planned, out_dir=str(tmp_path / "out"))
    metrics = json.loads((work / "metrics.json").read_text())
    assert metrics["steps"] == 20 and metrics["final_loss"] >= 0
