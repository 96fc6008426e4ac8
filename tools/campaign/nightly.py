"""Nightly-size crash and fuzz campaign: the CI fault tests run longer, with one summary.

    python -m tools.campaign --kills 100 --fuzz-seconds 1800
    python -m tools.campaign --suites crash,fuzz --kills 5 --fuzz-seconds 60
    python -m tools.campaign --suites failover --failovers 50
    python -m tools.campaign --suites netns --netns-rounds 10
    python -m tools.campaign --suites patroni --rounds 20

It runs the suite's own fault tests under pytest with the knobs of tests/campaign.py:

    crash     tests/server/test_crash_safety.py   SIGKILL a SQLite server under 4 clients, N times
    replicas  tests/server/test_replicas.py       SIGKILL a PostgreSQL replica N times under load,
                                                  and crash the database itself (pg_ctl -m immediate)
    failover  tests/server/test_pg_failover.py    crash a primary, promote its synchronous standby;
                                                  the loop does it F times (--failovers) and holds
                                                  each replica to the documented recovery bound
    fuzz      tests/server/test_fuzz.py           the fuzz quotas, then S more seconds of fuzzing
    netns     tests/contract/test_netns_faults.py faults between hosts in network namespaces
                                                  (partitions, a slow lossy link, skewed clocks,
                                                  watch on another host, PostgreSQL cut off),
                                                  each case R times (--netns-rounds; needs root)
    patroni   tests/contract/test_patroni_failover.py  Patroni fails PostgreSQL over by itself
                                                  (etcd, three nodes, two replicas, namespaces):
                                                  SIGKILL of the primary's postmaster, a
                                                  switchover under load, the primary cut off,
                                                  an etcd member cut off, the synchronous
                                                  standby SIGKILLed; each P times (--rounds;
                                                  needs root)

and prints kills made, acknowledged events checked, lost, moved and duplicated counts,
and fuzz requests by status code; the JSON lands in bench-results/campaign.json
(--out). Each test leaves its tally in --reports DIR as it ends (default: a temporary
directory), so a campaign stopped midway still has its finished tests' figures. The
PostgreSQL suites need Debian's postgresql package (or skip). Exit 0 when every test
passed and nothing was lost or duplicated, 1 otherwise, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

ROOT: Final = Path(__file__).resolve().parents[2]
SUITES: Final = {
    "crash": ["tests/server/test_crash_safety.py"],
    "replicas": ["tests/server/test_replicas.py"],
    "failover": ["tests/server/test_pg_failover.py"],
    "fuzz": ["tests/server/test_fuzz.py"],
    "netns": ["tests/contract/test_netns_faults.py"],
    "patroni": ["tests/contract/test_patroni_failover.py"],
}
# The counts a kill suite's tally carries (tests/campaign.py); any nonzero is a data-safety fault,
# or (the failover loop's last two) a replica that hung a call or came back past its bound.
FAULTS: Final = (
    *("lost", "moved", "duplicated", "unacknowledged_stored", "half_written_batches"),
    *("deadline_exceeded", "over_bound"),
    "pending",  # a netns case: emitted, never acknowledged (left in a spool)
)
# The times a netns case measures, printed as their worst over the rounds.
NETNS_TIMES: Final = (
    *("to_stale_s", "recover_s", "to_not_serving_s", "to_serving_s", "longest_ack_gap_s"),
)


def _suites(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SUITES))
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown suite {', '.join(unknown) or '(none)'}; choose from {', '.join(SUITES)}"
        )
    return names


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text}: must be above 0")
    return value


def run_campaign(
    suites: list[str],
    kills: int,
    fuzz_seconds: float,
    fuzz_scale: float,
    failovers: int = 50,
    netns_rounds: int = 10,
    patroni_rounds: int = 20,
    reports_dir: Path | None = None,
    select: str = "",
) -> dict[str, Any]:
    """Runs the suites' tests with the campaign's knobs; returns their tallies and the verdict.

    reports_dir: where each test leaves its tally (kept); a temporary directory if None.
    select: a pytest -k expression, to run some of the suites' tests only.
    """
    with contextlib.ExitStack() as stack:
        if reports_dir is None:
            reports = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="shardledger-campaign-")
            )
        else:
            reports_dir.mkdir(parents=True, exist_ok=True)
            reports = str(reports_dir)
        env = {
            **os.environ,
            "SHARDLEDGER_CAMPAIGN_KILLS": str(kills),
            "SHARDLEDGER_CAMPAIGN_FAILOVERS": str(failovers),
            "SHARDLEDGER_CAMPAIGN_NETNS_ROUNDS": str(netns_rounds),
            "SHARDLEDGER_CAMPAIGN_PATRONI_ROUNDS": str(patroni_rounds),
            "SHARDLEDGER_CAMPAIGN_FUZZ_SECONDS": str(fuzz_seconds),
            "SHARDLEDGER_CAMPAIGN_FUZZ_SCALE": str(fuzz_scale),
            "SHARDLEDGER_CAMPAIGN_REPORT_DIR": reports,
        }
        paths = [p for name in suites for p in SUITES[name]]
        started = time.monotonic()
        done = subprocess.run(
            # -n 0: one process, so the kills and the fuzzing have the machine to themselves
            # (the suite's own addopts spread tests over xdist workers).
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-n",
                "0",
                "-p",
                "no:cacheprovider",
                "-rs",
                # Every test of the files named, whatever pyproject's addopts deselect
                # (-m 'not patroni' leaves the Patroni suite to a step of its own).
                "-m",
                "",
                *(("-k", select) if select else ()),
                *paths,
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        tallies = {p.stem: json.loads(p.read_text()) for p in sorted(Path(reports).glob("*.json"))}
    kill_tallies = [t for t in tallies.values() if "kills" in t]
    netns_tallies = [t for t in tallies.values() if "case" in t]
    counted = kill_tallies + netns_tallies
    fuzz = tallies.get("fuzz", {})
    totals = {
        "kills": sum(t["kills"] for t in kill_tallies),
        "acknowledged": sum(t["acknowledged"] for t in counted),
        **{f: sum(t.get(f, 0) for t in counted) for f in FAULTS},
        "fuzz_requests": fuzz.get("requests", 0),
        "fuzz_forbidden": fuzz.get("forbidden", 0),
    }
    faults = sum(totals[f] for f in FAULTS) + totals["fuzz_forbidden"]
    return {
        "settings": {
            "suites": suites,
            "kills": kills,
            "failovers": failovers,
            "netns_rounds": netns_rounds,
            "patroni_rounds": patroni_rounds,
            "select": select,
            "fuzz_seconds": fuzz_seconds,
            "fuzz_scale": fuzz_scale,
        },
        "ok": done.returncode == 0 and faults == 0,
        "pytest_exit": done.returncode,
        "pytest_summary": done.stdout.strip().splitlines()[-1:] or [""],
        "seconds": round(time.monotonic() - started, 1),
        "totals": totals,
        "fuzz_codes": fuzz.get("codes", {}),
        "suites": tallies,
        "netns": netns_cases(netns_tallies),
        "patroni": patroni_faults([t for t in tallies.values() if "rounds" in t]),
        "pytest_output_tail": (done.stdout + done.stderr)[-4000:] if done.returncode else "",
    }


def netns_cases(tallies: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Returns each netns case's rounds summed: counts, faults, and its worst times."""
    cases: dict[str, dict[str, Any]] = {}
    for tally in tallies:
        case = cases.setdefault(tally["case"], {"rounds": 0, "acknowledged": 0})
        case["rounds"] += 1
        case["acknowledged"] += tally.get("acknowledged", 0)
        for key in FAULTS:
            if key in tally:
                case[key] = case.get(key, 0) + tally[key]
        for key in NETNS_TIMES:
            if key in tally:
                case[f"max_{key}"] = max(case.get(f"max_{key}", 0.0), tally[key])
    return cases


