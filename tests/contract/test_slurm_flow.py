"""A night on a real Slurm: an array job, hung tasks stopped through scancel, the rerun, 100 %."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ledger_server.server import RunningServer
from shard_client.client import LedgerClient
from shardledger_cli.cli import main
from tests import slurm
from tests.slurm import SlurmCluster

slurm_cluster = slurm.slurm_cluster

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
SUBMIT = REPO / "examples" / "slurm_submit.sh"
RUN = "night-slurm"
HUNG = {"s1", "s4"}


def _plan(tmp_path: Path, target: str) -> Path:
    """Plans six shards over small text files; returns the plan lines file."""
    lines = []
    for i in range(6):
        text = tmp_path / "data" / f"in{i}.txt"
        text.parent.mkdir(exist_ok=True)
        text.write_text(f"shard {i} says hello hello\n")
        lines.append(
            json.dumps({"shard_id": f"s{i}", "input": str(text), "expected_outputs": ["counts"]})
        )
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    assert main(["plan", RUN, "--manifest", str(manifest), "--server", target]) == 0
    plan_lines = tmp_path / "plan-lines.jsonl"
    with plan_lines.open("w") as out:
        subprocess.run(
            [
                *(sys.executable, "-m", "shardledger_cli", "plan", RUN),
                *("--manifest", str(manifest), "--server", target, "--dry-run"),
            ],
            cwd=REPO,
            stdout=out,
            check=True,
        )
    return plan_lines


def _submit(cluster: SlurmCluster, *args: str) -> int:
    """Submits as docs/cluster.md does: examples/slurm_submit.sh, from the repository root.

    The template asks for a GPU and 8 CPUs; this node has no GPU, so the test asks for none.
    """
    done = cluster.run(
        "bash", str(SUBMIT), "--gres=none", "--cpus-per-task=1", *args, cwd=REPO, timeout_s=60
    )
    return int(done.stdout.strip().split(";")[0])


def _wait_tasks(cluster: SlurmCluster, job_id: int, timeout_s: float = 30) -> dict[str, str]:
    """Waits until every task of the array is in a terminal state; returns them."""
    deadline = time.monotonic() + timeout_s
    while True:
        tasks = cluster.job_states(job_id)
        if tasks and set(tasks.values()) <= slurm.TERMINAL_STATES:
            return tasks
        assert time.monotonic() < deadline, f"job {job_id} still {tasks}"
        time.sleep(0.2)


def _wait_states(client: LedgerClient, want: dict[str, str], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        got = {v.shard_id: json.loads(v.view_json)["state"] for v in client.shards(RUN)}
        if all(got.get(k) == v for k, v in want.items()):
            return
        assert time.monotonic() < deadline, f"shards are {got}, not {want}"
        time.sleep(0.2)


def test_hung_array_tasks_are_stopped_through_scancel_and_the_rerun_completes_the_run(
    slurm_cluster: SlurmCluster,
    server: RunningServer,
    client: LedgerClient,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    target = client.target
    plan_lines = _plan(tmp_path, target)
    out = tmp_path / "out"
    for name, value in {
        "RUN": RUN,
        "PLAN_LINES": str(plan_lines),
        "OUT": str(out),
        "JOB": "tests/helpers/slurm_shard_job.py",
        "SHARDLEDGER_SERVER": target,
        "SHARDLEDGER_VENV": sys.prefix,
        "HANG_SHARDS": ",".join(sorted(HUNG)),
    }.items():
        monkeypatch.setenv(name, value)
    # The watchdog's scancel and scontrol talk to the test cluster.
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    monkeypatch.setenv("THROTTLE", "6")
    checkout_before = set(REPO.glob("slurm-*.out"))
    array_id = _submit(slurm_cluster)  # every plan line: 0-5%6
    # On a two-CPU node the two hung tasks hold every CPU: s5 waits for the watchdog.
    _wait_states(client, {"s1": "stale", "s4": "stale"})
    capsys.readouterr()

    argv = ["watch", RUN, "--kill-stale", "--once", "--grace", "1", "--server", target]
    assert main([*argv, "--diag-dir", str(out / "diag"), "--json"]) == 0
    actions = {a["shard_id"]: a for a in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(actions) == HUNG
    for action in actions.values():
        task = f"{array_id}_{action['scheduler']['array_task_id']}"
        assert action["scheduler"]["kind"] == "slurm"
        assert action["scheduler"]["array_job_id"] == str(array_id)
        assert action["method"] == "slurm"
        assert action["steps"][1:] == [
            f"scancel --signal=TERM --full {task}",
            f"scancel {task}",
            "slurm job ended",
        ]
        assert action["recorded_failed_timeout"] is True
        # The watchdog ran on the job's node: the SDK dumped the deadlocked stack for it.
        # The hung frame, as faulthandler names it ("in deadlock") or py-spy does, when the
        # machine has it ("    deadlock (slurm_shard_job.py:32)").
        assert re.search(
            r"\bin deadlock\b|^\s+deadlock \(slurm_shard_job\.py:",
            Path(action["diagnostics"]).read_text(),
            re.MULTILINE,
        )
    tasks = _wait_tasks(slurm_cluster, array_id)
    assert {t: s for t, s in tasks.items() if s != "COMPLETED"} == {
        f"{array_id}_{i}": "CANCELLED" for i in (1, 4)
    }
    views = {v.shard_id: json.loads(v.view_json) for v in client.shards(RUN, state="failed")}
    assert {k: (v["state"], v["detail"]) for k, v in views.items()} == {
        s: ("failed", "timeout") for s in HUNG
    }

    # The morning after, as the template says: verify, then resume what is left.
    main(["verify", RUN, "--root", str(out), "--server", target])
    capsys.readouterr()
    assert main(["resume", RUN, "--format", "slurm-array", "--server", target]) == 1
    array = capsys.readouterr().out.strip()
    assert array == "1,4"
    monkeypatch.delenv("HANG_SHARDS")
    rerun = _submit(slurm_cluster, f"--array={array}%6")
    assert slurm_cluster.wait_job(rerun) == "COMPLETED"
    # Every task logged under $OUT/logs, Slurm's word on a cancelled task included, and
    # nothing in the checkout the jobs were submitted from.
    logs = {p.name for p in (out / "logs").iterdir()}
    first = {f"project-x-{array_id}_{i}.out" for i in range(6)}
    assert logs == first | {f"project-x-{rerun}_{i}.out" for i in (1, 4)}
    assert "CANCELLED" in (out / "logs" / f"project-x-{array_id}_1.out").read_text()
    assert set(REPO.glob("slurm-*.out")) == checkout_before
    assert main(["verify", RUN, "--root", str(out), "--server", target]) == 0
    capsys.readouterr()
    assert main(["status", RUN, "--server", target, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["verified"], summary["submitted"]) == (6, 6)
