"""The examples run end to end against a real ledger server (a subprocess on a real SQLite file)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shard_client import LedgerClient
from shardledger_cli.cli import main as cli

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[str]:
    """Starts `shardledger serve` as a subprocess; yields its HOST:PORT."""
    port_file = tmp_path / "port"
    command = [
        sys.executable,
        "-m",
        "shardledger_cli",
        "serve",
        "--db",
        str(tmp_path / "ledger.db"),
    ]
    command += ["--listen", "127.0.0.1:0", "--port-file", str(port_file), "--log-level", "warning"]
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not port_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"127.0.0.1:{port_file.read_text()}"
    proc.terminate()
    proc.wait(15)


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The manifests name their inputs relative to the repository root, as the README runs them.
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("SHARDLEDGER_SPOOL_DIR", str(tmp_path / "spool"))
    monkeypatch.setenv("SHARDLEDGER_DIAG_DIR", str(tmp_path / "diag"))


def plan_lines(run: str, manifest: Path, server: str, out: Path) -> list[str]:
    """Plans the manifest and writes its plan lines (plan --dry-run) to out; returns them."""
    assert cli(["plan", run, "--manifest", str(manifest), "--server", server]) == 0
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardledger_cli",
            "plan",
            run,
            "--manifest",
            str(manifest),
            "--dry-run",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    out.write_text(proc.stdout)
    return proc.stdout.splitlines()


def example(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs an example script from the repository root."""
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, check=check, timeout=180
    )


def test_plain_job_commits_its_output_and_verify_confirms_it(ledger: str, tmp_path: Path) -> None:
    lines = plan_lines("ex-plain", EXAMPLES / "jobs.jsonl", ledger, tmp_path / "plan.jsonl")
    out = tmp_path / "out"
    example(
        *("examples/plain_job.py", "--run", "ex-plain", "--line", lines[0], "--out", str(out)),
        *("--server", ledger),
    )
    shard_id = json.loads(lines[0])["shard_id"]
    counts = json.loads((out / f"{shard_id}.counts.json").read_text())
    assert counts["success"] == 2  # "...reported success. / Success was a word..."
    assert cli(["verify", "ex-plain", "--root", str(out), "--server", ledger]) == 0
    views = {v.shard_id: json.loads(v.view_json) for v in LedgerClient(ledger).shards("ex-plain")}
    assert views[shard_id]["state"] == "verified"
    assert sorted(v["state"] for v in views.values()) == ["missing"] * 3 + ["verified"]


