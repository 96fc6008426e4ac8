"""PostgreSQL fails over by itself under Patroni and etcd, and the ledger keeps every acknowledgement.

The topology of docs/deployment.md ("High availability with Patroni"), each member a host
of its own on a private switch (tests/netns.py, tests/patroni.py): three etcd members,
three Patroni nodes (a primary, a synchronous standby, a second standby;
``synchronous_mode_strict``), two ledger replicas whose URL lists the three nodes with
``target_session_attrs=read-write``, and a load host that appends through both replicas
without pause, resending a refused batch with its event ids to the other
(tests/helpers/patroni_load.py). Nobody runs ``pg_ctl promote``: each fault is only the
fault, and Patroni decides.

Each fault is held to what the clients saw acknowledged: every acknowledged event is on
the leader at the end, once, at the sequence it was acknowledged with, and nothing else is
(0 lost, moved, duplicated); every refusal is UNAVAILABLE with a RetryInfo, never a
DEADLINE_EXCEEDED; each replica acknowledges again within ACK_BOUND_S of the new leader
taking writes. The figures of each round (time to a new leader, to the first
acknowledgement, acknowledged meanwhile) go to the campaign report
(``python -m tools.campaign --suites patroni``) and docs/operations.md.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pytest

from tests import campaign
from tests.netns import HELPERS, Host, Ledgerd, Network, network, wait_for
from tests.patroni import REST_PORT, TTL_S, PatroniCluster, skip_reason
from tests.server.test_replicas import assert_ledger_holds_exactly

ROUNDS: Final = campaign.patroni_rounds(1)
# A round takes about a minute on the loaded two-core machine, up to 4 when the former
# primary is slow to rejoin; the first test also starts the cluster. The suite's 300 s
# would end a campaign's test.
pytestmark = [
    pytest.mark.patroni,
    pytest.mark.slow,
    pytest.mark.timeout(240 + 480 * max(3, ROUNDS)),
]
# A replica acknowledges again within this many seconds of the new leader taking writes
# (promoted, and a synchronous standby streaming from it; docs/operations.md, "Failover
# under Patroni"): its probe retries every 0.25 s, and a connect attempt to a host that
# never answers takes up to 2 s per host listed first.
ACK_BOUND_S: Final = 10.0
# Leader roles as Patroni 3.0's REST API names them.
LEADER_ROLES: Final = ("master", "primary")


@dataclass
class Topology:
    """The running cluster, its two ledger replicas, and the host that drives the load."""

    net: Network
    cluster: PatroniCluster
    ledgers: list[Ledgerd]
    load_host: Host
    dbname: str
    workdir: Path
    # What every load so far saw acknowledged: the tests share the ledger's database.
    acked: dict[str, int] = field(default_factory=dict)


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    """Starts etcd, Patroni and two ledger replicas on one database (about 40 s)."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("patroni")
    cluster: PatroniCluster | None = None
    try:
        with network(workdir) as net:
            cluster = PatroniCluster(net)
            cluster.start()
            dbname = cluster.create_database()
            ledgers = [
                Ledgerd(net.host(f"ledger{i}"), cluster.ledger_url(dbname), workdir, name=f"l{i}")
                for i in (1, 2)
            ]
            for ledger in ledgers:
                ledger.start(key=workdir / "signing-key.pem")
            yield Topology(net, cluster, ledgers, net.host("load"), dbname, workdir)
    finally:
        # Once the network has killed every process: a running PostgreSQL or etcd would
        # write into the files being removed, and leave them.
        if cluster is not None:
            cluster.close()


