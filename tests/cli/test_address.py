"""Ledger addresses are checked before anything dials them; names that do not resolve fail naming them.

A newcomer's `SHARDLEDGER_SERVER=http://127.0.0.1:50551` waited out the whole
deadline and printed gRPC's resolver text. Each malformed form is now a usage
error (exit 2, so nothing was dialed: an unreachable ledger is exit 3) with the
accepted forms; every accepted form reaches a real ledger.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ledger_server.server import RunningServer
from shard_client.address import ACCEPTED_FORMS, AddressError, check_address, endpoint_of
from tests.builders import planned, run_cli


def cli(*argv: str, server: str) -> subprocess.CompletedProcess[str]:
    """Runs the CLI as a user's shell does, the address in $SHARDLEDGER_SERVER."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLEDGER_")}
    env["SHARDLEDGER_SERVER"] = server
    return subprocess.run(
        [sys.executable, "-m", "shardledger_cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("address", "hint"),
    [
        ("http://127.0.0.1:50551", "an address has no URL scheme: write 127.0.0.1:50551"),
        ("grpc://ledger:50551/", "an address has no URL scheme: write ledger:50551"),
        ("50551", "a port alone is not an address: write 127.0.0.1:50551"),
        (":50551", "the host is missing: write 127.0.0.1:50551"),
        ("ledger.example.com", "the port is missing: write ledger.example.com:50551"),
        ("127.0.0.1:", "the port is missing: write 127.0.0.1:50551"),
        ("::1:50551", "an IPv6 address goes in brackets"),
        ("127.0.0.1:99999", ""),
        ("not an address!", ""),
    ],
)
def test_a_malformed_server_address_is_refused_before_dialing_with_the_accepted_forms(
    address: str, hint: str
) -> None:
    proc = cli("status", "night-01", server=address)
    assert proc.returncode == 2, proc.stderr
    assert f"$SHARDLEDGER_SERVER {address!r} is not a ledger address" in proc.stderr
    assert hint in proc.stderr
    assert ACCEPTED_FORMS in proc.stderr
    assert "UNAVAILABLE" not in proc.stderr


def test_a_malformed_server_flag_is_named_as_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "status", "night-01", "--server", "https://ledger:443")
    assert code == 2
    assert "--server 'https://ledger:443' is not a ledger address" in err


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1:50551",
        "ledger-1.example.com:50551",
        "[::1]:50551",
        "unix:/run/shardledger.sock",
        "unix:///run/shardledger.sock",
        "dns:///ledger.example.com:50551",
        "10.0.0.1:50551,10.0.0.2:50551",
        "ipv4:10.0.0.1:50551,10.0.0.2:50551",
    ],
)
def test_every_documented_form_is_accepted(address: str) -> None:
    assert check_address(address) == address


def test_the_probe_dials_the_host_of_a_dns_target_and_nothing_of_a_socket() -> None:
    assert endpoint_of("dns:///ledger:50551") is not None
    assert endpoint_of("unix:/run/s.sock") is None
    with pytest.raises(AddressError):
        check_address("unix:")


@pytest.mark.parametrize("form", ["localhost:{port}", "dns:///127.0.0.1:{port}"])
def test_a_hostname_and_a_dns_target_reach_the_ledger(server: RunningServer, form: str) -> None:
    from shard_client import LedgerClient

    client = LedgerClient(f"127.0.0.1:{server.port}")
    client.append([planned()])
    client.close()
    proc = cli("runs", server=form.format(port=server.port))
    assert proc.returncode == 0, proc.stderr


def test_a_name_that_does_not_resolve_is_unreachable_and_named() -> None:
    # .invalid never resolves (RFC 2606), whatever the resolver.
    proc = cli("status", "night-01", server="no-such-ledger.invalid:50551")
    assert proc.returncode == 3, proc.stderr
    assert "cannot resolve no-such-ledger.invalid" in proc.stderr
