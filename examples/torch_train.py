"""A torch training job wired with shard_client: checkpoints, resume, SIGTERM grace.

    shardledger plan night-02 --manifest examples/train_jobs.jsonl
    LINE=$(shardledger plan night-02 --manifest examples/train_jobs.jsonl --dry-run | head -1)
    python examples/torch_train.py --run night-02 --line "$LINE" --out out/

docs/tutorial.md shows this file as it is (a test keeps the two identical).

What the SDK adds to an ordinary training loop:

* every ``checkpoint_every`` steps, ``shard.save_checkpoint`` writes model,
  optimizer and every RNG state atomically and records the checkpoint;
* on start, ``shard.load_latest_checkpoint`` restores the newest one the ledger
  recorded for this run and shard (its bytes re-hashed), so a rerun of a
  preempted or killed shard continues where it stopped, bit-exactly, and a new
  run never starts from an old run's weights; outputs live in
  ``OUT/<run>/<shard>/`` so two runs never share a checkpoint directory;
* ``shard.progress`` every few steps arms the SDK's hang watchdog: a deadlock
  (no progress for 10 x the step time + 5 min) is diagnosed, recorded as
  failed(timeout) and stopped without any external watchdog;
  ``--deadlock-at-step N`` makes the data loader hang at step N to see it;
* on SIGTERM (Slurm's ``--signal``, a spot reclaim), ``shard.stopping`` turns
  true: the loop saves a checkpoint and leaves within ``sigterm_grace``
  seconds; the attempt is recorded as failed(preempted) and the shard lands in
  the resume list;
* weights and metrics are committed with ``shard.atomic_write``; a clean exit
  without both is recorded as failed(incomplete), never as a success;
* ``input=line`` re-reads the input's identity against the plan when the shard
  starts: an input another pipeline rewrote since ``plan`` is recorded as
  failed(input_changed) before any step runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import blake3
import torch

from shard_client import Ledger, Preempted, Shard, determinism

EXIT_PREEMPTED = 143  # 128 + SIGTERM, what a scheduler expects from a job it stopped


def load_data(path: str, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns a regression task seeded by the input's bytes (stands in for your data loader)."""
    seed = int.from_bytes(blake3.blake3(Path(path).read_bytes()).digest()[:4], "little")
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 16, generator=generator)
    w = torch.randn(16, 1, generator=generator)
    return x, torch.tanh(x @ w)


def train(shard: Shard, line: dict[str, Any], work: Path, deadlock_at_step: int | None) -> int:
    """Trains from the latest checkpoint; returns the step it resumed from."""
    params = line["params"]
    steps, every = int(params["steps"]), int(params["checkpoint_every"])
    x, y = load_data(line["input"], int(params["samples"]))
    torch.manual_seed(int(params["seed"]))
    hidden = int(params["hidden"])
    model = torch.nn.Sequential(
        torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=float(params["lr"]))
    loaded = shard.load_latest_checkpoint(model=model, optimizer=optimizer)
    start = loaded.step if loaded else 0
    for step in range(start + 1, steps + 1):
        if step == deadlock_at_step:
            threading.Event().wait()  # a data loader waiting for a batch that never comes
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        if shard.stopping:
            # SIGTERM: save what we have and leave; the rerun continues from here.
            shard.save_checkpoint(step, model=model, optimizer=optimizer)
            return start
        if step % every == 0 and step < steps:
            shard.save_checkpoint(step, model=model, optimizer=optimizer)
        if step % 10 == 0 or step == steps:
            shard.progress(step, progress=step / steps, loss=loss.item())
    with torch.no_grad():
        final_loss = torch.nn.functional.mse_loss(model(x), y).item()
    with shard.atomic_write(
        work / "weights.pt", name="weights", media_type="application/x-torch"
    ) as f:
        torch.save(model.state_dict(), f)
    metrics = {"shard_id": line["shard_id"], "steps": steps, "final_loss": final_loss}
    with shard.atomic_write(
        work / "metrics.json", name="metrics", media_type="application/json"
    ) as f:
        f.write(json.dumps(metrics, sort_keys=True).encode())
    return start


def run_line(
    ledger: Ledger,
    run_id: str,
    line: dict[str, Any],
    *,
    out_dir: str,
    deadlock_at_step: int | None = None,
) -> None:
    """Runs one shard of the plan line as one attempt."""
    shard_id = line["shard_id"]
    # One directory per run and shard: a new run over the same inputs starts clean.
    work = Path(out_dir) / run_id / shard_id
    # Before the shard starts, so the fingerprint records the deterministic settings.
    determinism.enable(int(line["params"]["seed"]))
    with ledger.shard(
        run_id,
        shard_id,
        expected_outputs=["weights", "metrics"],
        output_dir=work,
        checkpoint_dir=work / "checkpoints",
        heartbeat_timeout=120.0,  # stale on the ledger after this long without a beat
        sigterm_grace=30.0,
        input=line,  # re-checked against the plan: a rewritten input stops it here
    ) as shard:
        resumed = train(shard, line, work, deadlock_at_step)
        print(f"{shard_id}: resumed from step {resumed}" if resumed else f"{shard_id}: fresh start")


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the shard of one plan line; exits 143 when SIGTERM stopped it after a checkpoint."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="run id")
    parser.add_argument("--line", required=True, help="one plan line (JSON) with its shard_id")
    parser.add_argument("--out", default="out", help="output directory (default: out)")
    parser.add_argument("--server", default=None, help="ledger HOST:PORT ($SHARDLEDGER_SERVER)")
    parser.add_argument(
        "--deadlock-at-step", type=int, default=None, help="hang at this step (see the watchdog)"
    )
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    with Ledger(args.server) as ledger:
        try:
            line = json.loads(args.line)
            run_line(
                ledger, args.run, line, out_dir=args.out, deadlock_at_step=args.deadlock_at_step
            )
        except Preempted as exc:
            print(f"preempted: {exc}", file=sys.stderr)
            return EXIT_PREEMPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
