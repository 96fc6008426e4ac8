"""A real single-node Slurm cluster for tests: munged, slurmctld and slurmd in a temp dir.

Bind the fixture in a test module (``slurm_cluster = tests.slurm.slurm_cluster``) and mark
the module ``pytestmark = pytest.mark.slurm``. The cluster needs root (``SlurmUser=root``)
and the Debian packages ``slurm-wlm`` and ``munge``; without them the fixture *fails* with
the install command, so CI cannot pass by silently skipping. Where Slurm cannot run (no
root), deselect the tests with ``pytest -m "not slurm"``.

What this container taught us (Debian 12, Slurm 22.05.8, munge 0.5.15, gVisor ``runsc``);
each line is an exact message and what answers it:

- ``munged: Error: Socket is inaccessible: execute permissions for all required on
  "/tmp/slx.DZKl"``: ``mkdtemp`` makes a 0700 directory; munged wants its socket's
  directory searchable by all, so the base directory is chmod 0755 (the key stays 0400).
- ``munged -F`` logs to stderr and ignores ``--log-file``; stderr goes to ``munged.log``.
- ``error: mpi/pmix_v4: init: (null) [0]: mpi_pmix.c:195: pmi/pmix: can not load PMIx
  library`` / ``Couldn't load specified plugin name for mpi/pmix_v4``: logged at every
  daemon start because ``--no-install-recommends`` leaves out libpmix; harmless with
  ``MpiDefault=none`` (no job uses PMIx), so it is not installed.
- ``error: Could not open node state file .../state/node_state: No such file or directory``
  (and job/resv/trigger state): a first start with an empty StateSaveLocation; harmless.
- ``ProctrackType=proctrack/cgroup``: the daemons start, but every batch step dies with
  ``[11.batch] error: cgroup namespace 'freezer' not mounted. aborting`` ... ``job_manager:
  exiting abnormally: Plugin initialization failed`` (gVisor's cgroup v1 emulation), and
  ``sbatch --wait`` still exits 0 with no job output. Hence ``proctrack/linuxproc`` (process
  tree from /proc), ``task/none`` and ``jobacct_gather/none``, which need no cgroups.
- ``proctrack/linuxproc`` tracks the step by parentage: a process whose parent exited is
  reparented away and escapes the step (after ``scancel --signal=TERM --batch`` the batch
  shell's ``sleep`` child outlived the job). ``stop`` therefore sweeps every process whose
  environment names this cluster's ``SLURM_CONF``.
- Signals: ``scancel --signal=TERM JOBID`` alone does not reach a batch job at all (only
  its srun steps); ``--batch`` signals only the batch shell; ``--full`` signals the batch
  shell and all its children. Plain ``scancel JOBID`` sends TERM, waits ``KillWait``
  (default 30 s, here 2 s) and then KILLs, so a TERM-ignoring job ends within ~5 s.
- ``sbatch --wait`` polls with a growing interval capped at 10 s, so a short array takes
  about 10 s to return; ``wait_job`` polls ``scontrol`` every 0.2 s instead.
- Slurm binds its ports on all addresses unless told otherwise: with only
  ``CommunicationParameters=NoInAddrAny`` slurmd listened on 127.0.0.1 but slurmctld still
  on 0.0.0.0 (/proc/net/tcp); ``NoCtldInAddrAny`` as well puts slurmctld on the address
  the hostname resolves to (127.0.0.1 here; where it resolves elsewhere both stay off).
  ``NodeAddr`` and ``SlurmctldHost=host(127.0.0.1)`` keep the traffic on loopback.
- Startup (munged, slurmctld answering ``scontrol ping``, node idle) takes about 0.35 s.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final

import pytest

PACKAGES: Final = ("slurm-wlm", "munge")
INSTALL_HINT: Final = "apt-get install -y --no-install-recommends " + " ".join(PACKAGES)
_BINARIES: Final = (
    "munged",
    "munge",
    "slurmctld",
    "slurmd",
    "sbatch",
    "scancel",
    "scontrol",
    "sinfo",
    "squeue",
)
# Job states after which Slurm does nothing more with a job; scontrol prints COMPLETING
# (not the final state) while the epilog and the kill of leftover processes still run.
TERMINAL_STATES: Final = frozenset(
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
# Variables a surrounding Slurm job or the user's shell may set that would steer our client
# commands (SBATCH_PARTITION, SLURM_CLUSTERS, ...) toward another cluster.
_CLIENT_ENV_PREFIXES: Final = ("SLURM_", "SBATCH_", "SQUEUE_", "SINFO_", "SCANCEL_", "SCONTROL_")


class SlurmError(RuntimeError):
    """A Slurm daemon or command failed; the message carries its output and log tails."""


def missing_requirements() -> str | None:
    """Returns why this machine cannot run the cluster (root, binaries), or None."""
    if os.geteuid() != 0:
        return (
            "the test Slurm cluster runs its daemons as root (SlurmUser=root); run as root or"
            ' deselect these tests with -m "not slurm"'
        )
    missing = [binary for binary in _BINARIES if shutil.which(binary) is None]
    if missing:
        return (
            f"{', '.join(missing)} not found: the test Slurm cluster needs the Debian packages"
            f" {' and '.join(PACKAGES)} (`{INSTALL_HINT}`)"
        )
    return None


@dataclass(frozen=True, slots=True)
class NodeShape:
    """The node line `slurmd -C` prints for this machine."""

    name: str
    fields: str

    @classmethod
    def detect(cls) -> NodeShape:
        """Returns this machine's shape from `slurmd -C`."""
        out = subprocess.run(
            ["slurmd", "-C"], check=True, capture_output=True, text=True, timeout=30
        ).stdout
        line = next(line for line in out.splitlines() if line.startswith("NodeName="))
        pairs = dict(part.split("=", 1) for part in line.split())
        name = pairs.pop("NodeName")
        return cls(name=name, fields=" ".join(f"{k}={v}" for k, v in pairs.items()))


