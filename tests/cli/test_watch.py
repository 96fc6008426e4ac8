"""The watchdog: a hung attempt is diagnosed, stopped and recorded as failed(timeout)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.duration_pb2 import Duration

from ledger_server.server import RunningServer
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from shard_client.scheduler import process_start_ticks
from shardledger_cli.cli import main
from tests.builders import event, planned, started

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Collects child processes and kills any still running at the end."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def hang_attempt(
    client: LedgerClient, children: list[subprocess.Popen[bytes]], shard_id: str, attempt_id: str
) -> subprocess.Popen[bytes]:
    """Starts a real child, stops it with SIGSTOP (it hangs), and records its attempt as started."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    children.append(proc)
    # A stopped process neither heartbeats, dumps its stack nor exits on SIGTERM: a true hang.
    os.kill(proc.pid, signal.SIGSTOP)
    client.append(
        [
            event(
                "run-1",
                shard_id,
                attempt_id,
                started=pb.AttemptStarted(
                    host=socket.gethostname(),
                    pid=proc.pid,
                    heartbeat_timeout=Duration(seconds=1),
                    process_start_ticks=process_start_ticks(proc.pid),
                ),
            )
        ]
    )
    return proc


def wait_stale(client: LedgerClient, shard_ids: set[str]) -> None:
    """Waits until exactly these shards are stale on the server clock."""
    deadline = time.monotonic() + 20
    while {v.shard_id for v in client.shards("run-1", state="stale")} != shard_ids:
        assert time.monotonic() < deadline, f"{sorted(shard_ids)} never all went stale"
        time.sleep(0.1)


def states(client: LedgerClient) -> dict[str, tuple[str, str]]:
    """Returns shard id -> (state, detail) as the ledger sees them now."""
    views = [json.loads(v.view_json) for v in client.shards("run-1")]
    return {v["shard_id"]: (v["state"], v["detail"]) for v in views}


def kill_stale(client: LedgerClient, diag: Path, grace: str, *extra: str) -> int:
    """Runs one `watch run-1 --kill-stale --json` pass with a grace period and a diag dir."""
    argv = ["watch", "run-1", "--kill-stale", "--server", client.target, "--grace", grace]
    return main([*argv, "--diag-dir", str(diag), *extra, "--json"])


