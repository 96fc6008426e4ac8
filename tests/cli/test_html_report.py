"""`shardledger report RUN --html`: one offline page, rendered by a real headless Chromium."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
import structlog

from shardledger_cli.cli import EXIT_LOCAL, EXIT_OK
from tests.builders import run_cli
from tests.nights import play_night

pytestmark = pytest.mark.usefixtures("spool_in_tmp")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Where CI keeps what a test wants a person to look at ($SHARDLEDGER_ARTIFACTS_DIR).
ARTIFACTS_ENV = "SHARDLEDGER_ARTIFACTS_DIR"


@pytest.fixture(autouse=True)
def quiet_server_logs() -> Iterator[None]:
    """Keeps the in-process server's log lines out of the CLI's captured stdout."""
    with structlog.testing.capture_logs():
        yield


@pytest.fixture
def page(capsys: pytest.CaptureFixture[str], target: str, tmp_path: Path) -> Path:
    """Three nights played through the SDK; the last one's report written as HTML."""
    root = tmp_path / "out"
    play_night(
        capsys, target, root, "night-1", ["ok", "ok", "ok", "ok", "ok"], labels={"provider": "A"}
    )
    play_night(capsys, target, root, "night-2", ["ok", "ok", "ok", "empty", "missing"])
    play_night(
        capsys,
        target,
        root,
        "night-3",
        ["ok", "empty", "truncated", "preempted", "missing"],
        labels={"provider": "D"},
    )
    out = tmp_path / "night-3.html"
    code, text, err = run_cli(capsys, "report", "night-3", "--html", str(out), "--server", target)
    assert code == EXIT_OK, err
    assert "no external resources" in text
    return out


class _Resources(HTMLParser):
    """Collects every tag that could load something, and every URL attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("script", "link", "img", "iframe", "object", "embed"):
            self.loads.append(tag)
        self.loads += [f"{tag}[{k}]" for k, v in attrs if k in ("src", "href") and v]


def test_the_page_loads_nothing_and_holds_the_key_figures(page: Path) -> None:
    html = page.read_text()
    parser = _Resources()
    parser.feed(html)

    assert parser.loads == []
    assert "http://" not in html and "https://" not in html and "@import" not in html
    assert "<svg" in html
    assert 'id="equation">submitted 5 = verified 2 + failed 0 + missing 1' in html
    assert "+ verify_failed 2</" in html


def _chromium(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    profile = tmp_path / "chromium-profile"
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",  # tests run as root in CI; the page is our own file
            "--disable-gpu",
            "--disable-dev-shm-usage",  # containers often have a tiny /dev/shm
            "--no-first-run",
            f"--user-data-dir={profile}",
            # Offline: no name resolves and no proxy answers, so any fetch would fail.
            "--host-resolver-rules=MAP * ~NOTFOUND",
            "--proxy-server=127.0.0.1:9",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run apt-installs it)")
def test_headless_chromium_renders_the_figures_offline_and_saves_a_screenshot(
    page: Path, tmp_path: Path
) -> None:
    dom = _chromium(tmp_path, "--dump-dom", page.as_uri())

    assert dom.returncode == 0, dom.stderr[-2000:]
    text = dom.stdout

    def figure(ident: str) -> str:
        found = re.search(rf'id="{ident}">([^<]*)<', text)
        assert found, ident
        return found.group(1)

    assert figure("run-id") == "night-3"
    assert figure("equation") == (
        "submitted 5 = verified 2 + failed 0 + missing 1 + running 0 + stale 0 + unverified 0"
        " + verify_failed 2"
    )
    assert figure("completion-rate") == "40.00 %"
    assert figure("silent-error-rate") == "40.00 %"
    assert figure("reconciliation-rate") == "20.00 %"  # only s0 verified at its first attempt
    assert re.search(r"checkpoint every [0-9.]+ s", figure("checkpoint-advice"))
    assert len(re.findall(r'data-state="verify_failed"', text)) == 2
    assert len(re.findall(r"<circle ", text)) == 6  # 3 runs x 2 series in the trend
    assert re.findall(r"<td>(night-\d)</td>", text) == ["night-1", "night-2", "night-3"]

    shot = tmp_path / "night-3.png"
    done = _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1100,2600", page.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    artifacts = os.environ.get(ARTIFACTS_ENV)
    if artifacts:
        os.makedirs(artifacts, exist_ok=True)
        shutil.copy(shot, Path(artifacts) / "report-night-3.png")


def test_an_unwritable_html_path_is_a_local_error(
    capsys: pytest.CaptureFixture[str], target: str, tmp_path: Path
) -> None:
    play_night(capsys, target, tmp_path / "out", "night-x", ["ok"])

    code, _, err = run_cli(
        capsys,
        "report",
        "night-x",
        "--html",
        str(tmp_path / "no" / "such" / "x.html"),
        "--server",
        target,
    )

    assert code == EXIT_LOCAL and "cannot write" in err
