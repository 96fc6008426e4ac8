"""Bad input to the CLI: a precise one-line message, the contract's exit code, no traceback, no change.

Exit codes (README, docs/cli.md): 0 ok, 1 problems found, 2 usage, 3 unreachable,
4 refused by the server, 5 local error.
"""

from __future__ import annotations

import datetime
import os
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ledger_server.config import ServerConfig
from ledger_server.server import RunningServer, create_server
from ledger_server.startup import StartupError
from ledger_server.store.sqlite import SqliteStore
from shard_client.client import LedgerClient
from shardledger_cli.cli import EXIT_LOCAL, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE
from tests.builders import planned, run_cli

ENTRY_POINT = Path(sys.executable).parent / "shardledger"


pytestmark = pytest.mark.usefixtures("quiet_logs")


cli = run_cli


def run_module(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Runs `python -m shardledger_cli ARGV` as a real process."""
    return subprocess.run(
        [sys.executable, "-m", "shardledger_cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def listed(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# --- python -m shardledger_cli and the entry point agree ---------------------------------


@pytest.mark.parametrize("runner", ["module", "entry_point"])
def test_a_command_error_is_one_line_and_its_exit_code_under_both_entry_points(
    tmp_path: Path, runner: str
) -> None:
    if runner == "entry_point" and not ENTRY_POINT.exists():
        pytest.skip("the shardledger script is not installed beside this interpreter")
    head = [sys.executable, "-m", "shardledger_cli"] if runner == "module" else [str(ENTRY_POINT)]
    argv = ["token", "create", "--role", "reader", "--expires-in", "soon"]
    done = subprocess.run(
        [*head, *argv, "--db", str(tmp_path / "l.db")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == EXIT_USAGE
    assert done.stderr == (
        "shardledger: bad duration 'soon': use a number and one of s, m, h, d, w (e.g. 30d)\n"
    )
    assert done.stdout == ""
    assert listed(tmp_path) == []


# --- shardledger serve: refused starts ----------------------------------------------


def serve(tmp_path: Path, *argv: str, db: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Runs `serve` as a real process; every case here must refuse within seconds."""
    database = str(db if db is not None else tmp_path / "ledger.db")
    return run_module("serve", "--db", database, "--log-level", "warning", *argv, timeout=60)


def assert_refused(done: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardledger: "), done.stderr
    for needle in needles:
        assert needle in done.stderr


def test_serve_on_a_port_in_use_names_the_port_and_creates_no_ledger(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = serve(tmp_path, "--listen", f"127.0.0.1:{port}")
    assert_refused(
        done, EXIT_LOCAL, f"cannot listen on 127.0.0.1:{port}: Address already in use", "--listen"
    )
    assert listed(tmp_path) == []


def test_serve_with_metrics_on_a_port_in_use_is_refused_before_the_ledger_exists(
    tmp_path: Path,
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = serve(tmp_path, "--listen", "127.0.0.1:0", "--metrics-listen", f"127.0.0.1:{port}")
    assert_refused(done, EXIT_LOCAL, "Address already in use", "--metrics-listen")
    assert listed(tmp_path) == []


def test_a_port_taken_between_the_check_and_the_bind_is_refused_and_releases_the_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("ledger_server.server.check_free", lambda listen, option: None)
    db = tmp_path / "ledger.db"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(StartupError) as refused:
            create_server(ServerConfig(database=str(db), listen=f"127.0.0.1:{port}"))
    assert f"cannot listen on 127.0.0.1:{port}: gRPC could not bind it" in refused.value.message
    assert not refused.value.usage
    SqliteStore(db).claim_writer()  # the refused start let go of the writer lock


def test_serve_on_a_directory_is_refused_and_writes_nothing_into_it(tmp_path: Path) -> None:
    done = serve(tmp_path, "--listen", "127.0.0.1:0", db=tmp_path)
    assert_refused(done, EXIT_LOCAL, f"--db {tmp_path} is a directory", "ledger.db")
    assert listed(tmp_path) == []
    assert not Path(f"{tmp_path}.signing-key.pem").exists()


def test_serve_in_a_directory_that_does_not_exist_is_refused_and_creates_nothing(
    tmp_path: Path,
) -> None:
    mistyped = tmp_path / "ledgr" / "ledger.db"
    done = serve(tmp_path, "--listen", "127.0.0.1:0", db=mistyped)
    assert_refused(
        done,
        EXIT_LOCAL,
        f"--db {mistyped}: the directory {mistyped.parent} does not exist",
        f"mkdir -p {mistyped.parent}",
    )
    assert listed(tmp_path) == []


def test_serve_on_a_file_that_is_not_a_database_is_refused_and_leaves_it_alone(
    tmp_path: Path,
) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a ledger\n" * 100)
    done = serve(tmp_path, "--listen", "127.0.0.1:0", db=notes)
    assert_refused(done, EXIT_LOCAL, f"cannot open the database {notes}", "file is not a database")
    assert notes.read_text() == "not a ledger\n" * 100
    assert listed(tmp_path) == ["notes.txt"]


def test_serve_with_tls_files_that_are_not_pem_names_the_file(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("hello\n")
    done = serve(
        tmp_path, "--listen", "127.0.0.1:0", "--tls-cert", str(junk), "--tls-key", str(junk)
    )
    assert_refused(done, EXIT_LOCAL, f"--tls-key {junk}: not a PEM private key")
    assert "Failed to bind" not in done.stderr
    assert listed(tmp_path) == ["junk.pem"]


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def test_serve_with_a_key_that_is_not_the_certificates_is_refused(tmp_path: Path) -> None:
    signer, other = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(signer.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(signer, hashes.SHA256())
    )
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "other.pem").write_bytes(_key_pem(other))
    done = serve(
        tmp_path,
        *("--listen", "127.0.0.1:0"),
        *("--tls-cert", str(tmp_path / "cert.pem"), "--tls-key", str(tmp_path / "other.pem")),
    )
    assert_refused(done, EXIT_LOCAL, "is not the key of --tls-cert")
    assert listed(tmp_path) == ["cert.pem", "other.pem"]


def test_serve_with_a_signing_key_that_is_not_one_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "key.pem"
    key.write_text("hello\n")
    done = serve(tmp_path, "--listen", "127.0.0.1:0", "--signing-key", str(key))
    assert_refused(done, EXIT_LOCAL, f"the signing key {key} (--signing-key) is unusable")
    assert "cryptography.io" not in done.stderr
    assert listed(tmp_path) == ["key.pem"]


def test_serve_with_a_port_file_that_is_a_directory_is_refused_before_listening(
    tmp_path: Path,
) -> None:
    (tmp_path / "run").mkdir()
    done = serve(tmp_path, "--listen", "127.0.0.1:0", "--port-file", str(tmp_path / "run"))
    assert_refused(done, EXIT_LOCAL, f"--port-file {tmp_path / 'run'} is a directory")
    assert "serving on" not in done.stderr
    assert listed(tmp_path) == ["run"] and listed(tmp_path / "run") == []


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (("--listen", "127.0.0.1:99999"), "--listen 127.0.0.1:99999: port 99999 is out of range"),
        (("--listen", "nonsense"), "--listen 'nonsense' is not HOST:PORT"),
        (("--listen", "::1:50551"), "IPv6 addresses go in brackets"),
        (("--listen", "127.0.0.1:0", "--metrics-listen", "nonsense"), "--metrics-listen"),
        (("--listen", "127.0.0.1:0", "--max-workers", "0"), "--max-workers: must be at least 1"),
        (("--listen", "127.0.0.1:0", "--grace", "nan"), "--grace: must be a finite number"),
        (("--listen", "0.0.0.0:0"), "refusing to serve plaintext on non-loopback address"),
        (("--listen", "127.0.0.1:0", "--database-url", "mysql://h/db"), "--database-url"),
    ],
)
def test_serve_with_a_malformed_option_is_a_usage_error_that_creates_nothing(
    tmp_path: Path, argv: Sequence[str], needle: str
) -> None:
    done = serve(tmp_path, *argv)
    assert done.returncode == EXIT_USAGE, done.stderr
    assert needle in done.stderr
    assert "Traceback" not in done.stderr
    assert "plaintext" not in done.stderr or "0.0.0.0" in argv[1]
    assert listed(tmp_path) == []


def test_a_second_server_on_a_ledger_exits_5_with_the_writer_message(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    first = create_server(ServerConfig(database=str(db), listen="127.0.0.1:0"))
    try:
        done = serve(tmp_path, "--listen", "127.0.0.1:0", db=db)
    finally:
        first.stop(0.5)
    assert_refused(done, EXIT_LOCAL, f"cannot serve {db}:", "is being written by another process")


# --- token and import: --db must name a ledger --------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ("token", "create", "--role", "reader"),
        ("token", "list"),
        ("token", "revoke", "abc123"),
    ],
)
def test_token_commands_refuse_a_missing_ledger_and_create_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: Sequence[str]
) -> None:
    missing = tmp_path / "typo" / "ledger.db"
    code, out, err = cli(capsys, *argv, "--db", str(missing))
    assert code == EXIT_LOCAL
    assert err == (
        f"shardledger: no ledger at {missing}: no such file"
        " (check --db; `shardledger serve --db PATH` creates a new ledger)\n"
    )
    assert out == ""  # no token printed that no server would accept
    assert listed(tmp_path) == []


