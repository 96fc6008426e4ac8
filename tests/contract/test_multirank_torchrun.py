"""Multi-rank shards with real torchrun jobs (Gloo on the CPU) against a real ledger server.

Each test starts torchrun on one node with the job in tests/helpers/ddp_shard_job.py
and reads what a user would: the shard's view (`shards --json`), the resume list,
`verify`, and the processes left behind. The shard's own timeouts (heartbeats, the
watchdog) are a few seconds; the bounds on a launch are derived from how long one takes
on this machine now (`launch_s`), measured once per module.

Nothing is retried: each launch has a rendezvous of its own (a new id, a store on a port
the agent binds itself), on 127.0.0.1 for the store and Gloo alike, and each elastic
restart opens its process group under a store prefix of its own (ddp_shard_job.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from blake3 import blake3

from ledger_server.server import RunningServer
from shard_client import Ledger
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from tests.builders import planned, run_cli

pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.torchrun

JOB = Path(__file__).resolve().parents[1] / "helpers" / "ddp_shard_job.py"
RUN, SHARD = "night-ddp", "shard-ddp"
OUTPUTS = ("weights.rank{rank}", "results.jsonl")

# A launch that only joins a 2-rank Gloo group and leaves: what start-up costs here.
PROBE_JOB = """
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


def torchrun(nproc: int, restarts: int, script: Path, *args: str) -> list[str]:
    """Returns the argv of a one-node torchrun launch with a rendezvous of its own."""
    return [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "1"),
        *("--nproc-per-node", str(nproc), "--max-restarts", str(restarts)),
        # A new id, and a store the agent binds on port 0 itself (so no other process can
        # take a port picked for it in between); 127.0.0.1, not the host's name or
        # localhost (which may try ::1 first), for the store the workers are sent to too.
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"),
        *("--rdzv-id", uuid.uuid4().hex, "--local-addr", "127.0.0.1"),
        *("--monitor-interval", "0.2", "--shutdown-timeout", "2"),
        *(str(script), *args),
    ]


