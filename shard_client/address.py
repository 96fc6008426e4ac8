"""Ledger addresses, checked before anything dials them.

gRPC takes any string as a target and reports a malformed one only when a call's
deadline runs out (``http://127.0.0.1:50551`` waited 10 s, then printed c-ares'
"Misformatted domain name"; a bare ``50551`` 8.8 s). :func:`check_address` refuses
such a string at once, naming the accepted forms, and :func:`resolve_within` bounds
the name lookup that a call would otherwise wait out.
"""

from __future__ import annotations

import re
import socket
import threading
from dataclasses import dataclass
from typing import Final

__all__ = [
    "ACCEPTED_FORMS",
    "RESOLVE_TIMEOUT_S",
    "AddressError",
    "Endpoint",
    "check_address",
    "endpoint_of",
    "resolve_within",
]

ACCEPTED_FORMS: Final = (
    "HOST:PORT (127.0.0.1:50551, ledger.example.com:50551), [IPV6]:PORT ([::1]:50551),"
    " unix:PATH (unix:/run/shardledger.sock), dns:///HOST:PORT, or several HOST:PORT"
    " separated by commas"
)
# A name that has not resolved by then fails: a call would otherwise wait its whole deadline.
RESOLVE_TIMEOUT_S: Final = 1.5

_HOSTNAME: Final = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
    r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?"
)
_SCHEME: Final = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<rest>.*)$")
_DEFAULT_PORT: Final = 50551


class AddressError(ValueError):
    """An address no ledger can be reached at; the message says why and what is accepted."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One TCP host and port to probe before a call (a name, or an IP address)."""

    host: str
    port: int


def _port(text: str) -> int | None:
    if not text.isdigit() or len(text) > 5:
        return None
    port = int(text)
    return port if 0 < port < 65536 else None


def _host_port(item: str) -> Endpoint | None:
    """Returns HOST:PORT or [V6]:PORT as an Endpoint; None when it is neither."""
    if item.startswith("["):
        inner, close, port = item[1:].partition("]:")
        if not close or _port(port) is None:
            return None
        try:
            socket.inet_pton(socket.AF_INET6, inner)
        except OSError:
            return None
        return Endpoint(inner, int(port))
    host, sep, port = item.rpartition(":")
    if not sep or _port(port) is None or not _HOSTNAME.fullmatch(host):
        return None
    return Endpoint(host, int(port))


def _hint(text: str) -> str:
    """Returns what the user probably meant, as a sentence, or ''."""
    scheme = _SCHEME.match(text)
    if scheme:
        rest = scheme["rest"].rstrip("/")
        if scheme["scheme"] in ("http", "https", "grpc", "grpcs", "tcp") and _host_port(rest):
            return f"an address has no URL scheme: write {rest}"
        return f"{scheme['scheme']}:// is no address gRPC dials"
    if _port(text) is not None:
        return f"a port alone is not an address: write 127.0.0.1:{text}"
    if text.startswith(":") and _port(text[1:]) is not None:
        return f"the host is missing: write 127.0.0.1{text}"
    host = text.removesuffix(":")
    if _HOSTNAME.fullmatch(host):
        return f"the port is missing: write {host}:{_DEFAULT_PORT}"
    if text.count(":") > 1 and not text.startswith("["):
        return "an IPv6 address goes in brackets: [::1]:50551"
    return ""


def check_address(text: str, *, source: str = "address") -> str:
    """Returns the address, stripped, when it is one gRPC can dial; raises AddressError otherwise.

    ``source`` names where it came from (``--server``, ``$SHARDLEDGER_SERVER``) for the message.
    """
    address = text.strip()
    if address.startswith("unix:") and len(address) > len("unix:"):
        return address
    if address.startswith(("dns:///", "ipv4:", "ipv6:")):
        rest = address.split(":", 1)[1].removeprefix("///")
        items = rest.split(",") if not address.startswith("dns:") else [rest]
        if all(_host_port(item) for item in items):
            return address
    elif address and all(_host_port(item.strip()) for item in address.split(",")):
        return address
    hint = _hint(address)
    raise AddressError(
        f"{source} {text!r} is not a ledger address{f' ({hint})' if hint else ''};"
        f" accepted: {ACCEPTED_FORMS}"
    )


def endpoint_of(address: str) -> Endpoint | None:
    """Returns the one TCP endpoint a checked address dials, or None (a socket, a list)."""
    if address.startswith("dns:///"):
        return _host_port(address.removeprefix("dns:///"))
    if address.startswith(("unix:", "ipv4:", "ipv6:")) or "," in address:
        return None
    return _host_port(address)


def resolve_within(host: str, port: int, timeout_s: float = RESOLVE_TIMEOUT_S) -> list[str]:
    """Returns the addresses a name resolves to; raises OSError naming the name on failure.

    getaddrinfo takes no timeout, and a resolver that does not answer can hold it for
    the resolver's own timeouts times its attempts; the lookup runs on a daemon thread
    and is abandoned (its answer dropped) after ``timeout_s``.
    """
    answer: list[list[str]] = []
    failure: list[OSError] = []

    # An ASCII name goes to getaddrinfo as bytes: a str would load the IDNA codec first
    # (encodings.idna, stringprep, unicodedata), a tenth of a CLI read's start-up.
    name = host.encode("ascii") if host.isascii() else host

    def lookup() -> None:
        try:
            infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
            answer.append([str(info[4][0]) for info in infos])
        except OSError as exc:
            failure.append(exc)

    worker = threading.Thread(target=lookup, name="shardledger-resolve", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if failure:
        reason = getattr(failure[0], "strerror", None) or str(failure[0])
        raise OSError(f"cannot resolve {host}: {reason}")
    if not answer:
        raise OSError(f"cannot resolve {host}: no answer within {timeout_s:g} s")
    return answer[0]