class LoadRun:
    """patroni_load.py on the load host for the length of a with block; its JSON lines after."""

    def __init__(self, topo: Topology, name: str) -> None:
        self.out = topo.workdir / f"load-{name}.jsonl"
        self.stop = topo.workdir / f"load-{name}.stop"
        nodes = ",".join(f"{n.name}={n.host.ip}:{REST_PORT}" for n in topo.cluster.nodes.values())
        self.proc = topo.load_host.popen(
            [
                *(sys.executable, str(HELPERS / "patroni_load.py")),
                *(str(self.out), str(self.stop), *(ledger.target for ledger in topo.ledgers)),
            ],
            log=topo.workdir / f"load-{name}.log",
            env={"PATRONI_NODES": nodes},
        )
        self.targets = [ledger.target for ledger in topo.ledgers]
        self.acked = topo.acked
        self._lines: list[dict[str, Any]] = []
        self._read = 0

    def lines(self) -> list[dict[str, Any]]:
        """Returns what the load logged so far (read on from where the last call stopped)."""
        if self.out.exists():
            with open(self.out, "rb") as log:
                log.seek(self._read)
                chunk = log.read()
            whole = chunk[: chunk.rfind(b"\n") + 1]  # a line being written waits for its end
            self._read += len(whole)
            self._lines += [json.loads(line) for line in whole.splitlines() if line.strip()]
        return self._lines

    def acks_after(self, at: float, target: str | None = None) -> list[dict[str, Any]]:
        """Returns the acknowledgements logged after wall time at (through target, if given)."""
        return [
            line
            for line in self.lines()
            if line["kind"] == "ack" and line["t"] > at and target in (None, line["target"])
        ]

    def wait_acks(self, count: int, *, after: float = 0.0, timeout_s: float = 60) -> None:
        """Waits until every replica has acknowledged count batches since after."""
        wait_for(
            f"{count} acknowledgements through each replica",
            lambda: all(len(self.acks_after(after, t)) >= count for t in self.targets),
            timeout_s=timeout_s,
        )

    def finish(self) -> list[dict[str, Any]]:
        """Stops the load (each batch in hand is resent until acknowledged); returns its lines.

        What it saw acknowledged joins the topology's record even when the test failed,
        so that the next test on the same ledger holds it to everything acknowledged.
        """
        self.stop.touch()
        self.proc.wait(timeout=240)
        lines = self.lines()
        for event_id, seq in acknowledged(lines).items():
            assert self.acked.setdefault(event_id, seq) == seq, f"{event_id} moved"
        assert [line for line in lines if line["kind"] == "gave_up"] == []
        assert lines and lines[-1]["kind"] == "stopped", f"the load died: {self.out}"
        return lines


def acknowledged(lines: list[dict[str, Any]]) -> dict[str, int]:
    """Returns every acknowledged event id with its sequence; asserts each was answered one way."""
    acked: dict[str, int] = {}
    for line in lines:
        if line["kind"] == "ack":
            for event_id, seq in line["events"]:
                assert acked.setdefault(event_id, seq) == seq, f"{event_id} moved"
    return acked


def promoted_at(lines: list[dict[str, Any]], old: str, after: float) -> tuple[str, float] | None:
    """Returns the member that became leader after wall time after, and when it answered so."""
    for line in lines:
        if (
            line["kind"] == "role"
            and line["t"] > after
            and line["node"] != old
            and line["role"] in LEADER_ROLES
            and line["state"] == "running"
        ):
            return str(line["node"]), float(line["t"])
    return None


def figures(
    lines: list[dict[str, Any]], targets: list[str], *, fault_at: float, old: str
) -> dict[str, Any]:
    """Returns what the clients saw of one fault: time to a new leader, to the acks after it."""
    found = promoted_at(lines, old, fault_at)
    assert found is not None, "no new leader was reported"
    leader, promoted = found
    # Strict synchronous mode: the new leader takes writes once a standby streams from it
    # as synchronous; the replicas' bound counts from then.
    at = min(
        (
            float(line["t"])
            for line in lines
            if line["kind"] == "role"
            and line["t"] >= promoted
            and line["node"] == leader
            and line["role"] in LEADER_ROLES
            and line.get("sync", 0) >= 1
        ),
        default=promoted,
    )
    first_ack = {
        target: min(
            (
                line["t"]
                for line in lines
                if line["kind"] == "ack" and line["t"] > at and line["target"] == target
            ),
            default=float("inf"),
        )
        - at
        for target in targets
    }
    refused = [line for line in lines if line["kind"] == "refused" and line["t"] > fault_at]
    return {
        "old_leader": old,
        "new_leader": leader,
        "new_leader_s": round(promoted - fault_at, 2),
        "writable_s": round(at - fault_at, 2),
        "first_ack_s": {t: round(s, 2) for t, s in first_ack.items()},
        "acked_between_fault_and_leader": sum(
            len(line["events"])
            for line in lines
            if line["kind"] == "ack" and fault_at < line["t"] < promoted
        ),
        "refused": len(refused),
        "refused_codes": sorted({f"{r['code']}/{r['reason']}" for r in refused}),
        "refused_without_retry_info": sum(
            1 for r in refused if r["code"] == "UNAVAILABLE" and not r["retry_info"]
        ),
        "deadline_exceeded": sum(1 for r in refused if r["code"] == "DEADLINE_EXCEEDED"),
        "not_serving_seen": sorted(
            {
                line["target"]
                for line in lines
                if line["kind"] == "health" and line["t"] > fault_at and line["status"] != "SERVING"
            }
        ),
    }


