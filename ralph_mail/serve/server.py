"""The server of `ralph-mail serve`: uvicorn on a socket bound here, stopped cleanly by
SIGTERM or SIGINT (the live feeds are ended first, so the shutdown does not wait). Its
address line is printed once it serves: a script may wait for it."""

from __future__ import annotations

import secrets
import signal
import sys
from collections.abc import Callable
from typing import Final

import uvicorn
from starlette.applications import Starlette

from ralph_mail.serve import HOST, PORT, listen, loopback, url
from ralph_mail.serve.app import Hub, build
from ralph_mail.serve.team import TeamView

#: How long open connections may take to end once the server is told to stop (s).
GRACE_S: Final = 3


class _Server(uvicorn.Server):
    """uvicorn's server, which also ends the page's live feeds when told to stop."""

    def __init__(self, config: uvicorn.Config, hub: Hub) -> None:
        super().__init__(config)
        self.hub = hub

    def handle_exit(self, sig: int, frame: object) -> None:
        self.hub.close_soon()
        super().handle_exit(sig, frame)  # type: ignore[arg-type]


def app_for(
    team: str,
    home: str | None,
    token: str,
    caller: str | None = None,
    ready: Callable[[], None] | None = None,
) -> Starlette:
    """The app that serves ``team``, guarded by ``token``; the members as A2A agents,
    delegated to from ``caller`` (default: the lead), when the a2a-sdk is installed."""
    view = TeamView(team, home)
    if caller is None and a2a_installed():
        caller = view.team().lead
    return build(view, token, caller, ready)


def a2a_installed() -> bool:
    """Whether the a2a-sdk (with its server part) can be imported."""
    import importlib.util

    return importlib.util.find_spec("a2a") is not None


def serve(
    team: str,
    home: str | None = None,
    host: str = HOST,
    port: int = PORT,
    caller: str | None = None,
) -> None:
    """Serve ``team`` until SIGTERM or SIGINT; print its address with a fresh token on
    standard output first, once it serves (and where its A2A agents are). A host beyond
    loopback is warned about on stderr."""
    token = secrets.token_urlsafe(24)
    sock = listen(host, port)
    address = url(sock, token)

    def ready() -> None:
        print(f"serving team {team} at {address}", flush=True)
        if app.state.caller is not None:
            base = address.partition("/?token=")[0]
            print(f"A2A: each member at {base}/a2a/NAME/ (delegating as {app.state.caller})",
                  flush=True)  # fmt: skip

    app = app_for(team, home, token, caller, ready)
    try:
        if not loopback(host):
            print(f"ralph-mail: warning: serving on {host}, beyond this machine: anyone who "
                  "reaches it with the token can act for the team", file=sys.stderr)  # fmt: skip
        config = uvicorn.Config(app, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=GRACE_S)  # fmt: skip
        # uvicorn raises the signal it stopped on again once it is down; with this
        # handler in place by then, SIGTERM ends the command with exit 0.
        signal.signal(signal.SIGTERM, lambda number, frame: None)
        _Server(config, app.state.hub).run(sockets=[sock])
    finally:
        sock.close()
