"""What the SDK costs a job: wall and CPU per process, per shard, per heartbeat and commit.

    python -m tools.bench job [--repeat N] [-o bench-results/job.json]

Every figure is a fresh interpreter's (the child's user + system CPU from os.wait4, its
wall from start to reaped), interleaved N times against a ledger started here, beside
baselines measured in the same run: `python -c pass`, `import grpc` + the generated stubs
(the SDK's floor), and each job without the SDK. The jobs:

- word count: reads a plan line's input, counts words, writes the counts atomically (the
  README's plain job); with the SDK it opens `Ledger()`, enters `ledger.shard(..., input=line)`
  and commits with `shard.atomic_write`;
- torch: a tiny model trained 20 steps on the CPU and saved (`torch.save`), with and
  without the SDK (torch imported before the shard, as a torch job does);
- the word count with the SDK while nothing listens at the ledger's address (exit wait);
- one process running 100 word-count shards, with and without the SDK (per shard);
- heartbeats (one shard beating every 20 ms) and commits (50 atomic writes of 4 KiB
  against write + fsync + rename), read as CPU per beat and per commit, then as the share
  of a 60 s shard at the SDK's default cadence (a beat every 15 s, one commit).

Targets (issue 46): the SDK's added cost for the word count <= import grpc + stubs + 100 ms
wall per process; for the torch job <= 100 ms over the job's own imports; heartbeats and
commits <= 0.5 % of a 60 s shard's CPU; exit with the ledger down <= 0.5 s. Nothing here
is asserted in the test suite.
"""

from __future__ import annotations

import compileall
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

REPO: Final = Path(__file__).resolve().parents[2]
GRPC_FLOOR: Final = (
    "import grpc; from shard_client.api.shardledger.v1 import ledger_pb2, ledger_pb2_grpc"
)
# The jobs, as files a user would write. argv: target run line_json out [count]
WORDS: Final = """
import json, os, sys
from collections import Counter
from pathlib import Path

def count(line, out):
    text = Path(line["input"]).read_text(encoding="utf-8").lower()
    return json.dumps(Counter(w.strip(".,:;!?") for w in text.split()), sort_keys=True).encode()
"""
PLAIN_BARE: Final = (
    WORDS
    + """
def write(out, data):
    tmp = out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data); f.flush(); os.fsync(f.fileno())
    os.replace(tmp, out)

lines = [json.loads(t) for t in sys.argv[3].split("\\n")]
for line in lines:
    write(f"{sys.argv[4]}.{line['shard_id']}", count(line, sys.argv[4]))
"""
)
PLAIN_SDK: Final = (
    WORDS
    + """
import time
from shard_client import Ledger

lines = [json.loads(t) for t in sys.argv[3].split("\\n")]
ledger = Ledger(sys.argv[1])
for line in lines:
    with ledger.shard(sys.argv[2], line["shard_id"], expected_outputs=["counts"], input=line) as s:
        data = count(line, sys.argv[4])
        with s.atomic_write(f"{sys.argv[4]}.{line['shard_id']}", name="counts") as f:
            f.write(data)
began = time.monotonic()
ledger.close()
print(json.dumps({"close_s": time.monotonic() - began, "torch": "torch" in sys.modules}))
"""
)
TRAIN: Final = """
import io, json, os, sys
import torch

def train():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    for _ in range(20):
        opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()
    return model.state_dict()

line = json.loads(sys.argv[3])
out = f"{sys.argv[4]}.{line['shard_id']}.pt"
"""
TORCH_BARE: Final = (
    TRAIN
    + """
tmp = out + ".tmp"
with open(tmp, "wb") as f:
    torch.save(train(), f); f.flush(); os.fsync(f.fileno())
os.replace(tmp, out)
"""
)
TORCH_SDK: Final = (
    TRAIN
    + """
from shard_client import Ledger

with Ledger(sys.argv[1]) as ledger:
    with ledger.shard(sys.argv[2], line["shard_id"], expected_outputs=["model"], input=line) as s:
        state = train()
        with s.atomic_write(out, name="model") as f:
            torch.save(state, f)
"""
)
BEATS: Final = """
import json, os, sys, time
from shard_client import Ledger

line, out = json.loads(sys.argv[3]), sys.argv[4]
interval, seconds, commits = float(sys.argv[5]), float(sys.argv[6]), int(sys.argv[7])
with Ledger(sys.argv[1]) as ledger:
    with ledger.shard(sys.argv[2], line["shard_id"], heartbeat_interval=interval,
                      expected_outputs=None, fingerprint=False) as s:
        time.sleep(seconds)
        cpu = time.process_time()
        for i in range(commits):
            with s.atomic_write(f"{out}.{line['shard_id']}.{i}", name=f"c{i}") as f:
                f.write(os.urandom(4096))
        sdk = time.process_time() - cpu
        cpu = time.process_time()
        for i in range(commits):
            tmp = f"{out}.raw.{i}.tmp"
            with open(tmp, "wb") as f:
                f.write(os.urandom(4096)); f.flush(); os.fsync(f.fileno())
            os.replace(tmp, f"{out}.raw.{i}")
        raw = time.process_time() - cpu
print(json.dumps({"commit_sdk_s": sdk, "commit_raw_s": raw, "attempt": s.attempt_id}))
"""