def hold_to_acknowledged(
    topo: Topology, suite: str, lines: list[dict[str, Any]], rounds: list[dict[str, Any]]
) -> None:
    """Asserts the leader holds every acknowledged event once at its sequence, and nothing else."""
    wait_settled(topo)  # read from a leader that stays one
    leader = topo.cluster.leader()
    assert leader is not None
    assert acknowledged(lines).items() <= topo.acked.items()  # LoadRun.finish joined them
    assert_ledger_holds_exactly(
        topo.cluster.nodes[leader].admin_url(topo.dbname),
        topo.acked,
        suite=suite,
        kills=len(rounds),
        rounds=rounds,
        deadline_exceeded=sum(r["deadline_exceeded"] for r in rounds),
        over_bound=sum(1 for r in rounds for s in r["first_ack_s"].values() if s > ACK_BOUND_S),
        bound_s=ACK_BOUND_S,
    )


def assert_round(figures_: dict[str, Any]) -> None:
    """Holds one round's figures to the documented bounds."""
    assert figures_["deadline_exceeded"] == 0, figures_
    assert figures_["refused_without_retry_info"] == 0, figures_
    assert all(s <= ACK_BOUND_S for s in figures_["first_ack_s"].values()), figures_


def wait_rejoined(topo: Topology, old: str, log_from: int) -> str:
    """Waits until the old leader runs again as a standby and the cluster has its sync standby.

    Healthy three times in a row, 1 s apart, every member on the leader's timeline: a
    demoted primary answers "running" for a moment before Patroni stops it to rewind,
    and a next fault meanwhile would leave the new leader no standby at all (strict mode:
    nothing commits; see docs/deployment.md). Returns how the node came back (rewind or
    restart); a node rebuilt from a base backup fails the test at once (its log from
    log_from says so): the rewind failed, and the cluster ran on one standby for minutes.
    """
    node = topo.cluster.nodes[old]

    def not_rebuilt() -> None:
        assert node.rejoined_by(log_from) != "rebuild", (
            f"{old} was rebuilt from a base backup, not rewound: {node.log}"
        )

    wait_settled(topo, f"{old} to rejoin as a standby", check=not_rebuilt)
    roles = {m["Member"]: m["Role"] for m in topo.cluster.members()}
    assert roles[old] in ("Replica", "Sync Standby"), roles
    return node.rejoined_by(log_from)


def wait_settled(
    topo: Topology, what: str = "the cluster to settle", *, check: Callable[[], None] = lambda: None
) -> None:
    """Waits until a leader runs with a synchronous and a second streaming standby.

    Three times in a row, 1 s apart, every member on one timeline (check() runs before
    each look): what the next fault, or the check of the ledger on the leader, starts from.
    """
    streak = [0]

    def settled() -> bool:
        check()
        members = topo.cluster.members()
        timelines = {m.get("TL") for m in members}
        ok = topo.cluster.healthy(members) and len(timelines) == 1
        streak[0] = streak[0] + 1 if ok else 0
        return streak[0] >= 3

    wait_for(what, settled, timeout_s=180, every_s=1.0)


def test_sigkill_of_the_primary_postmaster_fails_over_rewinds_and_leads_again(
    topology: Topology,
) -> None:
    topo = topology
    load = LoadRun(topo, "sigkill")
    led: list[str] = []
    rounds: list[dict[str, Any]] = []
    try:
        load.wait_acks(20)
        # By the third round a rewound former primary leads again.
        for _ in range(max(3, ROUNDS)):
            old = topo.cluster.leader()
            assert old is not None
            led.append(old)
            pid = topo.cluster.nodes[old].postmaster_pid()
            assert pid is not None
            log_from = topo.cluster.nodes[old].log_size()
            fault_at = time.time()
            os.kill(pid, signal.SIGKILL)
            wait_for(
                "a new leader",
                lambda: promoted_at(load.lines(), old, fault_at),  # noqa: B023
                timeout_s=60,
                every_s=0.1,
            )
            load.wait_acks(20, after=fault_at)
            rejoined_by = wait_rejoined(topo, old, log_from)
            got = figures(load.lines(), load.targets, fault_at=fault_at, old=old)
            rounds.append({"fault": "sigkill_postmaster", "rejoined_by": rejoined_by, **got})
            assert_round(got)
        led.append(str(topo.cluster.leader()))
    finally:
        lines = load.finish()
    hold_to_acknowledged(topo, "patroni_sigkill", lines, rounds)
    # A former primary, rewound onto the new timeline, was promoted again.
    assert len(set(led)) < len(led), led


