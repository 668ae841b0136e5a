"""The faces for LLM agents and people: ``ralph-mail mcp`` (the mailbox as MCP tools)
and ``ralph-mail top`` (a live dashboard). Each needs an optional extra, and says so in
one line when it is missing."""

from __future__ import annotations

import importlib

from ralph_mail.cli.app import Agent, Home, TeamName, app, command, identity
from ralph_mail.errors import MailError


def _need(module: str, extra: str, what: str) -> None:
    """Import ``module``, or say in one line which extra brings it."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise MailError(
            f"{what} needs the {extra} extra: pip install 'ralph_mail[{extra}]'"
        ) from None


@app.command("mcp")
def mcp(home: Home = None, team: TeamName = None, agent: Agent = None) -> None:
    """Serve AGENT's mailbox to an MCP client on stdio (Claude Code, Codex, ...): ask,
    delegate, notify, the inbox, channels, history, search and the lead's protocols as
    tools. Needs the mcp extra: pip install 'ralph_mail[mcp]'.

    \b
    Example:
      claude mcp add writer -e RALPH_TEAM=demo -e RALPH_AGENT=writer -- ralph-mail mcp
      ralph-mail mcp --team demo --agent writer
    """

    def action() -> int:
        _need("mcp", "mcp", "the MCP server")
        from ralph_mail.mcp_server import serve

        who = identity(home, team, agent)
        serve(who.need_team(), who.need_agent(), home)
        return 0

    command(action)


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
