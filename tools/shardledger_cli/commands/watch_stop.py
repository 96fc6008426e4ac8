"""How `shardledger watch` stops a hung attempt: by signals on its own host, or through the scheduler.

Every way ends the same: TERM first (the job's SIGTERM handler may checkpoint),
then, after the grace period, a kill it cannot refuse. A pid is signalled only
when its start time (/proc/PID/stat field 22) equals the one the attempt
recorded, so a pid reused by another process is never signalled.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal

from shard_client.scheduler import process_start_ticks
from shard_client.vocabulary import SCHEDULER_FIELDS

# Placeholders a --kill-command template may use: the scheduler identity's fields but its kind.
KILL_FIELDS: Final = (
    *(name for name in SCHEDULER_FIELDS if name != "kind"),
    "pod",
    "host",
    "pid",
    "start_ticks",
    "run_id",
    "shard_id",
    "attempt_id",
    "grace",
)
# Slurm states after which a job holds nothing any more (scontrol's JobState).
SLURM_DONE: Final = frozenset(
    [
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    ]
)
# Joining a Ray cluster as a driver and scheduling one task, beyond the grace period.
RAY_STOP_SLACK_S: Final = 120.0
# How long a cancelled job may take to end: above Slurm's default KillWait of 30 s.
SLURM_KILL_WAIT_S: Final = 60.0
# What scancel prints for a job that already ended (or that slurmctld forgot).
_SLURM_GONE: Final = (
    "Invalid job id",
    "already completing or completed",
    "Job has already finished",
)

Identity = Literal["same", "gone", "reused", "unknown"]


@dataclass(frozen=True, slots=True)
class Target:
    """The process behind one stale attempt, as its started event recorded it."""

    run_id: str
    shard_id: str
    attempt_id: str
    host: str = ""
    pid: int = 0
    start_ticks: int = 0
    scheduler: Mapping[str, str] = field(default_factory=dict)
    # A multi-rank attempt: its rank (-1: the attempt as a whole), and every rank's process.
    rank: int = -1
    ranks: tuple[Target, ...] = ()

    @property
    def local(self) -> bool:
        """Returns whether the attempt ran on this host."""
        return self.host in ("", socket.gethostname())

    def placeholders(self, grace_s: float) -> dict[str, str]:
        """Returns the values of the --kill-command placeholders ("" where unknown)."""
        s = self.scheduler
        values = {k: s.get(k, "") for k in SCHEDULER_FIELDS if k != "kind"}
        values["pod"] = s.get("job_id", "") if s.get("kind") == "kubernetes" else ""
        values |= {"host": self.host, "pid": str(self.pid or ""), "grace": f"{grace_s:g}"}
        values |= {"start_ticks": str(self.start_ticks or ""), "run_id": self.run_id}
        return values | {"shard_id": self.shard_id, "attempt_id": self.attempt_id}


@dataclass(slots=True)
class StartedIndex:
    """The started events of one run, by attempt id, read incrementally from the ledger."""

    run_id: str
    namespace: str
    after: int = 0
    started: dict[str, Any] = field(default_factory=dict)

    def refresh(self, client: Any) -> None:
        """Reads the events appended since the last refresh."""
        for event in client.list_events(
            self.run_id, namespace=self.namespace, after_sequence=self.after
        ):
            self.after = max(self.after, event.sequence)
            if event.WhichOneof("payload") == "started":
                self.started[event.attempt_id] = event.started

    def target(self, view: Mapping[str, Any], client: Any | None = None) -> Target:
        """Returns the stale view's latest attempt with what its started events recorded."""
        target = self._attempt_target(view, client)
        if not view.get("ranks"):
            return target
        # Every rank's started event recorded its own process (the view carries them all).
        ranks = tuple(
            Target(
                self.run_id,
                view["shard_id"],
                target.attempt_id,
                host=r.get("host") or "",
                pid=int(r.get("pid") or 0),
                start_ticks=int(r.get("process_start_ticks") or 0),
                scheduler=dict(r.get("scheduler") or {}),
                rank=int(r["rank"]),
            )
            for r in view["ranks"]
            if r.get("state") != "not_started"
        )
        return replace(target, ranks=ranks)

    def _attempt_target(self, view: Mapping[str, Any], client: Any | None) -> Target:
        attempt = view["latest_attempt"]
        if attempt not in self.started and client is not None:
            self.refresh(client)
        s = self.started.get(attempt)
        if s is None:  # not (yet) in the index: what the view itself carries
            return Target(
                self.run_id,
                view["shard_id"],
                attempt,
                host=view.get("host") or "",
                pid=int(view.get("pid") or 0),
                start_ticks=int(view.get("process_start_ticks") or 0),
                scheduler=dict(view.get("scheduler") or {}),
            )
        scheduler = {
            n: getattr(s.scheduler, n) for n in SCHEDULER_FIELDS if getattr(s.scheduler, n)
        }
        return Target(
            self.run_id,
            view["shard_id"],
            attempt,
            host=s.host,
            pid=s.pid,
            start_ticks=s.process_start_ticks,
            scheduler=scheduler,
        )


