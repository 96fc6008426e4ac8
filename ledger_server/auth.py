"""Tokens, principals and the authorization rules; pure except for the token store it is given.

A token reads ``slt_<id>_<secret>``. Only blake3(secret) is stored; the
secret is compared in constant time. Roles:

    admin    everything, every namespace
    auditor  read, export and audit every namespace; never append
    writer   append to its namespace (optionally only runs starting with a prefix), read it
    reader   read its namespace

Another tenant's run is answered PERMISSION_DENIED (reason NAMESPACE_FORBIDDEN)
before any lookup, so the answer is the same whether or not the run exists.
"""

from __future__ import annotations

import hmac
import re
import secrets
from dataclasses import dataclass
from typing import Final, Protocol

import blake3

from ledger_server.errors import LedgerError
from ledger_server.store.base import TokenRow

ROLES: Final = ("admin", "auditor", "writer", "reader")
TOKEN_PREFIX: Final = "slt_"
_TOKEN_RE: Final = re.compile(r"slt_([0-9a-f]{16})_([A-Za-z0-9_-]{43})")

READ: Final = "read"
APPEND: Final = "append"
AUDIT: Final = "audit"


class Unauthenticated(LedgerError):
    """The call carries no valid token (UNAUTHENTICATED)."""

    reason = "TOKEN_INVALID"


class Forbidden(LedgerError):
    """The caller's token does not allow this action on this run (PERMISSION_DENIED)."""

    reason = "PERMISSION_DENIED"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling, as established from a token."""

    token_id: str
    namespace: str
    role: str
    run_prefix: str = ""

    @property
    def all_namespaces(self) -> bool:
        """Returns whether the role spans every namespace."""
        return self.role in ("admin", "auditor")


class TokenSource(Protocol):
    """Where tokens are looked up (the store)."""

    def get_token(self, token_id: str) -> TokenRow | None:
        """Returns the token with this id, or None."""


def hash_secret(secret: str) -> str:
    """Returns the stored form of a token secret."""
    return blake3.blake3(secret.encode()).hexdigest()


def new_token(
    *,
    namespace: str,
    role: str,
    run_prefix: str = "",
    description: str = "",
    now_us: int,
    expires_us: int | None,
) -> tuple[str, TokenRow]:
    """Returns a fresh token string (shown once) and the row that stores its hash."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}")
    if run_prefix and role != "writer":
        raise ValueError("only writer tokens can be limited to a run prefix")
    token_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    row = TokenRow(
        token_id=token_id,
        namespace=namespace,
        role=role,
        run_prefix=run_prefix,
        secret_hash=hash_secret(secret),
        description=description,
        created_us=now_us,
        expires_us=expires_us,
        revoked_us=None,
    )
    return f"{TOKEN_PREFIX}{token_id}_{secret}", row


def authenticate(header: str | None, tokens: TokenSource, *, now_us: int) -> Principal:
    """Returns the principal of an `authorization: Bearer slt_...` header or raises Unauthenticated."""
    if not header:
        raise Unauthenticated(
            "no token: send 'authorization: Bearer slt_...'", reason="TOKEN_MISSING"
        )
    scheme, _, value = header.partition(" ")
    match = _TOKEN_RE.fullmatch(value.strip()) if scheme.lower() == "bearer" else None
    if match is None:
        raise Unauthenticated("the token is malformed", reason="TOKEN_MALFORMED")
    token_id, secret = match.groups()
    row = tokens.get_token(token_id)
    # Compare even for unknown ids so timing does not tell which ids exist.
    stored = row.secret_hash if row is not None else hash_secret("")
    if not hmac.compare_digest(stored, hash_secret(secret)) or row is None:
        raise Unauthenticated("the token is not valid", reason="TOKEN_INVALID")
    if row.revoked_us is not None:
        raise Unauthenticated("the token was revoked", reason="TOKEN_REVOKED", token_id=token_id)
    if row.expires_us is not None and row.expires_us <= now_us:
        raise Unauthenticated("the token has expired", reason="TOKEN_EXPIRED", token_id=token_id)
    return Principal(
        token_id=row.token_id, namespace=row.namespace, role=row.role, run_prefix=row.run_prefix
    )


def authorize(
    principal: Principal | None, action: str, *, namespace: str, run_id: str = ""
) -> None:
    """Raises Forbidden unless the principal may do action on the run (None: auth is off)."""
    if principal is None or principal.role == "admin":
        return
    if action == APPEND and principal.role != "writer":
        raise Forbidden(
            f"a {principal.role} token cannot append events",
            reason="ROLE_FORBIDDEN",
            role=principal.role,
        )
    if not principal.all_namespaces and namespace != principal.namespace:
        raise Forbidden(
            f"the token's tenant is {principal.namespace!r}, not {namespace!r}",
            reason="NAMESPACE_FORBIDDEN",
            namespace=namespace,
        )
    if action == APPEND and principal.run_prefix and not run_id.startswith(principal.run_prefix):
        raise Forbidden(
            f"the token may only append to runs starting with {principal.run_prefix!r}",
            reason="RUN_PREFIX_FORBIDDEN",
            run_id=run_id,
        )


def effective_namespace(principal: Principal | None, requested: str) -> str:
    """Returns the namespace a request means: its own, else the token's tenant, else "default"."""
    if requested:
        return requested
    if principal is not None and not principal.all_namespaces:
        return principal.namespace
    return "default"
