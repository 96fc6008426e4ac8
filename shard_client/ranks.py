"""Which rank of a multi-rank launch this process is, and the one attempt id all its ranks share.

A torchrun (or any launcher that sets ``RANK``/``WORLD_SIZE``) job runs one shard
as N processes. Each of them opens ``ledger.shard(run, shard)``; they must all
land in *one* attempt without talking to each other first, so the attempt id is
derived from what every rank of one launch sees alike: the run, the shard, the
launch id (torchrun's ``TORCHELASTIC_RUN_ID``, else Slurm's job and step ids)
and the launcher's restart count (an elastic restart is a new attempt that
supersedes the previous one).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from blake3 import blake3

__all__ = ["RANK_PLACEHOLDER", "RankInfo", "attempt_id_for", "detect", "own_outputs"]

RANK_PLACEHOLDER: Final = "{rank}"
_MAX_WORLD_SIZE: Final = 65_536


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        if default is None:
            raise ValueError(f"${name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r} is not an integer") from None


@dataclass(frozen=True, slots=True)
class RankInfo:
    """One process's place in a multi-rank launch."""

    rank: int
    world_size: int
    local_rank: int = 0
    launch_id: str = ""
    restart_count: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.world_size <= _MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be in [1, {_MAX_WORLD_SIZE}]")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} must be in [0, world_size {self.world_size})")
        if not 0 <= self.local_rank < self.world_size:
            raise ValueError("local_rank must be in [0, world_size)")
        if self.restart_count < 0:
            raise ValueError("restart_count must be >= 0")
        if len(self.launch_id) > 255:
            raise ValueError("launch_id must be at most 255 characters")

    @property
    def multi(self) -> bool:
        """Returns whether the launch has more than one rank."""
        return self.world_size > 1


def detect(env: Mapping[str, str] | None = None) -> RankInfo | None:
    """Returns this process's rank as torchrun (or srun) set it; None outside a multi-rank launch.

    ``RANK`` and ``WORLD_SIZE`` are what torch.distributed reads too; the launch id is
    ``TORCHELASTIC_RUN_ID``, else ``SLURM_JOB_ID.SLURM_STEP_ID``. A launch of several
    ranks without either has nothing all its ranks share: pass ``attempt_id=``.
    """
    env = os.environ if env is None else env
    if not env.get("WORLD_SIZE", "").strip():
        return None
    world = _int(env, "WORLD_SIZE")
    if world <= 1:
        return None
    launch = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if not launch and env.get("SLURM_JOB_ID", "").strip():
        launch = f"slurm-{env['SLURM_JOB_ID'].strip()}.{env.get('SLURM_STEP_ID', '0').strip()}"
    return RankInfo(
        rank=_int(env, "RANK"),
        world_size=world,
        local_rank=_int(env, "LOCAL_RANK", 0),
        launch_id=launch,
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
    )


def attempt_id_for(run_id: str, shard_id: str, info: RankInfo) -> str:
    """Returns the attempt id every rank of one launch (and restart) derives alike."""
    if not info.launch_id:
        raise ValueError(
            "a multi-rank shard needs a launch id all its ranks share: run it under torchrun "
            "(TORCHELASTIC_RUN_ID) or Slurm, or pass ranks=RankInfo(launch_id=...) or attempt_id="
        )
    key = "\x00".join((run_id, shard_id, info.launch_id, str(info.restart_count)))
    return f"r{info.restart_count}-{blake3(key.encode()).hexdigest()[:32]}"


def own_outputs(names: tuple[str, ...], info: RankInfo | None) -> tuple[str, ...]:
    """Returns the expected outputs this rank commits: its ``{rank}`` names; rank 0 the others too.

    A name without ``{rank}`` is the shard's (rank 0 writes it, after a barrier);
    ``weights.rank{rank}`` is each rank's own.
    """
    rank = info.rank if info is not None else 0
    out = []
    for name in names:
        if RANK_PLACEHOLDER in name:
            out.append(name.replace(RANK_PLACEHOLDER, str(rank)))
        elif rank == 0:
            out.append(name)
    return tuple(out)
