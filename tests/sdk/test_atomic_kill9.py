"""SIGKILL at random moments during atomic_write never leaves a torn or misreported file.

SIGKILL does not drop the page cache, so this checks atomicity and commit
reporting, not durability across power loss (that rests on the fsyncs).
Set SHARDLEDGER_KILL9_SEED to replay a failing run.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import blake3
import pytest

from shard_client.atomic import FAILPOINTS, TEMP_PREFIX, cleanup_orphans

HELPER = Path(__file__).resolve().parents[1] / "helpers" / "atomic_kill_writer.py"
ITERATIONS = 120
MAX_PAYLOAD = 4 * 1024 * 1024
# Kill points the helper reaches on its own; "none" means the test kills after a random delay.
SELF_KILLS = (*FAILPOINTS, "before_log", "after_log", "chunk:0", "chunk:7")
MAX_DELAY_S = 0.03


def choose_plan(rng: random.Random, iteration: int) -> str:
    """Returns where iteration N gets killed: every self-kill point once, then a random mix."""
    if iteration < len(SELF_KILLS):
        return SELF_KILLS[iteration]
    if rng.random() < 0.5:
        return "none"
    if rng.random() < 0.3:
        return f"chunk:{rng.randrange(64)}"
    return rng.choice(SELF_KILLS)


def choose_size(rng: random.Random) -> int:
    """Returns a payload size in 0..4 MiB, biased to include empty and tiny payloads."""
    roll = rng.random()
    if roll < 0.05:
        return 0
    if roll < 0.2:
        return rng.randrange(1, 4096)
    return rng.randrange(MAX_PAYLOAD + 1)


def run_and_kill(
    rng: random.Random, *, target: Path, log: Path, size: int, seed: int, plan: str
) -> None:
    """Runs the helper once and makes sure it ends by SIGKILL."""
    argv = [sys.executable, str(HELPER), str(target), str(log), str(size), str(seed), plan]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        if plan == "none":
            time.sleep(rng.uniform(0, MAX_DELAY_S))
        else:
            # EOF if it killed itself; "committed" if the kill point was never reached.
            proc.stdout.readline()
        proc.kill()
        assert proc.wait(timeout=30) == -signal.SIGKILL


def classify_outcome(*, target: Path, log: Path, size: int, seed: int, context: str) -> str:
    """Checks the invariants after a kill and returns which legal outcome happened."""
    expected = blake3.blake3(random.Random(seed).randbytes(size)).hexdigest()
    logged = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    assert len(logged) <= 1, context
    if target.exists():
        data = target.read_bytes()
        assert len(data) == size, context
        assert blake3.blake3(data).hexdigest() == expected, context
    if logged:
        assert target.exists(), f"commit logged but file missing: {context}"
        assert logged[0] == {"path": str(target), "size": size, "blake3": expected}, context
        return "committed"
    return "renamed_unlogged" if target.exists() else "absent"


@pytest.mark.slow
def test_sigkill_at_random_moments_never_leaves_a_torn_or_misreported_file(
    tmp_path: Path,
) -> None:
    master_seed = int(os.environ.get("SHARDLEDGER_KILL9_SEED", random.randrange(2**32)))
    rng = random.Random(master_seed)
    outcomes: Counter[str] = Counter()
    orphans_removed = 0

    for iteration in range(ITERATIONS):
        plan = choose_plan(rng, iteration)
        size = choose_size(rng)
        seed = rng.randrange(2**32)
        target = tmp_path / f"artifact-{iteration:03d}.bin"
        log = tmp_path / f"commit-{iteration:03d}.log"
        context = f"master_seed={master_seed} iteration={iteration} plan={plan} size={size}"

        run_and_kill(rng, target=target, log=log, size=size, seed=seed, plan=plan)

        outcomes[
            classify_outcome(target=target, log=log, size=size, seed=seed, context=context)
        ] += 1
        removed = cleanup_orphans(tmp_path)
        assert len(removed) <= 1, context
        assert all(os.path.basename(p).startswith(TEMP_PREFIX) for p in removed), context
        assert not [n for n in os.listdir(tmp_path) if n.startswith(TEMP_PREFIX)], context
        orphans_removed += len(removed)

    # The self-kill plans guarantee each outcome, so a silent no-op harness cannot pass.
    assert set(outcomes) == {"absent", "renamed_unlogged", "committed"}, (master_seed, outcomes)
    assert orphans_removed > 0, master_seed
