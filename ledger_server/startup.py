"""What `shardledger serve` checks before it creates anything.

Every option a start could fail on is checked first (the address, TLS files,
the signing key, a port already taken, the database file), so a refused start
says which option is wrong in one line and leaves no new ledger behind.
"""

from __future__ import annotations

import errno
import ipaddress
import math
import os
import shlex
import socket
from pathlib import Path
from typing import Final, Literal

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from ledger_server.config import DEFAULT_DB, ENGINES, ServerConfig, split_listen
from ledger_server.signing import SigningKey
from ledger_server.store import Store, open_store
from ledger_server.store.base import StoreError
from ledger_server.store.urls import redact_url, sqlite_path


class StartupError(SystemExit):
    """The server refuses to start; the message says which option is wrong and what to do.

    A SystemExit, so an embedder that does not catch it still exits with the
    message; `shardledger serve` maps ``usage`` to its exit codes (2 when a
    flag's value is wrong, 5 when the machine's state is: a port in use, a file).
    """

    def __init__(self, message: str, *, usage: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.usage = usage


def _split_listen(listen: str, option: str = "--listen") -> tuple[str, int]:
    """Returns (host, port) of a HOST:PORT address, or raises StartupError (usage)."""
    try:
        return split_listen(listen, option)
    except ValueError as exc:
        raise StartupError(str(exc), usage=True) from None


def is_loopback(listen: str) -> bool:
    """Returns whether a HOST:PORT listen address is on loopback only."""
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_config(config: ServerConfig) -> None:
    """Raises StartupError (usage) for option values no start could succeed with."""
    _split_listen(config.listen)
    if config.metrics_listen:
        _split_listen(config.metrics_listen, "--metrics-listen")
    tls = config.tls_cert is not None or config.tls_key is not None
    if tls and not (config.tls_cert and config.tls_key):
        raise StartupError("TLS needs both --tls-cert and --tls-key", usage=True)
    if config.client_ca and not tls:
        raise StartupError("--client-ca (mutual TLS) needs --tls-cert and --tls-key", usage=True)
    if not tls and not config.insecure and not is_loopback(config.listen):
        raise StartupError(
            f"refusing to serve plaintext on non-loopback address {config.listen}: "
            "anyone on the network could read and write the ledger; "
            "give --tls-cert/--tls-key, or pass --insecure to accept that",
            usage=True,
        )
    if config.auth not in ("auto", "tokens", "off"):
        raise StartupError(f"--auth must be auto, tokens or off, not {config.auth!r}", usage=True)
    if config.engine not in ENGINES:
        raise StartupError(
            f"--engine must be {', '.join(ENGINES[:-1])} or {ENGINES[-1]}, not {config.engine!r}",
            usage=True,
        )
    for option, value in (
        ("--max-workers", config.max_workers),
        ("--max-concurrent-rpcs", config.max_concurrent_rpcs),
        ("--max-append-streams", config.max_append_streams),
        ("--admission-min-events", config.admission_min_events),
    ):
        if value < 1:
            raise StartupError(f"{option} must be at least 1, not {value}", usage=True)
    for option, seconds in (
        ("--admission-delay", config.admission_delay_s),
        ("--admission-loop-lag", config.admission_loop_lag_s),
    ):
        if not (math.isfinite(seconds) and seconds >= 0):
            raise StartupError(
                f"{option} must be a number of seconds >= 0, not {seconds}", usage=True
            )
    if not (math.isfinite(config.grace_s) and config.grace_s >= 0):
        raise StartupError(
            f"--grace must be a number of seconds >= 0, not {config.grace_s}", usage=True
        )
    if not (math.isfinite(config.pg_commit_wait_bound_s) and config.pg_commit_wait_bound_s >= 0):
        raise StartupError(
            "--pg-commit-wait-bound must be a number of seconds >= 0 (0: no bound),"
            f" not {config.pg_commit_wait_bound_s}",
            usage=True,
        )
    if not (math.isfinite(config.store_probe_interval_s) and config.store_probe_interval_s > 0):
        raise StartupError(
            "--store-probe-interval must be a number of seconds above 0,"
            f" not {config.store_probe_interval_s}",
            usage=True,
        )


def check_free(listen: str, option: str) -> None:
    """Raises StartupError when a fixed port is taken, before anything is created.

    gRPC would only say "Failed to bind" after the database was opened; a test bind
    with the same SO_REUSEADDR names the reason. Port 0 always finds a free port.
    """
    host, port = _split_listen(listen, option)
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise StartupError(f"cannot listen on {listen}: {host}: {exc.strerror}") from None
    failures: list[OSError] = []
    for family, kind, proto, _, address in addresses:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
        except OSError as exc:
            if exc.errno in _BIND_ADVICE:
                raise StartupError(
                    f"cannot listen on {listen}: {exc.strerror}; {_BIND_ADVICE[exc.errno]}"
                    f" or pick another {option} (port 0 picks a free one)"
                ) from None
            failures.append(exc)
    # A name like localhost may also resolve to ::1 on a host without IPv6; like gRPC,
    # refuse only when no address binds at all.
    if failures and len(failures) == len(addresses):
        raise StartupError(
            f"cannot listen on {listen}: {failures[0].strerror}; is {host or '*'} an address"
            f" of this machine? pick another {option}"
        )


_BIND_ADVICE: Final = {
    errno.EADDRINUSE: "stop what holds the port",
    errno.EACCES: "ports below 1024 need privileges",
}


def open_database(database: str, *, commit_wait_bound_s: float | None = None) -> Store:
    """Opens (creating when new) the ledger database, or raises StartupError."""
    shown = redact_url(database)
    path = sqlite_path(database)
    if path is not None and os.path.isdir(path):
        raise StartupError(
            f"--db {shown} is a directory: give the ledger's file, e.g. {os.path.join(path, DEFAULT_DB)}"
        )
    parent = os.path.dirname(os.path.abspath(path)) if path not in (None, ":memory:") else None
    if parent is not None and not os.path.isdir(parent):
        # A mistyped directory must not turn into a new, empty ledger beside the real one.
        raise StartupError(
            f"--db {shown}: the directory {parent} does not exist; create it first"
            f" (mkdir -p {shlex.quote(parent)}) or correct the path"
        )
    if path not in (None, ":memory:"):
        _require_writable(path, shown)
    try:
        return open_store(database, commit_wait_bound_s=commit_wait_bound_s)
    except ValueError as exc:
        raise StartupError(f"--database-url: {exc}", usage=True) from None
    except StoreError as exc:
        if path is None:
            hint = (
                "is PostgreSQL running and accepting connections at that host and port"
                " (a database still starting up refuses them), with that user, password"
                " and database?"
            )
        elif exc.reason == "STORE_UNAVAILABLE":
            hint = "give a ledger file, or a new path to create one"
        else:  # the message already names the fault and the fix
            hint = ""
        raise StartupError(
            f"cannot open the database {shown} (--db/--database-url): {exc}"
            + (f"; {hint}" if hint else "")
        ) from None


def _require_writable(path: str, shown: str) -> None:
    """Raises StartupError when the server could read the ledger but not append to it.

    SQLite opens a file it may not write read-only without a word, and every append
    would then fail: a server that cannot write must not start and say SERVING.
    """
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
        mode = _mode(path)
        raise StartupError(
            f"--db {shown}: the ledger file is read-only for this user ({mode}), and the"
            f" server appends to it: give it write access (chmod u+rw {shlex.quote(path)},"
            " or chown it to the server's user), or remount its file system read-write"
        )
    for suffix in ("-wal", "-shm"):
        side = path + suffix
        if os.path.exists(side) and not os.access(side, os.R_OK | os.W_OK):
            raise StartupError(
                f"--db {shown}: SQLite's {suffix} file {side} is read-only for this user"
                f" ({_mode(side)}): give it the same owner and mode as the ledger file"
            )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise StartupError(
            f"--db {shown}: the directory {directory} is read-only for this user"
            f" ({_mode(directory)}); SQLite creates the ledger's -wal, -shm (and -lock)"
            " files beside it: give this user write access to the directory"
            " (or remount its file system read-write)"
        )


def _mode(path: str) -> str:
    """Returns 'mode 0444, owner uid 1000' for path, or why it cannot be read."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return exc.strerror or str(exc)
    read_only = os.statvfs(path).f_flag & os.ST_RDONLY
    return f"mode {st.st_mode & 0o7777:04o}, owner uid {st.st_uid}" + (
        ", on a read-only file system" if read_only else ""
    )


def existing_signing_key(path: str) -> SigningKey | None:
    """Returns the signing key at path, None when there is none yet, or raises StartupError."""
    try:
        return SigningKey.from_pem(Path(path).read_bytes())
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StartupError(
            f"cannot read the signing key {path} (--signing-key): {exc.strerror}"
        ) from None
    except ValueError as exc:
        raise StartupError(
            f"the signing key {path} (--signing-key) is unusable: {_short(exc)};"
            " give an Ed25519 key in PEM, or a new path to create one"
        ) from None


def create_signing_key(path: str) -> SigningKey:
    """Creates the signing key at path (first start), or raises StartupError."""
    try:
        return SigningKey.load_or_create(path)
    except OSError as exc:
        raise StartupError(
            f"cannot create the signing key {path} (--signing-key): {exc.strerror}"
        ) from None
    except ValueError as exc:  # another process published a bad file between the check and now
        raise StartupError(f"the signing key {path} (--signing-key) is unusable: {exc}") from None


def read_pem(path: str, kind: Literal["certificate", "private key"]) -> bytes:
    """Returns a PEM file holding a "certificate" (chain) or a "private key" (unencrypted).

    Raises OSError when it cannot be read, ValueError when it is not such PEM:
    gRPC would accept the bytes and fail later with an unrelated message.
    """
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        if kind == "certificate":
            x509.load_pem_x509_certificates(data)
        else:
            serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ValueError(f"not a PEM {kind}: {_short(exc)}") from None
    return data


def _short(exc: Exception) -> str:
    """Returns an error's message without cryptography's trailing FAQ link."""
    return str(exc).split(". See https://", 1)[0]
