"""The default-address guard (tests/isolation.py), run on small test files in a pytest of their own.

The session's own guard holds 127.0.0.1:50551 (or a ledger of the developer's does), so
the inner pytest watches a free port instead (``SHARDLEDGER_TEST_GUARD_PORT``), which
its tests treat as the default address.
"""

from __future__ import annotations

import socket
import textwrap
import threading
import time
from pathlib import Path
from typing import Final

import pytest

from tests import isolation

pytest_plugins = ("pytester",)

REPO = Path(__file__).resolve().parents[1]

CONFTEST = """
from tests import isolation

def pytest_configure(config):
    config.pluginmanager.register(isolation, "shardledger-default-address-guard")
"""


# The inner pytest in one process, and spread over two xdist workers (each module on
# one), where the controller holds the port and the worker asks it around each test.
WORKERS: Final = {"one process": ["-n", "0"], "xdist": ["-n", "2", "--dist", "loadscope"]}


@pytest.fixture(params=list(WORKERS))
def workers(request: pytest.FixtureRequest) -> list[str]:
    return WORKERS[request.param]


@pytest.fixture
def guard_port(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, workers: list[str]
) -> int:
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


def inner(pytester: pytest.Pytester, port: int, body: str, *pytester_args: str) -> pytest.RunResult:
    pytester.makepyfile(
        test_inner=f"import socket\nimport grpc\nimport pytest\nPORT = {port}\n"
        + textwrap.dedent(body)
    )
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", *pytester_args)


def test_a_test_that_connects_to_the_default_address_fails_naming_itself_and_the_fix(
    pytester: pytest.Pytester, guard_port: int, workers: list[str]
) -> None:
    who = "the xdist worker running the test" if "2" in workers else "this pytest process"
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
        *workers,
    )
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            f"*default-address guard: active on 127.0.0.1:{guard_port}*",
            "*ERROR at teardown of test_falls_back_on_the_default*",
            f"*test_falls_back_on_the_default connected to the default ledger address"
            f" 127.0.0.1:{guard_port}*{who}*pass its address explicitly"
            "*@pytest.mark.default_address*",
        ]
    )
    assert "test_own_address connected" not in result.stdout.str()


def test_a_connection_from_a_child_process_is_seen_too(
    pytester: pytest.Pytester, guard_port: int, workers: list[str]
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
        *workers,
    )
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*test_child_connects connected to the default ledger*pid *"])


def test_a_marked_test_may_serve_and_connect_on_the_default_address_and_the_guard_resumes(
    pytester: pytest.Pytester, guard_port: int, workers: list[str]
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
        *workers,
    )
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_after_it_falls_back*"])
    assert "test_means_the_default connected" not in result.stdout.str()


def test_with_the_port_taken_the_guard_is_inactive_and_a_marked_test_is_skipped(
    pytester: pytest.Pytester, guard_port: int, workers: list[str]
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
            *workers,
        )
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(
        [
            f"*default-address guard: inactive, 127.0.0.1:{guard_port} is in use*",
            f"*SKIPPED*127.0.0.1:{guard_port} is in use by another process*",
        ]
    )


def test_the_ledger_variables_of_a_developer_are_removed_from_the_tests_environment(
    pytester: pytest.Pytester, guard_port: int, monkeypatch: pytest.MonkeyPatch, workers: list[str]
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
        *workers,
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["*removed from the environment: SHARDLEDGER_SERVER, SHARDLEDGER_DATABASE_URL*"]
    )


def _barrier(pytester: pytest.Pytester) -> str:
    """Returns the source of meet(name): waits until two tests have called it (60 s at most)."""
    here = str(pytester.path)
    return (
        "import time, pathlib\n"
        "def meet(name):\n"
        f"    pathlib.Path({here!r}, 'barrier.' + name).touch()\n"
        "    deadline = time.monotonic() + 60\n"
        f"    while len(list(pathlib.Path({here!r}).glob('barrier.*'))) < 2:\n"
        "        assert time.monotonic() < deadline, 'the other worker never came'\n"
        "        time.sleep(0.02)\n"
    )


