"""Faults between hosts: partitions, slow and lossy links, skewed clocks, in network namespaces.

Each test builds its own machines (tests/netns.py): a ledger host running the real
`shardledger serve`, job hosts running real SDK jobs (tests/helpers/netns_job.py),
an operator's host whose observer (tests/helpers/netns_observer.py) reads the ledger
for the test, and for the PostgreSQL cases database hosts. Every case states its
expectation first, then holds the ledger to it against what the jobs recorded as
acknowledged: nothing acknowledged lost, nothing counted twice, the figures of a
clean night. The measured figures per fault (acknowledged, lost, duplicated, time
to recover) go to the campaign's report directory (tests/campaign.py) and are the
ones docs/operations.md ("Faults between hosts") quotes.

What this machine was found to allow, and what the suite therefore uses: `ip netns`
as root, veth pairs and a bridge inside a namespace of its own, nftables inside a
namespace (Debian's `nftables`), `tc qdisc ... tbf` (there is no `netem` qdisc in
this kernel: slow and lossy links are a userspace proxy), libfaketime preloaded into
one Python process (Debian's `libfaketime`; ``FAKETIME=+10m`` shifts time.time() by
600 s, gRPC works under it), and `unshare --uts` for a host name per machine.
`python -m tools.campaign --suites netns --netns-repeat 10` runs the suite ten times.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest

from tests import campaign, netns
from tests.netns import Host, Ledgerd, Network, Observer, wait_for

pytestmark = pytest.mark.netns

# Heartbeat timeout and interval of every job: short, so a partition outlasts the
# timeout within seconds.
TIMEOUT_S: Final = 2.0
INTERVAL_S: Final = 0.5
# What a loaded two-core machine may add to a bound the product promises.
ALLOWANCE_S: Final = 8.0
# Figures of a summary that depend on when it was read or on how many heartbeats
# arrived, never on what the night did.
TIME_FIGURES: Final = ("as_of_us", "event_count", "head_hash", "lifecycle")


@pytest.fixture
def net(tmp_path: Path) -> Iterator[Network]:
    """A private network for one test, torn down (processes, namespaces) whatever happens."""
    with netns.network(tmp_path) as network:
        yield network


@dataclass
class Job:
    """One SDK job process on a job host, and where it leaves its truth."""

    host: Host
    proc: subprocess.Popen[bytes]
    truth: Path
    gate: Path
    log: Path

    def reached(self, shard: str) -> float:
        """Waits until the job holds inside shard; returns when it got there (its clock)."""
        path = self.gate / f"{shard}.reached"
        wait_for(
            f"{self.host.name} to hold in {shard}",
            lambda: path.exists() or self._alive(),
            timeout_s=60,
        )
        return float(path.read_text())

    def go(self, shard: str) -> None:
        """Lets the job go on past its hold in shard."""
        (self.gate / f"{shard}.go").touch()

    def _alive(self) -> bool:
        code = self.proc.poll()
        if code is not None:
            raise AssertionError(
                f"job on {self.host.name} exited {code}: {self.log.read_text()[-3000:]}"
            )
        return False

    def result(self, timeout_s: float = 120) -> dict[str, Any]:
        """Waits for the job to end; returns its truth (what it emitted, what was acknowledged)."""
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"job on {self.host.name} still running after {timeout_s} s: {self.log.read_text()[-3000:]}"
            ) from None
        truth: dict[str, Any] = json.loads(self.truth.read_text())
        assert code == 0 and not truth["error"], (
            f"job on {self.host.name}: {truth['error']} {self.log.read_text()[-3000:]}"
        )
        return truth


def start_job(
    host: Host,
    target: str,
    run: str,
    shards: list[str],
    workdir: Path,
    *,
    hold: tuple[str, ...] = (),
    faketime: str = "",
    steps: int = 3,
    env: dict[str, str] | None = None,
) -> Job:
    """Starts netns_job.py on host for the shards of run."""
    name = f"{host.name}-{run}"
    gate = workdir / "gates" / name
    gate.mkdir(parents=True, exist_ok=True)
    truth = workdir / f"truth-{name}.json"
    log = workdir / f"job-{name}.log"
    argv = [
        *(sys.executable, str(netns.HELPERS / "netns_job.py"), "--target", target),
        *("--run", run, "--shards", ",".join(shards), "--out", str(workdir / "out")),
        *("--truth", str(truth), "--spool", str(workdir / "spool" / name)),
        *("--gate-dir", str(gate), "--timeout", str(TIMEOUT_S), "--interval", str(INTERVAL_S)),
        *("--steps", str(steps)),
    ]
    for shard in hold:
        argv += ["--hold", shard]
    proc = host.popen(argv, log=log, faketime=faketime, env=env)
    return Job(host, proc, truth, gate, log)


def shard_state(observer: Observer, target: str, run: str, shard: str) -> str:
    """Returns the shard's state as the ledger shows it now ("" when the ledger did not answer)."""
    views = observer.try_call("shards", target=target, run=run)
    if views is None:
        return ""
    return next((v["state"] for v in views if v["shard_id"] == shard), "")


def wait_state(
    observer: Observer, target: str, run: str, shard: str, state: str, timeout_s: float
) -> float:
    """Waits until the ledger shows the shard in state; returns the seconds it took."""
    began = time.monotonic()
    wait_for(
        f"shard {shard} of {run} to be {state}",
        lambda: shard_state(observer, target, run, shard) == state,
        timeout_s=timeout_s,
    )
    return time.monotonic() - began


