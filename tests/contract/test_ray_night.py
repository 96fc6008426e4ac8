"""A night on a real Ray cluster: retries, a worker killed mid-commit, the driver killed, resume.

Every task is a real Ray task on a local head (`tests.ray_cluster`), submitted by a
driver subprocess as a user's would be (tests/helpers/ray_night_driver.py over
examples/ray/ray_tasks.py), running inside `shard_client.ray.shard_task`. The
driver's faults are chosen per shard and Ray attempt; each attempt records what it
did before doing it (the truth). The ledger's sets after the night (verified,
failed, stale, duplicates, the resume list) and every attempt's row in `shards
--attempts` (its outcome and its Ray identity) must equal what the truth implies;
the resume list, handed back to a second driver, ends the run at 100 % verified.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import blake3
import pytest

from ledger_server.server import RunningServer
from shard_client.atomic import TEMP_PREFIX
from shard_client.client import LedgerClient
from shard_client.scheduler import process_start_ticks
from tests import ray_cluster as cluster_module
from tests.builders import run_cli
from tests.contract.test_tutorial import blocks, reader_env, run_doc
from tests.ray_cluster import MARKER, RayCluster

ray_cluster = cluster_module.ray_cluster

# A guard against a hang only: the waits below scale with the measured head start.
pytestmark = [pytest.mark.ray, pytest.mark.timeout(1200)]

REPO: Final = Path(__file__).resolve().parents[2]
DRIVER: Final = REPO / "tests" / "helpers" / "ray_night_driver.py"
DATA_DRIVER: Final = REPO / "tests" / "helpers" / "ray_data_driver.py"
DATA_EXAMPLE: Final = REPO / "examples" / "ray" / "ray_data.py"
RUN: Final = "night-ray"
DATA_RUN: Final = "night-ray-data"
DOC: Final = REPO / "docs" / "ray.md"
# shard -> what each Ray attempt does (attempt number as Ray counts it, from 0).
FAULTS: Final = {
    "t-raise": {"0": "raise"},  # retry_exceptions: attempt 1 commits
    "t-killed": {"0": "kill_mid_commit"},  # the worker dies mid-commit: attempt 1 commits
    "t-always": {"0": "raise", "1": "raise"},  # out of retries (max_retries=1): failed
    "t-gate": {"0": "gate"},  # still running when the driver is killed
}
SHARDS: Final = ("t-ok1", "t-ok2", "t-raise", "t-killed", "t-always", "t-gate")


def _plan(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    target: str,
    shards: tuple[str, ...] = SHARDS,
    run_id: str = RUN,
) -> Path:
    """Plans shards over small text files; returns the plan lines file."""
    manifest = tmp_path / "manifest.jsonl"
    with manifest.open("w") as out:
        for shard_id in shards:
            text = tmp_path / "data" / f"{shard_id}.txt"
            text.parent.mkdir(exist_ok=True)
            text.write_text(f"{shard_id} says hello hello\n")
            line = {"shard_id": shard_id, "input": str(text), "expected_outputs": ["counts"]}
            out.write(json.dumps(line) + "\n")
    assert run_cli(capsys, "plan", run_id, "--manifest", str(manifest), "--server", target)[0] == 0
    code, lines, _ = run_cli(capsys, "plan", run_id, "--manifest", str(manifest), "--dry-run")
    assert code == 0
    plan_lines = tmp_path / "plan-lines.jsonl"
    plan_lines.write_text(lines)
    return plan_lines


def _driver(
    cluster: RayCluster,
    target: str,
    lines: Path,
    out: Path,
    truth: Path,
    faults: dict[str, Any],
    *extra: str,
    run_id: str = RUN,
) -> subprocess.Popen[str]:
    env = cluster.driver_env(
        SHARDLEDGER_SERVER=target,
        SHARDLEDGER_SPOOL_DIR=str(out.parent / "spool"),
        SHARDLEDGER_DIAG_DIR=str(out.parent / "diag"),
    )
    argv = [sys.executable, str(DRIVER), run_id, str(lines), "--out", str(out)]
    argv += ["--truth", str(truth), "--faults", json.dumps(faults), *extra]
    return subprocess.Popen(
        argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _truth(truth: Path) -> dict[tuple[str, int, str], dict[str, Any]]:
    """Returns every step an attempt recorded: (shard, Ray attempt, step) -> its facts."""
    steps = {}
    for path in truth.glob("*.json"):
        fact = json.loads(path.read_text())
        steps[(fact["shard_id"], fact["ray_attempt"], fact["step"])] = fact
    return steps


def _wait(what: str, check: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


# The zombie night's driver pings each worker connection that has been idle this long
# (test_a_retry_while_the_first_attempt_still_runs_...): its docstring says why 5 s.
KEEPALIVE_MS: Final = 5000


def _driver_output(driver: subprocess.Popen[str] | None) -> str:
    """Stops a driver that is still running and returns what it said, for a failure's message."""
    if driver is None:
        return "the driver never started"
    if driver.poll() is None:
        driver.kill()
    stdout, stderr = driver.communicate(timeout=60)
    return (
        f"the driver exited {driver.returncode}; its stdout ends:\n{stdout[-1500:]}\n"
        f"its stderr ends:\n{stderr[-4000:]}"
    )


