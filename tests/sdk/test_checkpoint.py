"""Behaviour of checkpoints and determinism: round trips, RNG restore, bit-exact resume after SIGKILL."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from shard_client import determinism
from shard_client.atomic import TEMP_PREFIX, CommitInfo, hash_file
from shard_client.checkpoint import (
    CheckpointDigestMismatch,
    checkpoint_name,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)

REPO = Path(__file__).resolve().parents[2]
TRAINER = Path(__file__).resolve().parents[1] / "helpers" / "ckpt_train.py"


def subprocess_env() -> dict[str, str]:
    """Returns an environment in which helpers import shard_client from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@pytest.fixture
def restore_torch_globals(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Puts back the process-wide switches determinism.enable flips."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]


def tiny_training_state() -> tuple[nn.Module, Any, Any]:
    """Returns a model, optimizer and scheduler with non-trivial state after one step."""
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def draw_from_every_rng() -> tuple[float, float, list[float]]:
    """Returns one draw from python, numpy and torch global RNGs."""
    return random.random(), float(np.random.random()), torch.rand(3).tolist()


def test_save_then_load_restores_states_step_and_extra(tmp_path: Path) -> None:
    model, optimizer, scheduler = tiny_training_state()
    seen: list[CommitInfo] = []
    path = tmp_path / checkpoint_name(7)

    info = save_checkpoint(
        path,
        step=7,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        extra={"epoch": 2},
        on_commit=seen.append,
    )
    fresh_model = nn.Linear(3, 2)
    fresh_optimizer = torch.optim.Adam(fresh_model.parameters(), lr=0.01)
    fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_optimizer, step_size=1, gamma=0.5)
    loaded = load_checkpoint(
        path, model=fresh_model, optimizer=fresh_optimizer, scheduler=fresh_scheduler
    )

    assert seen == [info]
    assert (info.size_bytes, info.blake3_hex) == hash_file(path)
    assert (loaded.step, loaded.extra, loaded.path) == (7, {"epoch": 2}, str(path))
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh_model.state_dict()[name], tensor)
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 1
    assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr()


def test_load_restores_every_global_rng_to_the_saved_state(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "c.pt", step=0)
    expected = draw_from_every_rng()

    load_checkpoint(tmp_path / "c.pt")

    assert draw_from_every_rng() == expected


def test_load_without_restore_rng_leaves_rngs_alone(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "c.pt", step=0)
    draw_from_every_rng()
    state = (random.getstate(), torch.get_rng_state())

    load_checkpoint(tmp_path / "c.pt", restore_rng=False)

    assert random.getstate() == state[0]
    assert torch.equal(torch.get_rng_state(), state[1])


def test_load_with_expected_digest_refuses_a_different_file(tmp_path: Path) -> None:
    info = save_checkpoint(tmp_path / "c.pt", step=3)

    assert load_checkpoint(tmp_path / "c.pt", expected_blake3=info.blake3_hex).step == 3
    with pytest.raises(CheckpointDigestMismatch) as raised:
        load_checkpoint(tmp_path / "c.pt", expected_blake3="0" * 64)
    assert raised.value.actual == info.blake3_hex


def test_load_into_a_model_refuses_a_checkpoint_without_model_state(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "c.pt", step=1)

    with pytest.raises(ValueError, match="no model state"):
        load_checkpoint(tmp_path / "c.pt", model=nn.Linear(1, 1))


def test_failed_save_leaves_no_file_and_reports_no_commit(tmp_path: Path) -> None:
    seen: list[CommitInfo] = []
    unpicklable = {"callback": lambda: None}

    with pytest.raises(Exception, match="pickle"):
        save_checkpoint(tmp_path / "c.pt", step=1, extra=unpicklable, on_commit=seen.append)

    assert os.listdir(tmp_path) == []
    assert seen == []


def test_latest_checkpoint_picks_highest_step_and_ignores_temps_and_strangers(
    tmp_path: Path,
) -> None:
    for step in (2, 10, 9):
        (tmp_path / checkpoint_name(step)).write_bytes(b"")
    (tmp_path / f"{TEMP_PREFIX}{checkpoint_name(99)}.x1y2").write_bytes(b"")
    (tmp_path / "ckpt-latest.pt").write_bytes(b"")
    (tmp_path / "notes-00000500.txt").write_bytes(b"")
    (tmp_path / checkpoint_name(50)).mkdir()

    assert latest_checkpoint(tmp_path) == str(tmp_path / checkpoint_name(10))


def test_latest_checkpoint_returns_none_for_empty_or_missing_directory(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None


def test_importing_sdk_modules_does_not_import_torch() -> None:
    code = (
        "import sys, shard_client.checkpoint, shard_client.determinism, shard_client.environment;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, check=True
    )
    assert out.stdout.strip() == b"False"


def test_enable_makes_every_rng_repeat_and_reports_what_it_applied(
    restore_torch_globals: None,
) -> None:
    applied = determinism.enable(42)
    first = draw_from_every_rng()
    determinism.enable(42, warn_only=True)

    assert draw_from_every_rng() == first
    assert applied["torch.deterministic_algorithms"] == "true"
    assert applied["env.CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic
    assert not torch.backends.cudnn.benchmark


def test_enable_keeps_a_cublas_workspace_the_job_already_chose(
    restore_torch_globals: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")

    assert determinism.enable(1)["env.CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_enable_rejects_seeds_numpy_cannot_take(seed: int) -> None:
    with pytest.raises(ValueError, match="seed"):
        determinism.enable(seed)


def read_tagged(proc: subprocess.Popen[bytes], tag: str) -> str:
    """Returns the value of the next stdout line, which must start with tag."""
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().split()
    assert line and line[0] == tag, (tag, line)
    return line[1]


def trainer(mode: str, ckpt_dir: Path, *, split: int, total: int) -> subprocess.Popen[bytes]:
    """Starts the training helper in a new interpreter."""
    argv = [sys.executable, str(TRAINER), mode, str(ckpt_dir), str(split), str(total)]
    return subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=subprocess_env()
    )


@pytest.mark.slow
def test_resume_after_sigkill_matches_uninterrupted_training_bit_for_bit(tmp_path: Path) -> None:
    split, total = 6, 12
    # "verify" trains straight through while "first" trains half and saves; only
    # after "first" is SIGKILLed does "verify" resume from its checkpoint.
    with (
        trainer("first", tmp_path, split=split, total=total) as first,
        trainer("verify", tmp_path, split=split, total=total) as verify,
    ):
        saved = read_tagged(first, "saved")
        first.kill()
        assert first.wait(timeout=60) == -signal.SIGKILL
        assert saved == str(tmp_path / checkpoint_name(split))
        assert verify.stdin is not None
        verify.stdin.write(b"go\n")
        verify.stdin.flush()

        straight = read_tagged(verify, "straight")
        assert read_tagged(verify, "resumed") == straight
        # Proves the comparison is sensitive: skipping the RNG restore changes the weights.
        assert read_tagged(verify, "without_rng") != straight
        assert verify.wait(timeout=60) == 0
