"""The pure parts of `shardledger exec`: the progress protocol, tags from text and exit status, OOM counters."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shard_client.classify import failure_tag_of_output
from shard_client.vocabulary import FailureTag
from shardledger_cli.exec.guard import GUARD_BOUND_S, Guard, spawn
from shardledger_cli.exec.outcome import cgroup_oom_kills, judge_failure, signal_of
from shardledger_cli.exec.outputs import DeclaredOutput, env_name, parse_output
from shardledger_cli.exec.progress import Progress, parse_progress, parse_progress_file
from shardledger_cli.exec.supervise import ChildResult
from shardledger_cli.exec.target import Target, resolve_target, substitute


def test_a_progress_line_carries_step_fraction_and_metrics() -> None:
    line = "SHARDLEDGER_PROGRESS step=120 progress=0.4 loss=0.31 fps=24\n"
    assert parse_progress(line) == Progress(120, 0.4, {"loss": 0.31, "fps": 24.0})


def test_non_finite_metrics_pass_to_the_heartbeat_which_sends_them_by_name() -> None:
    report = parse_progress("SHARDLEDGER_PROGRESS step=3 loss=nan")
    assert report is not None and math.isnan(report.metrics["loss"])


@pytest.mark.parametrize(
    "line",
    [
        "progress: step=3",  # no marker
        "echo SHARDLEDGER_PROGRESS step=3",  # the marker not at the start
        "SHARDLEDGER_PROGRESS progress=0.5",  # no step
        "SHARDLEDGER_PROGRESS step=-1",
        "SHARDLEDGER_PROGRESS step=2 progress=1.5",  # a fraction above 1
        "SHARDLEDGER_PROGRESS step=2 loss=low",
        "SHARDLEDGER_PROGRESS step=2 step=3",
        "SHARDLEDGER_PROGRESS step=2 and more words",
        "SHARDLEDGER_PROGRESSstep=2",
    ],
)
def test_a_line_that_breaks_the_protocol_is_ordinary_output(line: str) -> None:
    assert parse_progress(line) is None


def test_a_progress_file_is_read_from_its_last_line_with_or_without_the_marker() -> None:
    assert parse_progress_file("step=1\nstep=2 loss=0.5\n\n") == Progress(2, 0.0, {"loss": 0.5})
    assert parse_progress_file("SHARDLEDGER_PROGRESS step=7\n") == Progress(7)
    assert parse_progress_file("") is None


@pytest.mark.parametrize(
    ("text", "tag"),
    [
        ("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB", FailureTag.OOM),
        ("terminate called after throwing an instance of 'std::bad_alloc'", FailureTag.OOM),
        ("json.decoder.JSONDecodeError: Expecting value", FailureTag.DATA),
        ("NCCL WARN Call to connect returned Connection refused", FailureTag.NCCL),
        ("Segmentation fault (core dumped)", FailureTag.UNKNOWN),
    ],
)
def test_the_last_output_lines_name_the_tag(text: str, tag: FailureTag) -> None:
    assert failure_tag_of_output(text) == tag


def test_shell_exit_statuses_above_128_are_signals() -> None:
    assert signal_of(-9) == signal.SIGKILL
    assert signal_of(137) == signal.SIGKILL
    assert signal_of(143) == signal.SIGTERM
    assert signal_of(3) is None
    assert signal_of(128) is None


@pytest.mark.parametrize(
    ("returncode", "signals", "oom_kills", "tag"),
    [
        (-9, [], 0, FailureTag.KILLED),
        (137, [], 0, FailureTag.KILLED),
        (-9, [], 1, FailureTag.OOM),  # the cgroup counted an OOM kill
        (-15, [], 0, FailureTag.PREEMPTED),
        (1, [signal.SIGTERM], 0, FailureTag.PREEMPTED),  # a job that catches TERM and exits 1
        (130, [signal.SIGINT], 0, FailureTag.KILLED),
        (2, [], 0, FailureTag.UNKNOWN),
    ],
)
def test_exit_status_and_signals_give_the_tag(
    returncode: int, signals: list[int], oom_kills: int, tag: FailureTag
) -> None:
    result = ChildResult(returncode=returncode, signals=signals, tail=["working\n"])
    verdict = judge_failure(result, ["./render", "--frame", "17"], oom_kills=oom_kills)
    assert verdict.tag == tag
    assert verdict.message.startswith("./render --frame 17 ")


def test_the_oom_kill_counter_is_read_from_cgroup_v2_or_v1(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job.slice/step_0\n")
    events = tmp_path / "sys" / "job.slice" / "step_0" / "memory.events"
    events.parent.mkdir(parents=True)
    events.write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 1\n")
    assert cgroup_oom_kills(proc, root=tmp_path / "sys") == 1
    proc.write_text("4:memory:/slurm/uid_0/job_7\n0::/\n")
    control = tmp_path / "sys" / "memory" / "slurm" / "uid_0" / "job_7" / "memory.oom_control"
    control.parent.mkdir(parents=True)
    control.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    assert cgroup_oom_kills(proc, root=tmp_path / "sys") == 3
    proc.write_text("0::/elsewhere\n")
    assert cgroup_oom_kills(proc, root=tmp_path / "sys") is None


def test_output_declarations_and_their_environment_names() -> None:
    assert parse_output("weights=out/w.bin").name == "weights"
    assert env_name("frame.png") == "SHARDLEDGER_OUTPUT_FRAME_PNG"
    for bad in ("weights", "=out/w.bin", "weights=", "weights=out/"):
        with pytest.raises(ValueError, match="--output"):
            parse_output(bad)


def test_placeholders_are_filled_and_other_braces_are_left_alone() -> None:
    target = Target("s-1", {"shard_id": "s-1", "input": "in/a.txt", "params": {"frame": 17}})
    outputs = [DeclaredOutput("w", "/out/w.bin", temp="/out/.shardledger-tmp-a.w.bin")]
    words = ["{tmp:w}", "--frame={param:frame}", "{input}", "{shard}@{run}", "awk '{print $1}'"]
    filled = substitute(words, run_id="r", target=target, attempt_id="a", outputs=outputs)
    assert filled == [
        "/out/.shardledger-tmp-a.w.bin",
        "--frame=17",
        "in/a.txt",
        "s-1@r",
        "awk '{print $1}'",
    ]
    with pytest.raises(ValueError, match=r"no params\.lr"):
        substitute(["{param:lr}"], run_id="r", target=target, attempt_id="a", outputs=outputs)


def test_the_shard_comes_from_one_source_only() -> None:
    line = '{"shard_id": "s-2", "input": "x"}'
    assert resolve_target(shard=None, plan_line=line, plan_file=None, index=None, env={}) == Target(
        "s-2", {"shard_id": "s-2", "input": "x"}
    )
    with pytest.raises(ValueError, match="not the plan line's shard_id"):
        resolve_target(shard="s-3", plan_line=line, plan_file=None, index=None, env={})
    with pytest.raises(ValueError, match="SLURM_ARRAY_TASK_ID"):
        resolve_target(shard=None, plan_line=None, plan_file="p.jsonl", index=None, env={})
    with pytest.raises(ValueError, match="name the shard"):
        resolve_target(shard=None, plan_line=None, plan_file=None, index=None, env={})


def _output_of(proc: subprocess.Popen[bytes]) -> str:
    out, _ = proc.communicate(timeout=30)
    return out.decode()


def test_the_child_dies_with_its_parent_and_keeps_the_default_sigpipe() -> None:
    # PR_GET_PDEATHSIG (2), read by the command itself: the launcher's setting survives exec.
    code = (
        "import ctypes; v = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0);"
        " print(v.value)"
    )
    assert _output_of(spawn([sys.executable, "-c", code], os.environ, guard=None)) == "9\n"
    # The wrapper (Python) ignores SIGPIPE; a shell pipeline in the child must not.
    status = _output_of(spawn(["grep", "SigIgn", "/proc/self/status"], os.environ, guard=None))
    ignored = int(status.split()[1], 16)
    assert not ignored & (1 << (signal.SIGPIPE - 1))


def test_a_command_that_cannot_be_run_raises_as_popen_does(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        spawn(["no-such-command-here"], os.environ, guard=None)
    script = tmp_path / "job.sh"
    script.write_text("echo hi\n")  # not executable
    with pytest.raises(PermissionError):
        spawn([str(script)], os.environ, guard=None)


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_when_exec_ends_without_disarming_the_guard_kills_the_group_and_removes_the_temps(
    tmp_path: Path,
) -> None:
    temp = tmp_path / ".shardledger-tmp-a.out.txt"
    temp.write_text("half of a file")
    guard = Guard.start(attempt_id="a-unit", temps=[str(temp)])
    proc = spawn(["sh", "-c", "sleep 60 & echo $!; wait"], os.environ, guard=guard)
    assert proc.stdout is not None
    grandchild = int(proc.stdout.readline())
    # What the kernel does to the guard's pipe when exec is SIGKILLed: close it, armed.
    guard.close()
    assert proc.wait(30) == -signal.SIGKILL
    deadline = time.monotonic() + GUARD_BOUND_S + 5.0
    while not _gone(grandchild) or temp.exists():
        assert time.monotonic() < deadline, (grandchild, temp.exists())
        time.sleep(0.05)


def test_a_disarmed_guard_leaves_the_files_to_exec(tmp_path: Path) -> None:
    temp = tmp_path / ".shardledger-tmp-a.out.txt"
    temp.write_text("a whole file, about to be committed")
    guard = Guard.start(attempt_id="a-unit", temps=[str(temp)])
    proc = spawn(["true"], os.environ, guard=guard)
    assert proc.wait(30) == 0
    guard.disarm()
    guard.close()
    assert temp.read_text() == "a whole file, about to be committed"
