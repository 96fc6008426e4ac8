"""The default-address guard (tests/isolation.py), run on small test files in a pytest of their own.

The session's own guard holds 127.0.0.1:50551 (or a ledger of the developer's does), so
the inner pytest watches a free port instead (``SHARDLEDGER_TEST_GUARD_PORT``), which
its tests treat as the default address.
"""

from __future__ import annotations

import socket
import textwrap
from pathlib import Path

import pytest

from tests import isolation

pytest_plugins = ("pytester",)

REPO = Path(__file__).resolve().parents[1]

CONFTEST = """
from tests import isolation

def pytest_configure(config):
    config.pluginmanager.register(isolation, "shardledger-default-address-guard")
"""


@pytest.fixture
def guard_port(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> int:
    """Sets up an inner pytest whose guard watches a free port; returns the port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    monkeypatch.setenv(isolation.PORT_ENV, str(port))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makeconftest(CONFTEST)
    pytester.makeini(
        f"[pytest]\nmarkers =\n    {isolation.MARKER}: means the default ledger address\n"
    )
    return port


def inner(pytester: pytest.Pytester, port: int, body: str) -> pytest.RunResult:
    pytester.makepyfile(
        test_inner=f"import socket\nimport grpc\nimport pytest\nPORT = {port}\n"
        + textwrap.dedent(body)
    )
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")


def test_a_test_that_connects_to_the_default_address_fails_naming_itself_and_the_fix(
    pytester: pytest.Pytester, guard_port: int
) -> None:
    result = inner(
        pytester,
        guard_port,
        """
        def test_falls_back_on_the_default():
            with grpc.insecure_channel(f"127.0.0.1:{PORT}") as channel:
                with pytest.raises(grpc.FutureTimeoutError):
                    grpc.channel_ready_future(channel).result(timeout=1)

        def test_own_address():
            pass
        """,
    )
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            f"*default-address guard: active on 127.0.0.1:{guard_port}*",
            "*ERROR at teardown of test_falls_back_on_the_default*",
            f"*test_falls_back_on_the_default connected to the default ledger address"
            f" 127.0.0.1:{guard_port}*this pytest process*pass its address explicitly"
            "*@pytest.mark.default_address*",
        ]
    )
    assert "test_own_address connected" not in result.stdout.str()


def test_a_connection_from_a_child_process_is_seen_too(
    pytester: pytest.Pytester, guard_port: int
) -> None:
    result = inner(
        pytester,
        guard_port,
        """
        import subprocess, sys

        def test_child_connects():
            code = (
                "import socket, time\\n"
                f"s = socket.create_connection(('127.0.0.1', {PORT}))\\n"
                "s.recv(1)\\n"  # held open until the guard has closed it
            )
            subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
        """,
    )
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*test_child_connects connected to the default ledger*pid *"])


def test_a_marked_test_may_serve_and_connect_on_the_default_address_and_the_guard_resumes(
    pytester: pytest.Pytester, guard_port: int
) -> None:
    result = inner(
        pytester,
        guard_port,
        """
        @pytest.mark.default_address
        def test_means_the_default(default_address):
            assert default_address == f"127.0.0.1:{PORT}"
            with socket.socket() as own:
                own.bind(("127.0.0.1", PORT))
                own.listen()
                socket.create_connection(("127.0.0.1", PORT)).close()

        def test_after_it_falls_back():
            socket.create_connection(("127.0.0.1", PORT)).close()
        """,
    )
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_after_it_falls_back*"])
    assert "test_means_the_default connected" not in result.stdout.str()


def test_with_the_port_taken_the_guard_is_inactive_and_a_marked_test_is_skipped(
    pytester: pytest.Pytester, guard_port: int
) -> None:
    with socket.socket() as users_ledger:
        users_ledger.bind(("127.0.0.1", guard_port))
        users_ledger.listen()
        result = inner(
            pytester,
            guard_port,
            """
            def test_unmarked_reaches_what_listens():
                socket.create_connection(("127.0.0.1", PORT)).close()

            @pytest.mark.default_address
            def test_marked():
                raise AssertionError("must not run beside another listener")
            """,
        )
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(
        [
            f"*default-address guard: inactive, 127.0.0.1:{guard_port} is in use*",
            f"*SKIPPED*127.0.0.1:{guard_port} is in use by another process*",
        ]
    )


def test_the_ledger_variables_of_a_developer_are_removed_from_the_tests_environment(
    pytester: pytest.Pytester, guard_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHARDLEDGER_SERVER", "ledger.example:50551")
    monkeypatch.setenv("SHARDLEDGER_DATABASE_URL", "postgresql://me@prod/ledger")
    result = inner(
        pytester,
        guard_port,
        """
        import os

        def test_sees_none():
            assert "SHARDLEDGER_SERVER" not in os.environ
            assert "SHARDLEDGER_DATABASE_URL" not in os.environ
        """,
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["*removed from the environment: SHARDLEDGER_SERVER, SHARDLEDGER_DATABASE_URL*"]
    )
