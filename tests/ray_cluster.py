"""A real local Ray cluster for tests: ``ray start --head`` on free ports, in a private temp dir.

Bind the fixture in a test module (``ray_cluster = tests.ray_cluster.ray_cluster``) and mark
the module ``pytestmark = pytest.mark.ray``: one cluster per module (a head starts in a few
seconds on an idle core and holds a raylet, a GCS and worker processes), stopped at the
module's end. The drivers are the tests' subprocesses (``ray.init(address=...)``), as a
user's are, so a test can SIGKILL one; the pytest process never imports ray.

What running it here taught us:

- ``ray stop`` stops every Ray process on the machine, a neighbour's cluster included, so
  `RayCluster.stop` signals only the processes whose environment carries this cluster's
  marker (``SHARDLEDGER_TEST_RAY=<its temp dir>``, inherited by the raylet's workers).
- Ray's default ports are fixed (GCS 6379, the dashboard agent's 52365, ...): each one
  gets a free port, and workers take theirs from the OS. ``--include-dashboard=false``
  still starts the dashboard's head process (8265) and the Ray client server (10001):
  both get free ports too.
- A head starts in 8 s on an idle machine, 20–45 s at a load of 12 on two cores; every
  new driver (a Ray job) starts worker processes of its own, a few seconds each.
- Ray writes Unix sockets under its temp dir, whose paths must stay under 108 bytes: the
  dir is a short ``mkdtemp`` under /tmp, not pytest's deep ``tmp_path``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import pytest

from tests.slurm import free_ports

MARKER: Final = "SHARDLEDGER_TEST_RAY"
# The head's CPUs: two task slots, on a machine whose two cores the suite shares.
NUM_CPUS: Final = 2
START_TIMEOUT_S: Final = 300.0
OBJECT_STORE_BYTES: Final = 100 * 1024 * 1024
# The GCS calls a node dead after 5 missed health checks a second apart (Ray's default:
# 5 every 3 s, each allowed 10 s), so a test's frozen or killed raylet is dead within
# seconds; a check may take 2 s, which a loaded machine's raylets answer within.
NODE_DEATH: Final = {
    "health_check_period_ms": "1000",
    "health_check_timeout_ms": "2000",
    "health_check_failure_threshold": "5",
}


class RayClusterError(RuntimeError):
    """The head did not start; the message carries `ray start`'s output."""


@dataclass
class RayCluster:
    """One local head node; ``address`` is what a driver passes to ``ray.init``."""

    base: Path
    env: dict[str, str]
    address: str = ""
    # How long `ray start` took: what the tests' waits scale with (a loaded machine is slow
    # at everything Ray does: workers, drivers, actors).
    start_s: float = 0.0
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.base / "ray-start.log"

    def start(self, **system: str) -> None:
        """Starts the head; ``system`` are RAY_<name> settings of its processes."""
        ports = free_ports(9)  # at once: no port handed out twice
        gcs, dash, client = ports[6:]
        for name, value in system.items():
            self.env[f"RAY_{name}"] = value
        began = time.monotonic()
        self._ray_start(
            ports[:6],
            "--head",
            f"--port={gcs}",
            f"--dashboard-port={dash}",
            f"--ray-client-server-port={client}",
            f"--num-cpus={NUM_CPUS}",
            "--include-dashboard=false",
            f"--temp-dir={self.base / 'ray'}",
            log=self.log,
        )
        self.start_s = time.monotonic() - began
        self.address = f"127.0.0.1:{gcs}"

    def _ray_start(self, ports: list[int], *flags: str, log: Path) -> int:
        """Runs `ray start` with ``flags`` and a raylet on six free ``ports``; returns its
        node manager port (`ray start` output in ``log``)."""
        manager, objects, agent_http, agent_grpc, env_agent, metrics = ports
        argv = [
            str(Path(sys.executable).parent / "ray"),
            "start",
            "--node-ip-address=127.0.0.1",
            f"--node-manager-port={manager}",
            f"--object-manager-port={objects}",
            f"--dashboard-agent-listen-port={agent_http}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--runtime-env-agent-port={env_agent}",
            f"--metrics-export-port={metrics}",
            # Ray's floor; the tests' objects are a few rows (the default takes 30 % of RAM).
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            "--num-gpus=0",
            "--disable-usage-stats",
            *flags,
        ]
        with log.open("w") as out:
            done = subprocess.run(
                argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, timeout=START_TIMEOUT_S
            )
        if done.returncode != 0:
            raise RayClusterError(
                f"ray start {flags[0]} exited {done.returncode}:\n{log.read_text()}"
            )
        return manager

    def add_worker_node(self, resource: str, *, num_cpus: int = 1) -> RayNode:
        """Starts a second raylet that joins the head, with one unit of the custom ``resource``.

        A task that asks for ``resource`` (or is pinned to the node) runs there; the test
        can then freeze or kill that raylet (`RayNode.raylet_pid`) as a node fault.
        """
        manager = self._ray_start(
            free_ports(6),
            f"--address={self.address}",
            f"--num-cpus={num_cpus}",
            f"--resources={json.dumps({resource: 1})}",
            log=self.base / f"ray-start-{resource}.log",
        )
        return RayNode(self, resource, manager)

    def allowance_s(self) -> float:
        """Returns how long a test may wait for Ray to do one thing: a minute, or 6 head starts."""
        return max(60.0, 6 * self.start_s)

    def driver_env(self, **extra: str) -> dict[str, str]:
        """Returns the environment of a driver subprocess: RAY_ADDRESS, the marker, ``extra``."""
        return {**self.env, "RAY_ADDRESS": self.address, **extra}

    def pids(self) -> list[int]:
        """Returns the live processes that carry this cluster's marker (workers included)."""
        found = []
        needle = f"{MARKER}={self.base}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
        return found

    def stop(self) -> None:
        """Signals every process of the cluster, TERM then KILL, and waits until none is left."""
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait_s
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.1)
            if not self.pids():
                return


@dataclass
class RayNode:
    """A second raylet of a `RayCluster` (`RayCluster.add_worker_node`)."""

    cluster: RayCluster
    resource: str
    # The raylet's --node_manager_port: what tells its processes from the head's.
    manager_port: int

    def processes(self) -> dict[int, list[bytes]]:
        """Returns the node's live processes (raylet, agents, workers): pid -> argv.

        Each names the raylet's port in its argv (``--node_manager_port=`` in the raylet's,
        ``--node-manager-port=`` in the others').
        """
        flags = {f"--node{sep}manager{sep}port={self.manager_port}".encode() for sep in "_-"}
        found = {}
        for pid in self.cluster.pids():
            with contextlib.suppress(OSError):
                argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
                if flags & set(argv):
                    found[pid] = argv
        return found

    def raylet_pid(self) -> int:
        """Returns the node's raylet pid."""
        (pid,) = (p for p, argv in self.processes().items() if argv[0].endswith(b"/raylet"))
        return pid

    def kill(self) -> None:
        """SIGKILLs every process of the node (a frozen one too) and waits until none is left."""
        deadline = time.monotonic() + 30.0
        while (left := self.processes()) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    """A local Ray head for the module, stopped (its processes only) at the module's end."""
    if importlib.util.find_spec("ray") is None:
        pytest.fail(
            "ray is not installed: the Ray tests need the ray extra (pip install -e '.[ray]');"
            ' deselect them with -m "not ray"'
        )
    # Short: Ray's socket paths live under it.
    base = Path(tempfile.mkdtemp(prefix="slray", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env[MARKER] = str(base)
    cluster = RayCluster(base, env)
    try:
        cluster.start(**NODE_DEATH)
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)
