"""Database URLs: which backend a URL names, the SQLite file it names, libpq's cut, redaction."""

from __future__ import annotations

from typing import Final, NamedTuple

POSTGRES_SCHEMES: Final = ("postgresql://", "postgres://")


def sqlite_path(url: str) -> str | None:
    """Returns the file a SQLite spec names (a path or sqlite:///PATH); None for other URLs."""
    path = url[len("sqlite:///") :] if url.startswith("sqlite:///") else url
    return None if "://" in path else path


class LibpqUrl(NamedTuple):
    """A database URL cut the way libpq cuts it; joining the parts gives it back."""

    prefix: str  # "scheme://", or "" for a plain path
    userinfo: str | None  # before the "@", None without one
    location: str  # host, port and path
    query: str | None  # after the "?", None without one

    def join(self) -> str:
        """Returns the URL the parts make."""
        user = "" if self.userinfo is None else f"{self.userinfo}@"
        query = "" if self.query is None else f"?{self.query}"
        return f"{self.prefix}{user}{self.location}{query}"


def split_libpq(url: str) -> LibpqUrl:
    """Splits a URL as libpq does: the user information runs to the last "@" before
    the first "/", so a "#" or "?" inside a password stays part of it."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return LibpqUrl("", None, url, None)
    slash = rest.find("/")
    at = (rest if slash < 0 else rest[:slash]).rfind("@")
    userinfo, after = (rest[:at], rest[at + 1 :]) if at >= 0 else (None, rest)
    location, question, query = after.partition("?")
    return LibpqUrl(scheme + sep, userinfo, location, query if question else None)


def redact_url(url: str) -> str:
    """Returns the URL with any password (user:PASSWORD@, ?password=, ?sslpassword=) as ***.

    A URL with no password comes back exactly as given.
    """
    parts = split_libpq(url)
    if not parts.prefix:
        return url
    userinfo, query = parts.userinfo, parts.query
    if userinfo is not None and ":" in userinfo:
        userinfo = userinfo.split(":", 1)[0] + ":***"
    if query is not None:
        query = "&".join(
            f"{item.split('=', 1)[0]}=***"
            if "=" in item and item.split("=", 1)[0].lower().endswith("password")
            else item
            for item in query.split("&")
        )
    redacted = parts._replace(userinfo=userinfo, query=query).join()
    return url if redacted == url else redacted