def launch_environment(**env: str) -> dict[str, str]:
    """Returns the environment of a launch: Gloo and the store on loopback, one thread a rank."""
    loopback = {"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
    return {**os.environ, **loopback, **env}


@pytest.fixture(scope="module")
def launch_s(tmp_path_factory: pytest.TempPathFactory) -> float:
    """Returns the seconds one 2-rank launch (start, join the group, leave) takes here now."""
    script = tmp_path_factory.mktemp("probe") / "probe.py"
    script.write_text(PROBE_JOB)
    start = time.monotonic()
    done = subprocess.run(
        torchrun(2, 0, script),
        env=launch_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return time.monotonic() - start


@pytest.fixture
def ddp(
    server: RunningServer, client: LedgerClient, tmp_path: Path, launch_s: float
) -> Iterator[_Ddp]:
    client.append([planned(RUN, SHARD, outputs=OUTPUTS)])
    launcher = _Ddp(f"127.0.0.1:{server.port}", client, tmp_path, launch_s)
    yield launcher
    launcher.cleanup()


class _Ddp:
    """Starts torchrun jobs of the test and reads the shard back."""

    def __init__(self, target: str, client: LedgerClient, tmp: Path, launch_s: float) -> None:
        self.target, self.client, self.tmp = target, client, tmp
        self.out = tmp / "out"
        self.diag = tmp / "diag"
        self.procs: list[subprocess.Popen[str]] = []
        self.run_id = RUN
        # A job is a launch and six short steps; a restart is a second launch. Ten launches'
        # time is a bound a healthy job never nears, however loaded the machine.
        self.deadline_s = 30 + 10 * launch_s
        # The SDK's watchdog, where a test does not set it short on purpose: no step of this
        # job takes as long as a launch, so three launches' time is a hang, not a slow step.
        self.hang_s = max(30.0, 3 * launch_s)

    def start(
        self, mode: str, *, nproc: int = 2, restarts: int = 0, **env: str
    ) -> subprocess.Popen[str]:
        defaults = {
            "SHARDLEDGER_DIAG_DIR": str(self.diag),
            "SHARDLEDGER_KILL_GRACE": "1",
            "SHARDLEDGER_HANG_TIMEOUT": str(self.hang_s),
            "DDP_PG_TIMEOUT": str(self.deadline_s),
        }
        environ = launch_environment(**(defaults | env))
        argv = torchrun(nproc, restarts, JOB, self.target, self.run_id, SHARD, str(self.out), mode)
        # A session of its own, so that cleanup stops torchrun and every rank it started.
        proc = subprocess.Popen(
            argv,
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def run(self, mode: str, **kwargs: Any) -> tuple[int, str]:
        proc = self.start(mode, **kwargs)
        output, _ = proc.communicate(timeout=self.deadline_s)
        return proc.returncode, output

    def view(self) -> dict[str, Any]:
        views: list[dict[str, Any]] = [
            json.loads(v.view_json) for v in self.client.shards(self.run_id)
        ]
        assert [v["shard_id"] for v in views] == [SHARD]
        return views[0]

    def wait_for(self, what: str, predicate: Any) -> dict[str, Any]:
        deadline = time.monotonic() + self.deadline_s
        while True:
            view = self.view()
            if predicate(view):
                return view
            assert time.monotonic() < deadline, f"never {what}: {view}"
            time.sleep(0.2)

    def resume(self) -> list[pb.ResumeEntry]:
        return list(self.client.resume(self.run_id))

    def stop_all(self) -> None:
        """SIGKILLs every launch started so far, its ranks too, and reaps it."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the ranks too, even once torchrun is gone
            proc.kill()
            proc.communicate(timeout=30)

    def cleanup(self) -> None:
        self.stop_all()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie child of torchrun's is gone for every purpose but its pid entry.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_a_clean_two_rank_run_is_one_attempt_with_every_ranks_outputs_verified(
    ddp: _Ddp, capsys: pytest.CaptureFixture[str]
) -> None:
    code, output = ddp.run("clean")
    assert code == 0, output
    view = ddp.view()
    assert view["attempts"] == 1
    assert view["world_size"] == 2
    assert [r["state"] for r in view["ranks"]] == ["finished", "finished"]
    assert sorted(view["artifacts"]) == ["results.jsonl", "weights.rank0", "weights.rank1"]
    assert view["state"] == "unverified"
    # The ranks' results, each slice written in its own order, merged by id.
    lines = (ddp.out / "results.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == [f"item-{i:03d}" for i in range(8)]
    assert [json.loads(line)["rank"] for line in lines] == [0, 1] * 4

    code, out, err = run_cli(capsys, "verify", RUN, "--server", ddp.target, "--root", str(ddp.tmp))
    assert code == 0, out + err
    assert ddp.view()["state"] == "verified"
    assert ddp.resume() == []
    code, out, _ = run_cli(capsys, "shards", RUN, "--server", ddp.target)
    assert code == 0
    header, row = out.splitlines()
    assert "RANKS" in header and "\t0/2\t" in row  # both ranks finished: none alive


def test_a_rank_killed_mid_step_fails_the_attempt_stops_the_other_and_resumes_once(
    ddp: _Ddp,
) -> None:
    code, output = ddp.run("kill")
    assert code != 0
    # The bound: a silent rank makes the attempt stale once its heartbeat timeout passes.
    view = ddp.wait_for("failed or stale", lambda v: v["state"] in ("failed", "stale"))
    # Rank 0 was in the gradients' all-reduce when its peer died: either Gloo's error
    # reached it (failed: nccl) or torchrun stopped it first, leaving the attempt with
    # a silent rank (stale). Either way the ledger no longer shows it running.
    assert view["state"] in ("failed", "stale"), output
    if view["state"] == "failed":
        assert view["detail"] in ("nccl", "preempted")
    by_rank = {r["rank"]: r for r in view["ranks"]}
    assert by_rank[1]["failed_tag"] == ""  # killed: it recorded nothing
    assert all(_gone(r["pid"]) for r in view["ranks"])
    entries = ddp.resume()
    assert [e.shard_id for e in entries] == [SHARD]
    assert entries[0].reason in ("failed:nccl", "failed:preempted", "stale")


def test_a_stopped_rank_makes_the_attempt_stale_and_the_others_watchdog_ends_it_as_timeout(
    ddp: _Ddp,
) -> None:
    # Rank 1 SIGSTOPs itself; rank 0 blocks in the all-reduce, its heartbeat thread alive.
    proc = ddp.start("stop", SHARDLEDGER_HANG_TIMEOUT="6", DDP_HEARTBEAT_TIMEOUT="2")
    stale = ddp.wait_for("stale", lambda v: v["state"] == "stale")
    by_rank = {r["rank"]: r for r in stale["ranks"]}
    assert by_rank[1]["state"] == "silent"
    assert by_rank[0]["state"] == "alive"  # one silent rank is enough: stale
    assert stale["ranks_alive"] == 1
    # Rank 0's own watchdog notices that its all-reduce stopped progressing.
    view = ddp.wait_for("failed", lambda v: v["state"] == "failed")
    assert view["detail"] == "timeout"
    events = [e for e in ddp.client.list_events(RUN) if e.WhichOneof("payload") == "failed"]
    assert len(events) == 1 and events[0].failed.rank == 0
    bundle = Path(events[0].failed.diagnostics_path)
    assert bundle.name == f"{view['latest_attempt']}.rank0.hang.txt"
    assert "backward" in bundle.read_text()  # where rank 0 waited: the gradients' all-reduce
    # The frozen rank resumes (SIGCONT): the ledger refuses its heartbeat, and it stops too.
    os.kill(by_rank[1]["pid"], signal.SIGCONT)
    proc.communicate(timeout=ddp.deadline_s)
    assert all(_gone(r["pid"]) for r in view["ranks"])
    assert len([e for e in ddp.client.list_events(RUN) if e.WhichOneof("payload") == "failed"]) == 1


def test_watch_kill_stale_stops_every_rank_of_a_stale_attempt_and_records_timeout(
    ddp: _Ddp, capsys: pytest.CaptureFixture[str]
) -> None:
    proc = ddp.start("stop", SHARDLEDGER_WATCHDOG="off", DDP_HEARTBEAT_TIMEOUT="2")
    stale = ddp.wait_for("stale", lambda v: v["state"] == "stale")
    pids = [r["pid"] for r in stale["ranks"]]
    argv = ("watch", RUN, "--server", ddp.target, "--kill-stale", "--once", "--grace", "1")
    code, out, err = run_cli(capsys, *argv, "--json", "--diag-dir", str(ddp.diag))
    assert code in (0, 5), out + err  # 5: a frozen rank's stack dump timed out (reported)
    (action,) = [json.loads(line) for line in out.splitlines()]
    assert [r["rank"] for r in action["ranks"]] == [0, 1]
    assert all("SIGTERM" in r["steps"] for r in action["ranks"])
    assert action["recorded_failed_timeout"] is True
    proc.communicate(timeout=ddp.deadline_s)
    assert all(_gone(pid) for pid in pids)
    view = ddp.view()
    assert (view["state"], view["detail"]) == ("failed", "timeout")
    failed = [e for e in ddp.client.list_events(RUN) if e.WhichOneof("payload") == "failed"]
    assert [e.failed.rank for e in failed] == [1]  # the silent rank's, once


def test_rank0_exiting_cleanly_while_rank1s_output_is_missing_is_incomplete(ddp: _Ddp) -> None:
    code, output = ddp.run("missing")
    assert code == 0, output  # every process exited 0: the launcher saw a success
    view = ddp.view()
    assert (view["state"], view["detail"]) == ("failed", "incomplete")
    assert "weights.rank1" not in view["artifacts"]
    assert [(e.shard_id, e.reason) for e in ddp.resume()] == [(SHARD, "failed:incomplete")]


def test_an_elastic_restart_resumes_from_a_whole_checkpoint_and_old_commits_are_zombies(
    ddp: _Ddp, capsys: pytest.CaptureFixture[str]
) -> None:
    code, output = ddp.run("restart", restarts=1)
    assert code == 0, output
    # Step 2's checkpoint lacks rank 1's part: both ranks resume from step 1, the newest whole one.
    assert "rank=0 resumed_from=1" in output and "rank=1 resumed_from=1" in output
    view = ddp.view()
    assert view["attempts"] == 2
    assert view["restart_count"] == 1 and view["state"] == "unverified"
    old = {
        e.attempt_id
        for e in ddp.client.list_events(ddp.run_id)
        if e.WhichOneof("payload") == "started" and e.started.restart_count == 0
    }
    assert len(old) == 1 and view["latest_attempt"] not in old
    # A commit of the first round that reaches the ledger only now (its spool drained
    # late): the restarted attempt superseded it, so it is a zombie's.
    import torch

    old_weights = ddp.tmp / "old-weights.pt"
    torch.save({"weight": torch.zeros(1)}, old_weights)
    ledger = Ledger(ddp.target, spool_dir=str(ddp.tmp / "late-spool"))
    late = pb.ShardEvent(
        event_id=uuid.uuid4().hex,
        run_id=ddp.run_id,
        shard_id=SHARD,
        attempt_id=old.pop(),
        artifact_committed=pb.ArtifactCommitted(
            name="weights.rank0",
            path=str(old_weights),
            size_bytes=old_weights.stat().st_size,
            blake3_hex=blake3(old_weights.read_bytes()).hexdigest(),
        ),
    )
    ack = ledger.emit(late).result(10)
    ledger.close()
    assert ack.outcome == "appended"
    assert "zombie" in ddp.view()["duplicates"]
    code, out, err = run_cli(
        capsys, "verify", ddp.run_id, "--server", ddp.target, "--root", str(ddp.tmp)
    )
    assert code == 0, out + err
    assert ddp.view()["state"] == "verified"
    assert ddp.resume() == []


@pytest.mark.slow
def test_a_four_rank_run_is_one_attempt(ddp: _Ddp) -> None:
    code, output = ddp.run("clean", nproc=4)
    assert code == 0, output
    view = ddp.view()
    assert view["attempts"] == 1 and view["world_size"] == 4
    assert sorted(view["artifacts"]) == ["results.jsonl"] + [f"weights.rank{r}" for r in range(4)]
