"""Knobs that `python -m tools.campaign` turns on the crash and fuzz tests, and their tallies.

Unset, every knob leaves a test at its CI size. ``SHARDLEDGER_CAMPAIGN_KILLS`` sets
the SIGKILLs of each kill loop, ``SHARDLEDGER_CAMPAIGN_FAILOVERS`` the stop-and-promote
rounds of the PostgreSQL failover loop, ``SHARDLEDGER_CAMPAIGN_NETNS_ROUNDS`` how often
each case of the network-namespace fault suite runs, ``SHARDLEDGER_CAMPAIGN_PATRONI_ROUNDS``
how often each fault of the Patroni suite runs, ``SHARDLEDGER_CAMPAIGN_FUZZ_SECONDS``
the wall time the fuzz campaign keeps going after its quotas (shared among its tests),
``SHARDLEDGER_CAMPAIGN_FUZZ_SCALE`` multiplies the fuzz quotas, and
``SHARDLEDGER_CAMPAIGN_REPORT_DIR`` is where each test leaves a JSON tally of what
it checked (written before the test asserts, so a failing run still says what it saw).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Final

ENV_KILLS: Final = "SHARDLEDGER_CAMPAIGN_KILLS"
ENV_FUZZ_SECONDS: Final = "SHARDLEDGER_CAMPAIGN_FUZZ_SECONDS"
ENV_FUZZ_SCALE: Final = "SHARDLEDGER_CAMPAIGN_FUZZ_SCALE"
ENV_REPORT_DIR: Final = "SHARDLEDGER_CAMPAIGN_REPORT_DIR"
ENV_FAILOVERS: Final = "SHARDLEDGER_CAMPAIGN_FAILOVERS"
ENV_NETNS_ROUNDS: Final = "SHARDLEDGER_CAMPAIGN_NETNS_ROUNDS"
ENV_PATRONI_ROUNDS: Final = "SHARDLEDGER_CAMPAIGN_PATRONI_ROUNDS"


def _number(name: str, default: float, *, minimum: float) -> float:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number") from None
    if not value >= minimum:  # also refuses NaN
        raise ValueError(f"{name}={raw!r}: expected a number >= {minimum:g}")
    return value


def kills(default: int) -> int:
    """Returns the SIGKILLs a kill loop makes: the campaign's setting, else the default."""
    return int(_number(ENV_KILLS, default, minimum=1))


def failovers(default: int) -> int:
    """Returns the stop-and-promote rounds of the failover loop: the campaign's setting, else the default."""
    return int(_number(ENV_FAILOVERS, default, minimum=1))


def netns_rounds(default: int) -> int:
    """Returns how many times each network-namespace fault case runs: the campaign's setting, else the default."""
    return int(_number(ENV_NETNS_ROUNDS, default, minimum=1))


def patroni_rounds(default: int) -> int:
    """Returns how many times each Patroni fault runs: the campaign's setting, else the default."""
    return int(_number(ENV_PATRONI_ROUNDS, default, minimum=1))


def fuzz_seconds() -> float:
    """Returns the wall time the fuzz campaign runs past its quotas (0: stop at the quotas)."""
    return _number(ENV_FUZZ_SECONDS, 0.0, minimum=0)


def fuzz_scale() -> float:
    """Returns the factor on the fuzz quotas (1: the CI size)."""
    return _number(ENV_FUZZ_SCALE, 1.0, minimum=0.001)


def report(name: str, tally: dict[str, Any]) -> None:
    """Saves one test's tally as NAME.json in the campaign's report directory, if one is set."""
    directory = os.environ.get(ENV_REPORT_DIR)
    if not directory:
        return
    path = Path(directory) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"suite": name, **tally}, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