def _spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {}
    return {"min": ordered[0], "median": ordered[len(ordered) // 2], "max": ordered[-1]}


def patroni_faults(tallies: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Returns each Patroni fault's figures over its rounds: times to a new leader and to acks."""
    faults: dict[str, dict[str, Any]] = {}
    for tally in tallies:
        for r in tally["rounds"]:
            fault = faults.setdefault(
                r["fault"],
                {
                    "rounds": 0,
                    "new_leader_s": [],
                    "writable_s": [],
                    "first_ack_s": [],
                    "longest_ack_gap_s": [],
                },
            )
            fault["rounds"] += 1
            # A fault that keeps the leader (a standby, an etcd member) has no new leader.
            if "new_leader_s" in r:
                fault["new_leader_s"].append(r["new_leader_s"])
                fault["writable_s"].append(r.get("writable_s", r["new_leader_s"]))
            if "longest_ack_gap_s" in r:
                fault["longest_ack_gap_s"].append(r["longest_ack_gap_s"])
            fault["first_ack_s"].append(max(r["first_ack_s"].values(), default=0.0))
            during = r.get("acked_between_fault_and_leader", r.get("acked_during_fault", 0))
            fault["acked_during"] = fault.get("acked_during", 0) + during
            for key in ("refused", "deadline_exceeded", "refused_without_retry_info"):
                fault[key] = fault.get(key, 0) + r[key]
            # How the stopped member came back: "rewind", "restart" (a base-backup
            # "rebuild" fails its test).
            if "rejoined_by" in r:
                by = fault.setdefault("rejoined_by", {})
                by[r["rejoined_by"]] = by.get(r["rejoined_by"], 0) + 1
    for fault in faults.values():
        for key in ("new_leader_s", "writable_s", "first_ack_s", "longest_ack_gap_s"):
            fault[key] = _spread(fault[key])
    return faults


def print_summary(result: dict[str, Any]) -> None:
    """Prints what the campaign did and found, one line per suite."""
    totals = result["totals"]
    for name, tally in result["suites"].items():
        if "kills" in tally:
            faults = ", ".join(f"{f} {tally.get(f, 0)}" for f in FAULTS if f in tally)
            print(
                f"{name}: {tally['kills']} kills, {tally['acknowledged']} acknowledged events"
                f" checked; {faults}; chains {'ok' if tally.get('chains_ok') else 'BROKEN'}"
            )
        if "first_ack_s" in tally:
            acks = tally["first_ack_s"]
            print(
                f"{name}: first acknowledgement after each promotion, per replica: max"
                f" {max(acks, default=0):.2f} s over {len(acks)} (bound {tally['bound_s']} s)"
            )
    for name, case in result["netns"].items():
        faults = ", ".join(f"{f} {case[f]}" for f in FAULTS if f in case)
        times = ", ".join(
            f"{k[4:]} max {case[k]:.2f}" for k in sorted(case) if k.startswith("max_")
        )
        print(
            f"netns {name}: {case['rounds']} rounds, {case['acknowledged']} acknowledged"
            f" events checked; {faults}" + (f"; {times}" if times else "")
        )
    for name, fault in result.get("patroni", {}).items():
        spread = {
            key: "/".join(f"{fault[key][k]:.2f}" for k in ("min", "median", "max"))
            for key in ("new_leader_s", "writable_s", "first_ack_s", "longest_ack_gap_s")
            if fault[key]
        }
        leader = spread.get("new_leader_s")
        print(
            f"patroni {name}: {fault['rounds']} rounds"
            + (f"; new leader after {leader} s (min/median/max)" if leader else "")
            + (f", taking writes after {spread['writable_s']} s" if leader else "")
            + f"; every replica acknowledging {spread['first_ack_s']} s after"
            + (" it took writes" if leader else " the fault")
            + (
                f"; longest gap between acks {spread['longest_ack_gap_s']} s"
                if "longest_ack_gap_s" in spread
                else ""
            )
            + f"; {fault['acked_during']} acknowledged during; {fault['refused']} refused,"
            f" {fault['deadline_exceeded']} DEADLINE_EXCEEDED"
            + (
                "; rejoined by "
                + ", ".join(f"{k} {n}" for k, n in sorted(fault["rejoined_by"].items()))
                if fault.get("rejoined_by")
                else ""
            )
        )
    if result["fuzz_codes"]:
        codes = ", ".join(f"{c} {n}" for c, n in sorted(result["fuzz_codes"].items()))
        print(f"fuzz: {totals['fuzz_requests']} requests ({codes})")
    print(
        f"total: {totals['kills']} kills, {totals['acknowledged']} acknowledged events,"
        f" {totals['lost']} lost, {totals['duplicated']} duplicated,"
        f" {totals['fuzz_requests']} fuzz requests ({totals['fuzz_forbidden']} UNKNOWN/INTERNAL)"
        f" in {result['seconds']} s; pytest: {result['pytest_summary'][0]}"
    )
    if result["pytest_output_tail"]:
        print(result["pytest_output_tail"], file=sys.stderr)
    print("campaign: " + ("clean" if result["ok"] else "PROBLEMS FOUND"))


def main(argv: list[str] | None = None) -> int:
    """Runs the campaign, prints the summary, saves the JSON; 0 when clean, 1 otherwise."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.campaign",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--kills", type=int, default=100, help="SIGKILLs per kill loop (100)")
    parser.add_argument(
        "--failovers",
        type=int,
        default=50,
        help="stop-and-promote rounds of the PostgreSQL failover loop (50)",
    )
    parser.add_argument(
        "--netns-rounds",
        type=int,
        default=10,
        help="times each case of the network-namespace fault suite runs (10)",
    )
    parser.add_argument(
        "--rounds",
        "--patroni-rounds",
        dest="patroni_rounds",
        type=int,
        default=20,
        help="times each fault of the Patroni suite runs (20)",
    )
    parser.add_argument(
        "--fuzz-seconds", type=float, default=1800.0, help="fuzzing past the quotas (1800)"
    )
    parser.add_argument(
        "--fuzz-scale", type=_positive, default=1.0, help="factor on the fuzz quotas (1)"
    )
    parser.add_argument(
        "--suites",
        type=_suites,
        default=list(SUITES),
        help="comma list (all: " + ",".join(SUITES) + ")",
    )
    parser.add_argument("--out", default="bench-results/campaign.json", help="JSON file to write")
    parser.add_argument(
        "--reports",
        type=Path,
        default=None,
        help="keep each test's tally here as it ends (default: a temporary directory)",
    )
    parser.add_argument(
        "--select",
        default="",
        metavar="EXPR",
        help="run only the tests pytest -k EXPR selects (e.g. cut_off: the Patroni partition)",
    )
    args = parser.parse_args(argv)
    counts = (args.kills, args.failovers, args.netns_rounds, args.patroni_rounds)
    if min(counts) < 1 or args.fuzz_seconds < 0:
        parser.error(
            "--kills, --failovers, --netns-rounds and --rounds must be at least 1"
            " and --fuzz-seconds at least 0"
        )
    result = run_campaign(
        args.suites,
        args.kills,
        args.fuzz_seconds,
        args.fuzz_scale,
        failovers=args.failovers,
        netns_rounds=args.netns_rounds,
        patroni_rounds=args.patroni_rounds,
        reports_dir=args.reports,
        select=args.select,
    )
    print_summary(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"saved {out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
