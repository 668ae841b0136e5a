"""The faces for LLM agents and people: ``ralph-mail mcp`` (the mailbox as MCP tools)
and ``ralph-mail top`` (a live dashboard). Each needs an optional extra, and says so in
one line when it is missing."""

from __future__ import annotations

import importlib
import json
import os
import select
import time
from typing import Annotated, Final

from ralph_mail import settings
from ralph_mail.cli import EXIT_REFUSED, EXIT_USAGE, error_line
from ralph_mail.cli.app import Agent, Home, TeamName, app, command, identity
from ralph_mail.cli.command import Option
from ralph_mail.errors import MailError, RefusedByRules

#: JSON-RPC's "internal error": what a client's opening request gets from a server that
#: cannot start (not -32022, which would send the SDK's client probing again).
_CANNOT_START: Final = -32603


def _need(module: str, extra: str, what: str) -> None:
    """Import ``module``, or say in one line which extra brings it."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise MailError(
            f"{what} needs the {extra} extra: pip install 'ralph_mail[{extra}]'"
        ) from None


@app.command("mcp")
def mcp(
    push: Annotated[
        bool,
        Option("--push", help="Send each new message to the client as a Claude Code channel "
               "event (delivered once: check_inbox does not return it again)."),
    ] = False,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
) -> None:  # fmt: skip
    """Serve AGENT's mailbox to an MCP client on stdio (Claude Code, Codex, ...): ask,
    delegate, notify, the inbox, channels, history, search and the lead's protocols as
    tools; the inbox is also the resource ralph://inbox, which a client can subscribe to.
    Needs the mcp extra: pip install 'ralph_mail[mcp]'.

    \b
    Example:
      claude mcp add writer -e RALPH_TEAM=demo -e RALPH_AGENT=writer -- ralph-mail mcp
      ralph-mail mcp --team demo --agent writer --push
    """

    def action() -> int:
        try:
            _need("mcp", "mcp", "the MCP server")
            from ralph_mail import mcp_server

            who = identity(home, team, agent)
            server, box = mcp_server.start(who.need_team(), who.need_agent(), home, push=push)
        except MailError as exc:  # the client is told too, not left with "Connection closed"
            error_line(str(exc))
            _refuse_client(str(exc))
            return EXIT_REFUSED if isinstance(exc, RefusedByRules) else EXIT_USAGE
        mcp_server.run(server, box)
        return 0

    command(action)


def _refuse_client(reason: str) -> None:
    """Answer the MCP client's opening requests (initialize, and a discover probe before
    it) with a JSON-RPC error whose message is ``reason``. Reads standard input for at
    most MCP_REFUSAL_WAIT_S and MCP_MAX_REQUEST_BYTES; not at all from a terminal."""
    deadline = time.monotonic() + settings.MCP_REFUSAL_WAIT_S
    pending = bytearray()
    try:
        if os.isatty(0):
            return
        while len(pending) <= settings.MCP_MAX_REQUEST_BYTES:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([0], [], [], left)[0]:
                return
            chunk = os.read(0, settings.MCP_READ_CHUNK_BYTES)
            if not chunk:
                return
            pending += chunk
            *lines, rest = pending.split(b"\n")
            pending = bytearray(rest)
            for line in lines:
                try:
                    request = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(request, dict) or "id" not in request:
                    continue
                error = {"code": _CANNOT_START, "message": reason}
                answer = {"jsonrpc": "2.0", "id": request["id"], "error": error}
                os.write(1, json.dumps(answer).encode() + b"\n")
                if request.get("method") == "initialize":
                    return
    except OSError:  # no standard input or output to speak of: stderr said it
        return


@app.command("top")
def top(home: Home = None, team: TeamName = None) -> None:
    """A live dashboard of the team: the roster (presence, state, task, progress, unread),
    the task tree and the conversations, internal messages folded. It only looks: no
    cursor moves. Keys: q quit, tab next pane, enter open, i internal, / search, ? help.
    Needs the tui extra: pip install 'ralph_mail[tui]'.

    \b
    Example:
      ralph-mail top --team demo
    """

    def action() -> int:
        _need("textual", "tui", "the dashboard")
        from ralph_mail.dashboard import Dashboard

        Dashboard(identity(home, team, None).need_team(), home).run()
        return 0

    command(action)


@app.command("serve")
def serve(
    home: Home = None,
    team: TeamName = None,
    host: Annotated[
        str, Option("--host", help="Where to listen; beyond loopback it warns.", metavar="HOST")
    ] = "127.0.0.1",
    port: Annotated[
        int, Option("--port", help="The port (0: any free one).", metavar="N", most=65535)
    ] = 8400,
    caller: Annotated[
        str | None,
        Option(
            "--caller",
            help="The member outside A2A agents delegate as [default: the lead].",
            metavar="AGENT",
        ),
    ] = None,
) -> None:
    """Serve the team over HTTP: a live page for people (roster, tasks, conversation,
    approvals to approve or deny, questions to a human member to answer), and each
    member as an A2A agent at /a2a/NAME/ (a message to it is a task delegated by
    --caller). Prints its address with a fresh access token, which every request needs;
    runs until SIGTERM or Ctrl-C. Needs the serve extra: pip install 'ralph_mail[serve]'.

    \b
    Example:
      ralph-mail serve --team demo --port 8400
    """

    def action() -> int:
        _need("uvicorn", "serve", "the server")
        _need("starlette", "serve", "the server")
        if caller is not None:
            _need("a2a", "serve", "the A2A agents")
        from ralph_mail.serve.server import serve as run_server
        from ralph_mail.team import load_team

        name = identity(home, team, None).need_team()
        roster = load_team(name, home)  # an unknown team: one line, before anything listens
        if caller is not None:
            roster.member(caller)
        try:
            run_server(name, home, host, port, caller)
        except OSError as exc:  # the port is taken, the host is not this machine's
            raise MailError(
                f"cannot listen on {host}:{port} ({exc.strerror or exc}): "
                "pick another --port or --host"
            ) from None
        return 0

    command(action)
