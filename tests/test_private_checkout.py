"""The suite's permission tests pass from a checkout in a private (0700) directory.

A clone in a home directory or in `mktemp -d` sits under a directory only its owner may
enter. The tests of permission errors start a child that file modes bind
(tests.builders.without_root_bypass); as root it must still read the checkout and its
virtual environment. Here the sources are copied into such a directory, with a virtual
environment of their own beside them (the copy as its editable install, this
interpreter's path for the dependencies), and those tests run there in a pytest of their own.
A child of another uid (nobody, what they used before) cannot enter the directory: it
failed with "No module named shardledger_cli".
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Final

import pytest

from tests.builders import holds_root_bypass

REPO: Final = Path(__file__).resolve().parents[1]
# Every test whose child runs through without_root_bypass (the check below keeps it whole).
PERMISSION_TESTS: Final = (
    "tests/cli/test_plan.py::test_an_input_or_directory_the_planner_may_not_read_is_named_with_exit_5",
    "tests/server/test_storage_faults.py::test_a_read_only_ledger_file_or_directory_is_refused_at_start_with_the_fix",
)
# What the permission tests import and the pytest configuration (pyproject.toml).
COPIED: Final = ("ledger_server", "shard_client", "tools", "tests", "pyproject.toml")


def test_every_test_that_drops_root_bypass_is_run_from_a_private_checkout() -> None:
    users = {
        path.relative_to(REPO).as_posix()
        for path in (REPO / "tests").rglob("test_*.py")
        if path != Path(__file__).resolve()
        and "without_root_bypass(" in path.read_text(encoding="utf-8")
    }
    assert users == {node.split("::")[0] for node in PERMISSION_TESTS}


@pytest.mark.skipif(
    not holds_root_bypass(),
    reason="not root: the permission tests start their children as they are, from anywhere",
)
def test_the_permission_tests_pass_from_a_checkout_in_a_0700_directory() -> None:
    private = Path(tempfile.mkdtemp(prefix="sl-private-"))
    try:
        assert private.stat().st_mode & 0o777 == 0o700
        checkout = private / "shardledger"
        checkout.mkdir()
        for name in COPIED:
            source = REPO / name
            if source.is_dir():
                ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", "*.pyc")
                shutil.copytree(source, checkout / name, ignore=ignore)
            else:
                shutil.copy2(source, checkout / name)
        python = _venv(private / "venv", checkout)
        done = subprocess.run(
            [python, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *PERMISSION_TESTS],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=checkout,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            | {"PYTHONDONTWRITEBYTECODE": "1"},
        )
        out = done.stdout + done.stderr
        assert done.returncode == 0, out[-4000:]
        assert re.search(rf"\b{len(PERMISSION_TESTS)} passed\b", out), out[-4000:]
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _venv(where: Path, checkout: Path) -> str:
    """Makes a virtual environment that imports the checkout; returns its python.

    A path file puts the checkout first, as the editable install's finder does, then
    the entries of this interpreter's path that are not this checkout, for the
    dependencies: as paths, so their own path files, and with them the finder that
    points at this checkout, are not read.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = {REPO, REPO / "tools"}
    deps = [p for p in sys.path if p and Path(p).resolve() not in ours]
    paths = [str(checkout), str(checkout / "tools"), *deps]
    (Path(purelib) / "shardledger-checkout.pth").write_text("".join(f"{p}\n" for p in paths))
    return str(python)