def test_launch_pool_runs_exactly_the_resume_list_to_full_completion(
    ledger: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = plan_lines("ex-pool", EXAMPLES / "jobs.jsonl", ledger, tmp_path / "plan.jsonl")
    out = tmp_path / "out"
    example(
        *("examples/plain_job.py", "--run", "ex-pool", "--line", lines[1], "--out", str(out)),
        *("--server", ledger),
    )
    assert cli(["verify", "ex-pool", "--root", str(out), "--server", ledger]) == 0
    rerun = tmp_path / "rerun.jsonl"
    assert cli(["resume", "ex-pool", "--server", ledger, "-o", str(rerun)]) == 1
    assert rerun.read_text().splitlines() == [lines[0], lines[2], lines[3]]
    proc = example(
        "examples/launch_pool.py",
        "ex-pool",
        str(rerun),
        "--job",
        "examples/plain_job.py",
        "--workers",
        "2",
        "--out",
        str(out),
        "--server",
        ledger,
    )
    assert sorted(proc.stdout.split()) == sorted(
        [json.loads(line)["shard_id"] for line in (lines[0], lines[2], lines[3])] + ["ok"] * 3
    )
    assert cli(["verify", "ex-pool", "--root", str(out), "--server", ledger]) == 0
    capsys.readouterr()
    assert cli(["status", "ex-pool", "--server", ledger, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["submitted"], summary["verified"], summary["attempts"]) == (4, 4, 4)
    assert cli(["resume", "ex-pool", "--server", ledger]) == 0


def test_launch_pool_exits_nonzero_when_a_job_fails(ledger: str, tmp_path: Path) -> None:
    lines = plan_lines("ex-fail", EXAMPLES / "jobs.jsonl", ledger, tmp_path / "plan.jsonl")
    broken = json.loads(lines[0]) | {"input": "examples/data/no-such-file.txt"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(broken) + "\n")
    proc = example(
        "examples/launch_pool.py",
        "ex-fail",
        str(bad),
        "--job",
        "examples/plain_job.py",
        "--server",
        ledger,
        "--out",
        str(tmp_path / "out"),
        check=False,
    )
    assert proc.returncode == 1
    # The job names its input (input=line): a line whose input is not the planned one
    # stops before any work, tagged input_changed, and the pool says which shard.
    assert "InputChanged" in proc.stdout and broken["shard_id"] in proc.stdout
    views = [json.loads(v.view_json) for v in LedgerClient(ledger).shards("ex-fail")]
    failed = [v for v in views if v["state"] == "failed"]
    assert [v["shard_id"] for v in failed] == [broken["shard_id"]]
    assert failed[0]["detail"] == "input_changed"


def test_torch_train_checkpoints_on_sigterm_and_its_rerun_resumes(
    ledger: str, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    manifest = tmp_path / "train.jsonl"
    params: dict[str, float] = {"steps": 400, "checkpoint_every": 20, "samples": 2048}
    params |= {"hidden": 32, "lr": 0.01, "seed": 0}
    line = {"input": "examples/data/alpha.txt", "params": params}
    manifest.write_text(json.dumps(line | {"expected_outputs": ["weights", "metrics"]}) + "\n")
    [plan_line] = plan_lines("ex-train", manifest, ledger, tmp_path / "plan.jsonl")
    shard_id = json.loads(plan_line)["shard_id"]
    out = tmp_path / "out"
    argv = ["examples/torch_train.py", "--run", "ex-train", "--line", plan_line, "--out", str(out)]
    argv += ["--server", ledger]
    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stderr=subprocess.PIPE, text=True)
    client = LedgerClient(ledger)
    deadline = time.monotonic() + 120
    while not any(e.HasField("checkpoint") for e in client.list_events("ex-train")):
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint was recorded"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    [entry] = list(client.resume("ex-train"))
    assert (entry.shard_id, entry.reason) == (shard_id, "failed:preempted")
    rerun = example(*argv)
    resumed = int(rerun.stdout.split("resumed from step ")[1].split()[0])
    assert resumed >= 20
    assert os.path.exists(out / "ex-train" / shard_id / "weights.pt")
    assert cli(["verify", "ex-train", "--root", str(out), "--server", ledger]) == 0
    assert list(client.resume("ex-train")) == []


def test_slurm_array_template_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(EXAMPLES / "slurm_array.sbatch")], check=True)
    text = (EXAMPLES / "slurm_array.sbatch").read_text()
    assert "--format slurm-array" in text
    assert "SLURM_ARRAY_TASK_ID + 1" in text


@pytest.mark.parametrize(
    ("settings", "plan_lines", "message"),
    [
        ({"PLAN_LINES": "plan-lines.jsonl"}, "x\n", "RUN: set RUN (the run id)"),
        ({"RUN": "n1", "PLAN_LINES": "no-such.jsonl"}, "x\n", "is not a readable file"),
        ({"RUN": "n1", "PLAN_LINES": "plan-lines.jsonl"}, "", "has no plan line"),
    ],
)
def test_the_slurm_submit_script_refuses_a_bad_setting_before_submitting(
    tmp_path: Path, settings: dict[str, str], plan_lines: str, message: str
) -> None:
    # No Slurm here: a stand-in sbatch on PATH records any call, and none may come.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\necho called >> {tmp_path}/sbatch-calls\n")
    (bin_dir / "sbatch").chmod(0o755)
    (tmp_path / "plan-lines.jsonl").write_text(plan_lines)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": "out", **settings}
    done = subprocess.run(
        ["bash", str(EXAMPLES / "slurm_submit.sh")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode != 0 and message in done.stderr, done.stderr
    assert not (tmp_path / "sbatch-calls").exists()


def test_the_slurm_submit_script_sends_every_plan_line_with_logs_in_out(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > args\necho 42\n')
    (bin_dir / "sbatch").chmod(0o755)
    (tmp_path / "plan-lines.jsonl").write_text("a\nb\nc\n")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "RUN": "n1", "PLAN_LINES": "plan-lines.jsonl"}
    done = subprocess.run(
        ["bash", str(EXAMPLES / "slurm_submit.sh"), "--gres=none"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout == "42\n"
    assert (tmp_path / "out" / "logs").is_dir()
    assert (tmp_path / "args").read_text().splitlines() == [
        "--parsable",
        "--export=ALL",
        "--output=out/logs/%x-%A_%a.out",
        "--array=0-2%64",
        "--gres=none",
        str(EXAMPLES / "slurm_submit.sh").replace("slurm_submit.sh", "slurm_array.sbatch"),
    ]
