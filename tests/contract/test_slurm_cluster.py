"""A real single-node Slurm runs array jobs, shows jobs their identity, and delivers scancel signals."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests import slurm
from tests.slurm import SlurmCluster

slurm_cluster = slurm.slurm_cluster

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(60)]


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)
    return path


def _wait_file(path: Path, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return path.read_text()


def _submit(cluster: SlurmCluster, tmp_path: Path, script: Path, *args: str) -> int:
    return cluster.sbatch(
        f"--chdir={tmp_path}", f"--output={tmp_path}/slurm-%A_%a.out", *args, str(script)
    )


# A batch script that reports TERM (and so does its child), to show who the signal reached.
TRAPPING = """\
trap 'echo "got TERM" > got_term; wait; exit 0' TERM
bash -c 'trap "echo got TERM > child_got_term; exit 0" TERM; while :; do sleep 0.1; done' &
echo $$ > running
wait
"""


def test_array_tasks_each_run_once_with_their_own_ids(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    script = _script(
        tmp_path / "task.sh",
        'echo "$SLURM_ARRAY_TASK_ID $SLURM_JOB_ID $SLURM_ARRAY_JOB_ID" > "out.$SLURM_ARRAY_TASK_ID"\n',
    )
    array_id = _submit(slurm_cluster, tmp_path, script, "--array=0-3", "--wait")
    rows = {}
    for path in sorted(tmp_path.glob("out.*")):
        task, job, array = path.read_text().split()
        assert path.name == f"out.{task}"
        rows[int(task)] = (int(job), int(array))
    assert sorted(rows) == [0, 1, 2, 3]
    assert {array for _, array in rows.values()} == {array_id}
    job_ids = {job for job, _ in rows.values()}
    # Each task is its own job; Slurm gives the array's own id to one of them.
    assert len(job_ids) == 4 and array_id in job_ids
    assert slurm_cluster.job_states(array_id) == {f"{array_id}_{t}": "COMPLETED" for t in range(4)}


def test_a_job_sees_its_scheduler_identity(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = _script(tmp_path / "env.sh", "env -0 > job.env\n")
    array_id = _submit(slurm_cluster, tmp_path, script, "--array=2")
    assert slurm_cluster.wait_job(array_id) == "COMPLETED"
    env = dict(
        item.split("=", 1) for item in (tmp_path / "job.env").read_text().split("\0") if item
    )
    assert slurm_cluster.node is not None
    assert env["SLURM_CLUSTER_NAME"] == slurm_cluster.cluster
    assert env["SLURMD_NODENAME"] == slurm_cluster.node.name
    assert env["SLURM_ARRAY_JOB_ID"] == str(array_id)
    assert env["SLURM_ARRAY_TASK_ID"] == "2"
    assert int(env["SLURM_JOB_ID"]) > 0


def test_scancel_term_full_reaches_the_batch_script_and_its_children(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    job_id = _submit(slurm_cluster, tmp_path, _script(tmp_path / "trap.sh", TRAPPING))
    _wait_file(tmp_path / "running")
    slurm_cluster.run("scancel", "--signal=TERM", "--full", str(job_id))
    assert slurm_cluster.wait_job(job_id) == "COMPLETED"  # the trap exits 0
    assert (tmp_path / "got_term").read_text() == "got TERM\n"
    assert (tmp_path / "child_got_term").read_text() == "got TERM\n"


def test_scancel_term_without_full_does_not_reach_a_batch_script(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    # Without --full (or --batch) Slurm signals only srun steps, which a batch job may lack:
    # a watchdog that wants the job's own handler to run must pass --full.
    job_id = _submit(slurm_cluster, tmp_path, _script(tmp_path / "trap.sh", TRAPPING))
    _wait_file(tmp_path / "running")
    slurm_cluster.run("scancel", "--signal=TERM", str(job_id))
    time.sleep(1.5)
    assert slurm_cluster.job_state(job_id) == "RUNNING"
    assert not (tmp_path / "got_term").exists()
    slurm_cluster.run("scancel", "--signal=TERM", "--full", str(job_id))
    assert slurm_cluster.wait_job(job_id) == "COMPLETED"


def test_plain_scancel_kills_a_job_that_ignores_term(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    script = _script(
        tmp_path / "stubborn.sh",
        # One line per beat, appended: `> beat` truncated the file before each write, and
        # under load both reads of a loaded CI run fell in that gap ('' == '').
        "trap '' TERM\necho $$ > running\nwhile :; do date +%s%N >> beats; sleep 0.1; done\n",
    )
    job_id = _submit(slurm_cluster, tmp_path, script)
    pid = int(_wait_file(tmp_path / "running"))
    slurm_cluster.run("scancel", "--signal=TERM", "--full", str(job_id))
    time.sleep(1.0)
    assert slurm_cluster.job_state(job_id) == "RUNNING"
    beats = tmp_path / "beats"
    seen = beats.read_bytes().count(b"\n")
    # Still beating after TERM: a new line comes (within a deadline, not a guessed sleep).
    deadline = time.monotonic() + 20
    while beats.read_bytes().count(b"\n") <= seen:
        assert time.monotonic() < deadline, "the job stopped beating after TERM"
        time.sleep(0.05)

    started = time.monotonic()
    slurm_cluster.run("scancel", str(job_id))
    assert slurm_cluster.wait_job(job_id, timeout_s=20) == "CANCELLED"
    # TERM, KillWait (2 s in the fixture's slurm.conf), then KILL.
    assert time.monotonic() - started < 15
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (where PID 1 does not reap) is dead for our purposes.
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