def tally(truths: list[dict[str, Any]], stored: list[dict[str, Any]]) -> dict[str, int]:
    """Compares what the jobs saw acknowledged with the ledger's rows.

    lost: acknowledged, not stored; moved: stored at another sequence than acknowledged;
    duplicated: an event id stored twice, or a shard with more than one commit or attempt
    (counted twice); pending: emitted, never acknowledged (still spooled when the job ended).
    """
    rows = {e["event_id"]: e for e in stored}
    emitted = [e for t in truths for e in t["events"]]
    acked = [e for e in emitted if e["acknowledged"]]
    commits = Counter(e["shard_id"] for e in stored if e["kind"] == "artifact_committed")
    attempts = Counter(e["shard_id"] for e in stored if e["kind"] == "started")
    return {
        "acknowledged": len(acked),
        "lost": sum(1 for e in acked if e["event_id"] not in rows),
        "moved": sum(
            1
            for e in acked
            if e["event_id"] in rows and rows[e["event_id"]]["sequence"] != e["sequence"]
        ),
        "duplicated": len(stored)
        - len(rows)
        + sum(n - 1 for n in commits.values())
        + sum(n - 1 for n in attempts.values()),
        "pending": len(emitted) - len(acked),
    }


def figures(summary: dict[str, Any]) -> dict[str, Any]:
    """Returns the summary's figures without those that depend on when it was read."""
    return {k: v for k, v in summary.items() if k not in TIME_FIGURES and k != "run_id"}


def report(name: str, result: dict[str, Any]) -> None:
    """Leaves the case's measured figures for the campaign (and prints them for -s)."""
    campaign.report(f"netns_{name}", result)
    print(f"netns {name}: {json.dumps(result, sort_keys=True)}")


def test_a_partition_longer_than_the_heartbeat_timeout_spools_goes_stale_and_loses_nothing(
    net: Network, tmp_path: Path
) -> None:
    """Job ↔ ledger partition for longer than the heartbeat timeout, then healed.

    Expectation: job1's events wait in its spool while it is cut off (the job keeps
    running); the ledger shows its shard stale once the heartbeat timeout passes on the
    server's clock, and running again once the spool drains after the heal; job2, on
    the other side, never notices. Afterwards every event either job saw acknowledged
    is stored at the sequence it was acknowledged with, none twice, every emitted event
    is acknowledged (nothing left in a spool), every shard has one attempt and one
    commit, and `late_attempts` counts exactly job1's two attempts whose events waited
    in the spool longer than the heartbeat timeout.
    """
    ledger_host, job1_host, job2_host, ops = (
        net.host(n) for n in ("ledger", "job1", "job2", "ops")
    )
    ledger = Ledgerd(ledger_host, str(tmp_path / "ledger.db"), tmp_path)
    ledger.start()
    observer = Observer(ops, tmp_path)
    run = "night"
    shards1, shards2 = ["j1-s0", "j1-s1"], ["j2-s0", "j2-s1", "j2-s2"]
    observer.call("plan", target=ledger.target, run=run, shards=shards1 + shards2)
    job1 = start_job(job1_host, ledger.target, run, shards1, tmp_path, hold=("j1-s0", "j1-s1"))
    job2 = start_job(job2_host, ledger.target, run, shards2, tmp_path, steps=10)

    job1.reached("j1-s0")
    wait_state(observer, ledger.target, run, "j1-s0", "running", timeout_s=30)
    cut = time.monotonic()
    net.partition(job1_host, ledger_host)
    to_stale = wait_state(observer, ledger.target, run, "j1-s0", "stale", TIMEOUT_S + ALLOWANCE_S)
    # Cut off: the commit of j1-s0 and the start of j1-s1 go to job1's spool.
    job1.go("j1-s0")
    job1.reached("j1-s1")
    # Both waited in the spool longer than the heartbeat timeout once this passes.
    wait_for(
        "the spooled events to age past the timeout",
        lambda: time.monotonic() > cut + to_stale + TIMEOUT_S + 0.5,
        timeout_s=30,
    )
    assert shard_state(observer, ledger.target, run, "j1-s0") == "stale"
    healed, healed_at = time.monotonic(), time.time()
    net.heal(job1_host, ledger_host)
    to_running = wait_state(
        observer, ledger.target, run, "j1-s1", "running", TIMEOUT_S + ALLOWANCE_S
    )
    job1.go("j1-s1")
    truths = [job1.result(), job2.result()]

    stored = observer.call("events", target=ledger.target, run=run)
    counts = tally(truths, stored)
    summary = observer.call("summary", target=ledger.target, run=run)
    spooled_acks = [e for e in truths[0]["events"] if (e["acked_at"] or 0) > healed_at]
    result = {
        **counts,
        "partition_s": round(healed - cut, 2),
        "to_stale_s": round(to_stale, 2),
        "recover_s": round(to_running, 2),
        "late_attempts": summary["late_attempts"],
        "job1_events": len(truths[0]["events"]),
        "job1_acked_after_heal": len(spooled_acks),
    }
    report("partition", result)

    assert counts == {**counts, "lost": 0, "moved": 0, "duplicated": 0, "pending": 0}
    assert summary["unverified"] == len(shards1 + shards2)
    assert summary["stale"] == summary["running"] == summary["missing"] == summary["failed"] == 0
    assert summary["attempts"] == len(shards1 + shards2)
    assert summary["late_attempts"] == 2