def test_watch_kill_stale_dumps_stack_kills_and_records_timeout(
    server: RunningServer, client: LedgerClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client.append([planned()])
    diag = tmp_path / "diag"
    proc = subprocess.Popen(
        [
            sys.executable,
            "tests/helpers/hung_job.py",
            client.target,
            "run-1",
            "shard-0",
            "att-hung",
            str(diag),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 20
        while next(iter(client.shards("run-1", state="stale")), None) is None:
            assert time.monotonic() < deadline, "the attempt never went stale"
            time.sleep(0.2)
        code = kill_stale(client, diag, "1")
        assert code == 0
        actions = json_lines(capsys.readouterr().out)
        # The watchdog reaps its own children, so the exit status may already be collected.
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [a["shard_id"] for a in actions] == ["shard-0"]
    assert actions[0]["steps"][:2] == ["diagnostics", "SIGTERM"]
    report = Path(actions[0]["diagnostics"]).read_text()
    assert "stuck_in_data_loader" in report
    views = [json.loads(v.view_json) for v in client.shards("run-1")]
    assert (views[0]["state"], views[0]["detail"]) == ("failed", "timeout")
    assert [(e.shard_id, e.reason) for e in client.resume("run-1")] == [
        ("shard-0", "failed:timeout")
    ]
    # A second pass finds nothing left to do.
    assert main(["watch", "run-1", "--server", client.target, "--json"]) == 0
    assert json_lines(capsys.readouterr().out) == []


def test_watch_kill_stale_leaves_alone_a_shard_that_heartbeats_again_while_another_is_handled(
    client: LedgerClient,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    children: list[subprocess.Popen[bytes]],
) -> None:
    client.append([planned(shard_id="shard-0", index=0), planned(shard_id="shard-1", index=1)])
    hang_attempt(client, children, "shard-0", "att-0")
    second = hang_attempt(client, children, "shard-1", "att-1")
    wait_stale(client, {"shard-0", "shard-1"})
    diag = tmp_path / "diag"
    done = threading.Event()

    def second_recovers() -> None:
        # The first's report is written just before its SIGTERM; its grace period follows.
        while not (diag / "att-0.watchdog.txt").exists():
            if done.wait(0.05):
                return
        os.kill(second.pid, signal.SIGCONT)
        step = 0
        while not done.is_set():
            step += 1
            client.append([event("run-1", "shard-1", "att-1", heartbeat=pb.Heartbeat(step=step))])
            done.wait(0.2)

    helper = threading.Thread(target=second_recovers)
    helper.start()
    try:
        # One at a time, so that shard-1 recovers while shard-0 is being handled.
        code = kill_stale(client, diag, "3", "--parallel", "1")
        assert second.poll() is None, "the recovered shard's process was signalled"
        # Still heartbeating here: stopped first, shard-1 would turn stale within its 1 s.
        assert states(client) == {"shard-0": ("failed", "timeout"), "shard-1": ("running", "")}
    finally:
        done.set()
        helper.join()
    assert code == 0
    actions = json_lines(capsys.readouterr().out)
    assert [(a["shard_id"], a["recorded_failed_timeout"], a["recovered"]) for a in actions] == [
        ("shard-0", True, False),
        ("shard-1", False, True),
    ]
    assert actions[1]["steps"] == ["recovered: no longer stale on the ledger, left alone"]


@pytest.mark.parametrize(
    ("option", "make", "code", "message"),
    [
        ("--log-file", lambda tmp: f"{tmp}/logs/{{bogus}}.log", 2, "unknown field {bogus}"),
        ("--log-file", lambda tmp: str(tmp), 5, "is a directory, not a log file"),
        ("--diag-dir", lambda tmp: str(tmp / "plain-file"), 5, "exists and is not a directory"),
    ],
    ids=["log-template-unknown-field", "log-file-is-a-directory", "diag-dir-is-a-file"],
)
def test_watch_rejects_an_unusable_option_at_startup_before_any_hang(
    client: LedgerClient,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    option: str,
    make: Callable[[Path], str],
    code: int,
    message: str,
) -> None:
    (tmp_path / "plain-file").write_text("not a directory\n")
    client.append([planned()])
    argv = ["watch", "run-1", "--kill-stale", "--server", client.target]
    if option != "--diag-dir":
        argv += ["--diag-dir", str(tmp_path / "diag")]
    assert main([*argv, option, make(tmp_path)]) == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("broken", ["report-path", "log-path"])
def test_watch_kill_stale_still_stops_and_records_when_diagnostics_cannot_be_written(
    client: LedgerClient,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    children: list[subprocess.Popen[bytes]],
    broken: str,
) -> None:
    client.append([planned()])
    diag, logs = tmp_path / "diag", tmp_path / "logs"
    # Both paths pass the startup checks and only break for this attempt, at kill time.
    (diag / "att-hung.watchdog.txt" if broken == "report-path" else logs / "shard-0").mkdir(
        parents=True
    )
    proc = hang_attempt(client, children, "shard-0", "att-hung")
    wait_stale(client, {"shard-0"})
    code = kill_stale(client, diag, "0.5", "--log-file", f"{logs}/{{shard_id}}")
    proc.wait(timeout=10)
    assert states(client) == {"shard-0": ("failed", "timeout")}
    out, err = capsys.readouterr()
    assert code == 5
    assert "diagnostics of attempt att-hung of shard shard-0" in err
    assert "Is a directory" in err
    [action] = json_lines(out)
    assert action["steps"][-2:] == ["SIGTERM", "SIGKILL"]
    assert action["recorded_failed_timeout"] is True
    assert len(action["diagnostics_errors"]) == 1


def test_watch_interval_json_prints_json_lines_one_object_per_stale_attempt(
    client: LedgerClient,
) -> None:
    client.append([planned(), started(timeout_s=1)])
    wait_stale(client, {"shard-0"})
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardledger_cli",
            "watch",
            "run-1",
            "--server",
            client.target,
            "--interval",
            "0.1",
            "--json",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]
    finally:
        proc.kill()
        proc.wait()
    # Three polls, each line a whole JSON document.
    for line in lines:
        assert line.endswith("\n")
        assert json.loads(line)["shard_id"] == "shard-0"
        assert json.loads(line)["attempt_id"] == "att-1"


def record_started(client: LedgerClient, shard_id: str, attempt_id: str, **fields: object) -> None:
    """Records a started event with a 1 s heartbeat timeout and the given fields."""
    started = pb.AttemptStarted(heartbeat_timeout=Duration(seconds=1), **fields)  # type: ignore[arg-type]
    client.append([event("run-1", shard_id, attempt_id, started=started)])


def test_watch_kill_stale_handles_twenty_hung_attempts_in_about_one_grace_period(
    client: LedgerClient,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    children: list[subprocess.Popen[bytes]],
) -> None:
    shard_ids = {f"shard-{i:02}" for i in range(20)}
    client.append([planned(shard_id=s, index=i) for i, s in enumerate(sorted(shard_ids))])
    procs = [hang_attempt(client, children, s, f"att-{s}") for s in sorted(shard_ids)]
    wait_stale(client, shard_ids)
    began = time.monotonic()
    code = kill_stale(client, tmp_path / "diag", "2")
    took = time.monotonic() - began
    assert code == 0
    actions = json_lines(capsys.readouterr().out)
    assert all(a["steps"][-2:] == ["SIGTERM", "SIGKILL"] for a in actions)
    assert {a["shard_id"] for a in actions if a["recorded_failed_timeout"]} == shard_ids
    assert all(p.poll() is not None for p in procs)
    # One at a time this takes 20 grace periods (40 s); concurrently about one.
    assert took < 2 * 2 + 4, f"20 hung attempts took {took:.1f} s"


def test_a_killed_attempt_leaves_no_empty_stack_file_behind_but_a_dump_stays(
    client: LedgerClient,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    children: list[subprocess.Popen[bytes]],
) -> None:
    diag = tmp_path / "diag"
    diag.mkdir()
    client.append([planned(shard_id=s, index=i) for i, s in enumerate(("empty", "dumped"))])
    for shard_id in ("empty", "dumped"):
        hang_attempt(client, children, shard_id, f"att-{shard_id}")
    # What the SDK leaves for a process SIGKILL stops: the SIGUSR1 file it opened at start.
    (diag / "att-empty.stack").write_text("")
    (diag / "att-dumped.stack").write_text("Thread 0x1 (most recent call first):\n")
    wait_stale(client, {"empty", "dumped"})
    assert kill_stale(client, diag, "0.5") == 0
    capsys.readouterr()
    assert sorted(p.name for p in diag.glob("*.stack")) == ["att-dumped.stack"]


def test_watch_never_signals_a_reused_pid_whose_start_time_differs(
    client: LedgerClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client.append([planned(shard_id="shard-0", index=0), planned(shard_id="shard-1", index=1)])
    # A live, unrelated process holds the recorded pid now: the attempt's own process is gone.
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        host, pid = socket.gethostname(), unrelated.pid
        ticks = process_start_ticks(pid)
        assert ticks > 0
        record_started(
            client, "shard-0", "att-reused", host=host, pid=pid, process_start_ticks=ticks + 1
        )
        # An older SDK records no start time: the pid cannot be told apart from another process.
        record_started(client, "shard-1", "att-unknown", host=host, pid=pid)
        wait_stale(client, {"shard-0", "shard-1"})
        code = kill_stale(client, tmp_path / "diag", "0.5")
        time.sleep(0.3)
        assert unrelated.poll() is None, "the unrelated process was signalled"
    finally:
        unrelated.kill()
        unrelated.wait()
    assert code == 0
    reused, unknown = json_lines(capsys.readouterr().out)
    assert reused["steps"] == [
        f"pid {pid} is now another process (its start time differs): not signalled"
    ]
    assert reused["recorded_failed_timeout"] is True
    assert "no process start time recorded" in unknown["steps"][0]
    assert unknown["recorded_failed_timeout"] is False
    assert states(client) == {"shard-0": ("failed", "timeout"), "shard-1": ("stale", "")}


PREEMPTED_JOB = """\
import faulthandler, os, signal, sys, time, uuid
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
target, diag = sys.argv[1:3]
faulthandler.register(signal.SIGUSR1, file=open(os.path.join(diag, "att-own.stack"), "a"))
def on_term(*_):
    # What the SDK's SIGTERM handler does: it records its own end first.
    failed = pb.AttemptFailed(tag=pb.FAILURE_TAG_PREEMPTED, message="stopped by SIGTERM")
    LedgerClient(target).append([pb.ShardEvent(event_id=uuid.uuid4().hex, run_id="run-1",
        shard_id="shard-0", attempt_id="att-own", failed=failed)])
    sys.exit(143)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


def test_watch_treats_an_attempt_that_recorded_its_own_end_meanwhile_as_done(
    client: LedgerClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client.append([planned()])
    diag = tmp_path / "diag"
    diag.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", PREEMPTED_JOB, client.target, str(diag)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        record_started(
            client,
            "shard-0",
            "att-own",
            host=socket.gethostname(),
            pid=proc.pid,
            process_start_ticks=process_start_ticks(proc.pid),
        )
        wait_stale(client, {"shard-0"})
        code = kill_stale(client, diag, "5")
        # The watchdog reaps its own children, so the exit status may already be collected.
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    out, err = capsys.readouterr()
    assert code == 0, err
    [action] = json_lines(out)
    assert action["ended_meanwhile"] is True
    assert action["recorded_failed_timeout"] is False
    assert action["steps"][-1].startswith("ended meanwhile")
    assert states(client) == {"shard-0": ("failed", "preempted")}


def _recorder(tmp_path: Path, name: str) -> Path:
    """Writes an executable that appends its arguments, as one JSON line, to <name>.calls."""
    script = tmp_path / "bin" / name
    script.parent.mkdir(exist_ok=True)
    calls = tmp_path / f"{name}.calls"
    script.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    script.chmod(0o755)
    return calls


def _calls(path: Path) -> list[list[str]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_watch_deletes_a_hung_kubernetes_pod_with_its_grace_period(
    client: LedgerClient,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _recorder(tmp_path, "kubectl")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    client.append([planned()])
    pod = pb.SchedulerIdentity(kind="kubernetes", job_id="train-7", namespace="ml", node="gpu-3")
    record_started(client, "shard-0", "att-pod", host="train-7", pid=1, scheduler=pod)
    wait_stale(client, {"shard-0"})
    assert kill_stale(client, tmp_path / "diag", "30") == 0
    [action] = json_lines(capsys.readouterr().out)
    assert _calls(calls) == [["delete", "pod", "train-7", "--namespace", "ml", "--grace-period=30"]]
    assert (action["method"], action["recorded_failed_timeout"]) == ("kubernetes", True)
    assert action["scheduler"] == {
        "kind": "kubernetes",
        "job_id": "train-7",
        "namespace": "ml",
        "node": "gpu-3",
    }
    assert states(client) == {"shard-0": ("failed", "timeout")}


def test_watch_kill_command_gets_each_placeholder_as_one_argument_without_a_shell(
    client: LedgerClient,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _recorder(tmp_path, "stopper")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    client.append([planned()])
    job = pb.SchedulerIdentity(kind="slurm", job_id="41", array_job_id="40", array_task_id="1")
    record_started(client, "shard-0", "att-cmd", host="node 9; rm -rf /", pid=77, scheduler=job)
    wait_stale(client, {"shard-0"})
    template = "stopper {job_id} {array_job_id}_{array_task_id} {host} pid={pid} {grace}"
    assert kill_stale(client, tmp_path / "diag", "7", "--kill-command", template) == 0
    assert _calls(calls) == [["41", "40_1", "node 9; rm -rf /", "pid=77", "7"]]
    assert states(client) == {"shard-0": ("failed", "timeout")}
    assert main(["watch", "run-1", "--kill-stale", "--kill-command", "x {nope}"]) == 2
    assert "unknown placeholder {nope}" in capsys.readouterr().err


def test_watch_loop_outlives_a_ledger_restart_and_stops_what_hangs_after_it(
    tmp_path: Path, children: list[subprocess.Popen[bytes]]
) -> None:
    from ledger_server.config import ServerConfig
    from ledger_server.server import create_server

    db = str(tmp_path / "ledger.db")
    first = create_server(ServerConfig(database=db, listen="127.0.0.1:0"))
    target = f"127.0.0.1:{first.port}"
    c = LedgerClient(target, timeout_s=5, retry_deadline_s=5)
    c.append([planned()])
    watch = subprocess.Popen(
        [
            *(sys.executable, "-m", "shardledger_cli", "watch", "run-1", "--server", target),
            *("--kill-stale", "--interval", "0.2", "--grace", "1", "--timeout", "1", "--json"),
            *("--diag-dir", str(tmp_path / "diag")),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    children.append(watch)  # type: ignore[arg-type]
    lines: list[str] = []
    assert watch.stderr is not None
    reader = threading.Thread(target=lambda: lines.extend(iter(watch.stderr.readline, "")))  # type: ignore[union-attr]
    reader.start()
    second: RunningServer | None = None
    try:
        # Conditions, not sleeps: the watchdog is connected to the first ledger (it has
        # started and polled, however slow its start on a loaded machine), then has seen
        # it gone, and only then does the ledger come back.
        _wait_connected(watch.pid, first.port)
        first.stop(0)
        deadline = time.monotonic() + 60
        while not any("ledger unreachable" in line for line in lines):
            assert watch.poll() is None, "the watchdog exited when the ledger went away"
            assert time.monotonic() < deadline, "the watchdog never noticed the ledger gone"
            time.sleep(0.05)
        second = create_server(ServerConfig(database=db, listen=target))
        proc = hang_attempt(c, children, "shard-0", "att-after")
        assert watch.stdout is not None
        action = json.loads(watch.stdout.readline())
        assert (action["attempt_id"], action["recorded_failed_timeout"]) == ("att-after", True)
        proc.wait(timeout=10)
        assert states(c) == {"shard-0": ("failed", "timeout")}
    finally:
        c.close()
        watch.terminate()
        watch.wait(timeout=10)
        reader.join(timeout=10)
        if second is not None:
            second.stop(0)
    err = "".join(lines)
    assert "ledger unreachable" in err and "ledger reachable again" in err


def _wait_connected(pid: int, port: int) -> None:
    """Waits until process pid holds an established TCP connection to 127.0.0.1:port."""
    deadline = time.monotonic() + 60
    while True:
        inodes = set()
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        # gRPC's sockets are dual-stack: an IPv4 connection is listed in tcp6, mapped.
        table = Path("/proc/net/tcp").read_text().splitlines()[1:]
        table += Path("/proc/net/tcp6").read_text().splitlines()[1:]
        for line in table:
            cols = line.split()
            remote_port, state, inode = int(cols[2].rsplit(":", 1)[1], 16), cols[3], cols[9]
            if remote_port == port and state == "01" and inode in inodes:  # 01: ESTABLISHED
                return
        assert time.monotonic() < deadline, f"pid {pid} never connected to port {port}"
        time.sleep(0.05)


def test_scheduler_identity_is_read_from_slurm_and_kubernetes_variables(tmp_path: Path) -> None:
    from shard_client.scheduler import SchedulerIdentity, detect

    slurm_env = {
        "SLURM_JOB_ID": "41",
        "SLURM_ARRAY_JOB_ID": "40",
        "SLURM_ARRAY_TASK_ID": "1",
        "SLURM_CLUSTER_NAME": "gpu",
        "SLURMD_NODENAME": "n7",
    }
    assert detect(slurm_env) == SchedulerIdentity("slurm", "41", "40", "1", "gpu", "n7")
    sa = tmp_path / "namespace"
    sa.write_text("ml\n")
    pod_env = {"POD_NAME": "train-7", "NODE_NAME": "gpu-3"}
    assert detect(pod_env, sa_namespace=sa) == SchedulerIdentity(
        "kubernetes", "train-7", node="gpu-3", namespace="ml"
    )
    bare_pod = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "HOSTNAME": "train-8"}
    assert detect(bare_pod, sa_namespace=tmp_path / "absent") == SchedulerIdentity(
        "kubernetes", "train-8"
    )
    assert detect({"HOSTNAME": "laptop"}) is None


def test_process_start_ticks_tell_a_process_from_a_later_one_with_its_pid() -> None:
    mine = process_start_ticks()
    assert mine > 0 and process_start_ticks(os.getpid()) == mine
    assert process_start_ticks(2**22 + 12345) == 0  # no such process


def test_started_event_from_the_sdk_carries_slurm_identity_and_start_time(
    client: LedgerClient,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from shard_client import Ledger

    client.append([planned()])
    for name, value in {"SLURM_JOB_ID": "41", "SLURM_ARRAY_JOB_ID": "40"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    with Ledger(client.target) as ledger, ledger.shard("run-1", "shard-0", fingerprint=False) as s:
        (tmp_path / "out").write_text("done\n")
        s.commit(tmp_path / "out", name="out")
    [started_event] = [e for e in client.list_events("run-1") if e.HasField("started")]
    identity = started_event.started.scheduler
    assert (identity.kind, identity.job_id, identity.array_job_id) == ("slurm", "41", "40")
    assert started_event.started.process_start_ticks == process_start_ticks()
    assert main(["events", "run-1", "--server", client.target]) == 0
    assert "job=slurm:40_1" in capsys.readouterr().out


def json_lines(out: str) -> list[Any]:
    """Returns the objects of `watch --json`: one JSON object per line."""
    return [json.loads(line) for line in out.splitlines()]


def test_a_kill_whose_record_the_ledger_did_not_take_is_recorded_next_pass_with_its_diagnostics(
    server: RunningServer, client: LedgerClient, tmp_path: Path
) -> None:
    # The demo's ledger outage hit the moment after the watchdog had dumped the stack and
    # killed a hung job: the next pass found the process gone and recorded a failure that
    # no longer named the diagnostics.
    from shard_client.errors import LedgerUnavailable
    from shardledger_cli.commands.watch_handle import Action, handle_stale
    from shardledger_cli.commands.watch_stop import StartedIndex

    client.append([planned()])
    diag = tmp_path / "diag"
    helper = [sys.executable, "tests/helpers/hung_job.py", client.target, "run-1", "shard-0"]
    proc = subprocess.Popen([*helper, "att-hung", str(diag)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
        wait_stale(client, {"shard-0"})
        view = json.loads(next(iter(client.shards("run-1", state="stale"))).view_json)
        target = StartedIndex("run-1", "").target(view, client)

        def ledger_down(events: list[pb.ShardEvent]) -> object:
            raise LedgerUnavailable("the ledger is restarting")

        unrecorded: dict[str, Action] = {}
        common: dict[str, Any] = {
            "run_id": "run-1", "namespace": "", "grace_s": 1.0, "diag_dir": diag,
            "target": target, "unrecorded": unrecorded,
        }  # fmt: skip
        with pytest.raises(LedgerUnavailable):
            handle_stale(view, append=ledger_down, **common)
        proc.wait(timeout=10)  # stopped, though not recorded
        assert list(unrecorded) == ["att-hung"]
        action = handle_stale(view, append=client.append, **common)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert unrecorded == {}
    assert action.recorded and action.steps[0] == "diagnostics"
    assert action.steps[-1] == "recorded on a later pass (the ledger was unreachable)"
    assert "stuck_in_data_loader" in Path(action.diagnostics).read_text()
    [failed] = [e.failed for e in client.list_events("run-1") if e.HasField("failed")]
    assert f"diagnostics in {action.diagnostics}" in failed.message
    assert states(client)["shard-0"] == ("failed", "timeout")