def free_ports(count: int) -> list[int]:
    """Returns distinct free loopback TCP ports (all held open together while chosen)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


def _resolves_to_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def render_slurm_conf(
    base: Path, *, cluster: str, node: NodeShape, ctld_port: int, slurmd_port: int
) -> str:
    """Returns the slurm.conf of a one-node cluster whose files all live under base."""
    return "\n".join(
        [
            f"ClusterName={cluster}",
            f"SlurmctldHost={node.name}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            *(
                ["CommunicationParameters=NoInAddrAny,NoCtldInAddrAny"]
                if _resolves_to_loopback(node.name)
                # Binding to the hostname's address would take the daemons off loopback
                # (a Docker host name maps to the container's IP): listen everywhere instead.
                else []
            ),
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={base / 'munge.socket'}",
            f"StateSaveLocation={base / 'state'}",
            f"SlurmdSpoolDir={base / 'spool'}",
            f"SlurmctldPidFile={base / 'slurmctld.pid'}",
            f"SlurmdPidFile={base / 'slurmd.pid'}",
            f"SlurmctldLogFile={base / 'slurmctld.log'}",
            # Without it slurmstepd, which runs each job, logs to syslog and its errors vanish.
            f"SlurmdLogFile={base / 'slurmd.log'}",
            f"PlugStackConfig={base / 'plugstack.conf'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            # TERM to KILL in 2 s, so that a plain scancel of a TERM-ignoring job ends fast.
            "KillWait=2",
            "MailProg=/bin/true",
            f"NodeName={node.name} NodeAddr=127.0.0.1 {node.fields} State=UNKNOWN",
            f"PartitionName=debug Nodes={node.name} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


def _parse_scontrol_record(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"  ({path.name}: absent)"
    return "\n".join(f"  {path.name}: {line}" for line in text[-lines:])


class SlurmCluster:
    """munged + slurmctld + slurmd for one node, in a private temp dir on loopback ports."""

    def __init__(self, *, cluster: str = "sltest", base_dir: Path | None = None) -> None:
        self.cluster = cluster
        self._own_dir = base_dir is None
        self.base = (
            Path(tempfile.mkdtemp(prefix="slurm-")) if base_dir is None else base_dir.resolve()
        )
        self.conf = self.base / "slurm.conf"
        self.node: NodeShape | None = None
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []

    @property
    def env(self) -> dict[str, str]:
        """Returns the environment for client commands (and jobs) of this cluster."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(_CLIENT_ENV_PREFIXES)}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 45.0) -> None:
        """Starts the daemons and waits until the node is idle; stops them all on failure."""
        problem = missing_requirements()
        if problem:
            raise SlurmError(problem)
        deadline = time.monotonic() + timeout_s
        try:
            self._write_files()
            self._spawn(
                "munged",
                [
                    "munged",
                    "--foreground",
                    f"--socket={self.base / 'munge.socket'}",
                    f"--key-file={self.base / 'munge.key'}",
                    f"--pid-file={self.base / 'munged.pid'}",
                    f"--seed-file={self.base / 'munged.seed'}",
                    f"--log-file={self.base / 'munged.file.log'}",
                ],
            )
            self._wait_for("munged socket", deadline, self._munge_works)
            self._spawn("slurmctld", ["slurmctld", "-D"])
            self._wait_for("slurmctld", deadline, lambda: self._scontrol_ok("ping"))
            assert self.node is not None
            self._spawn("slurmd", ["slurmd", "-D", "-N", self.node.name])
            self._wait_for("node idle", deadline, self._node_idle)
        except BaseException:
            self.stop()
            raise

    def _write_files(self) -> None:
        # munged refuses a socket directory that not everyone can search (see the module doc).
        self.base.chmod(0o755)
        for sub in ("state", "spool"):
            (self.base / sub).mkdir(exist_ok=True)
        key = self.base / "munge.key"
        # munged accepts any key of 32 bytes or more; 1024 random bytes is what mungekey makes.
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as fh:
            fh.write(os.urandom(1024))
        # An empty plugstack.conf keeps the host's /etc/slurm SPANK plugins out of our jobs.
        (self.base / "plugstack.conf").write_text("")
        self.node = NodeShape.detect()
        ctld_port, slurmd_port = free_ports(2)
        self.conf.write_text(
            render_slurm_conf(
                self.base,
                cluster=self.cluster,
                node=self.node,
                ctld_port=ctld_port,
                slurmd_port=slurmd_port,
            )
        )

    def _spawn(self, name: str, argv: Sequence[str]) -> None:
        log = (self.base / f"{name}.stderr").open("ab")
        self._logs.append(log)
        self._procs[name] = subprocess.Popen(
            list(argv),
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def _wait_for(self, what: str, deadline: float, ready: Callable[[], bool]) -> None:
        while True:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise SlurmError(
                        f"{name} exited with {proc.returncode} while waiting for {what}\n"
                        + self.diagnostics()
                    )
            if ready():
                return
            if time.monotonic() > deadline:
                raise SlurmError(f"timed out waiting for {what}\n" + self.diagnostics())
            time.sleep(0.1)

    def _munge_works(self) -> bool:
        if not (self.base / "munge.socket").exists():
            return False
        cmd = ["munge", "--no-input", f"--socket={self.base / 'munge.socket'}"]
        return subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0

    def _scontrol_ok(self, *args: str) -> bool:
        result = self.run("scontrol", *args, check=False, timeout_s=10)
        return result.returncode == 0 and "DOWN" not in result.stdout

    def _node_idle(self) -> bool:
        assert self.node is not None
        result = self.run("sinfo", "-h", "-n", self.node.name, "-o", "%T", check=False)
        return result.returncode == 0 and result.stdout.strip() == "idle"

    def diagnostics(self) -> str:
        """Returns the tails of every daemon log, for failure messages."""
        names = ["munged.stderr", "slurmctld.stderr", "slurmctld.log", "slurmd.stderr"]
        return "\n".join(_tail(self.base / n) for n in [*names, "slurmd.log"])

    def run(
        self, *argv: str, check: bool = True, timeout_s: float = 30.0, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Runs a Slurm client command against this cluster."""
        result = subprocess.run(
            list(argv),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=cwd,
        )
        if check and result.returncode != 0:
            raise SlurmError(
                f"`{shlex.join(argv)}` exited {result.returncode}\nstdout: {result.stdout}\n"
                f"stderr: {result.stderr}\n" + self.diagnostics()
            )
        return result

    def sbatch(self, *args: str, cwd: Path | None = None, timeout_s: float = 60.0) -> int:
        """Submits a batch job (args as for sbatch, script last) and returns its job id."""
        result = self.run("sbatch", "--parsable", *args, cwd=cwd, timeout_s=timeout_s)
        match = re.match(r"(\d+)", result.stdout.strip())
        if match is None:
            raise SlurmError(f"sbatch printed no job id: {result.stdout!r}")
        return int(match.group(1))

    def job_states(self, job_id: int) -> dict[str, str]:
        """Returns {job or array task: state} for a job id; empty once Slurm forgot it."""
        result = self.run("scontrol", "-o", "show", "job", str(job_id), check=False)
        if result.returncode != 0:
            if "Invalid job id" in result.stderr:
                return {}
            raise SlurmError(f"scontrol show job {job_id}: {result.stderr}")
        states = {}
        for line in result.stdout.splitlines():
            record = _parse_scontrol_record(line)
            if "JobState" not in record:
                continue
            task = record.get("ArrayTaskId")
            key = f"{record['ArrayJobId']}_{task}" if task else record["JobId"]
            states[key] = record["JobState"]
        return states

    def job_state(self, job_id: int) -> str:
        """Returns a job's state; for an array, the one state all its tasks share."""
        states = set(self.job_states(job_id).values())
        if len(states) != 1:
            raise SlurmError(f"job {job_id} has no single state: {self.job_states(job_id)}")
        return states.pop()

    def wait_job(self, job_id: int, timeout_s: float = 30.0) -> str:
        """Waits until a job (every task of an array) is in a terminal state; returns it."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = self.job_states(job_id)
            if states and set(states.values()) <= TERMINAL_STATES:
                return self.job_state(job_id)
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job_id} still {states} after {timeout_s} s")
            time.sleep(0.2)

    def wait_state(self, job_id: int, state: str, timeout_s: float = 30.0) -> None:
        """Waits until a job reaches the given state (e.g. RUNNING)."""
        deadline = time.monotonic() + timeout_s
        while (current := self.job_states(job_id)) != {} and set(current.values()) != {state}:
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job_id} is {current}, not {state}, after {timeout_s} s")
            time.sleep(0.1)
        if not current:
            raise SlurmError(f"job {job_id} is unknown to slurmctld")

    def stop(self) -> None:
        """Cancels every job, stops every daemon we started and removes the temp dir."""
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
            with contextlib.suppress(Exception):
                self._cancel_all()
        # slurmd before slurmctld, so it does not retry registering with a gone controller.
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self._procs.pop(name, None)
            if proc is not None:
                _terminate(proc)
        self._kill_strays()
        for log in self._logs:
            log.close()
        self._logs.clear()
        if self._own_dir:
            shutil.rmtree(self.base, ignore_errors=True)

    def _cancel_all(self) -> None:
        listed = self.run("squeue", "-h", "-o", "%A", check=False, timeout_s=10)
        ids = listed.stdout.split()
        if not ids:
            return
        self.run("scancel", "--signal=KILL", "--full", *ids, check=False, timeout_s=10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if not self.run("squeue", "-h", "-o", "%A", check=False, timeout_s=10).stdout.strip():
                return
            time.sleep(0.2)

    def _kill_strays(self) -> None:
        # Job processes (and slurmstepd) inherit SLURM_CONF; whatever still carries ours
        # escaped proctrack/linuxproc and would outlive the cluster.
        marker = f"SLURM_CONF={self.conf}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if marker not in (entry / "environ").read_bytes().split(b"\0"):
                    continue
                os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ValueError):
                continue


def _terminate(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace_s)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """Starts one Slurm cluster for the session; fails (never skips) where it cannot run."""
    problem = missing_requirements()
    if problem:
        pytest.fail(problem, pytrace=False)
    with SlurmCluster() as cluster:
        yield cluster
