"""The NATS backend's URLs: where one points and the login it carries (`address`), the
servers of a cluster it names (`servers`), and how it is shown with its password
hidden (`redacted`)."""

from __future__ import annotations

from typing import NamedTuple
from urllib.parse import SplitResult, unquote, urlsplit


class Address(NamedTuple):
    """Where a NATS URL points, and the login it carries."""

    host: str
    port: int
    tls: bool
    user: str | None
    password: str | None


def address(url: str) -> Address:
    """``url``'s parts; `ValueError` saying what is wrong with it and the fix."""
    try:
        where = urlsplit(url)
        port = where.port
    except ValueError as exc:  # a port that is no number (:abc), a host that is no host
        raise ValueError(f"invalid NATS URL {redacted(url)!r} ({exc}): use "
                         "nats://HOST:PORT, e.g. nats://127.0.0.1:4222") from None  # fmt: skip
    if where.scheme not in ("nats", "tls") or not where.hostname:
        raise ValueError(f"invalid NATS URL {redacted(url)!r}: use nats://HOST:PORT (or "
                         "tls://HOST:PORT), e.g. nats://127.0.0.1:4222")  # fmt: skip
    user = unquote(where.username) if where.username else None
    password = unquote(where.password) if where.password is not None else None
    return Address(where.hostname, port or 4222, where.scheme == "tls", user, password)


def servers(url: str) -> list[str]:
    """The servers a backend URL names, one URL each: a cluster's are given comma
    separated, ``nats://h1:4222,nats://h2:4222`` or ``nats://h1:4222,h2:4222`` (a server
    without a scheme or a login takes the first one's); `ValueError` saying what is
    wrong and the fix, for an empty one."""
    parts = [part.strip() for part in url.split(",")]
    if len(parts) == 1:
        return parts
    if not all(parts):
        raise ValueError(f"invalid NATS URL {redacted(url)!r}: an empty server between "
                         "commas; use nats://HOST:PORT,HOST:PORT,...")  # fmt: skip
    scheme, _, rest = parts[0].partition("://")
    login = rest.partition("/")[0].rpartition("@")[0]
    found = [parts[0]]
    for part in parts[1:]:
        if "://" not in part:
            part = f"{scheme}://{part}"
        kind, _, place = part.partition("://")
        if login and "@" not in place.partition("/")[0]:
            part = f"{kind}://{login}@{place}"
        found.append(part)
    return found


def addresses(url: str) -> list[Address]:
    """`address` of each of the servers ``url`` names (`servers`)."""
    return [address(server) for server in servers(url)]


def redacted(url: str) -> str:
    """``url`` fit to be shown: a password (or a token) in it as ``***`` (in each of the
    servers it names)."""
    if "," in url:  # (a server given without its scheme, shown as if it had one)
        return ",".join(redacted(part) if "://" in part or not part.strip()
                        else redacted(f"nats://{part}")[7:] for part in url.split(","))  # fmt: skip
    try:
        where = urlsplit(url)
    except ValueError:
        return url.rpartition("@")[2]
    if "@" not in where.netloc:
        return url
    login, _, place = where.netloc.rpartition("@")
    user, colon, _ = login.partition(":")
    hidden = f"{user}:***" if colon else "***"
    return SplitResult(where.scheme, f"{hidden}@{place}", *where[2:]).geturl()
