"""Checkpoints that resume bit-exactly: model, optimizer, scheduler and every global RNG.

Checkpoints are written with :func:`shard_client.atomic.atomic_write`, so a
crash never leaves a torn ``ckpt-*.pt`` and the digest is computed while the
bytes stream out. torch (and numpy) are imported inside the functions: importing
this module costs nothing in jobs that never checkpoint.

Loading unpickles arbitrary objects (RNG states are not plain tensors, so
``weights_only=False`` is required): load checkpoints only from locations the
job trusts, and pass ``expected_blake3`` from the ledger to refuse a file that
is not the one that was committed.
"""

from __future__ import annotations

import fnmatch
import importlib
import os
import random
import re
from dataclasses import dataclass
from typing import Any

from shard_client.atomic import TEMP_PREFIX, CommitInfo, OnCommit, atomic_write, hash_fd

__all__ = [
    "CHECKPOINT_PATTERN",
    "CheckpointDigestMismatch",
    "LoadedCheckpoint",
    "checkpoint_name",
    "checkpoints_newest_first",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]

FORMAT_VERSION = 1
CHECKPOINT_PATTERN = "ckpt-*.pt"
_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    """What a loaded checkpoint hands back besides the states it restored in place."""

    step: int
    extra: dict[str, Any]
    path: str


class CheckpointDigestMismatch(ValueError):
    """Raised when a checkpoint's BLAKE3 digest differs from the expected one."""

    def __init__(self, *, path: str, expected: str, actual: str) -> None:
        super().__init__(f"{path}: blake3 {actual} != expected {expected}")
        self.path = path
        self.expected = expected
        self.actual = actual


def checkpoint_name(step: int) -> str:
    """Returns the conventional file name for a step, zero-padded so names sort by step."""
    return f"ckpt-{step:08d}.pt"


def _optional_module(name: str) -> Any:
    """Returns the imported module, or None if it is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _capture_rng(torch: Any) -> dict[str, Any]:
    """Returns the state of every global RNG a training step may draw from."""
    numpy = _optional_module("numpy")
    return {
        "python": random.getstate(),
        "numpy": numpy.random.get_state() if numpy is not None else None,
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _restore_rng(torch: Any, rng: dict[str, Any]) -> None:
    """Puts every global RNG back into a captured state."""
    random.setstate(rng["python"])
    numpy = _optional_module("numpy")
    if numpy is not None and rng["numpy"] is not None:
        numpy.random.set_state(rng["numpy"])
    # map_location may have moved the state tensors; the setters want CPU bytes.
    torch.set_rng_state(rng["torch_cpu"].cpu())
    if torch.cuda.is_available():
        # Resuming on fewer GPUs restores the ones that exist; more GPUs keep fresh seeds.
        for index, state in enumerate(rng["torch_cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state.cpu(), device=index)


def _state_dict(component: Any) -> Any:
    """Returns a component's state_dict, or None when there is no component."""
    return None if component is None else component.state_dict()


def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    step: int,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
    on_commit: OnCommit | None = None,
) -> CommitInfo:
    """Atomically writes a checkpoint of the given states and all RNGs, and returns its commit."""
    torch: Any = importlib.import_module("torch")
    payload = {
        "format": FORMAT_VERSION,
        "step": step,
        "model": _state_dict(model),
        "optimizer": _state_dict(optimizer),
        "scheduler": _state_dict(scheduler),
        "extra": dict(extra or {}),
        "rng": _capture_rng(torch),
    }
    with atomic_write(path, on_commit=on_commit) as f:
        torch.save(payload, f)
    return f.commit_info


def _restore_component(component: Any, state: Any, *, name: str, path: str) -> None:
    """Loads a saved state into a component, refusing a checkpoint that lacks it."""
    if component is None:
        return
    if state is None:
        raise ValueError(f"{path}: checkpoint has no {name} state")
    component.load_state_dict(state)


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    map_location: Any = "cpu",
    restore_rng: bool = True,
    expected_blake3: str | None = None,
) -> LoadedCheckpoint:
    """Loads a checkpoint from a trusted location, restoring the given states and the RNGs."""
    torch: Any = importlib.import_module("torch")
    final = os.path.abspath(os.fspath(path))
    with open(final, "rb") as f:
        if expected_blake3 is not None:
            # Hash the descriptor we then load from, so a concurrent replace cannot slip in.
            _, actual = hash_fd(f.fileno())
            if actual != expected_blake3:
                raise CheckpointDigestMismatch(path=final, expected=expected_blake3, actual=actual)
        payload = torch.load(f, map_location=map_location, weights_only=False)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION:
        raise ValueError(f"{final}: not a shardledger checkpoint of format {FORMAT_VERSION}")
    _restore_component(model, payload["model"], name="model", path=final)
    _restore_component(optimizer, payload["optimizer"], name="optimizer", path=final)
    _restore_component(scheduler, payload["scheduler"], name="scheduler", path=final)
    if restore_rng:
        _restore_rng(torch, payload["rng"])
    return LoadedCheckpoint(step=int(payload["step"]), extra=payload["extra"], path=final)


def latest_checkpoint(
    directory: str | os.PathLike[str], pattern: str = CHECKPOINT_PATTERN
) -> str | None:
    """Returns the checkpoint with the highest step in a directory, or None if there is none.

    The step is the last run of digits in the file name; temp files of
    interrupted writes never count, and a missing directory means no checkpoint.
    """
    found = checkpoints_newest_first(directory, pattern)
    return found[0] if found else None


def checkpoints_newest_first(
    directory: str | os.PathLike[str], pattern: str = CHECKPOINT_PATTERN
) -> list[str]:
    """Returns the directory's checkpoints, highest step first (see latest_checkpoint)."""
    root = os.path.abspath(os.fspath(directory))
    try:
        with os.scandir(root) as scan:
            entries = list(scan)
    except FileNotFoundError:
        return []
    found: list[tuple[int, str]] = []
    for entry in entries:
        if entry.name.startswith(TEMP_PREFIX) or not fnmatch.fnmatchcase(entry.name, pattern):
            continue
        digits = _DIGITS.findall(entry.name)
        if digits and entry.is_file():
            found.append((int(digits[-1]), entry.name))
    return [os.path.join(root, name) for _, name in sorted(found, reverse=True)]
