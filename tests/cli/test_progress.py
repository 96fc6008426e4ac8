"""Progress on long commands: a line every 10 s when piped (a batch log), nothing with --quiet."""

from __future__ import annotations

import pytest

from shardledger_cli import cli, output


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_piped_work_reports_n_of_m_rate_and_time_left_every_interval_and_at_its_end(
    capsys: pytest.CaptureFixture[str],
) -> None:
    clock = Clock()
    with output._lines("verifying", 1000, every_s=10.0, clock=clock) as advance:
        for _ in range(4):  # 40 items in the first 4 s: no line yet
            clock.now += 1.0
            advance(10)
        assert capsys.readouterr().err == ""
        clock.now += 6.0
        advance(60)  # 100 items at 10 s
        clock.now += 5.0
        advance(50)  # 15 s: under the interval since the last line
        clock.now += 5.0
        advance(50)  # 200 items at 20 s
        clock.now += 1.0  # then it ends (an error, say): the last line says where
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "shardledger: verifying: 100/1,000 (10%), 10.0/s, 90 s left",
        "shardledger: verifying: 200/1,000 (20%), 10.0/s, 80 s left",
        "shardledger: verifying: 200/1,000 (20%), 9.5/s, 84 s left",
    ]


def test_work_that_ends_within_the_interval_prints_nothing_when_piped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    clock = Clock()
    with output._lines("hashing inputs", 3, every_s=10.0, clock=clock) as advance:
        for _ in range(3):
            clock.now += 1.0
            advance(1)
    assert capsys.readouterr().err == ""


def test_quiet_silences_progress(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "QUIET", True)
    with output.progress("verifying", 1_000_000) as advance:
        advance(1_000_000)
    assert capsys.readouterr().err == ""
    assert cli.build_parser().parse_args(["verify", "r", "--quiet"]).quiet is True
