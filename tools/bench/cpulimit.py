"""A share of one core for a benchmark's server: a CPU cgroup with a CFS quota.

The overload benchmark must offer three times what the server can take. On a small
machine one client process cannot offer three times a whole core's worth of
acknowledged events (it spends about as much CPU per event as the server does), so
the server gets a fraction of a core instead: a cgroup whose quota is that fraction
of every 10 ms period. Root only; cgroup v2 (``cpu.max``) or v1 (``cpu.cfs_quota_us``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

ROOT: Final = Path("/sys/fs/cgroup")
# A short period: the server is stopped at most (1 - share) x 10 ms at a time, well
# under the loop-lag probe's 50 ms, so the quota lowers capacity without looking like
# a stalled loop.
PERIOD_US: Final = 10_000


class CpuLimitError(RuntimeError):
    """The machine cannot give a process a share of a core (not root, no cpu controller)."""


def _group_dir(name: str) -> tuple[Path, str]:
    """Returns the new group's directory and the cgroup version ("2" or "1")."""
    if (ROOT / "cgroup.controllers").exists():
        if "cpu" not in (ROOT / "cgroup.controllers").read_text().split():
            raise CpuLimitError("cgroup v2 without the cpu controller")
        with contextlib.suppress(OSError):
            (ROOT / "cgroup.subtree_control").write_text("+cpu")
        return ROOT / name, "2"
    if (ROOT / "cpu" / "cpu.cfs_quota_us").exists():
        return ROOT / "cpu" / name, "1"
    raise CpuLimitError(f"no CPU cgroup controller under {ROOT}")


@contextlib.contextmanager
def cpu_share(pid: int, share: float) -> Iterator[str]:
    """Holds ``pid`` (all its threads) to ``share`` of one core until the block ends.

    Yields a description for the benchmark's JSON. Raises CpuLimitError where the
    machine cannot (the benchmark then says so instead of measuring a different thing).
    """
    if not 0.01 <= share <= 1.0:
        raise CpuLimitError(f"a share of one core between 0.01 and 1, not {share}")
    group, version = _group_dir(f"shardledger-bench-{os.getpid()}-{pid}")
    quota = round(share * PERIOD_US)
    try:
        group.mkdir()
        if version == "2":
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        (group / "cgroup.procs").write_text(str(pid))
    except OSError as exc:
        with contextlib.suppress(OSError):
            group.rmdir()
        raise CpuLimitError(f"cannot limit the server's CPU in {group}: {exc}") from exc
    try:
        yield f"cgroup v{version} {group.name}: {quota} of every {PERIOD_US} us"
    finally:
        # A group can go once its processes have left it (the caller stops the server
        # first); wait briefly for the exit to be reaped.
        deadline = time.monotonic() + 10.0
        while True:
            try:
                group.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