def _proc_state(pid: int) -> str:
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115 - one short read
    except OSError:
        return ""
    return stat.rpartition(")")[2].split()[0]


def identity(pid: int, start_ticks: int) -> Identity:
    """Returns whether pid is still the recorded process, gone, reused, or unknown (no start time)."""
    if pid <= 0 or _proc_state(pid) in ("", "Z", "X"):
        # A zombie has exited; only its parent's wait is missing.
        return "gone"
    if not start_ticks:
        return "unknown"
    return "same" if process_start_ticks(pid) == start_ticks else "reused"


def _wait_gone(pid: int, start_ticks: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        # Reap it when it is our own child (the demo's workers are), else just poll.
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        if identity(pid, start_ticks) != "same":
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def stop_local(steps: list[str], pid: int, start_ticks: int, grace_s: float) -> None:
    """Sends SIGTERM, waits the grace period, then SIGKILL, each only to the recorded process."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        steps.append("exited before SIGTERM")
        return
    steps.append("SIGTERM")
    if _wait_gone(pid, start_ticks, grace_s):
        return
    # Checked again just before the kill: in the grace period the pid may have been reused.
    if identity(pid, start_ticks) != "same":
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return  # it exited between the last poll and the kill
    steps.append("SIGKILL")
    _wait_gone(pid, start_ticks, 5.0)


class StopFailed(Exception):
    """The scheduler or the kill command could not stop the attempt; the message says why."""


def _run(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    if shutil.which(argv[0]) is None:
        raise StopFailed(f"{argv[0]} not found on PATH")
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise StopFailed(f"`{shlex.join(argv)}` did not finish in {timeout_s:g} s") from None
    except OSError as exc:
        raise StopFailed(f"cannot run {argv[0]}: {exc.strerror}") from None


def _failed(argv: list[str], proc: subprocess.CompletedProcess[str]) -> StopFailed:
    said = (proc.stderr or proc.stdout).strip().splitlines()
    return StopFailed(f"`{shlex.join(argv)}` exited {proc.returncode}: {' '.join(said)[:300]}")


def slurm_state(job_id: str) -> str:
    """Returns the job's JobState ("" once slurmctld forgot it)."""
    proc = _run(["scontrol", "-o", "show", "job", job_id], 30)
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr:
            return ""
        raise _failed(["scontrol", "-o", "show", "job", job_id], proc)
    for part in proc.stdout.split():
        if part.startswith("JobState="):
            return part.partition("=")[2]
    return ""


def _scancel(steps: list[str], *args: str) -> bool:
    """Runs scancel; returns False when the job had already ended."""
    argv = ["scancel", *args]
    proc = _run(argv, 30)
    if proc.returncode != 0 or any(g in proc.stderr for g in _SLURM_GONE):
        if any(g in proc.stderr for g in _SLURM_GONE):
            steps.append("slurm job already ended")
            return False
        raise _failed(argv, proc)
    steps.append(shlex.join(argv))
    return True


def slurm_job(scheduler: Mapping[str, str]) -> str:
    """Returns the id scancel takes for the job: ARRAYJOB_TASK for an array task, else JOBID."""
    # Slurm 22.05 refuses a plain `scancel JOBID` of an array task by its own job id
    # ("job_str_signal(3): invalid JobId=3"), though it takes --signal with it.
    if scheduler.get("array_job_id") and scheduler.get("array_task_id"):
        return f"{scheduler['array_job_id']}_{scheduler['array_task_id']}"
    return scheduler["job_id"]


def _slurm_wait(job: str, timeout_s: float) -> bool:
    """Returns whether the job ended (or is completing) within the time."""
    deadline = time.monotonic() + timeout_s
    while True:
        if slurm_state(job) in SLURM_DONE | {"", "COMPLETING"}:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.25)