def test_token_list_on_a_missing_file_leaves_no_file_behind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(capsys, "token", "list", "--db", str(tmp_path / "never.db"))
    assert code == EXIT_LOCAL and "no ledger at" in err and "no tokens" not in err
    assert listed(tmp_path) == []


def test_token_commands_refuse_a_directory_and_a_file_that_is_not_a_ledger(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(capsys, "token", "list", "--db", str(tmp_path))
    assert code == EXIT_LOCAL
    assert err == f"shardledger: no ledger at {tmp_path}: a directory, not a ledger file\n"

    notes = tmp_path / "notes.txt"
    notes.write_text("hello\n")
    code, _, err = cli(capsys, "token", "create", "--role", "reader", "--db", str(notes))
    assert code == EXIT_LOCAL
    assert err == f"shardledger: no ledger at {notes}: file is not a database\n"
    assert notes.read_text() == "hello\n"

    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE t (x)")
    before = other.read_bytes()
    code, out, err = cli(capsys, "token", "create", "--role", "reader", "--db", str(other))
    assert code == EXIT_LOCAL and out == ""
    assert "a SQLite database without the ledger's tables" in err
    assert other.read_bytes() == before  # no tables added, journal mode untouched
    assert listed(tmp_path) == ["notes.txt", "other.db"]


def test_token_commands_still_work_on_an_existing_ledger(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "ledger.db"
    SqliteStore(db).close()
    code, out, _ = cli(capsys, "token", "create", "--role", "reader", "--db", str(db))
    assert code == EXIT_OK and out.startswith("slt_")
    code, out, _ = cli(capsys, "token", "list", "--db", f"sqlite:///{db}", "--format", "table")
    assert code == EXIT_OK and " active " in out


def test_a_token_that_expires_at_creation_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "ledger.db"
    SqliteStore(db).close()
    code, out, err = cli(
        capsys, "token", "create", "--role", "reader", "--expires-in", "0d", "--db", str(db)
    )
    assert code == EXIT_USAGE and out == ""
    assert "--expires-in must be more than zero" in err
    store = SqliteStore(db, must_exist=True)
    try:
        assert store.list_tokens() == []
    finally:
        store.close()


@pytest.fixture
def exported(
    server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> Iterator[Path]:
    """Returns a valid export file of a one-shard run."""
    client = LedgerClient(f"127.0.0.1:{server.port}", timeout_s=10)
    try:
        client.append([planned("run-1", "s0", 0)])
        path = tmp_path / "exports" / "run.jsonl"
        path.parent.mkdir()
        code, _, err = cli(capsys, "export", "run-1", "--server", client.target, "-o", str(path))
        assert code == EXIT_OK, err
        yield path
    finally:
        client.close()


def test_import_into_a_new_ledger_in_a_missing_directory_is_refused(
    exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "typo" / "nested" / "copy.db"
    code, out, err = cli(capsys, "import", str(exported), "--db", str(target))
    assert code == EXIT_LOCAL and out == ""
    assert err == (
        f"shardledger: cannot create a ledger at {target}: no directory {target.parent}"
        " (create it first)\n"
    )
    assert not (tmp_path / "typo").exists()


def test_import_refuses_a_directory_or_a_non_ledger_file_and_changes_neither(
    exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(capsys, "import", str(exported), "--db", str(exported.parent))
    assert code == EXIT_LOCAL and "a directory, not a ledger file" in err
    assert listed(exported.parent) == ["run.jsonl"]

    notes = tmp_path / "notes.txt"
    notes.write_text("hello\n")
    code, _, err = cli(capsys, "import", str(exported), "--db", str(notes))
    assert code == EXIT_LOCAL and f"no ledger at {notes}: file is not a database" in err
    assert notes.read_text() == "hello\n"


def test_import_creates_a_new_ledger_in_an_existing_directory(
    exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "copy.db"
    code, out, err = cli(capsys, "import", str(exported), "--db", str(target))
    assert code == EXIT_OK, err
    assert "imported 1 events" in out and target.exists()


# --- connection options --------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "-1", "0", "inf", "soon"])
def test_a_timeout_that_is_not_a_positive_number_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], value: str
) -> None:
    code, _, err = cli(capsys, "status", "run-1", "--timeout", value)
    assert code == EXIT_USAGE
    assert "argument --timeout:" in err and "unreachable" not in err


def test_a_tls_ca_that_is_not_pem_is_a_local_error_before_connecting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    junk = tmp_path / "ca.pem"
    junk.write_text("hello\n")
    port = free_port()
    code, _, err = cli(
        capsys, "status", "run-1", "--server", f"127.0.0.1:{port}", "--tls-ca", str(junk)
    )
    assert code == EXIT_LOCAL
    assert err == f"shardledger: --tls-ca {junk}: not a PEM certificate: Unable to load PEM file\n"

    monkeypatch.setenv("SHARDLEDGER_TLS_CA", str(junk))
    code, _, err = cli(capsys, "status", "run-1", "--server", f"127.0.0.1:{port}")
    assert code == EXIT_LOCAL and f"$SHARDLEDGER_TLS_CA {junk}: not a PEM certificate" in err

    monkeypatch.setenv("SHARDLEDGER_TLS_CA", str(tmp_path / "missing.pem"))
    code, _, err = cli(capsys, "status", "run-1", "--server", f"127.0.0.1:{port}")
    assert code == EXIT_LOCAL and "cannot read $SHARDLEDGER_TLS_CA" in err


def test_unreachable_names_the_target_from_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    target = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("SHARDLEDGER_SERVER", target)
    code, _, err = cli(capsys, "status", "run-1", "--timeout", "0.5")
    assert code == EXIT_UNAVAILABLE
    assert err.startswith(f"shardledger: ledger unreachable at {target}: ")
    assert "default" not in err.splitlines()[0].split(": ")[1]


# --- db and trend ----------------------------------------------------------------------


@pytest.mark.parametrize("role", ["", "  ", "x" * 64])
def test_grants_for_a_role_no_role_can_have_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], role: str
) -> None:
    code, out, err = cli(capsys, "db", "grants", "--role", role)
    assert code == EXIT_USAGE and out == ""
    assert "argument --role:" in err


def test_migrate_shows_a_sqlite_url_as_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    assert url.startswith("sqlite:////")
    code, out, _ = cli(capsys, "db", "migrate", "--database-url", url)
    assert code == EXIT_OK
    assert out.startswith(f"{url}: schema version ")


def test_trend_into_a_closed_pipe_exits_0_like_the_other_commands(server: RunningServer) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # like `| head -1` after its line: every write now fails with EPIPE
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "shardledger_cli",
                "trend",
                "--server",
                f"127.0.0.1:{server.port}",
            ],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert done.returncode == EXIT_OK, done.stderr
    assert done.stderr == ""
