"""`ralph-mail serve`: the team over HTTP, on loopback by default (the ``serve`` extra:
Starlette and uvicorn).

A page for people at ``/`` (the roster with presence, the task tree, the conversation,
held approvals to approve or deny, questions to a human member to answer), updated live
over server-sent events. Every request needs the access token the server prints with
its URL.

The server itself is `ralph_mail.serve.server.serve`; this module holds what the
command checks before it imports Starlette.

Example:
    >>> from ralph_mail.serve.server import serve   # doctest: +SKIP
    >>> serve("demo", port=8400)   # doctest: +SKIP
    serving team demo at http://127.0.0.1:8400/?token=...
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Final

#: Where the server listens unless told: this machine only.
HOST: Final = "127.0.0.1"
PORT: Final = 8400


def loopback(host: str) -> bool:
    """Whether ``host`` is this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` (0: any free port), listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def url(sock: socket.socket, token: str) -> str:
    """The page's address, token included."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/?token={token}"
