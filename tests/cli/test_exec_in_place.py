"""`shardledger exec` commits a program that writes the output path it was given itself.

The README promises "any program as a shard, no code changes"; such a program
writes its own path, never the temp path exec makes. These tests run the
README's line as printed (RUN and SHARD filled in, as a reader does), a
previous run's file that the command never touched, and a child that dies after
writing its final path, against a real ledger with the CLI in real subprocesses.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.builders import run_cli

REPO = Path(__file__).resolve().parents[2]
RUN = "night-01"
# A renderer one cannot change: it writes where --out says and knows nothing of shardledger.
RENDER = """#!/bin/bash
set -e
while [ $# -gt 0 ]; do
  case "$1" in
    --frame) frame="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) echo "render: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$(dirname "$out")"
printf 'frame %s weights\\n' "$frame" > "$out"
eval "${RENDER_THEN:-true}"
"""


def readme_exec_line() -> str:
    """Returns the exec command the README's table prints, without its backquotes."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    (line,) = re.findall(r"`(shardledger exec RUN SHARD [^`]+)`", text)
    return str(line)


def plan_one_shard(capsys: pytest.CaptureFixture[str], target: str, tmp_path: Path) -> str:
    """Plans one shard of RUN; returns its id."""
    scene = tmp_path / "scene17.txt"
    scene.write_text("frame 17\n")
    manifest = tmp_path / "jobs.jsonl"
    entry = {"input": str(scene), "params": {"frame": 17}, "expected_outputs": ["weights"]}
    manifest.write_text(json.dumps(entry) + "\n")
    code, _, err = run_cli(capsys, "plan", RUN, "--manifest", str(manifest), "--server", target)
    assert code == 0, err
    code, out, err = run_cli(capsys, "plan", RUN, "--manifest", str(manifest), "--dry-run")
    assert code == 0, err
    return str(json.loads(out.splitlines()[0])["shard_id"])


def shell(command: str, cwd: Path, target: str, **extra: str) -> subprocess.CompletedProcess[str]:
    """Runs one command line in bash as a reader's shell would, `shardledger` on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLEDGER_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(
        SHARDLEDGER_SERVER=target,
        SHARDLEDGER_SPOOL_DIR=str(cwd / "spool"),
        SHARDLEDGER_DIAG_DIR=str(cwd / "diag"),
        SHARDLEDGER_EXIT_WAIT="5",
        **extra,
    )
    return subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A working directory holding ./render."""
    work = tmp_path / "work"
    work.mkdir()
    render = work / "render"
    render.write_text(RENDER)
    render.chmod(0o755)
    return work


def view(capsys: pytest.CaptureFixture[str], target: str) -> dict[str, Any]:
    code, out, err = run_cli(capsys, "shards", RUN, "--server", target, "--json")
    assert code == 0, err
    (shard,) = [json.loads(line) for line in out.splitlines()]
    return dict(shard)


def commits(capsys: pytest.CaptureFixture[str], target: str) -> list[dict[str, Any]]:
    code, out, err = run_cli(capsys, "events", RUN, "--server", target, "--json")
    assert code == 0, err
    events = [json.loads(line) for line in out.splitlines()]
    return [e["artifact_committed"] for e in events if "artifact_committed" in e]


def test_the_readmes_exec_line_commits_a_program_that_writes_its_own_path(
    work: Path, target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shard = plan_one_shard(capsys, target, tmp_path)
    line = readme_exec_line()
    assert "RUN SHARD" in line and "{tmp:" not in line  # the program is told its own path
    proc = shell(line.replace("RUN SHARD", f"{RUN} {shard}", 1), work, target)
    assert proc.returncode == 0, proc.stderr
    weights = work / "out" / "w.bin"
    assert weights.read_text() == "frame 17 weights\n"
    (commit,) = commits(capsys, target)
    assert (commit["name"], commit["path"]) == ("weights", str(weights))
    assert int(commit["size_bytes"]) == weights.stat().st_size
    assert view(capsys, target)["state"] == "unverified"
    code, _, err = run_cli(capsys, "verify", RUN, "--root", str(work / "out"), "--server", target)
    assert code == 0, err
    assert view(capsys, target)["state"] == "verified"


def test_a_previous_runs_file_left_untouched_is_missing_and_the_refusal_names_both_fixes(
    work: Path, target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shard = plan_one_shard(capsys, target, tmp_path)
    old = work / "out" / "c.json"
    old.parent.mkdir()
    old.write_text('{"from": "yesterday"}')
    proc = shell(
        f"shardledger exec {RUN} {shard} --output counts=out/c.json --json -- true", work, target
    )
    assert proc.returncode == 65, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    (problem,) = report["problems"]
    assert problem["reason"] == "missing"
    assert f"must write {old} itself" in problem["detail"]
    assert "$SHARDLEDGER_OUTPUT_COUNTS ({tmp:counts} in its words)" in problem["detail"]
    assert "still holds what it held before" in problem["detail"]
    assert old.read_text() == '{"from": "yesterday"}'
    assert commits(capsys, target) == []
    assert (view(capsys, target)["state"], view(capsys, target)["detail"]) == (
        "failed",
        "incomplete",
    )


def test_a_child_killed_after_writing_its_final_path_leaves_it_unrecorded_and_the_shard_to_rerun(
    work: Path, target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shard = plan_one_shard(capsys, target, tmp_path)
    proc = shell(
        f"shardledger exec {RUN} {shard} --output weights=out/w.bin --json"
        " -- ./render --frame 17 --out out/w.bin",
        work,
        target,
        RENDER_THEN="kill -KILL $$",
    )
    assert proc.returncode == 137, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["tag"] == "killed"
    assert f"left unrecorded at the final path: {work / 'out' / 'w.bin'}" in report["message"]
    assert (work / "out" / "w.bin").exists()  # what the child wrote stays, as documented
    assert commits(capsys, target) == []
    code, out, err = run_cli(capsys, "resume", RUN, "--server", target, "--json")
    assert code == 1, err
    assert [json.loads(r)["shard_id"] for r in out.splitlines()] == [shard]


def test_an_empty_file_written_in_place_refuses_the_commit_and_says_to_fix_the_job(
    work: Path, target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shard = plan_one_shard(capsys, target, tmp_path)
    proc = shell(
        f"shardledger exec {RUN} {shard} --output weights=out/w.bin --json"
        " -- bash -c 'mkdir -p out && : > out/w.bin'",
        work,
        target,
    )
    assert proc.returncode == 65, proc.stderr
    (problem,) = json.loads(proc.stdout.splitlines()[-1])["problems"]
    assert problem["reason"] == "empty"
    assert problem["detail"].endswith("fix the job, then rerun the shard")
    assert commits(capsys, target) == []
