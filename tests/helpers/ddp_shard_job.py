"""A multi-rank training shard run under torchrun (Gloo on the CPU): the multi-rank tests' job.

Usage: torchrun --standalone --nproc-per-node N ddp_shard_job.py TARGET RUN SHARD OUT_DIR MODE

Every rank opens ``ledger.shard(run, shard)``; torchrun's environment makes them
one attempt. A step is a DDP forward/backward over a tiny model (Gloo
all-reduces the gradients) and a ``progress()``. At the end each rank writes
its keyed results and its weights (``weights.rank{rank}``), then, after a
barrier, rank 0 merges the results by id into ``results.jsonl``.

MODE:
  clean     every rank finishes and commits.
  kill      rank 1 SIGKILLs itself at step 3 (the others are in an all-reduce).
  stop      rank 1 SIGSTOPs itself at step 3 (the others block in an all-reduce).
  missing   rank 1 never writes its weights and exits cleanly; rank 0 exits cleanly.
  restart   every rank saves its part of a sharded checkpoint at step 1; at step 2
            rank 0 saves its part and both die hard (os._exit: nothing recorded, as
            after a node failure). torchrun restarts them (--max-restarts 1): a new
            attempt, which resumes from step 1, the newest checkpoint with every part.
Timeouts come from the environment the test sets (SHARDLEDGER_HANG_TIMEOUT,
DDP_PG_TIMEOUT, ...).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from shard_client import Ledger, keyed

STEPS = 6


def init_process_group(rank: int, world: int, restart: int, timeout: datetime.timedelta) -> None:
    """Joins this round's Gloo group under a store prefix of the round's own.

    torchrun's agent keeps one store for the whole launch, and a restarted round finds
    the keys of the round before it there: the group's start barrier passed at once and
    Gloo could read a dead peer's address (connectFullMesh failed, or the round hung).
    """
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    # The stores are public API, imported in torch.distributed without a re-export.
    store = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not shared and rank == 0,
        timeout=timeout,
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"round-{restart}", store),  # type: ignore[attr-defined]
        rank=rank,
        world_size=world,
        timeout=timeout,
    )


def main() -> None:
    target, run_id, shard_id, out_dir, mode = sys.argv[1:6]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = Path(out_dir)
    # The collective's own timeout is long (the test's bound on a launch): the SDK's
    # watchdog is what must notice a hang.
    timeout = datetime.timedelta(seconds=float(os.environ.get("DDP_PG_TIMEOUT", "120")))
    init_process_group(rank, world, restart, timeout)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ledger = Ledger(target, spool_dir=str(out / f"spool-{rank}-{restart}"))
    expected = None if mode == "missing" else ["weights.rank{rank}", "results.jsonl"]
    ids = [f"item-{i:03d}" for i in range(8)]
    with ledger.shard(
        run_id,
        shard_id,
        expected_outputs=expected,
        output_dir=out,
        heartbeat_timeout=float(os.environ.get("DDP_HEARTBEAT_TIMEOUT", "3")),
        heartbeat_interval=0.3,
        fingerprint=False,
    ) as shard:
        print(f"rank={rank} attempt={shard.attempt_id} pid={os.getpid()}", flush=True)
        first = 0
        if mode == "restart":
            loaded = shard.load_latest_checkpoint_part(model=model.module, optimizer=optimizer)
            first = loaded.step + 1 if loaded is not None else 0
            print(f"rank={rank} resumed_from={loaded.step if loaded else None}", flush=True)
        for step in range(first, STEPS):
            if step == 3 and rank == 1 and mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if step == 3 and rank == 1 and mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if mode == "restart" and restart == 0 and step == 2:
                if rank == 0:  # rank 0's part of step 2 is saved, rank 1's never is
                    shard.save_checkpoint_part(step, model=model.module, optimizer=optimizer)
                os._exit(1)  # a hard crash: no failed event, as a node failure leaves it
            optimizer.zero_grad()
            loss = model(torch.ones(2, 4) * (rank + 1)).pow(2).mean()
            loss.backward()  # the gradients' all-reduce: a peer that is gone blocks here
            optimizer.step()
            shard.progress(step, (step + 1) / STEPS, loss=float(loss.detach()))
            if mode == "restart" and restart == 0 and step == 1:
                shard.save_checkpoint_part(step, model=model.module, optimizer=optimizer)
            time.sleep(0.1)
        mine = ids[rank::world]
        part = out / f"results.rank{rank}.jsonl"
        # Each rank finishes its slice in its own order: the merge must order by id.
        part.write_text("".join(json.dumps({"id": i, "rank": rank}) + "\n" for i in reversed(mine)))
        if not (mode == "missing" and rank == 1):
            with shard.atomic_write(
                out / f"weights.rank{rank}.pt", name=f"weights.rank{rank}"
            ) as f:
                torch.save(model.module.state_dict(), f)
        dist.barrier()
        if rank == 0:
            parts = [out / f"results.rank{r}.jsonl" for r in range(world)]
            lines = keyed.merge(parts, input_ids=ids)
            with shard.atomic_write(out / "results.jsonl", name="results.jsonl", mode="w") as f:
                f.writelines(lines)
    dist.destroy_process_group()
    ledger.close()


if __name__ == "__main__":
    main()
