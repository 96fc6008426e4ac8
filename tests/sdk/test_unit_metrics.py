"""progress() values become a heartbeat the ledger stores, whatever a training loop passes."""

from __future__ import annotations

import decimal
import logging
from typing import Any

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from ledger_server.codec import decode_event
from ledger_server.validation import MAX_MAP_ENTRIES, validate
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.metrics import MAX_METRIC_NAME_CHARS, MAX_METRICS, TelemetryCoercer


def coercer() -> TelemetryCoercer:
    """Returns a coercer for one attempt."""
    return TelemetryCoercer(shard_id="s-1", attempt_id="a-1")


def stored(step: object, progress: object, metrics: dict[str, Any]) -> pb.Heartbeat:
    """Coerces values into a heartbeat and checks that the ledger's validation accepts it."""
    values = coercer().coerce(step, progress, metrics)
    beat = pb.Heartbeat(
        step=values.step,
        progress=values.progress,
        metrics=values.metrics,
        nonfinite_metrics=values.nonfinite,
    )
    # The longest envelope the ledger accepts: the budget must leave room for it.
    event = pb.ShardEvent(
        event_id="e" * 128,
        namespace="n" * 63,
        run_id="r" * 128,
        shard_id="s" * 128,
        attempt_id="a" * 128,
        client_time=Timestamp(seconds=1_700_000_000, nanos=123_456_789),
        heartbeat=beat,
    )
    validate(decode_event(event))  # raises InvalidEvent or LimitExceeded if it would be refused
    return beat


class Unfloatable:
    """A value whose __float__ raises, like a tensor with several elements."""

    def __float__(self) -> float:
        raise RuntimeError("a Tensor with 4 elements cannot be converted to Scalar")


def test_nan_and_infinite_metrics_are_named_sorted_and_unique_and_finite_ones_kept() -> None:
    beat = stored(3, 0.5, {"loss": float("nan"), "grad": float("inf"), "lr": 1e-3, "a": -1e999})
    assert dict(beat.metrics) == {"lr": 1e-3}
    assert list(beat.nonfinite_metrics) == ["a", "grad", "loss"]


def test_numbers_of_every_kind_are_read_with_float() -> None:
    beat = stored(1, 0.1, {"i": 3, "b": True, "d": decimal.Decimal("0.25"), "huge": 10**400})
    assert dict(beat.metrics) == {"i": 3.0, "b": 1.0, "d": 0.25}
    assert list(beat.nonfinite_metrics) == ["huge"]  # beyond any float: infinite


def test_numpy_and_torch_scalars_are_coerced_and_their_nans_named() -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    beat = stored(
        np.int64(7),
        np.float32(0.5),
        {
            "np": np.float32(0.5),
            "np_nan": np.float64("nan"),
            "t": torch.tensor(2.0),
            "t_inf": torch.tensor(float("-inf")),
            "vector": torch.ones(4),
        },
    )
    assert beat.step == 7 and beat.progress == 0.5
    assert dict(beat.metrics) == {"np": 0.5, "t": 2.0}
    assert list(beat.nonfinite_metrics) == ["np_nan", "t_inf"]


def test_values_that_are_no_number_are_dropped_and_logged_once_per_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    telemetry = coercer()
    odd = {"s": "0.5", "raw": b"1", "none": None, "list": [1.0], "bad": Unfloatable(), "ok": 2}
    with caplog.at_level(logging.WARNING, logger="shard_client"):
        for step in range(3):
            values = telemetry.coerce(step, 0.0, odd)
            assert (values.metrics, values.nonfinite) == ({"ok": 2.0}, ())
    dropped = [r.getMessage() for r in caplog.records if "metric_dropped" in r.getMessage()]
    assert len(dropped) == 5  # one line per bad metric, not one per call
    assert any("metric='bad'" in line and "cannot be converted" in line for line in dropped)


def test_a_nan_is_logged_the_first_time_only(caplog: pytest.LogCaptureFixture) -> None:
    telemetry = coercer()
    with caplog.at_level(logging.WARNING, logger="shard_client"):
        for step in range(5):
            telemetry.coerce(step, 0.0, {"loss": float("nan")})
    [line] = [r.getMessage() for r in caplog.records]
    assert "metric_nonfinite" in line and "metric='loss'" in line and "step 0" in line


def test_too_many_metrics_and_too_long_names_are_clamped_to_the_ledgers_limits() -> None:
    many = {f"m{i}": float(i) for i in range(MAX_MAP_ENTRIES + 50)}
    assert len(stored(1, 0.0, many).metrics) == MAX_METRICS == MAX_MAP_ENTRIES
    long_names = {f"{i:03d}" + "x" * 400: float(i) for i in range(MAX_MAP_ENTRIES)}
    long_names |= {f"{i:03d}" + "y" * 400: float("nan") for i in range(10)}
    beat = stored(1, 0.0, long_names)  # fits the 64 KiB the ledger stores per event
    # Every non-finite name is kept (the evidence), finite values fill what is left.
    assert len(beat.nonfinite_metrics) == 10 and 100 < len(beat.metrics) < MAX_MAP_ENTRIES
    assert all(len(n) == MAX_METRIC_NAME_CHARS for n in [*beat.metrics, *beat.nonfinite_metrics])


def test_names_the_ledger_refuses_are_repaired_or_dropped() -> None:
    beat = stored(1, 0.0, {"": 1.0, "a\x00b": 2.0})
    assert dict(beat.metrics) == {"a?b": 2.0}


@pytest.mark.parametrize(
    ("step", "progress", "expected"),
    [
        (-1, 0.5, (0, 0.5)),
        (2**70, 0.5, (0, 0.5)),
        ("x", 0.5, (0, 0.5)),
        (4.9, float("nan"), (4, 0.0)),
        (1, 1.5, (1, 1.0)),
        (1, -2.0, (1, 0.0)),
        (1, "half", (1, 0.0)),
    ],
)
def test_a_step_or_progress_out_of_range_is_clamped_not_raised(
    step: object, progress: object, expected: tuple[int, float]
) -> None:
    beat = stored(step, progress, {})
    assert (beat.step, beat.progress) == expected