def stop_slurm(steps: list[str], job: str, grace_s: float) -> None:
    """Sends TERM to the batch script and its children, then cancels the job after the grace."""
    # --full: without it scancel signals only srun steps, never the batch script itself.
    if not _scancel(steps, "--signal=TERM", "--full", job):
        return
    if _slurm_wait(job, grace_s):
        steps.append("slurm job ended after TERM")
        return
    # Plain scancel: TERM again, then KILL after the cluster's KillWait (30 s by default).
    if not _scancel(steps, job):
        return
    if not _slurm_wait(job, SLURM_KILL_WAIT_S):
        raise StopFailed(
            f"slurm job {job} is still {slurm_state(job)} {SLURM_KILL_WAIT_S:g} s after scancel"
        )
    steps.append("slurm job ended")


def stop_kubernetes(steps: list[str], pod: str, namespace: str, grace_s: float) -> None:
    """Deletes the pod: the kubelet sends TERM, waits the grace period, then KILLs."""
    argv = ["kubectl", "delete", "pod", pod, f"--grace-period={max(1, round(grace_s))}"]
    if namespace:
        argv[4:4] = ["--namespace", namespace]
    proc = _run(argv, grace_s + 60)
    if proc.returncode != 0:
        if "NotFound" in proc.stderr or "not found" in proc.stderr:
            steps.append("pod already gone")
            return
        raise _failed(argv, proc)
    steps.append(shlex.join(argv))


def stop_ray(steps: list[str], target: Target, grace_s: float) -> None:
    """Ends the attempt's Ray worker on its node, through Ray (shardledger_cli.ray_stop)."""
    argv = [sys.executable, "-m", "shardledger_cli.ray_stop", "--node", target.scheduler["node"]]
    argv += ["--pid", str(target.pid), "--start-ticks", str(target.start_ticks)]
    proc = _run([*argv, "--grace", f"{grace_s:g}"], grace_s + RAY_STOP_SLACK_S)
    if proc.returncode != 0:
        raise _failed(argv, proc)
    steps.append(f"ray: stop worker pid {target.pid}")
    steps.extend(json.loads(proc.stdout.strip().splitlines()[-1]))


def check_template(template: str) -> list[str]:
    """Returns the template's words; ValueError names a bad placeholder or quoting."""
    try:
        words = shlex.split(template)
    except ValueError as exc:
        raise ValueError(f"{template!r}: {exc}") from None
    if not words:
        raise ValueError("the command is empty")
    sample = dict.fromkeys(KILL_FIELDS, "x")
    for word in words:
        try:
            word.format(**sample)
        except KeyError as exc:
            known = ", ".join(f"{{{f}}}" for f in KILL_FIELDS)
            raise ValueError(f"unknown placeholder {{{exc.args[0]}}} (known: {known})") from None
        except (IndexError, ValueError) as exc:
            raise ValueError(f"{word!r}: {exc or 'positional placeholder {}'}") from None
    return words


def stop_command(steps: list[str], template: str, target: Target, grace_s: float) -> None:
    """Runs the user's --kill-command with the attempt's placeholders filled in (no shell)."""
    values = target.placeholders(grace_s)
    # Split first, then fill: a value with spaces or quotes stays one argument.
    argv = [word.format(**values) for word in check_template(template)]
    proc = _run(argv, grace_s + 60)
    if proc.returncode != 0:
        raise _failed(argv, proc)
    steps.append(shlex.join(argv))


def method(target: Target, *, kill_command: str | None) -> str | None:
    """Returns how to stop the attempt: command, slurm, kubernetes, ray, signal, or None (no way)."""
    kind = target.scheduler.get("kind")
    if kill_command:
        return "command"
    if kind == "slurm" and target.scheduler.get("job_id"):
        return "slurm"
    if kind == "kubernetes" and target.scheduler.get("job_id"):
        return "kubernetes"
    # Through Ray where this watchdog can join the cluster (the ray extra): it reaches the
    # worker's node; without ray, a worker on this host is still signalled directly.
    if (
        kind == "ray"
        and target.scheduler.get("node")
        and target.pid
        and importlib.util.find_spec("ray") is not None
    ):
        return "ray"
    if target.local and target.pid:
        return "signal"
    return None