def _outcome(stdout: str) -> dict[str, str]:
    """Returns the driver's outcome line: shard id -> "ok" or what Ray raised."""
    (line,) = (t for t in stdout.splitlines() if t.startswith("outcome: "))
    outcome: dict[str, str] = json.loads(line.removeprefix("outcome: "))
    return outcome


def _views(client: LedgerClient) -> dict[str, dict[str, Any]]:
    return {v.shard_id: json.loads(v.view_json) for v in client.shards(RUN)}


def _attempts(capsys: pytest.CaptureFixture[str], target: str) -> list[dict[str, Any]]:
    code, out, err = run_cli(capsys, "shards", RUN, "--attempts", "--json", "--server", target)
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()]


@pytest.fixture
def night(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "out").mkdir()
    (tmp_path / "truth").mkdir()
    yield tmp_path


def test_a_ray_night_with_retries_kills_and_a_killed_driver_resumes_to_100_percent(
    ray_cluster: RayCluster,
    server: RunningServer,
    client: LedgerClient,
    night: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    target = client.target
    plan_lines = _plan(capsys, night, target)
    out, truth = night / "out", night / "truth"
    first = _driver(ray_cluster, target, plan_lines, out, truth, FAULTS)
    finished = {"t-ok1", "t-ok2", "t-raise", "t-killed"}

    def first_pass_settled() -> bool:
        steps = _truth(truth)
        done = {s for (s, _, step) in steps if step == "committed"}
        always = ("t-always", 1, "raised") in steps
        return finished <= done and always and ("t-gate", 0, "waiting") in steps

    _wait("the first pass to settle", first_pass_settled, ray_cluster.allowance_s())
    # Both failed attempts of t-always are on the ledger before the driver dies.
    _wait(
        "t-always to fail",
        lambda: _views(client)["t-always"]["state"] == "failed",
        ray_cluster.allowance_s(),
    )
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    # Ray ends a dead driver's tasks: the gated attempt ends unheard and goes stale.
    _wait(
        "t-gate to go stale",
        lambda: _views(client)["t-gate"]["state"] == "stale",
        ray_cluster.allowance_s(),
    )

    code, _, err = run_cli(capsys, "verify", RUN, "--root", str(out), "--server", target)
    assert code == 0, err  # every commit passes; t-always and t-gate committed nothing
    views = _views(client)
    states = {s: v["state"] for s, v in views.items()}
    assert states == {
        "t-ok1": "verified",
        "t-ok2": "verified",
        "t-raise": "verified",
        "t-killed": "verified",
        "t-always": "failed",
        "t-gate": "stale",
    }
    code, out_json, _ = run_cli(capsys, "status", RUN, "--server", target, "--json")
    summary = json.loads(out_json)
    assert (summary["verified"], summary["failed"], summary["stale"]) == (4, 1, 1)
    assert summary["duplicates"] == {"wasted": 0, "nondeterministic": 0, "zombie": 0}
    code, resume, _ = run_cli(capsys, "resume", RUN, "--format", "ids", "--server", target)
    assert code == 1
    assert sorted(resume.split()) == ["t-always", "t-gate"]

    # Every attempt the truth saw is one row of `shards --attempts`, with its Ray identity.
    steps = _truth(truth)
    rows = {(r["shard_id"], r["attempt_id"]): r for r in _attempts(capsys, target)}
    started = {k: v for k, v in steps.items() if k[2] == "started"}
    assert {(f["shard_id"], f["attempt_id"]) for f in started.values()} == set(rows)
    want_outcome = {
        ("t-ok1", 0): "verified",
        ("t-ok2", 0): "verified",
        ("t-raise", 0): "failed",
        ("t-raise", 1): "verified",
        ("t-killed", 0): "superseded",
        ("t-killed", 1): "verified",
        ("t-always", 0): "failed",
        ("t-always", 1): "failed",
        ("t-gate", 0): "stale",
    }
    assert {(s, a) for (s, a, _) in started} == set(want_outcome)
    for (shard_id, attempt, _), fact in started.items():
        row = rows[(shard_id, fact["attempt_id"])]
        assert row["outcome"] == want_outcome[(shard_id, attempt)], row
        assert row["pid"] == fact["pid"]
        assert row["scheduler"] == {
            "kind": "ray",
            "job_id": fact["job_id"],
            "task_id": fact["task_id"],
            "task_attempt": str(attempt),
            "node": fact["node_id"],
            "namespace": row["scheduler"]["namespace"],
        }
        assert row["job"].startswith(f"ray:{fact['job_id']}/{fact['task_id']}#{attempt}@")
    # The half-written output of the killed worker was never committed: its temp file is
    # all that is left of it, and the committed file is the retry's whole output.
    assert json.loads((out / "t-killed.counts.json").read_text()) == {
        "t-killed": 1,
        "says": 1,
        "hello": 2,
    }
    (orphan,) = out.glob(f"{TEMP_PREFIX}t-killed.counts.json.*")
    assert orphan.read_bytes() == b'{"half": '

    # The morning: the resume list, as plan lines, back to Ray through a new driver.
    code, rerun_text, _ = run_cli(capsys, "resume", RUN, "--server", target)
    rerun = night / "rerun.jsonl"
    rerun.write_text(rerun_text)
    second = _driver(ray_cluster, target, rerun, out, truth, {})
    stdout, stderr = second.communicate(timeout=2 * ray_cluster.allowance_s())
    assert second.returncode == 0, stderr
    assert _outcome(stdout) == {"t-always": "ok", "t-gate": "ok"}
    assert run_cli(capsys, "verify", RUN, "--root", str(out), "--server", target)[0] == 0
    summary = json.loads(run_cli(capsys, "status", RUN, "--server", target, "--json")[1])
    assert (summary["verified"], summary["submitted"]) == (6, 6)
    assert run_cli(capsys, "resume", RUN, "--server", target)[0] == 0


def test_ray_data_batches_are_shards_and_the_resume_list_feeds_the_same_pipeline(
    ray_cluster: RayCluster,
    server: RunningServer,
    client: LedgerClient,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    target = client.target
    env = ray_cluster.driver_env(
        SHARDLEDGER_SERVER=target, SHARDLEDGER_SPOOL_DIR=str(tmp_path / "spool")
    )
    items = REPO / "examples" / "data" / "items.jsonl"
    manifest = tmp_path / "batches.jsonl"
    with manifest.open("w") as written:
        subprocess.run(
            [sys.executable, str(DATA_EXAMPLE), "manifest", str(items), "--batch-size", "4"],
            stdout=written,
            check=True,
            env=env,
        )
    assert (
        run_cli(capsys, "plan", DATA_RUN, "--manifest", str(manifest), "--server", target)[0] == 0
    )
    plan_lines = tmp_path / "plan-lines.jsonl"
    plan_lines.write_text(
        run_cli(capsys, "plan", DATA_RUN, "--manifest", str(manifest), "--dry-run")[1]
    )
    batches = {
        (line := json.loads(text))["shard_id"]: [r["id"] for r in line["rows"]]
        for text in plan_lines.read_text().splitlines()
    }
    assert sorted(len(ids) for ids in batches.values()) == [2, 4, 4]
    by_item = {i: shard for shard, ids in batches.items() for i in ids}
    dropped, raised = by_item["item-05"], by_item["item-08"]

    out = tmp_path / "out"
    argv = [sys.executable, str(DATA_DRIVER), DATA_RUN, str(plan_lines), "--out", str(out)]
    first = subprocess.run(
        [*argv, "--drop", "item-05", "--raise", "item-08"],
        env=env,
        capture_output=True,
        text=True,
        timeout=3 * ray_cluster.allowance_s(),
    )
    # Failed shards are skipped, not fatal: the pipeline returns the good batch's rows only.
    assert first.returncode == 0, first.stderr
    assert "4 rows scored" in first.stderr
    assert run_cli(capsys, "verify", DATA_RUN, "--root", str(out), "--server", target)[0] == 0
    views = {v.shard_id: json.loads(v.view_json) for v in client.shards(DATA_RUN)}
    assert {s: (v["state"], v["detail"]) for s, v in views.items()} == {
        **{s: ("verified", "") for s in batches if s not in (dropped, raised)},
        dropped: ("failed", "data"),
        raised: ("failed", "unknown"),
    }
    code, rerun_text, _ = run_cli(
        capsys, "resume", DATA_RUN, "--format", "jsonl", "--server", target
    )
    assert code == 1
    rerun = tmp_path / "rerun.jsonl"
    rerun.write_text(rerun_text)
    # The resume list is the failed batches' plan lines, rows and all.
    assert {
        json.loads(t)["shard_id"]: [r["id"] for r in json.loads(t)["rows"]]
        for t in rerun_text.splitlines()
    } == {dropped: batches[dropped], raised: batches[raised]}

    # The morning: the example's own pipeline, unchanged, reads the resume list.
    morning = subprocess.run(
        [sys.executable, str(DATA_EXAMPLE), "run", DATA_RUN, str(rerun), "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=3 * ray_cluster.allowance_s(),
    )
    assert morning.returncode == 0, morning.stderr
    assert "6 rows scored" in morning.stderr
    assert run_cli(capsys, "verify", DATA_RUN, "--root", str(out), "--server", target)[0] == 0
    summary = json.loads(run_cli(capsys, "status", DATA_RUN, "--server", target, "--json")[1])
    assert (summary["verified"], summary["submitted"]) == (3, 3)
    # Only the resume list ran again; every attempt ran in a Ray Data actor.
    rows = [
        json.loads(line)
        for line in run_cli(capsys, "shards", DATA_RUN, "--attempts", "--json", "--server", target)[
            1
        ].splitlines()
    ]
    assert sorted(r["shard_id"] for r in rows) == sorted([*batches, dropped, raised])
    assert all(r["scheduler"]["kind"] == "ray" and r["scheduler"]["actor_id"] for r in rows)
    # Each committed file holds exactly its batch's ids, in the batch's order.
    for shard_id, ids in batches.items():
        lines = (out / f"{shard_id}.jsonl").read_text().splitlines()
        assert [json.loads(t)["id"] for t in lines] == ids


def test_docs_ray_runs_as_written_on_a_ray_cluster(
    ray_cluster: RayCluster, server: RunningServer, tmp_path: Path, quiet_logs: None
) -> None:
    for block in blocks(DOC):
        if block.lang == "python":
            assert block.not_run, f"{block.where()}: a python block must say <!-- not run: why -->"
    work = tmp_path / "work"
    shutil.copytree(REPO / "examples", work / "examples")
    env = reader_env(tmp_path, server)
    env.update(RAY_ADDRESS=ray_cluster.address, **{MARKER: str(ray_cluster.base)})
    run_doc(DOC, work, env, tmp_path, timeout_s=3 * ray_cluster.allowance_s())
    client = LedgerClient(f"127.0.0.1:{server.port}")
    try:
        for run_id, shards in (("night-ray", 4), ("night-data", 3)):
            states = [json.loads(v.view_json)["state"] for v in client.shards(run_id)]
            assert states == ["verified"] * shards, run_id
    finally:
        client.close()


def test_watch_kill_stale_stops_a_hung_ray_task_through_ray_and_ray_retries_it(
    ray_cluster: RayCluster,
    server: RunningServer,
    client: LedgerClient,
    night: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    target, run_id = client.target, "night-ray-hang"
    lines = _plan(capsys, night, target, ("t-hang",), run_id)
    out, truth = night / "out", night / "truth"
    faults = {"t-hang": {"0": "hang"}}
    driver = _driver(
        ray_cluster, target, lines, out, truth, faults, "--progress-timeout", "1", run_id=run_id
    )

    def state() -> str:
        return str(json.loads(next(iter(client.shards(run_id))).view_json)["state"])

    _wait("t-hang to go stale", lambda: state() == "stale", ray_cluster.allowance_s())
    hung = _truth(truth)[("t-hang", 0, "hung")]
    # The watchdog joins the cluster through $RAY_ADDRESS, as a platform's would.
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)
    argv = ["watch", run_id, "--kill-stale", "--once", "--grace", "1", "--json"]
    code, text, err = run_cli(capsys, *argv, "--diag-dir", str(night / "diag"), "--server", target)
    assert code == 0, err
    (action,) = map(json.loads, text.splitlines())
    assert action["method"] == "ray"
    # The worker runs on this host: its deadlocked stack is in the diagnostics, as the
    # SDK's faulthandler writes it ('in faulty') or py-spy where installed ('faulty (').
    stack = Path(action["diagnostics"]).read_text()
    assert re.search(r"\bin faulty\b|^\s+faulty \(", stack, re.MULTILINE), stack
    assert action["recorded_failed_timeout"] is True
    pid, node = hung["pid"], hung["node_id"][:12]
    assert f"ray: stop worker pid {pid}" in action["steps"]
    assert f"on Ray node {node}: kill -TERM {pid}" in action["steps"]
    assert action["steps"][-1] in (
        f"on Ray node {node}: process ended",
        f"on Ray node {node}: kill -KILL {pid}",
    )
    # Ray saw its worker die and ran the task again: attempt 1 commits.
    stdout, stderr = driver.communicate(timeout=2 * ray_cluster.allowance_s())
    assert driver.returncode == 0, stderr
    assert _outcome(stdout) == {"t-hang": "ok"}
    assert run_cli(capsys, "verify", run_id, "--root", str(out), "--server", target)[0] == 0
    code, text, _ = run_cli(capsys, "shards", run_id, "--attempts", "--json", "--server", target)
    rows = [json.loads(t) for t in text.splitlines()]
    assert [(r["outcome"], r["detail"], r["scheduler"]["task_attempt"]) for r in rows] == [
        ("failed", "timeout", "0"),
        ("verified", "", "1"),
    ]
    assert rows[0]["attempt_id"] == hung["attempt_id"]


def _facts_of(truth: Path, shard_id: str) -> dict[tuple[int, str], dict[str, Any]]:
    """Returns one shard's recorded steps: (Ray attempt, step) -> its facts."""
    return {(a, step): f for (s, a, step), f in _truth(truth).items() if s == shard_id}


def _rows_of(capsys: pytest.CaptureFixture[str], target: str, run_id: str) -> list[dict[str, Any]]:
    code, text, err = run_cli(capsys, "shards", run_id, "--attempts", "--json", "--server", target)
    assert code == 0, err
    return [json.loads(t) for t in text.splitlines()]


def test_a_retry_while_the_first_attempt_still_runs_leaves_a_zombie_commit_the_ledger_names(
    ray_cluster: RayCluster,
    server: RunningServer,
    client: LedgerClient,
    night: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Node b's raylet frozen: the GCS marks the node dead, Ray runs the task again on the
    head while the first attempt, on a worker nobody froze, still runs and commits late.

    Ray 2.60 retries a task of a dead node only once its owner's connection to the
    worker fails (a frozen raylet alone: no retry in 60 s, the first attempt's result
    returned as usual; a connection reset by ``ss -K`` did not make it retry either). A
    partition breaks that connection; here the driver's gRPC keepalive does: a ping
    every KEEPALIVE_MS on an idle connection, which the worker's gRPC server answers,
    at its third, with GOAWAY "too_many_pings", closing it. It does so on every
    connection of the driver's, the retry's too, so the ping comes slowly enough
    (about 15 s from a connection's last data) for a loaded machine to start the first
    attempt before it and to run the retry, a few seconds' work, under it. At a ping a
    second, the CI machine's load had the retry's worker cut off as well and Ray ran
    out of retries.
    """
    target, run_id = client.target, "night-ray-zombie"
    node = ray_cluster.add_worker_node("node_b")
    driver = None
    try:
        lines = _plan(capsys, night, target, ("z-late",), run_id)
        out, truth = night / "out", night / "truth"
        env = ray_cluster.driver_env(
            SHARDLEDGER_SERVER=target,
            SHARDLEDGER_SPOOL_DIR=str(night / "spool"),
            RAY_grpc_client_keepalive_time_ms=str(KEEPALIVE_MS),
            RAY_grpc_client_keepalive_timeout_ms=str(KEEPALIVE_MS),
        )
        argv = [sys.executable, str(DRIVER), run_id, str(lines), "--out", str(out)]
        argv += ["--truth", str(truth), "--faults", json.dumps({"z-late": {"0": "gate"}})]
        argv += ["--pin", "node_b", "--linger", str(night / "release")]
        driver = subprocess.Popen(
            argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        allowance = ray_cluster.allowance_s()
        _wait(
            "attempt 0 on node b", lambda: (0, "waiting") in _facts_of(truth, "z-late"), allowance
        )
        os.kill(node.raylet_pid(), signal.SIGSTOP)
        # The node's death (seconds), then the keepalive's GOAWAY (about 3 pings), then
        # a new worker on the head, on a loaded machine.
        _wait(
            "Ray's retry to commit",
            lambda: (1, "committed") in _facts_of(truth, "z-late"),
            2 * allowance,
        )
        facts = _facts_of(truth, "z-late")
        first, retry = facts[(0, "started")], facts[(1, "started")]
        assert first["node_id"] != retry["node_id"]  # the retry ran on the head
        # The first attempt's worker still runs (only its raylet is frozen), unheard of.
        assert process_start_ticks(first["pid"]) != 0
        rows = _rows_of(capsys, target, run_id)
        assert [(r["attempt_id"], r["outcome"]) for r in rows] == [
            (first["attempt_id"], "superseded"),
            (retry["attempt_id"], "unverified"),
        ]
        committed_by_retry = (out / "z-late.counts.json").read_bytes()

        # The zombie goes on: it commits late, over the retry's commit, the same bytes.
        (truth / "open-gate").touch()
        _wait(
            "the zombie's commit", lambda: (0, "committed") in _facts_of(truth, "z-late"), allowance
        )
        _wait(
            "the zombie's commit on the ledger",
            lambda: json.loads(next(iter(client.shards(run_id))).view_json)["duplicates"],
            allowance,
        )
        (night / "release").touch()
        stdout, stderr = driver.communicate(timeout=allowance)
        assert driver.returncode == 0, stderr
        assert _outcome(stdout) == {"z-late": "ok"}
    except AssertionError as failed:
        raise AssertionError(f"{failed}\n{_driver_output(driver)}") from None
    finally:
        node.kill()
    assert (out / "z-late.counts.json").read_bytes() == committed_by_retry
    assert not list(out.glob(f"{TEMP_PREFIX}*"))  # nothing half-written left behind
    assert run_cli(capsys, "verify", run_id, "--root", str(out), "--server", target)[0] == 0
    rows = _rows_of(capsys, target, run_id)
    # Each attempt committed the whole output; the first after the retry started: a zombie.
    assert [(r["attempt_id"], r["outcome"]) for r in rows] == [
        (first["attempt_id"], "verified"),
        (retry["attempt_id"], "verified"),
    ]
    assert [r["scheduler"]["task_attempt"] for r in rows] == ["0", "1"]
    assert [r["scheduler"]["node"] for r in rows] == [first["node_id"], retry["node_id"]]
    summary = json.loads(run_cli(capsys, "status", run_id, "--server", target, "--json")[1])
    assert summary["duplicates"] == {"wasted": 1, "nondeterministic": 0, "zombie": 1}
    assert (summary["verified"], summary["submitted"]) == (1, 1)
    (view,) = (json.loads(v.view_json) for v in client.shards(run_id))
    assert view["state"] == "verified"
    assert view["artifacts"]["counts"]["blake3"] == blake3.blake3(committed_by_retry).hexdigest()
    assert run_cli(capsys, "resume", run_id, "--format", "ids", "--server", target)[:2] == (0, "")


def test_a_killed_node_and_lineage_reexecution_of_a_verified_shard(
    ray_cluster: RayCluster,
    server: RunningServer,
    client: LedgerClient,
    night: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Node c runs two tasks: one that waits (its raylet is SIGKILLed under it, Ray runs it
    again on the head) and one whose result, over 100 KiB, lives only in node c's object
    store. That shard is verified before the kill; the driver's `ray.get` afterwards makes
    Ray re-execute its task to rebuild the lost result. The re-execution finds the shard
    verified: it returns the committed result and neither runs nor rewrites anything.
    """
    target, run_id = client.target, "night-ray-node"
    node = ray_cluster.add_worker_node("node_c", num_cpus=2)
    shards = ("n-killed", "n-lineage")
    faults = {"n-killed": {"0": "gate"}, "n-lineage": {"0": "big"}}
    try:
        lines = _plan(capsys, night, target, shards, run_id)
        out, truth = night / "out", night / "truth"
        go = night / "go"
        driver = _driver(
            ray_cluster,
            target,
            lines,
            out,
            truth,
            faults,
            "--pin",
            "node_c",
            "--hold",
            str(go),
            run_id=run_id,
        )
        allowance = ray_cluster.allowance_s()

        def placed() -> bool:
            steps = _truth(truth)
            return ("n-killed", 0, "waiting") in steps and ("n-lineage", 0, "committed") in steps

        _wait("both tasks on node c", placed, allowance)
        steps = _truth(truth)
        node_c = steps[("n-killed", 0, "started")]["node_id"]
        assert steps[("n-lineage", 0, "started")]["node_id"] == node_c
        code, _, err = run_cli(capsys, "verify", run_id, "--root", str(out), "--server", target)
        assert code == 0, err
        verified = (out / "n-lineage.counts.json").read_bytes()
        digest = blake3.blake3(verified).hexdigest()
        os.kill(node.raylet_pid(), signal.SIGKILL)  # the node's workers die with it
        go.touch()  # now fetch the results: n-lineage's is lost with node c
        stdout, stderr = driver.communicate(timeout=2 * allowance)
        assert driver.returncode == 0, stderr
    finally:
        node.kill()
    steps = _truth(truth)
    # Ray ran both again, elsewhere: the killed task as attempt 1, the lost result's
    # task as attempt 1, which found the shard verified and ran nothing.
    assert {(s, a, step) for (s, a, step) in steps if a > 0} == {
        ("n-killed", 1, "started"),
        ("n-killed", 1, "committed"),
        ("n-lineage", 1, "reused"),
    }
    assert steps[("n-killed", 1, "started")]["node_id"] != node_c
    assert steps[("n-lineage", 1, "reused")]["node_id"] != node_c
    assert _outcome(stdout) == {
        "n-killed": "ok",
        "n-lineage": f"n-lineage reused {digest}",
    }
    # The verified artifact is the one verified, untouched, and the only attempt at it.
    assert (out / "n-lineage.counts.json").read_bytes() == verified
    assert run_cli(capsys, "verify", run_id, "--root", str(out), "--server", target)[0] == 0
    rows = _rows_of(capsys, target, run_id)
    want = {
        ("n-killed", steps[("n-killed", 0, "started")]["attempt_id"]): ("superseded", "0"),
        ("n-killed", steps[("n-killed", 1, "started")]["attempt_id"]): ("verified", "1"),
        ("n-lineage", steps[("n-lineage", 0, "started")]["attempt_id"]): ("verified", "0"),
    }
    assert {
        (r["shard_id"], r["attempt_id"]): (r["outcome"], r["scheduler"]["task_attempt"])
        for r in rows
    } == want
    views = {v.shard_id: json.loads(v.view_json) for v in client.shards(run_id)}
    assert views["n-lineage"]["artifacts"]["counts"]["blake3"] == digest
    assert {s: v["state"] for s, v in views.items()} == dict.fromkeys(shards, "verified")
    summary = json.loads(run_cli(capsys, "status", run_id, "--server", target, "--json")[1])
    assert summary["duplicates"] == {"wasted": 0, "nondeterministic": 0, "zombie": 0}
    assert run_cli(capsys, "resume", run_id, "--format", "ids", "--server", target)[:2] == (0, "")


def test_a_hung_shard_inside_an_actor_goes_stale_and_watch_stops_the_actor_through_ray(
    ray_cluster: RayCluster,
    server: RunningServer,
    client: LedgerClient,
    night: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One actor (one process) runs four shards in order; the third hangs with the process
    alive. The ledger shows that one stale and the first two verified; `watch --kill-stale`
    ends the actor's worker through Ray and records failed(timeout); the fourth, queued
    behind it, never started. The resume list is those two; a second actor finishes them."""
    target, run_id = client.target, "night-ray-actor"
    shards = ("a-1", "a-2", "a-hang", "a-4")
    lines = _plan(capsys, night, target, shards, run_id)
    out, truth = night / "out", night / "truth"
    faults = {"a-hang": {"0": "hang"}}
    driver = _driver(
        ray_cluster,
        target,
        lines,
        out,
        truth,
        faults,
        "--actor",
        "--progress-timeout",
        "1",
        run_id=run_id,
    )

    def states() -> dict[str, str]:
        return {v.shard_id: json.loads(v.view_json)["state"] for v in client.shards(run_id)}

    _wait("a-hang to go stale", lambda: states()["a-hang"] == "stale", ray_cluster.allowance_s())
    steps = _truth(truth)
    # Committed, not yet verified; hung; never started.
    assert states() == {
        "a-1": "unverified",
        "a-2": "unverified",
        "a-hang": "stale",
        "a-4": "missing",
    }
    assert {s for (s, _, step) in steps if step == "committed"} == {"a-1", "a-2"}
    hung = steps[("a-hang", 0, "hung")]
    # One process ran them all, in one actor, each shard an attempt of its own.
    assert {f["pid"] for f in steps.values()} == {hung["pid"]}
    rows = _rows_of(capsys, target, run_id)
    actors = {r["scheduler"]["actor_id"] for r in rows}
    assert len(actors) == 1 and "" not in actors
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)
    argv = ["watch", run_id, "--kill-stale", "--once", "--grace", "1", "--json"]
    code, text, err = run_cli(capsys, *argv, "--diag-dir", str(night / "diag"), "--server", target)
    assert code == 0, err
    (action,) = map(json.loads, text.splitlines())
    assert (action["shard_id"], action["method"]) == ("a-hang", "ray")
    assert action["recorded_failed_timeout"] is True
    assert f"ray: stop worker pid {hung['pid']}" in action["steps"]
    stdout, stderr = driver.communicate(timeout=2 * ray_cluster.allowance_s())
    assert driver.returncode == 0, stderr
    # The actor died (no restarts): its hung call and the one queued behind it fail in Ray.
    assert _outcome(stdout) == {
        "a-1": "ok",
        "a-2": "ok",
        "a-hang": "ActorDiedError",
        "a-4": "ActorDiedError",
    }
    assert run_cli(capsys, "verify", run_id, "--root", str(out), "--server", target)[0] == 0
    started = {s for (s, _, step) in _truth(truth) if step == "started"}
    assert started == {"a-1", "a-2", "a-hang"}  # a-4 never ran
    rows = _rows_of(capsys, target, run_id)
    assert [(r["shard_id"], r["outcome"], r["detail"]) for r in rows] == [
        ("a-1", "verified", ""),
        ("a-2", "verified", ""),
        ("a-hang", "failed", "timeout"),
    ]
    code, resume, _ = run_cli(capsys, "resume", run_id, "--format", "ids", "--server", target)
    assert (code, resume.split()) == (1, ["a-hang", "a-4"])

    # The morning: the resume list to a new actor.
    rerun = night / "rerun.jsonl"
    rerun.write_text(run_cli(capsys, "resume", run_id, "--server", target)[1])
    second = _driver(ray_cluster, target, rerun, out, truth, {}, "--actor", run_id=run_id)
    stdout, stderr = second.communicate(timeout=2 * ray_cluster.allowance_s())
    assert second.returncode == 0, stderr
    assert _outcome(stdout) == {"a-hang": "ok", "a-4": "ok"}
    assert run_cli(capsys, "verify", run_id, "--root", str(out), "--server", target)[0] == 0
    summary = json.loads(run_cli(capsys, "status", run_id, "--server", target, "--json")[1])
    assert (summary["verified"], summary["submitted"]) == (4, 4)