def _measured(argv: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """Runs argv to its end; returns (wall s, user + system CPU s from os.wait4, stdout)."""
    began = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    out = proc.stdout.read()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - began
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv[:4])} failed ({proc.returncode}): {err.decode()[-2000:]}"
        )
    return wall, usage.ru_utime + usage.ru_stime, out.decode()


def _child_env() -> dict[str, str]:
    """Returns the children's environment: this checkout first, its bytecode compiled.

    An installed wheel has every module's bytecode compiled at install time; an editable
    install under PYTHONDONTWRITEBYTECODE=1 (this machine's shells, CI) compiles the SDK's
    sources in every process instead, ~0.25 s of CPU that no user of a wheel pays. The
    figures here are a wheel's: the checkout is compiled once, and children may read it.
    """
    for package in ("shard_client", "ledger_server", "tools/shardledger_cli"):
        compileall.compile_dir(str(REPO / package), quiet=1)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SHARDLEDGER_") and k != "PYTHONDONTWRITEBYTECODE"
    }
    env["PYTHONPATH"] = str(REPO)
    return env


def _plan(work: Path, target: str, run: str, count: int) -> list[str]:
    """Plans `count` word-count shards over small files; returns their plan lines."""
    words = "the quick brown fox jumps over the lazy dog and keeps on running " * 40
    manifest = work / "manifest.jsonl"
    with manifest.open("w") as f:
        for i in range(count):
            path = work / "in" / f"{i:04d}.txt"
            path.parent.mkdir(exist_ok=True)
            path.write_text(f"{words} {i}\n")
            f.write(json.dumps({"input": str(path), "expected_outputs": ["counts"]}) + "\n")
    cli = [sys.executable, "-m", "shardledger_cli", "plan", run, "--manifest", str(manifest)]
    env = {**os.environ, "SHARDLEDGER_SERVER": target}
    subprocess.run(cli, env=env, check=True, capture_output=True, timeout=300)
    dry = subprocess.run([*cli, "--dry-run"], env=env, check=True, capture_output=True, text=True)
    return [t for t in dry.stdout.splitlines() if t.strip()]


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def bench_job(repeat: int = 5, beat_seconds: float = 6.0) -> dict[str, Any]:
    """Measures every job with and without the SDK against a ledger started here."""
    from ledger_server.config import ServerConfig
    from ledger_server.server import create_server
    from shard_client.client import LedgerClient

    work = Path(tempfile.mkdtemp(prefix="bench-job-"))
    running = create_server(ServerConfig(database=str(work / "ledger.db"), listen="127.0.0.1:0"))
    try:
        target = f"127.0.0.1:{running.port}"
        lines = iter(_plan(work, target, "bench-job", 60 + 12 * repeat + 200 * repeat))
        env = _child_env()
        env.update(SHARDLEDGER_SPOOL_DIR=str(work / "spool"))
        scripts = {}
        for name, text in (
            ("plain_bare", PLAIN_BARE),
            ("plain_sdk", PLAIN_SDK),
            ("torch_bare", TORCH_BARE),
            ("torch_sdk", TORCH_SDK),
            ("beats", BEATS),
        ):
            scripts[name] = work / f"{name}.py"
            scripts[name].write_text(text)
        out = str(work / "out")
        py = sys.executable

        def job(name: str, *, count: int = 1, server: str = target) -> list[str]:
            batch = "\n".join(next(lines) for _ in range(count))
            return [py, str(scripts[name]), server, "bench-job", batch, out]

        refused = "127.0.0.1:9"  # discard: nothing listens (a refused connection)
        calls: dict[str, Callable[[], list[str]]] = {
            "python -c pass": lambda: [py, "-c", "pass"],
            "import grpc + stubs": lambda: [py, "-c", GRPC_FLOOR],
            "import torch": lambda: [py, "-c", "import torch"],
            "word count": lambda: job("plain_bare"),
            "word count + SDK": lambda: job("plain_sdk"),
            "word count + SDK, ledger down": lambda: job("plain_sdk", server=refused),
            "torch job": lambda: job("torch_bare"),
            "torch job + SDK": lambda: job("torch_sdk"),
        }
        samples: dict[str, list[tuple[float, float, str]]] = {name: [] for name in calls}
        for _ in range(repeat):  # interleaved: a burst of other load hits every call alike
            for name, argv in calls.items():
                samples[name].append(_measured(argv(), env))
        per_process = {
            name: {
                "wall_s": _median([s[0] for s in got]),
                "cpu_s": _median([s[1] for s in got]),
            }
            for name, got in samples.items()
        }
        closes = [json.loads(s[2])["close_s"] for s in samples["word count + SDK, ledger down"]]
        torch_loaded = [json.loads(s[2])["torch"] for s in samples["word count + SDK"]]
        many: dict[str, list[tuple[float, float, str]]] = {"bare": [], "sdk": []}
        for _ in range(repeat):
            many["bare"].append(_measured(job("plain_bare", count=100), env))
            many["sdk"].append(_measured(job("plain_sdk", count=100), env))
        # The same shard twice, beat_seconds each with 50 commits: beating every 20 ms, and not.
        beats = _measured([*job("beats"), "0.02", str(beat_seconds), "50"], env)
        quiet = _measured([*job("beats"), "1000", str(beat_seconds), "50"], env)
        beat_figures = json.loads(beats[2])
        client = LedgerClient(target)
        counted = {json.loads(run[2])["attempt"]: 0 for run in (beats, quiet)}
        for event in client.list_events("bench-job"):
            if event.attempt_id in counted and event.WhichOneof("payload") == "heartbeat":
                counted[event.attempt_id] += 1
        client.close()
        beat_count = counted[beat_figures["attempt"]] - counted[json.loads(quiet[2])["attempt"]]
        commit_s = beat_figures["commit_sdk_s"] / 50
        commit_extra_s = (beat_figures["commit_sdk_s"] - beat_figures["commit_raw_s"]) / 50
        beat_s = max(beats[1] - quiet[1], 0.0) / max(beat_count, 1)
    finally:
        running.stop(grace_s=0)
    floor = per_process["import grpc + stubs"]
    base = per_process["python -c pass"]
    plain_added = {
        k: round(per_process["word count + SDK"][k] - per_process["word count"][k], 4)
        for k in ("wall_s", "cpu_s")
    }
    torch_added = {
        k: round(per_process["torch job + SDK"][k] - per_process["torch job"][k], 4)
        for k in ("wall_s", "cpu_s")
    }
    per_shard = {
        "wall_s": round(
            (_median([s[0] for s in many["sdk"]]) - _median([s[0] for s in many["bare"]])) / 100, 5
        ),
        "cpu_s": round(
            (_median([s[1] for s in many["sdk"]]) - _median([s[1] for s in many["bare"]])) / 100, 5
        ),
    }
    # A 60 s shard at the default cadence: heartbeat_timeout 60 s -> a beat every 15 s.
    shard_share = (4 * beat_s + commit_extra_s) / 60
    # The budget is the SDK's floor (import grpc + stubs, over an empty interpreter) + 100 ms,
    # in wall time as the issue states it and in CPU, which another process's load on
    # the machine moves far less (each process is mostly CPU-bound, so on an idle
    # machine the two agree).
    budget = {k: floor[k] - base[k] + 0.100 for k in ("wall_s", "cpu_s")}
    targets = {
        "word count: SDK adds <= import grpc + stubs + 100 ms": {
            "added_wall_s": plain_added["wall_s"],
            "budget_wall_s": round(budget["wall_s"], 4),
            "added_cpu_s": plain_added["cpu_s"],
            "budget_cpu_s": round(budget["cpu_s"], 4),
            "met": plain_added["wall_s"] <= budget["wall_s"],
            "met_cpu": plain_added["cpu_s"] <= budget["cpu_s"],
        },
        "torch job: SDK adds <= 100 ms over the job's own imports": {
            "added_wall_s": torch_added["wall_s"],
            "added_cpu_s": torch_added["cpu_s"],
            "budget_s": 0.1,
            "met": torch_added["wall_s"] <= 0.1,
            "met_cpu": torch_added["cpu_s"] <= 0.1,
        },
        "heartbeats + commit <= 0.5 % of a 60 s shard's CPU": {
            "share_pct": round(100 * shard_share, 4),
            "met": shard_share <= 0.005,
        },
        "exit with the ledger down <= 0.5 s": {
            "close_s_median": _median(closes),
            "close_s_max": round(max(closes), 4),
            "met": max(closes) <= 0.5,
        },
    }
    return {
        "env": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "load_1m": round(os.getloadavg()[0], 2),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "repeat": repeat,
        "per_process": per_process,
        "ratios_to_python": {
            name: round(row["cpu_s"] / base["cpu_s"], 2) if base["cpu_s"] else None
            for name, row in per_process.items()
        },
        "sdk_added": {"word_count": plain_added, "torch_job": torch_added},
        "torch_imported_by_word_count": any(torch_loaded),
        "per_shard_in_a_100_shard_process": per_shard,
        "heartbeat": {"beats": beat_count, "cpu_s_per_beat": round(beat_s, 6)},
        "commit_4kib": {
            "cpu_s_sdk": round(commit_s, 6),
            "cpu_s_over_raw": round(commit_extra_s, 6),
        },
        "targets": targets,
    }