def test_switchover_under_load_loses_nothing(topology: Topology) -> None:
    topo = topology
    load = LoadRun(topo, "switchover")
    rounds: list[dict[str, Any]] = []
    try:
        load.wait_acks(20)
        for _ in range(ROUNDS):
            members = topo.cluster.members()
            old = next(m["Member"] for m in members if m["Role"] == "Leader")
            sync = next(m["Member"] for m in members if m["Role"] == "Sync Standby")
            log_from = topo.cluster.nodes[old].log_size()
            fault_at = time.time()
            topo.cluster.patronictl(
                "switchover", "--leader", old, "--candidate", sync, "--force", timeout_s=120
            )
            wait_for(
                "the candidate to lead",
                lambda: promoted_at(load.lines(), old, fault_at),  # noqa: B023
                timeout_s=60,
                every_s=0.1,
            )
            load.wait_acks(20, after=fault_at)
            rejoined_by = wait_rejoined(topo, old, log_from)
            got = figures(load.lines(), load.targets, fault_at=fault_at, old=old)
            rounds.append({"fault": "switchover", "rejoined_by": rejoined_by, **got})
            assert got["new_leader"] == sync
            assert_round(got)
    finally:
        lines = load.finish()
    hold_to_acknowledged(topo, "patroni_switchover", lines, rounds)


def test_primary_cut_off_from_etcd_and_standbys_stops_acknowledging_and_rejoins(
    topology: Topology,
) -> None:
    topo = topology
    net, cluster = topo.net, topo.cluster
    load = LoadRun(topo, "partition")
    rounds: list[dict[str, Any]] = []
    try:
        load.wait_acks(20)
        for _ in range(ROUNDS):
            old = cluster.leader()
            assert old is not None
            primary = cluster.nodes[old].host
            # Cut from etcd, from the other nodes and from the second replica; the first
            # replica still reaches it (and everything else).
            cut = [
                *cluster.etcd_hosts,
                *(n.host for n in cluster.nodes.values() if n.name != old),
                topo.ledgers[1].host,
            ]
            log_from = cluster.nodes[old].log_size()
            fault_at = time.time()
            for other in cut:
                net.partition(primary, other)
            # A COMMIT confirmed by the standby just before the cut may be answered just after.
            cut_done = time.time() + 0.5
            try:
                wait_for(
                    "a new leader beside the cut-off one",
                    lambda: promoted_at(load.lines(), old, fault_at),  # noqa: B023
                    timeout_s=90,
                    every_s=0.1,
                )
                load.wait_acks(20, after=fault_at)
            finally:
                for other in cut:
                    net.heal(primary, other)
            rejoined_by = wait_rejoined(topo, old, log_from)
            got = figures(load.lines(), load.targets, fault_at=fault_at, old=old)
            got["rejoined_by"] = rejoined_by
            # What the replica that still reached the old primary acknowledged after the cut:
            # each of those is checked below with every other acknowledgement.
            got["acked_through_reaching_replica_after_cut"] = sum(
                len(line["events"]) for line in load.acks_after(fault_at, topo.ledgers[0].target)
            )
            # Nothing commits on a primary whose synchronous standby is cut off.
            leader_at = fault_at + got["new_leader_s"]
            got["acked_after_cut_before_leader"] = sum(
                len(line["events"]) for line in load.acks_after(cut_done) if line["t"] < leader_at
            )
            rounds.append({"fault": "partition_primary", **got})
            assert_round(got)
            assert got["acked_after_cut_before_leader"] == 0, got
    finally:
        lines = load.finish()
    hold_to_acknowledged(topo, "patroni_partition", lines, rounds)