@pytest.mark.parametrize("workers", [WORKERS["xdist"]], ids=["xdist"], indirect=False)
def test_with_tests_in_two_workers_at_once_only_the_one_that_connected_fails(
    pytester: pytest.Pytester, guard_port: int
) -> None:
    # Both modules wait at a barrier, so their tests overlap in two workers; the
    # connection is made (by a child, as a CLI would) while both run.
    pytester.makepyfile(
        test_connects=_barrier(pytester)
        + f"import subprocess, sys\nPORT = {guard_port}\n"
        + textwrap.dedent(
            """
            def test_child_reaches_the_default():
                meet("connects")
                code = (
                    "import socket\\n"
                    f"s = socket.create_connection(('127.0.0.1', {PORT}))\\n"
                    "s.recv(1)\\n"
                )
                subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
                time.sleep(0.5)
            """
        ),
        test_quiet=_barrier(pytester)
        + textwrap.dedent(
            """
            def test_stays_home():
                meet("quiet")
                time.sleep(1.5)
            """
        ),
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", *WORKERS["xdist"])
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        ["*test_child_reaches_the_default connected to the default ledger*pid *"]
    )
    assert "test_stays_home connected" not in result.stdout.str()


@pytest.mark.parametrize("workers", [WORKERS["xdist"]], ids=["xdist"], indirect=False)
def test_a_connection_no_worker_made_fails_the_session_naming_the_tests_then_running(
    pytester: pytest.Pytester, guard_port: int
) -> None:
    # A daemonised grandchild (re-parented away from its worker) holds a connection open
    # while tests run in both workers: the guard cannot name one, so the session fails.
    pytester.makepyfile(
        test_daemon=_barrier(pytester)
        + f"import subprocess, sys\nPORT = {guard_port}\n"
        + textwrap.dedent(
            """
            def test_leaves_a_daemon():
                meet("daemon")
                code = (
                    "import os, socket, time\\n"
                    "if os.fork():\\n"
                    "    os._exit(0)\\n"
                    f"s = socket.create_connection(('127.0.0.1', {PORT}))\\n"
                    "time.sleep(3)\\n"
                )
                subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
                time.sleep(1)
            """
        ),
        test_quiet=_barrier(pytester)
        + textwrap.dedent(
            """
            def test_stays_home():
                meet("quiet")
                time.sleep(1.5)
            """
        ),
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", *WORKERS["xdist"])
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*= default-address guard =*",
            "*connection(s) to 127.0.0.1:*that no test could be named for*",
            "*while these tests ran: test_daemon.py::test_leaves_a_daemon,"
            " test_quiet.py::test_stays_home*",
        ]
    )


def test_a_connection_from_outside_the_session_is_charged_to_no_test(
    pytester: pytest.Pytester, guard_port: int, workers: list[str]
) -> None:
    # Another checkout's suite, or a CLI of the developer's, reaches the port while a test
    # runs here: this process (the outer pytest) is neither the inner session's
    # descendant nor carries its token. The inner test waits until it has connected.
    here = pytester.path
    reached = threading.Event()

    def outsider() -> None:
        deadline = time.monotonic() + 60
        while not (here / "running").exists():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with socket.create_connection(("127.0.0.1", guard_port)) as sock:
            sock.recv(1)  # until the guard has closed it
        (here / "connected").touch()
        reached.set()

    thread = threading.Thread(target=outsider, daemon=True)
    thread.start()
    result = inner(
        pytester,
        guard_port,
        f"""
        import pathlib, time

        def test_runs_while_someone_else_connects():
            pathlib.Path({str(here)!r}, "running").touch()
            deadline = time.monotonic() + 60
            while not pathlib.Path({str(here)!r}, "connected").exists():
                assert time.monotonic() < deadline, "the outsider never connected"
                time.sleep(0.02)
        """,
        *workers,
    )
    thread.join(60)
    assert reached.is_set()
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["*1 connection(s) to 127.0.0.1:* from processes outside this session*"]
    )
