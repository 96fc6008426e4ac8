"""docs/deployment.md's Patroni step by step runs as written, each block on the hosts it names.

The blocks of "High availability with Patroni" / "Step by step" run in order, as root,
with ``bash -e``, each on every host of its ``<!-- runs on: HOST... -->`` marker: the
hosts of a tests/netns.py network named as the page names the machines (etcd1..3,
pg1..3, ledger1..2). The page's variables block is marked not run; the test sets the
same variables on each host (its addresses, its own directories, random passwords). A
block followed by a ``text`` block runs again until its output has those lines (step 4
waits for the cluster so). Three lines change, each asserted to be on the page:

* the watchdog is off: a network namespace has no watchdog device, and one
  ``/dev/watchdog`` cannot serve three nodes on one machine;
* each node's Unix socket lies in its own directory: the three share a file system;
* ``serve`` runs with ``--insecure --auth off`` instead of the TLS and token options,
  which docs/cluster.md's own test (test_cluster_doc.py) checks.

Before the switchover (step 7) a load host appends through both replicas without pause
(tests/helpers/patroni_load.py); after it, every acknowledged event is on the new
leader once, at its sequence, and the old leader streams from it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import string
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest

from tests import pg
from tests.contract.test_patroni_failover import acknowledged
from tests.contract.test_tutorial import Block, blocks, missing_lines
from tests.netns import HELPERS, Host, Network, network, wait_for
from tests.patroni import skip_reason
from tests.server.test_replicas import assert_ledger_holds_exactly

REPO: Final = Path(__file__).resolve().parents[2]
DEPLOYMENT: Final = REPO / "docs" / "deployment.md"
SECTION: Final = "## High availability with Patroni"
STEPS: Final = "### Step by step"
RUNS_ON: Final = re.compile(r"<!-- runs on: (?P<hosts>[\w ]+?) -->")
HOSTS: Final = ("etcd1", "etcd2", "etcd3", "pg1", "pg2", "pg3", "ledger1", "ledger2")
# What the test runs instead of the page's line, and why (module docstring).
WATCHDOG: Final = ("watchdog: {mode: required, device: /dev/watchdog}", 'watchdog: {mode: "off"}')
SOCKETS: Final = (
    "unix_socket_directories: /var/run/postgresql",
    "unix_socket_directories: $PATRONI_DIR",
)
SERVE_TLS: Final = (
    '--tls-cert "$LEDGER_DIR/tls/server.pem" --tls-key "$LEDGER_DIR/tls/server.key" --auth tokens',
    "--insecure --auth off",
)
LEDGER_PORT: Final = 50551
REST_PORT: Final = 8008


@dataclass(frozen=True)
class Step:
    """One block of the step by step and the hosts it runs on."""

    block: Block
    hosts: tuple[str, ...]


def section_blocks() -> tuple[Block, list[Step]]:
    """Returns the step by step's variables block and its steps, in the page's order."""
    lines = DEPLOYMENT.read_text(encoding="utf-8").splitlines()
    start = lines.index(SECTION) + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("## "))
    steps_at = lines.index(STEPS, start) + 1
    assert steps_at < end, f"{STEPS} is not in {SECTION}"
    variables: Block | None = None
    steps: list[Step] = []
    for block in blocks(DEPLOYMENT):
        if not steps_at < block.line < end + 1 or block.lang != "bash":
            continue
        if block.not_run is not None:
            assert variables is None, f"{block.where()}: one not-run block, the variables"
            variables = block
            continue
        marker = RUNS_ON.fullmatch(lines[block.line - 2].strip())
        assert marker, f"{block.where()}: say <!-- runs on: HOST... --> on the line before"
        hosts = tuple(marker["hosts"].split())
        assert set(hosts) <= set(HOSTS), f"{block.where()}: {hosts}"
        steps.append(Step(block, hosts))
    assert variables is not None, "the variables block (not run) was not found"
    return variables, steps


def exported(block: Block) -> dict[str, str]:
    """Returns the names and values the variables block exports (its example machine's)."""
    values: dict[str, str] = {}
    for line in block.body.splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["export"]:
            values |= dict(word.split("=", 1) for word in words[1:])
    return values


def config_lines(step: Step, values: dict[str, str]) -> list[str]:
    """Returns the lines of the Patroni configuration step 2 writes, for values' machine."""
    body = step.block.body
    heredoc = body[body.index("<<EOF\n") + len("<<EOF\n") : body.index("\nEOF\n")]
    return string.Template(heredoc).substitute(values).splitlines()


def test_the_settings_shown_are_the_ones_the_steps_write() -> None:
    variables, steps = section_blocks()
    [config] = [s for s in steps if "<<EOF" in s.block.body]
    written = set(config_lines(config, exported(variables)))
    [settings] = [
        b
        for b in blocks(DEPLOYMENT)
        if b.lang == "yaml" and b.body.startswith("scope: shardledger")
    ]
    for line in settings.body.splitlines():
        line = line.split("  #")[0].rstrip()
        assert line in written, f"{settings.where()}: {line!r} is not what step 2 writes"


@dataclass
class Machines:
    """The network, one directory per host, and each host's variables."""

    net: Network
    root: Path
    env: dict[str, dict[str, str]]

    def run(self, step: Step, host: str, *, timeout_s: float = 120) -> str:
        """Runs the step's block on host with bash -e; returns its output, fails on an error."""
        body = step.block.body
        for old, new in (WATCHDOG, SOCKETS, SERVE_TLS):
            body = body.replace(old, new)
        script = self.root / f"step-{step.block.line}-{host}.sh"
        script.write_text(body)
        log = self.root / f"step-{step.block.line}-{host}.log"
        log.unlink(missing_ok=True)
        proc = self.net.hosts[host].popen(
            ["bash", "-e", "-o", "pipefail", str(script)],
            log=log,
            env=self.env[host],
            cwd=self.root,
        )
        code = proc.wait(timeout=timeout_s)
        output = log.read_text(errors="replace")
        assert code == 0, f"{step.block.where()} on {host} exited {code}:\n{body}\n{output}"
        return output


@pytest.fixture
def machines(tmp_path: Path) -> Iterator[Machines]:
    """A network of the page's machines and a load host, each with the page's variables."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    # PostgreSQL runs as postgres, which must reach its files (pytest's tmp_path is 0700).
    root = Path(tempfile.mkdtemp(prefix="shardledger-patroni-doc-"))
    root.chmod(0o755)
    try:
        with network(tmp_path) as net:
            hosts = {name: net.host(name) for name in HOSTS}
            net.host("load")
            every = {
                **{f"ETCD{i}": hosts[f"etcd{i}"].ip for i in (1, 2, 3)},
                **{f"PG{i}": hosts[f"pg{i}"].ip for i in (1, 2, 3)},
                **{
                    name: secrets.token_hex(12)
                    for name in (
                        "PG_SUPERUSER_PASSWORD",
                        "PG_REPLICATION_PASSWORD",
                        "LEDGER_OWNER_PASSWORD",
                        "LEDGER_APP_PASSWORD",
                    )
                },
                # shardledger and psql as installed beside this interpreter and the system's.
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            }
            env = {}
            for name, host in hosts.items():
                mine = root / name
                env[name] = every | {
                    "NAME": name,
                    "IP": host.ip,
                    "PATRONI_DIR": str(mine / "patroni"),
                    "PGDATA_DIR": str(mine / "data"),
                    "ETCD_DATA": str(mine / "etcd"),
                    "LOG_DIR": str(mine / "log"),
                    "LEDGER_DIR": str(mine / "ledger"),
                }
            yield Machines(net, root, env)
    finally:
        for log in root.glob("*/log/*.log"):
            shutil.copy(log, tmp_path / f"{log.parent.parent.name}-{log.name}")
        shutil.rmtree(root, ignore_errors=True)


def members(machines: Machines) -> list[dict[str, Any]]:
    """Returns `patronictl list` as JSON, asked on pg1."""
    env = machines.env["pg1"]
    done = machines.net.hosts["pg1"].run(
        ["patronictl", "-c", f"{env['PATRONI_DIR']}/config.yml", "list", "-f", "json"],
        timeout_s=30,
    )
    return list(json.loads(done.stdout or "[]")) if done.returncode == 0 else []


def leader(machines: Machines) -> str | None:
    """Returns the member that leads and runs, or None."""
    for member in members(machines):
        if member.get("Role") == "Leader" and member.get("State") == "running":
            return str(member["Member"])
    return None


def settled(machines: Machines) -> bool:
    """Returns whether a leader runs with a synchronous and a second streaming standby."""
    found = members(machines)
    roles = sorted(str(m.get("Role")) for m in found)
    states = {str(m.get("State")) for m in found}
    return (
        roles == ["Leader", "Replica", "Sync Standby"]
        and states <= {"running", "streaming"}
        and len({m.get("TL") for m in found}) == 1
    )


@pytest.mark.patroni
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_patroni_steps_build_a_cluster_that_switches_over_under_load(
    machines: Machines,
) -> None:
    text = DEPLOYMENT.read_text(encoding="utf-8")
    for line, _ in (WATCHDOG, SOCKETS, SERVE_TLS):
        assert line in text, f"docs/deployment.md no longer says {line!r}: update this test"
    bin_dir = pg.find_bin_dir()
    assert bin_dir is not None
    assert f"bin_dir: {bin_dir}\n" in text, f"the page's bin_dir is not {bin_dir}"
    _, steps = section_blocks()
    *build, switchover = steps
    assert "switchover" in switchover.block.body
    for step in build:
        for host in step.hosts:
            if step.block.expected is None:
                machines.run(step, host)
                continue
            expected = step.block.expected
            wait_for(
                f"{step.block.where()} on {host} to print {expected!r}",
                lambda: not missing_lines(expected, machines.run(step, host)),  # noqa: B023
                timeout_s=240,
                every_s=2.0,
            )
    wait_for("the cluster to settle", lambda: settled(machines), timeout_s=120, every_s=1.0)

    # Jobs append through both replicas while the switchover runs.
    net, workdir = machines.net, machines.root
    targets = [f"{net.hosts[h].ip}:{LEDGER_PORT}" for h in ("ledger1", "ledger2")]
    out, stop = workdir / "load.jsonl", workdir / "load.stop"
    nodes = ",".join(f"{h}={net.hosts[h].ip}:{REST_PORT}" for h in ("pg1", "pg2", "pg3"))
    load: Host = net.hosts["load"]
    proc = load.popen(
        [sys.executable, str(HELPERS / "patroni_load.py"), str(out), str(stop), *targets],
        log=workdir / "load.log",
        env={"PATRONI_NODES": nodes},
    )

    def lines() -> list[dict[str, Any]]:
        if not out.exists():
            return []
        text = out.read_text()
        return [json.loads(t) for t in text[: text.rfind("\n") + 1].splitlines() if t.strip()]

    def acked_through_each(after: float) -> bool:
        acks = [t for t in lines() if t["kind"] == "ack" and t["t"] > after]
        return all(sum(1 for a in acks if a["target"] == t) >= 20 for t in targets)

    try:
        wait_for(
            "acknowledgements through both replicas", lambda: acked_through_each(0.0), timeout_s=120
        )
        old = leader(machines)
        assert old is not None
        switched_at = time.time()
        for host in switchover.hosts:
            machines.run(switchover, host)
        wait_for(
            "another member to lead",
            lambda: leader(machines) not in (None, old),
            timeout_s=120,
            every_s=1.0,
        )
        wait_for(
            "acknowledgements through both replicas after the switchover",
            lambda: acked_through_each(switched_at),
            timeout_s=120,
        )
        wait_for(
            f"{old} to stream from the new leader",
            lambda: settled(machines),
            timeout_s=180,
            every_s=1.0,
        )
    finally:
        stop.touch()
        proc.wait(timeout=240)
    got = lines()
    assert [t for t in got if t["kind"] == "gave_up"] == []
    assert got and got[-1]["kind"] == "stopped", f"the load died: {workdir / 'load.log'}"
    now = leader(machines)
    assert now is not None and now != old
    env = machines.env[now]
    admin = (
        f"postgresql://postgres:{env['PG_SUPERUSER_PASSWORD']}@/ledger"
        f"?host={env['PATRONI_DIR']}&port=5432"
    )
    assert_ledger_holds_exactly(admin, acknowledged(got), suite="patroni_doc", kills=1)