def report(result: dict[str, Any]) -> None:
    """Prints the figures as a table, then each target and whether it is met."""
    base = result["per_process"]["python -c pass"]
    print(f"{'per process':<32} {'wall s':>8} {'CPU s':>8} {'CPU x pass':>10}")
    for name, row in result["per_process"].items():
        ratio = row["cpu_s"] / base["cpu_s"] if base["cpu_s"] else float("nan")
        print(f"{name:<32} {row['wall_s']:8.3f} {row['cpu_s']:8.3f} {ratio:10.1f}")
    added = result["sdk_added"]
    print(
        f"SDK added: word count {added['word_count']['wall_s']:+.3f} s wall"
        f" {added['word_count']['cpu_s']:+.3f} s CPU; torch job"
        f" {added['torch_job']['wall_s']:+.3f} s wall {added['torch_job']['cpu_s']:+.3f} s CPU;"
        f" torch imported by the word count: {result['torch_imported_by_word_count']}"
    )
    shard = result["per_shard_in_a_100_shard_process"]
    print(
        f"per shard (100 in one process): {shard['wall_s'] * 1000:.2f} ms wall,"
        f" {shard['cpu_s'] * 1000:.2f} ms CPU; per heartbeat"
        f" {result['heartbeat']['cpu_s_per_beat'] * 1000:.3f} ms CPU"
        f" ({result['heartbeat']['beats']} beats); per 4 KiB commit"
        f" {result['commit_4kib']['cpu_s_over_raw'] * 1000:.3f} ms CPU over write+fsync+rename"
    )
    for name, target in result["targets"].items():
        figures = ", ".join(f"{k} {v}" for k, v in target.items() if k != "met")
        print(f"  {'met   ' if target['met'] else 'MISSED'} {name}: {figures}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m tools.bench job",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--repeat", type=int, default=5, help="runs of each job (5)")
    parser.add_argument(
        "--beat-seconds", type=float, default=6.0, help="how long each heartbeat shard runs (6)"
    )
    parser.add_argument("-o", "--output", default="bench-results/job.json", help="JSON file")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.beat_seconds <= 0:
        parser.error("--beat-seconds must be positive")
    from ledger_server.server import configure_logging
    from tools.bench.projections import save_result

    configure_logging("warning")
    result = bench_job(args.repeat, args.beat_seconds)
    report(result)
    save_result(args.output, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
