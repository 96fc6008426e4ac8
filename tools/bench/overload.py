"""Overload: the fleet at 1x and 2x the SDK's cadence against one server, in one run.

    python -m tools.bench.overload [--connections 10000] [--seconds 30] [--speedups 1,2]
                                   [--server SRC[:ARGS]] ... [--rounds N] [--pin]
                                   [--server-cpu SHARE] [-o FILE]

Each server (`shardledger serve` in its own process, a fresh ledger) takes the
fleet of tools.bench.fleet (one channel per job, started, a heartbeat per interval,
a checkpoint every fourth beat, the commit after --seconds) at each speedup in turn,
one run of its own per speedup: 1 is the SDK's real 15 s heartbeat interval, 2 is
twice its rate. Reported per phase: offered and acknowledged events/s, refusals
(OVERLOADED with a RetryInfo delay, and gRPC's own RESOURCE_EXHAUSTED), commit
acknowledgement p50/p99, the readers' latencies and errors; per server: the ratio
of acknowledged events/s at the last speedup to the first (target >= 0.9, with
nothing refused at 1x).

``--server SRC[:ARGS]`` runs the server of the checkout at SRC (default: this one)
with extra `serve` flags ARGS (space-separated), so one run measures a before (a
`git worktree` of an older commit) and an after on the same machine state; with
--rounds the servers alternate. ``--pin`` puts the server on CPU 0 and the client
processes on the other CPUs (taskset / sched_setaffinity). ``--server-cpu SHARE``
holds the server to a share of one core (a CPU cgroup, root), so that one client
process can offer three times what the server acknowledges and the run shows
`past_capacity` (>= 0.9x of capacity acknowledged at 3x, all acknowledged again
back at the first speedup). JSON goes to bench-results/overload.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import grpc

from ledger_server.server import raise_fd_limit
from tools.bench.cpulimit import CpuLimitError, cpu_share
from tools.bench.fleet import CLIENT_PROCS, DEFAULT_INTERVAL_S, drive, served

RESULTS = Path("bench-results")
TARGET_RATIO = 0.9
# The load back to normal: every event acknowledged within this of the overload ending.
RECOVER_S = 60.0


def _git(src: str, *args: str) -> str:
    done = subprocess.run(["git", "-C", src, *args], capture_output=True, text=True, check=False)
    return done.stdout.strip()


def _env() -> dict[str, Any]:
    return {
        "grpcio": grpc.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def measure(
    src: str,
    server_args: list[str],
    *,
    connections: int,
    seconds: float,
    speedups: list[float],
    pin: bool,
    path: str = "stream",
    cpu_share: float | None = None,
) -> dict[str, Any]:
    """Runs every speedup against one server of the checkout at src; returns the phases and ratio."""
    cpus = os.sched_getaffinity(0)
    server_cpus = [min(cpus)] if pin and len(cpus) > 1 else None
    client_cpus = sorted(cpus - set(server_cpus)) if server_cpus else None
    phases = []
    with served(server_args, src=src, cpus=server_cpus, cpu_share=cpu_share) as server:
        limit = server.cpu_limit
        for index, speedup in enumerate(speedups):
            load = [round(x, 2) for x in os.getloadavg()]
            phase = drive(
                server,
                f"overload-{index}",
                connections,
                seconds=seconds,
                interval=DEFAULT_INTERVAL_S / speedup,
                client_cpus=client_cpus,
                path=path,
            )
            # How long the jobs offered load: the last starts one interval in, and each
            # commits at its first beat --seconds or more into the drive (one interval at
            # the least). What the drive took beyond that is the backlog's drain.
            interval = DEFAULT_INTERVAL_S / speedup
            load_s = max(seconds, interval) + interval
            phase = {"speedup": speedup, "load_average_before": load, **phase}
            phase["backlog_drained_s"] = round(max(0.0, phase["drive_s"] - load_s), 1)
            print(json.dumps(phase), flush=True)
            phases.append(phase)
    first, last = phases[0], phases[-1]
    ratio = round(last["events_per_s"] / max(first["events_per_s"], 1), 3)
    # The most acknowledged per second in any phase: the capacity this run showed.
    capacity = max(p["events_per_s"] for p in phases)
    return {
        "server_src": str(Path(src).resolve()),
        "server_commit": _git(src, "rev-parse", "--short", "HEAD"),
        "server_dirty": bool(_git(src, "status", "--porcelain", "--untracked-files=no")),
        "server_args": server_args,
        "pinned": {"server": server_cpus, "clients": client_cpus},
        "server_cpu_limit": limit,
        "phases": phases,
        "path": path,
        "acknowledged_ratio_last_to_first": ratio,
        "capacity_events_per_s": capacity,
        "phases_vs_capacity": [
            {
                "speedup": p["speedup"],
                "offered_vs_capacity": round(p["offered_events_per_s"] / max(capacity, 1), 2),
                "acknowledged_vs_capacity": round(p["events_per_s"] / max(capacity, 1), 2),
                "acknowledged_vs_offered": round(
                    p["events_per_s"] / max(p["offered_events_per_s"], 1), 2
                ),
                "resent": p["resent_unavailable"],
                "refused_with_retry_info": p["refused_overloaded"],
            }
            for p in phases
        ],
        "past_capacity": _past_capacity(phases, capacity),
        "met": ratio >= TARGET_RATIO and first["refused"] == 0,
    }


def _past_capacity(phases: list[dict[str, Any]], capacity: int) -> dict[str, Any]:
    """The no-collapse figures: the first phase offered >= 3x what it acknowledged, and after.

    Capacity is the most this run acknowledged per second in any phase (give a phase
    just past capacity, e.g. --speedups 1,5,16,1, so that it is measured beside the
    overload). Met when that phase still acknowledged >= 0.9x capacity, its backlog was
    acknowledged within 60 s of its load ending, and a later phase back at the first
    speedup acknowledged everything it was offered.
    """
    over = next(
        (i for i, p in enumerate(phases) if p["offered_events_per_s"] >= 3 * p["events_per_s"]),
        None,
    )
    if over is None:
        return {
            "reached": False,
            "why": "no phase offered 3x what it acknowledged: raise --speedups",
        }
    phase = phases[over]
    after = [p for p in phases[over + 1 :] if p["speedup"] == phases[0]["speedup"]]
    recovered = (
        bool(after) and after[0]["events"] >= after[0]["sent_events"] and not after[0]["errors"]
    )
    share = round(phase["events_per_s"] / max(capacity, 1), 2)
    return {
        "reached": True,
        "speedup": phase["speedup"],
        "offered_vs_acknowledged": round(
            phase["offered_events_per_s"] / max(phase["events_per_s"], 1), 2
        ),
        "acknowledged_vs_capacity": share,
        "refused_with_retry_info": phase["refused_overloaded"],
        "resent_without_an_answer": phase["resent_unavailable"],
        "backlog_drained_s": phase["backlog_drained_s"],
        "back_at_first_speedup_all_acknowledged": recovered if after else None,
        "met": share >= TARGET_RATIO and recovered and phase["backlog_drained_s"] <= RECOVER_S,
    }


def main(argv: list[str] | None = None) -> int:
    """Measures each server at each speedup, prints and saves the JSON."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.overload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--connections", type=int, default=10_000, help="jobs, one channel each")
    parser.add_argument(
        "--seconds", type=float, default=30.0, help="each job's life: the commit after this"
    )
    parser.add_argument(
        "--speedups", default="1,2", help="heartbeat rates as multiples of the SDK's cadence"
    )
    parser.add_argument(
        "--server",
        action="append",
        default=None,
        metavar="SRC[:ARGS]",
        help="a checkout whose server to run, with extra serve flags (repeatable; default: .)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="run every server this many times")
    parser.add_argument(
        "--path",
        choices=("stream", "unary"),
        default="stream",
        help="how jobs send: one StreamAppendEvents stream each (the SDK's default), or a"
        " unary AppendEvents per event (run both for a same-run comparison)",
    )
    parser.add_argument(
        "--pin", action="store_true", help="server on CPU 0, the client processes on the rest"
    )
    parser.add_argument(
        "--server-cpu",
        type=float,
        default=None,
        metavar="SHARE",
        help="hold the server to this share of one core (a CPU cgroup; root), so that one"
        " client process can offer 3x what it acknowledges: 'past capacity' on a small machine",
    )
    parser.add_argument("-o", "--output", default=str(RESULTS / "overload.json"))
    args = parser.parse_args(argv)
    if args.server_cpu is not None and not 0.01 <= args.server_cpu <= 1.0:
        parser.error(f"--server-cpu {args.server_cpu:g}: a share of one core, 0.01 to 1")
    try:
        speedups = [float(x) for x in args.speedups.split(",")]
    except ValueError:
        parser.error(f"--speedups {args.speedups!r}: give numbers, e.g. 1,2")
    if not speedups or min(speedups) <= 0 or args.connections < 1 or args.seconds <= 0:
        parser.error("--speedups, --connections and --seconds must be positive")
    servers = []
    for spec in args.server or ["."]:
        src, _, extra = spec.partition(":")
        servers.append((src or ".", extra.split()))
    raise_fd_limit()
    report: dict[str, Any] = {
        "env": _env(),
        "workload": f"{args.connections} jobs in {CLIENT_PROCS} client processes, one channel"
        f" each; a heartbeat every 15 s / speedup, a checkpoint every 4th beat, the commit after"
        f" {args.seconds:g} s; status, resume and /metrics once a second",
        "target": f"acknowledged at {speedups[-1]:g}x >= {TARGET_RATIO} x at {speedups[0]:g}x,"
        " nothing refused at 1x",
        "runs": [],
    }
    if args.server_cpu is not None:
        # Fail before any phase runs where the machine cannot hold the server to a share.
        probe = subprocess.Popen(["sleep", "60"])
        try:
            with cpu_share(probe.pid, args.server_cpu):
                probe.kill()  # the group goes once it is empty
                probe.wait()
        except CpuLimitError as exc:
            parser.error(f"--server-cpu: {exc}")
        finally:
            probe.kill()
            probe.wait()
    for round_ in range(args.rounds):
        for src, extra in servers:
            run = measure(
                src,
                extra,
                connections=args.connections,
                seconds=args.seconds,
                speedups=speedups,
                pin=args.pin,
                path=args.path,
                cpu_share=args.server_cpu,
            )
            run["round"] = round_
            print(json.dumps({k: v for k, v in run.items() if k != "phases"}), flush=True)
            report["runs"].append(run)
    report["env"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
