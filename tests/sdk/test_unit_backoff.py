"""The retry schedule: 50 ms, doubling, capped; the client's sleeps jittered into [half, all)."""

from __future__ import annotations

import inspect

import pytest

from shard_client import backoff
from shard_client.client import LedgerClient
from shard_client.sender import Sender


def _schedule(cap_s: float, count: int) -> list[float]:
    delays = [backoff.FIRST_DELAY_S]
    while len(delays) < count:
        delays.append(backoff.grown(delays[-1], cap_s))
    return delays


def test_delays_double_from_50_ms_until_the_cap() -> None:
    assert _schedule(2.0, 9) == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0]
    assert _schedule(5.0, 9) == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]


@pytest.mark.parametrize(("draw", "expected"), [(0.0, 0.8), (0.5, 1.2), (0.999, 1.5992)])
def test_jitter_keeps_between_half_and_all_of_the_delay(draw: float, expected: float) -> None:
    assert backoff.jittered(1.6, lambda: draw) == pytest.approx(expected)


def test_the_client_and_the_sender_cap_at_their_documented_defaults() -> None:
    client_cap = inspect.signature(LedgerClient).parameters["max_backoff_s"].default
    sender_cap = inspect.signature(Sender).parameters["max_backoff_s"].default
    assert (client_cap, sender_cap) == (2.0, 5.0)
