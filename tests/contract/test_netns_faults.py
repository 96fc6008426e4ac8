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
one Python process (Debian's `libfaketime`; ``FAKETIME=+600s`` shifts time.time() by
600 s and gRPC works under it, with ``FAKETIME_DONT_FAKE_MONOTONIC=1``: a faked
monotonic clock leaves Python's timed waits waiting the whole offset), and `unshare
--uts` for a host name per machine. The whole module takes about a minute.
`python -m tools.campaign --suites netns --netns-rounds 10` runs each case ten times.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest

from tests import campaign, netns, pg
from tests.netns import (
    Host,
    Ledgerd,
    Network,
    Observer,
    Proxy,
    start_pg,
    start_replicated_pair,
    wait_for,
)

pytestmark = pytest.mark.netns

# Heartbeat timeout and interval of every job: short, so a partition outlasts the
# timeout within seconds.
TIMEOUT_S: Final = 2.0
INTERVAL_S: Final = 0.5
# The heartbeat timeout of jobs that must never look stale or late while alive (a
# loaded two-core machine stalls a process for a second or two now and then).
LIVE_TIMEOUT_S: Final = 10.0
# What a loaded two-core machine may add to a bound the product promises.
ALLOWANCE_S: Final = 8.0
# Figures of a summary that depend on when it was read or on how many heartbeats
# arrived, never on what the night did.
TIME_FIGURES: Final = ("as_of_us", "event_count", "head_hash", "lifecycle")


# How often each case runs: once in CI, more in the campaign (--suites netns).
ROUNDS: Final = campaign.netns_rounds(1)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if ROUNDS > 1 and "round_index" in metafunc.fixturenames:
        metafunc.parametrize("round_index", range(ROUNDS), indirect=True, ids=lambda r: f"round{r}")


@pytest.fixture
def round_index(request: pytest.FixtureRequest) -> int:
    """Which of the campaign's rounds this is (0 in CI)."""
    return int(getattr(request, "param", 0))


@pytest.fixture
def net(tmp_path: Path, round_index: int) -> Iterator[Network]:
    """A private network for one test, torn down (processes, namespaces) whatever happens."""
    with netns.network(tmp_path) as network:
        network.round = round_index
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
    step_s: float = 0.1,
    progress_timeout: float | None = None,
    timeout_s: float = TIMEOUT_S,
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
        *("--gate-dir", str(gate), "--timeout", str(timeout_s), "--interval", str(INTERVAL_S)),
        *("--steps", str(steps), "--step-s", str(step_s)),
    ]
    for shard in hold:
        argv += ["--hold", shard]
    if progress_timeout is not None:
        argv += ["--progress-timeout", str(progress_timeout)]
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


def report(net: Network, name: str, result: dict[str, Any]) -> None:
    """Leaves the case's measured figures for the campaign (and prints them for -s)."""
    campaign.report(f"netns_{name}_{net.round:03d}", {"case": name, "round": net.round, **result})
    print(f"netns {name}: {json.dumps(result, sort_keys=True)}")


def test_a_partition_longer_than_the_heartbeat_timeout_spools_goes_stale_and_loses_nothing(
    net: Network, tmp_path: Path
) -> None:
    """Job ↔ ledger partition for longer than the heartbeat timeout, then healed.

    Expectation: job1's events wait in its spool while it is cut off (the job keeps
    running); the ledger shows its shard stale once the heartbeat timeout passes on the
    server's clock, and running again once the spool drains after the heal; job2, on
    the other side, never notices (none of its attempts is late). Afterwards every
    event either job saw acknowledged is stored at the sequence it was acknowledged
    with, none twice, every emitted event is acknowledged (nothing left in a spool),
    every shard has one attempt and one commit, and `late_attempts` counts exactly
    job1's two attempts whose events waited in the spool longer than the heartbeat
    timeout.
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
    # The stale shard is back: its commit, made while cut off, drained with the spool.
    assert shard_state(observer, ledger.target, run, "j1-s0") == "unverified"
    job1.go("j1-s1")
    truths = [job1.result(), job2.result()]
    views = observer.call("shards", target=ledger.target, run=run)
    late = {v["shard_id"]: [a["late"] for a in v["attempt_history"]] for v in views}

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
        "job2_longest_ack_gap_s": round(longest_ack_gap(truths[1]), 2),
    }
    report(net, "partition", result)

    assert counts == {**counts, "lost": 0, "moved": 0, "duplicated": 0, "pending": 0}
    assert summary["unverified"] == len(shards1 + shards2)
    assert summary["stale"] == summary["running"] == summary["missing"] == summary["failed"] == 0
    assert summary["attempts"] == len(shards1 + shards2)
    assert summary["late_attempts"] == 2
    assert late == {"j1-s0": [True], "j1-s1": [True], **{s: [False] for s in shards2}}


# A link a night may meet: 40-80 ms each way, one chunk in 20 held 0.5 s more (a burst of
# retransmissions), every 20th chunk lost with its connection (a reset both ways; a
# job's night is some 40 chunks each way at least).
LOSSY_LINK: Final = (
    *("--delay-ms", "40", "--jitter-ms", "40", "--stall-prob", "0.05", "--stall-ms", "500"),
    *("--reset-every", "20"),
)
NIGHT_SHARDS: Final = 4  # per job host


def test_a_night_over_a_slow_lossy_link_has_the_figures_of_a_clean_night(
    net: Network, tmp_path: Path
) -> None:
    """A whole night of shards over a slow, lossy link (delays, stalls, connection resets).

    Expectation: the same night run at the same time over the clean link and over a
    link that delays every segment 40-80 ms, stalls some 0.5 s, caps the bandwidth at
    512 kbit/s (tbf) and resets a connection every 20 chunks ends with the same figures:
    every shard committed once with the same digest, nothing late, stale or failed;
    every event either job saw acknowledged is stored once at its sequence, and nothing
    is left in a spool. The resets are real: the link reports them. The jobs' heartbeat
    timeout is 10 s here: with 2 s, a reset, its reconnect and a stall on a loaded
    machine delayed a commit 2.4 s once in ten nights, which is late by definition.
    """
    ledger_host, job1, job2, wan, ops = (
        net.host(n) for n in ("ledger", "job1", "job2", "wan", "ops")
    )
    ledger = Ledgerd(ledger_host, str(tmp_path / "ledger.db"), tmp_path)
    ledger.start()
    observer = Observer(ops, tmp_path)
    net.limit_rate(wan, "512kbit")
    links = [Proxy(wan, 7000 + i, ledger.target, tmp_path, *LOSSY_LINK, seed=i) for i in (1, 2)]
    shards = {h.name: [f"{h.name}-s{i}" for i in range(NIGHT_SHARDS)] for h in (job1, job2)}
    nights = {"clean": (ledger.target, ledger.target), "lossy": tuple(p.target for p in links)}
    jobs = {}
    for run, targets in nights.items():
        observer.call(
            "plan",
            target=ledger.target,
            run=run,
            shards=[s for names in shards.values() for s in names],
        )
        for host, target in zip((job1, job2), targets, strict=True):
            jobs[run, host.name] = start_job(
                host, target, run, shards[host.name], tmp_path, timeout_s=LIVE_TIMEOUT_S
            )
    truths = {key: job.result() for key, job in jobs.items()}

    result: dict[str, Any] = {"links": [p.stats() for p in links]}
    # The campaign's totals: both nights' counts together.
    summaries, digests = {}, {}
    for run in nights:
        stored = observer.call("events", target=ledger.target, run=run)
        result[run] = tally([t for (r, _), t in truths.items() if r == run], stored)
        summaries[run] = figures(observer.call("summary", target=ledger.target, run=run))
        digests[run] = {e["shard_id"]: e["blake3"] for e in stored if e["blake3"]}
    for key in ("acknowledged", "lost", "moved", "duplicated", "pending"):
        result[key] = sum(result[run][key] for run in nights)
    result["figures_differing"] = {
        k: [summaries["clean"].get(k), v]
        for k, v in summaries["lossy"].items()
        if summaries["clean"].get(k) != v
    }
    report(net, "lossy_link", result)
    for run in nights:
        assert result[run] == {**result[run], "lost": 0, "moved": 0, "duplicated": 0, "pending": 0}
    assert all(s["resets"] >= 1 for s in result["links"]), result["links"]
    assert summaries["lossy"] == summaries["clean"]
    assert summaries["clean"]["unverified"] == 2 * NIGHT_SHARDS
    assert summaries["clean"]["late_attempts"] == 0
    assert digests["lossy"] == digests["clean"]


SKEW_S: Final = 600  # ten minutes, each way
PROGRESS_TIMEOUT_S: Final = 1.0  # the hung job's heartbeats stop this long after its progress


def watch_states(
    observer: Observer, target: str, run: str, shard: str, seen: Counter[str]
) -> dict[str, str]:
    """Returns every shard's state now, counting each state seen for shard."""
    views = observer.try_call("shards", target=target, run=run) or []
    states = {v["shard_id"]: v["state"] for v in views}
    seen[states.get(shard, "")] += 1
    return states


def test_a_skewed_job_clock_changes_no_figure_and_shows_per_attempt(
    net: Network, tmp_path: Path
) -> None:
    """Job hosts whose wall clocks are ten minutes ahead and ten minutes behind (libfaketime).

    Expectation: stale detection and every figure use the ledger's receive time, so a
    live job whose clock is behind is never stale, a job whose clock is ahead goes stale
    within its heartbeat timeout once it hangs (no progress: with progress_timeout its
    heartbeats stop) and is running again when it resumes; no attempt of a clean night
    is late however far off its clock, and
    an attempt of the fast clock whose commit waited in a spool past the heartbeat
    timeout (a partition) is late: `late_attempts` is exactly 1. Each attempt shows
    its skew (`shards`: attempt_history[].clock_skew_us, +600 s and -600 s within 5 s).
    Nothing acknowledged is lost or counted twice.
    """
    ledger_host, ahead, behind, ops = (net.host(n) for n in ("ledger", "ahead", "behind", "ops"))
    ledger = Ledgerd(ledger_host, str(tmp_path / "ledger.db"), tmp_path)
    ledger.start()
    observer = Observer(ops, tmp_path)
    run, target = "skewed", ledger.target
    shards = ["ahead-s0", "ahead-s1", "behind-s0", "behind-s1"]
    observer.call("plan", target=target, run=run, shards=shards)
    fast = start_job(
        ahead,
        target,
        run,
        shards[:2],
        tmp_path,
        hold=("ahead-s0", "ahead-s1"),
        faketime=f"+{SKEW_S}s",
        steps=8,
        step_s=0.2,
        progress_timeout=PROGRESS_TIMEOUT_S,
    )
    # Its timeout is ten seconds: a stall of a loaded machine is no stale shard, and a
    # ledger that judged it by its clock, ten minutes behind, would see it stale anyway.
    slow = start_job(
        behind,
        target,
        run,
        shards[2:],
        tmp_path,
        hold=("behind-s0",),
        faketime=f"-{SKEW_S}s",
        timeout_s=LIVE_TIMEOUT_S,
    )
    fast.reached("ahead-s0")  # its progress stops here, so do its heartbeats
    hung = time.monotonic()
    slow.reached("behind-s0")
    wait_state(observer, target, run, "behind-s0", "running", timeout_s=30)
    behind_seen: Counter[str] = Counter()
    watched_since = time.monotonic()
    wait_for(
        "the hung job's shard to go stale",
        lambda: (
            watch_states(observer, target, run, "behind-s0", behind_seen).get("ahead-s0") == "stale"
        ),
        timeout_s=PROGRESS_TIMEOUT_S + TIMEOUT_S + ALLOWANCE_S,
    )
    to_stale = time.monotonic() - hung
    fast.go("ahead-s0")
    resumed = time.monotonic()
    wait_for(
        "the resumed job's shard to run again",
        lambda: (
            watch_states(observer, target, run, "behind-s0", behind_seen).get("ahead-s0")
            == "running"
        ),
        timeout_s=TIMEOUT_S + ALLOWANCE_S,
    )
    to_running = time.monotonic() - resumed
    # The slow clock's live job, watched for four seconds at least: never stale.
    wait_for(
        "four seconds of watching",
        lambda: (
            watch_states(observer, target, run, "behind-s0", behind_seen)
            and time.monotonic() > watched_since + 2 * TIMEOUT_S
        ),
        timeout_s=30,
    )
    slow.go("behind-s0")
    fast.reached("ahead-s1")
    net.partition(ahead, ledger_host)
    cut = time.monotonic()
    fast.go("ahead-s1")  # its commit waits in the spool while the link is cut
    wait_for(
        "the commit to wait past the timeout",
        lambda: time.monotonic() > cut + TIMEOUT_S + 3.5,
        timeout_s=30,
    )
    net.heal(ahead, ledger_host)
    truths = [fast.result(), slow.result()]

    stored = observer.call("events", target=target, run=run)
    counts = tally(truths, stored)
    summary = observer.call("summary", target=target, run=run)
    views = {v["shard_id"]: v for v in observer.call("shards", target=target, run=run)}
    skews = {
        shard: [a.get("clock_skew_us") for a in view.get("attempt_history", [])]
        for shard, view in views.items()
    }
    late = {
        shard: [a.get("late") for a in view.get("attempt_history", [])]
        for shard, view in views.items()
    }
    result = {
        **counts,
        "skew_s": SKEW_S,
        "to_stale_s": round(to_stale, 2),
        "to_running_s": round(to_running, 2),
        "behind_states_seen": dict(behind_seen),
        "late_attempts": summary["late_attempts"],
        "clock_skew_us": skews,
    }
    report(net, "skewed_clock", result)
    assert counts == {**counts, "lost": 0, "moved": 0, "duplicated": 0, "pending": 0}
    assert set(behind_seen) == {"running"}, behind_seen
    assert summary["unverified"] == len(shards)
    assert summary["stale"] == summary["running"] == summary["failed"] == 0
    assert summary["late_attempts"] == 1
    assert late == {
        "ahead-s0": [False],
        "ahead-s1": [True],
        "behind-s0": [False],
        "behind-s1": [False],
    }
    for shard, sign in (("ahead-s0", 1), ("ahead-s1", 1), ("behind-s0", -1), ("behind-s1", -1)):
        (skew,) = skews[shard]
        assert skew is not None and abs(skew - sign * SKEW_S * 1_000_000) < 5_000_000, skews


def test_watch_on_another_host_never_signals_a_local_pid_that_matches_a_remote_attempt(
    net: Network, tmp_path: Path
) -> None:
    """`watch --kill-stale` run on the operator's host while a job host is cut off.

    Expectation: the job's attempt goes stale on the ledger (its host is partitioned
    away), and the watchdog on another host lists it but never signals the pid it
    recorded, although that pid is, on the watchdog's machine, a live process with the
    recorded start time (the hosts share a PID namespace here: the job process itself);
    it says the attempt was not stopped and records nothing. Healed, the job goes on
    and commits as if nothing happened: no SIGTERM, no SIGUSR1 stack dump.
    """
    from shardledger_cli.commands.watch_stop import identity

    ledger_host, job_host, ops = (net.host(n) for n in ("ledger", "job1", "ops"))
    ledger = Ledgerd(ledger_host, str(tmp_path / "ledger.db"), tmp_path)
    ledger.start()
    observer = Observer(ops, tmp_path)
    run, target = "watched", ledger.target
    observer.call("plan", target=target, run=run, shards=["j1-s0"])
    diag = tmp_path / "diag"
    job = start_job(
        job_host,
        target,
        run,
        ["j1-s0"],
        tmp_path,
        hold=("j1-s0",),
        env={"SHARDLEDGER_DIAG_DIR": str(diag)},
    )
    job.reached("j1-s0")
    wait_state(observer, target, run, "j1-s0", "running", timeout_s=30)
    net.partition(job_host, ledger_host)
    wait_state(observer, target, run, "j1-s0", "stale", TIMEOUT_S + ALLOWANCE_S)
    (view,) = observer.call("shards", target=target, run=run)
    assert view["pid"] == job.proc.pid and view["host"] == job_host.hostname
    # On the watchdog's machine that pid is a live process with the recorded start time.
    assert identity(view["pid"], view["process_start_ticks"]) == "same"
    watched = ops.run(
        [
            *(sys.executable, "-m", "shardledger_cli", "watch", run, "--server", target),
            *("--kill-stale", "--once", "--grace", "1", "--json", "--diag-dir", str(diag)),
        ],
        timeout_s=60,
    )
    actions = [json.loads(line) for line in watched.stdout.splitlines() if line.startswith("{")]
    status = Path(f"/proc/{job.proc.pid}/status").read_text()
    pending = {
        k: v
        for k, v in (line.split(":\t") for line in status.splitlines() if ":\t" in line)
        if k in ("State", "SigPnd", "ShdPnd")
    }
    net.heal(job_host, ledger_host)
    wait_state(observer, target, run, "j1-s0", "running", TIMEOUT_S + ALLOWANCE_S)
    job.go("j1-s0")
    truth = job.result()
    summary = observer.call("summary", target=target, run=run)
    stored = observer.call("events", target=target, run=run)
    result = {
        **tally([truth], stored),
        "watch_exit": watched.returncode,
        "watch_steps": [a.get("steps") for a in actions],
        "job_signals_pending": pending,
    }
    report(net, "remote_watch", result)
    assert len(actions) == 1, watched.stdout + watched.stderr
    assert actions[0]["host"] == job_host.hostname
    assert "not stopped" in " ".join(actions[0]["steps"]), actions
    assert pending["SigPnd"] == pending["ShdPnd"] == "0000000000000000", pending
    assert not pending["State"].startswith("T"), pending
    assert summary["unverified"] == 1 and summary["failed"] == 0
    assert not any(p.stat().st_size for p in diag.glob("*.stack")), "a stack dump was taken"
    assert result == {**result, "lost": 0, "moved": 0, "duplicated": 0, "pending": 0}


def acks_between(truths: list[dict[str, Any]], start: float, end: float) -> int:
    """Returns how many events the jobs saw acknowledged between two wall-clock instants."""
    return sum(1 for t in truths for e in t["events"] if start <= (e["acked_at"] or 0) < end)


def longest_ack_gap(truth: dict[str, Any]) -> float:
    """Returns the longest time the job went without an acknowledgement (its own clock)."""
    times = sorted(e["acked_at"] for e in truth["events"] if e["acked_at"])
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def wait_health(observer: Observer, target: str, status: str, timeout_s: float) -> float:
    """Waits until the replica's health says status; returns the seconds it took."""
    began = time.monotonic()
    wait_for(
        f"{target} to be {status}",
        lambda: observer.call("health", target=target) == status,
        timeout_s=timeout_s,
    )
    return time.monotonic() - began


# docs/operations.md ("Faults between hosts"): a replica cut off from its database without
# a reset (packets dropped) is NOT_SERVING within the probe interval (1 s) plus
# tcp_user_timeout (5 s), and SERVING again within a probe retry (0.25 s) and a connect
# once the database answers.
CUT_OFF_BOUND_S: Final = 6.0
RECONNECT_BOUND_S: Final = 2.5
# A replica cut off mid-group leaves its runs locked until the database finds its host
# gone: the server-side keepalives the store sets, 5 s idle + 3 probes 2 s apart.
LOCK_FREED_BOUND_S: Final = 11.0


@pytest.mark.postgres
def test_a_replica_cut_off_from_postgres_turns_not_serving_and_clients_fail_over(
    net: Network, tmp_path: Path
) -> None:
    """Ledger replica ↔ PostgreSQL partition, two replicas, clients given both addresses.

    Expectation: replica A, cut off from the database (packets dropped, no reset),
    turns NOT_SERVING within the documented bound (probe interval + tcp_user_timeout);
    the jobs, whose target lists both replicas (``ipv4:A,B``, round robin), go on
    through replica B meanwhile: their shards commit through B while A is cut off,
    although A was cut off in the middle of a group holding their run's lock (the worst
    case, made certain here: a session of A's store sent half a pipeline): the database
    finds A's host gone by the keepalives the store sets (5 s + 3 x 2 s) and frees the
    lock. Healed, A is SERVING again within a probe retry and a connect. Nothing
    acknowledged is lost or counted twice, nothing is left in a spool.
    """
    if pg.find_bin_dir() is None:
        pytest.skip(pg.SKIP_REASON)
    db_host, host_a, host_b, job1_host, job2_host, ops = (
        net.host(n) for n in ("pg", "ledger-a", "ledger-b", "job1", "job2", "ops")
    )
    cluster = start_pg(db_host)
    url = cluster.host_url(cluster.new_database())
    key = tmp_path / "signing-key.pem"
    replica_a = Ledgerd(host_a, url, tmp_path, name="ledger-a")
    replica_b = Ledgerd(host_b, url, tmp_path, name="ledger-b")
    replica_a.start(key=key)
    replica_b.start(key=key)
    observer = Observer(ops, tmp_path)
    both = f"{replica_a.target},{replica_b.target}"
    run = "failover"
    shards = {h.name: [f"{h.name}-s{i}" for i in range(3)] for h in (job1_host, job2_host)}
    observer.call(
        "plan",
        target=replica_b.target,
        run=run,
        shards=[s for names in shards.values() for s in names],
    )
    jobs = [
        start_job(
            h,
            both,
            run,
            shards[h.name],
            tmp_path,
            hold=(f"{h.name}-s0", f"{h.name}-s2"),
            steps=4,
            step_s=0.25,
        )
        for h in (job1_host, job2_host)
    ]
    for job in jobs:
        job.reached(f"{job.host.name}-s0")
    wait_health(observer, replica_a.target, "SERVING", 30)
    # A's group in flight on the run when the link goes: its lock, half a request sent.
    Observer(host_a, tmp_path, name="group").call("hold_run_lock", dsn=url, run=run)
    cut, cut_at = time.monotonic(), time.time()
    net.partition(host_a, db_host)
    prober = Observer(ops, tmp_path, name="prober")
    with ThreadPoolExecutor(1) as pool:
        # How long B's appends to the run wait for A's lock.
        through_b = pool.submit(
            prober.call,
            "probe_append",
            target=replica_b.target,
            run=run,
            shard="probe",
            deadline_s=5,
            retry_s=60,
            timeout_s=90,
        )
        for job in jobs:
            job.go(f"{job.host.name}-s0")
        to_not_serving = wait_health(
            observer, replica_a.target, "NOT_SERVING", CUT_OFF_BOUND_S + ALLOWANCE_S
        )
        lock_freed = through_b.result()
    for job in jobs:  # a shard committed through replica B while A is cut off
        wait_state(observer, replica_b.target, run, f"{job.host.name}-s1", "unverified", 30)
        job.reached(f"{job.host.name}-s2")
    healed, healed_at = time.monotonic(), time.time()
    net.heal(host_a, db_host)
    to_serving = wait_health(observer, replica_a.target, "SERVING", RECONNECT_BOUND_S + ALLOWANCE_S)
    for job in jobs:
        job.go(f"{job.host.name}-s2")
    truths = [job.result() for job in jobs]

    stored = observer.call("events", target=replica_b.target, run=run)
    counts = tally(truths, stored)
    summary = observer.call("summary", target=replica_a.target, run=run)
    result = {
        **counts,
        "partition_s": round(healed - cut, 2),
        "to_not_serving_s": round(to_not_serving, 2),
        "to_serving_s": round(to_serving, 2),
        "acked_during_partition": acks_between(truths, cut_at, healed_at),
        "longest_ack_gap_s": round(max(longest_ack_gap(t) for t in truths), 2),
        "lock_freed_s": round(lock_freed.get("seconds", -1), 2),
    }
    report(net, "replica_db_partition", result)
    assert counts == {**counts, "lost": 0, "moved": 0, "duplicated": 0, "pending": 0}
    assert to_not_serving < CUT_OFF_BOUND_S + ALLOWANCE_S
    assert lock_freed["ok"], lock_freed
    assert lock_freed["seconds"] < LOCK_FREED_BOUND_S + ALLOWANCE_S
    # The six shards and the probe's plan; one attempt each.
    assert summary["unverified"] == 6 and summary["missing"] == 1 and summary["attempts"] == 6


@pytest.mark.postgres
def test_appends_wait_for_a_cut_off_synchronous_standby_and_resume_when_healed(
    net: Network, tmp_path: Path
) -> None:
    """Primary ↔ standby partition under synchronous replication.

    Expectation: while the synchronous standby is cut off, no append is acknowledged:
    each COMMIT waits for the standby, and past --pg-commit-wait-bound (5 s) the replica
    cancels it without acknowledging it, says NOT_SERVING, and answers UNAVAILABLE (not
    DEADLINE_EXCEEDED) to a call whose deadline is longer than the bound; the job spools
    and keeps running; every event a job saw acknowledged before the heal is already on
    the standby. Healed, the probe's write commits, the spool drains, the resends land
    exactly once: nothing acknowledged is lost or counted twice.
    """
    if pg.find_bin_dir() is None:
        pytest.skip(pg.SKIP_REASON)
    primary_host, standby_host, ledger_host, job_host, ops = (
        net.host(n) for n in ("pg-primary", "pg-standby", "ledger", "job1", "ops")
    )
    primary, standby = start_replicated_pair(primary_host, standby_host)
    dbname = primary.new_database()
    url = (
        f"postgresql://postgres@{primary_host.ip}:{netns.PG_PORT},{standby_host.ip}:{netns.PG_PORT}"
        f"/{dbname}?target_session_attrs=read-write"
    )
    ledger = Ledgerd(ledger_host, url, tmp_path)
    ledger.start(key=tmp_path / "signing-key.pem")
    observer = Observer(ops, tmp_path)
    run, target = "synchronous", ledger.target
    shards = [f"j1-s{i}" for i in range(4)]
    observer.call("plan", target=target, run=run, shards=shards)
    job = start_job(job_host, target, run, shards, tmp_path, hold=("j1-s0", "j1-s2"))
    job.reached("j1-s0")
    wait_state(observer, target, run, "j1-s0", "running", timeout_s=30)
    cut, cut_at = time.monotonic(), time.time()
    net.partition(primary_host, standby_host)
    job.go("j1-s0")
    blocked = observer.call("probe_append", target=target, run=run, shard="probe", deadline_s=2.0)
    # A deadline past the bound: answered UNAVAILABLE once the bound cancels the COMMIT.
    bounded = observer.call(
        "probe_append", target=target, run=run, shard="probe", deadline_s=10.0, timeout_s=30
    )
    wait_for(
        "the replica to say NOT_SERVING",
        lambda: observer.call("health", target=target) == "NOT_SERVING",
        timeout_s=10,
    )
    to_not_serving = time.monotonic() - cut
    health = "NOT_SERVING"
    job.reached("j1-s2")  # the job went on, spooling
    on_standby = {
        row[0]
        for row in observer.call(
            "sql",
            dsn=standby.host_url(dbname),
            query="SELECT event_id FROM events",
        )
    }
    healed, healed_at = time.monotonic(), time.time()
    net.heal(primary_host, standby_host)
    recovered = wait_for(
        "an append to be acknowledged again",
        lambda: observer.call(
            "probe_append", target=target, run=run, shard="probe", deadline_s=2.0
        )["ok"],
        timeout_s=30,
    )
    to_recover = time.monotonic() - healed
    job.go("j1-s2")
    truth = job.result()

    stored = observer.call("events", target=target, run=run)
    counts = tally([truth], stored)
    acked_before_heal = [e for e in truth["events"] if e["acked_at"] and e["acked_at"] < healed_at]
    result = {
        **counts,
        "partition_s": round(healed - cut, 2),
        "acked_during_partition": acks_between([truth], cut_at + 0.5, healed_at),
        "acked_before_heal_not_on_standby": sum(
            1 for e in acked_before_heal if e["event_id"] not in on_standby
        ),
        "probe_during_partition": blocked,
        "health_during_partition": health,
        "to_not_serving_s": round(to_not_serving, 2),
        "probe_past_the_bound": bounded,
        "recover_s": round(to_recover, 2),
        "longest_ack_gap_s": round(longest_ack_gap(truth), 2),
    }
    report(net, "standby_partition", result)
    assert recovered
    assert counts == {**counts, "lost": 0, "moved": 0, "duplicated": 0, "pending": 0}
    assert not blocked["ok"], blocked
    assert not bounded["ok"] and "LedgerUnavailable: UNAVAILABLE" in bounded["error"], bounded
    assert result["acked_before_heal_not_on_standby"] == 0
    assert result["acked_during_partition"] == 0
