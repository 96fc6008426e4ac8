"""Subprocess for the resume test: trains a small MLP whose every step draws from all global RNGs.

Usage: ckpt_train.py MODE CKPT_DIR SPLIT_STEP TOTAL_STEPS

MODE "first": trains 0..SPLIT, saves a checkpoint, prints "saved <path>", then
blocks until it is SIGKILLed.
MODE "verify": trains 0..TOTAL from scratch and prints "straight <hex>"; waits
for a line on stdin (the first run has then been killed); resumes from the
latest checkpoint, trains to TOTAL and prints "resumed <hex>"; resumes once
more without restoring RNGs and prints "without_rng <hex>", which must differ
if the RNGs matter. One interpreter does all three because importing torch and
enabling determinism dominate the runtime.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import blake3
import numpy as np
import torch
from torch import nn

from shard_client import determinism
from shard_client.checkpoint import (
    checkpoint_name,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)

SEED = 1234
BATCH = 8


def build() -> tuple[nn.Module, Any, Any]:
    """Returns a fresh model, SGD-with-momentum optimizer and StepLR scheduler."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return model, optimizer, scheduler


def train(model: nn.Module, optimizer: Any, scheduler: Any, *, start: int, stop: int) -> None:
    """Runs steps start..stop; data, shuffling, dropout and loss scale all consume RNG."""
    model.train()
    for _ in range(start, stop):
        x = torch.randn(BATCH, 16)
        y = torch.randint(0, 4, (BATCH,))
        order = torch.from_numpy(np.random.permutation(BATCH))
        scale = 1.0 + random.random() * 0.1
        loss = nn.functional.cross_entropy(model(x[order]) * scale, y[order])
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        scheduler.step()


def digest(model: nn.Module, optimizer: Any) -> str:
    """Returns BLAKE3 over the weights and momentum buffers, in a fixed order."""
    hasher = blake3.blake3()
    for name, tensor in sorted(model.state_dict().items()):
        hasher.update(name.encode())
        hasher.update(tensor.detach().contiguous().numpy().tobytes())
    for _, state in sorted(optimizer.state_dict()["state"].items()):
        hasher.update(state["momentum_buffer"].contiguous().numpy().tobytes())
    return hasher.hexdigest()


def resume(ckpt_dir: str, *, total: int, restore_rng: bool) -> str:
    """Resumes from the latest checkpoint, trains to total and returns the digest."""
    model, optimizer, scheduler = build()
    path = latest_checkpoint(ckpt_dir)
    assert path is not None, f"no checkpoint in {ckpt_dir}"
    loaded = load_checkpoint(
        path, model=model, optimizer=optimizer, scheduler=scheduler, restore_rng=restore_rng
    )
    train(model, optimizer, scheduler, start=loaded.step, stop=total)
    return digest(model, optimizer)


def main() -> None:
    """Runs the mode named on the command line."""
    mode, ckpt_dir, split, total = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    # Thread count changes CPU reduction order; pin it so processes are comparable.
    torch.set_num_threads(1)
    determinism.enable(SEED)
    model, optimizer, scheduler = build()
    if mode == "verify":
        train(model, optimizer, scheduler, start=0, stop=total)
        print("straight", digest(model, optimizer), flush=True)
        sys.stdin.readline()
        print("resumed", resume(ckpt_dir, total=total, restore_rng=True), flush=True)
        print("without_rng", resume(ckpt_dir, total=total, restore_rng=False), flush=True)
        return
    train(model, optimizer, scheduler, start=0, stop=split)
    info = save_checkpoint(
        f"{ckpt_dir}/{checkpoint_name(split)}",
        step=split,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        extra={"note": "first half"},
    )
    print("saved", info.path, flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