def steady_figures(
    lines: list[dict[str, Any]],
    targets: list[str],
    *,
    fault_at: float,
    healed_at: float,
    settled_at: float | None = None,
) -> dict[str, Any]:
    """Returns what the clients saw of a fault that keeps the leader: acks during, the longest gap.

    stopped_members counts until settled_at (the cluster settled after the heal), if given.
    """
    acks = sorted(line["t"] for line in lines if line["kind"] == "ack" and line["t"] > fault_at)
    gaps = [b - a for a, b in zip([fault_at, *acks], acks, strict=False)]
    refused = [line for line in lines if line["kind"] == "refused" and line["t"] > fault_at]
    return {
        # Members that stopped PostgreSQL meanwhile (a demoted leader says so before it stops).
        "stopped_members": sorted(
            {
                line["node"]
                for line in lines
                if line["kind"] == "role"
                and fault_at < line["t"] < (settled_at or healed_at)
                and line["state"] == "stopping"
            }
        ),
        "acked_during_fault": sum(
            len(line["events"])
            for line in lines
            if line["kind"] == "ack" and fault_at < line["t"] < healed_at
        ),
        "longest_ack_gap_s": round(max(gaps, default=0.0), 2),
        "first_ack_s": {
            t: round(
                min(
                    (
                        line["t"]
                        for line in lines
                        if line["kind"] == "ack" and line["t"] > fault_at and line["target"] == t
                    ),
                    default=float("inf"),
                )
                - fault_at,
                2,
            )
            for t in targets
        },
        "refused": len(refused),
        "refused_codes": sorted({f"{r['code']}/{r['reason']}" for r in refused}),
        "refused_without_retry_info": sum(
            1 for r in refused if r["code"] == "UNAVAILABLE" and not r["retry_info"]
        ),
        "deadline_exceeded": sum(1 for r in refused if r["code"] == "DEADLINE_EXCEEDED"),
    }


def test_partitioned_etcd_member_keeps_the_leader_and_appends_go_on(topology: Topology) -> None:
    topo = topology
    net, cluster = topo.net, topo.cluster
    load = LoadRun(topo, "etcd")
    rounds: list[dict[str, Any]] = []
    try:
        load.wait_acks(20)
        for index in range(ROUNDS):
            leader = cluster.leader()
            member = cluster.etcd_hosts[index % len(cluster.etcd_hosts)]
            others = [h for h in topo.net.hosts.values() if h is not member]
            fault_at = time.time()
            for other in others:
                net.partition(member, other)
            try:
                # A whole ttl of leader-lock renewals with one member cut off.
                load.wait_acks(20, after=fault_at)
                time.sleep(TTL_S)
            finally:
                for other in others:
                    net.heal(member, other)
            healed_at = time.time()
            wait_settled(topo)
            got = steady_figures(
                load.lines(),
                load.targets,
                fault_at=fault_at,
                healed_at=healed_at,
                settled_at=time.time(),
            )
            rounds.append({"fault": "partition_etcd_member", "member": member.name, **got})
            assert cluster.leader() == leader, "a minority etcd member moved the leader"
            # Appends go on. Patroni 3.0's etcd client may still miss one lock update while
            # it moves off the silent member, and the leader then demotes itself and takes
            # the lock back (stopped_members; seen in 1 of 5 rounds on a loaded machine):
            # refused meanwhile, never hung, nothing lost (docs/operations.md).
            assert got["acked_during_fault"] > 0, got
            assert got["deadline_exceeded"] == 0, got
            assert got["refused_without_retry_info"] == 0, got
            assert got["longest_ack_gap_s"] <= ACK_BOUND_S, got
    finally:
        lines = load.finish()
    hold_to_acknowledged(topo, "patroni_etcd", lines, rounds)


def test_synchronous_standby_killed_under_load_blocks_briefly_and_loses_nothing(
    topology: Topology,
) -> None:
    topo = topology
    cluster = topo.cluster
    load = LoadRun(topo, "standby")
    rounds: list[dict[str, Any]] = []
    try:
        load.wait_acks(20)
        for _ in range(ROUNDS):
            members = cluster.members()
            leader = next(m["Member"] for m in members if m["Role"] == "Leader")
            sync = next(m["Member"] for m in members if m["Role"] == "Sync Standby")
            pid = cluster.nodes[sync].postmaster_pid()
            assert pid is not None
            log_from = cluster.nodes[sync].log_size()
            fault_at = time.time()
            os.kill(pid, signal.SIGKILL)
            # The other standby becomes synchronous (or this one restarts): appends go on.
            load.wait_acks(20, after=fault_at)
            rejoined_by = wait_rejoined(topo, sync, log_from)
            got = steady_figures(
                load.lines(), load.targets, fault_at=fault_at, healed_at=time.time()
            )
            rounds.append(
                {
                    "fault": "sigkill_sync_standby",
                    "standby": sync,
                    "rejoined_by": rejoined_by,
                    **got,
                }
            )
            assert cluster.leader() == leader, "a standby's crash moved the leader"
            assert got["deadline_exceeded"] == 0, got
            assert got["refused_without_retry_info"] == 0, got
            assert all(s <= ACK_BOUND_S for s in got["first_ack_s"].values()), got
    finally:
        lines = load.finish()
    hold_to_acknowledged(topo, "patroni_standby", lines, rounds)
