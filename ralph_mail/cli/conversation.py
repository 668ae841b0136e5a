"""Commands for conversations and discovery: ask, reply, history, thread, ack, acks,
agents, presence, and the roster's edits (team set, team config). Delegation and the
task tree are `ralph_mail.cli.tasks`'."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Annotated

from ralph_mail import settings
from ralph_mail.cli import EXIT_NO, EXIT_NOTHING, error_line, say
from ralph_mail.cli.app import Agent, Home, Json, JsonRecords, TeamName, app, command, identity
from ralph_mail.cli.command import Argument, Option
from ralph_mail.cli.mail import Priority, Visibility, team_app
from ralph_mail.cli.render import deliver, print_json_lines, print_table, safe
from ralph_mail.cli.send import read_body
from ralph_mail.errors import MailError
from ralph_mail.message import Message, encode

if TYPE_CHECKING:
    pass


def _find(who_team: str, who: str, home: str | None, message_id: str) -> Message:
    """A message of my inbox by id, consumed or not (looked for among the recent ones)."""
    from ralph_mail.message import check_id
    from ralph_mail.talk.history import History

    check_id(message_id)
    view = History(who_team, [who], home)
    try:
        recent = view.last(settings.RESPOND_LOOKBACK_LINES)
    finally:
        view.close()
    for message in reversed(recent):
        if message.id == message_id:
            return message
    raise MailError(
        f"no message {message_id} among the last {settings.RESPOND_LOOKBACK_LINES} of "
        f"{who}'s inbox: check the id with 'ralph-mail tail {who}'"
    )


@app.command("ask")
def ask(
    to: Annotated[str, Argument(help="Whom to ask.", metavar="AGENT")],
    question: Annotated[
        str | None, Argument(help="The question; '-' or omitted with a pipe: standard input.")
    ] = None,
    context: Annotated[
        str | None, Option("--context", help="Background the answer needs.", metavar="C")
    ] = None,
    timeout: Annotated[
        float, Option("--timeout", help="Give up after S seconds (exit 1).", metavar="S")
    ] = 120.0,
    priority: Priority = None,
    request_id: Annotated[
        str | None,
        Option(
            "--id",
            help="Name the request (12 hex): run again with the same id, the command prints "
            "the reply without asking again.",
            metavar="ID",
        ),
    ] = None,
    visibility: Visibility = None,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
    json: Json = False,
) -> None:
    """Ask a teammate and print its reply: exit 0 answered, 1 no reply in time, 3 the
    reply reports an error, 4 refused (offline, too deep).

    \b
    Example:
      ralph-mail ask analyst 'What was Q4 revenue?' --context 'investor update' --timeout 60
      ralph-mail ask analyst 'Q4 revenue?' --id 0123456789ab   # again: the same reply
    """

    def action() -> int:
        from ralph_mail.errors import NoReply

        if timeout < 0:
            raise MailError(f"invalid --timeout {timeout}: give a number of seconds >= 0")
        body = read_body(question, settings.max_message_bytes())
        bus = identity(home, team, agent).bus()
        try:
            answer = bus.ask(to, body, context=context, timeout=timeout, priority=priority,
                             id=request_id, visibility=visibility)  # fmt: skip
        except NoReply as exc:
            error_line(str(exc))
            return EXIT_NOTHING
        finally:
            bus.close()
        deliver([answer], json) if json else say(safe(answer.content) + "\n")
        if "error" in answer.metadata:
            error_line(f"{to} reports an error: {answer.metadata['error']}")
            return EXIT_NO
        return 0

    command(action)


@app.command("reply")
def reply(
    message_id: Annotated[str, Argument(help="The message to answer (its id).", metavar="ID")],
    content: Annotated[
        str | None, Argument(help="The answer; '-' or omitted with a pipe: standard input.")
    ] = None,
    error: Annotated[
        bool, Option("--error", help="The answer reports a failure (metadata.error).")
    ] = False,
    visibility: Visibility = None,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
    json: Json = False,
) -> None:
    """Answer a message of my inbox, even one already consumed; prints the reply's id.

    \b
    Example:
      ralph-mail reply 3f2a9c1d4b5e 'Q4 revenue was $2.4M' --agent analyst
    """

    def action() -> None:
        body = read_body(content, settings.max_message_bytes())
        who = identity(home, team, agent)
        asked = _find(who.need_team(), who.need_agent(), home, message_id)
        bus = who.bus()
        try:
            metadata = {"error": body} if error else None
            sent = bus.reply(asked, body, metadata, visibility=visibility)
        finally:
            bus.close()
        say(encode(sent).decode() if json else sent.id + "\n")

    command(action)


@app.command("history")
def history(
    with_agent: Annotated[str, Argument(help="The other agent.", metavar="AGENT")],
    lines: Annotated[int, Option("-n", "--lines", help="How many messages.")] = 20,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
    json: Json = False,
) -> None:
    """The last messages between me and AGENT, both directions, oldest first.

    \b
    Example:
      ralph-mail history analyst -n 20 --agent coordinator
    """

    def action() -> None:
        if lines < 0:
            raise MailError(f"invalid -n {lines}: give a count >= 0")
        bus = identity(home, team, agent).bus()
        try:
            found = bus.history(with_agent, lines)
        finally:
            bus.close()
        deliver(found, json)

    command(action)


@app.command("thread")
def thread(
    thread_id: Annotated[str, Argument(help="The thread (its first message's id).", metavar="ID")],
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
    json: Json = False,
) -> None:
    """Every message of a thread, in order: a request or delegation and what answered it.

    \b
    Example:
      ralph-mail thread 3f2a9c1d4b5e --json
    """

    def action() -> None:
        bus = identity(home, team, agent).viewer()
        try:
            found = bus.thread(thread_id)
        finally:
            bus.close()
        deliver(found, json)

    command(action)


@app.command("ack")
def ack(
    message_id: Annotated[str, Argument(help="The message to acknowledge.", metavar="ID")],
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
) -> None:
    """Acknowledge a message of my inbox (reading never does); prints the ack's id.

    \b
    Example:
      ralph-mail ack 3f2a9c1d4b5e --agent writer
    """

    def action() -> None:
        who = identity(home, team, agent)
        asked = _find(who.need_team(), who.need_agent(), home, message_id)
        bus = who.bus()
        try:
            sent = bus.ack(asked)
        finally:
            bus.close()
        say(sent.id + "\n")

    command(action)


@app.command("acks")
def acks(
    overdue: Annotated[
        float | None,
        Option("--overdue", help="Exit 3 when one is older than S seconds.", metavar="S"),
    ] = None,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
    json: Json = False,
) -> None:
    """List what I sent with --ack that no ack has answered; with --overdue S, a watchdog
    that exits 3 when one of them is older than S seconds.

    \b
    Example:
      ralph-mail acks --overdue 300 --agent lead || echo 'someone did not confirm'
    """

    def action() -> int:
        if overdue is not None and overdue < 0:
            raise MailError(f"invalid --overdue {overdue}: give a number of seconds >= 0")
        bus = identity(home, team, agent).bus()
        try:
            pending = bus.pending_acks()
            late = bus.pending_acks(older_than=overdue) if overdue is not None else []
        finally:
            bus.close()
        deliver(pending, json)
        if late:
            error_line(f"{len(late)} acknowledgement(s) overdue by more than {overdue:g} s")
            return EXIT_NO
        return 0

    command(action)


@app.command("agents")
def agents(
    everyone: Annotated[bool, Option("--all", help="Include me.")] = False,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
    json: JsonRecords = False,
) -> None:
    """List my teammates (with no --agent: the whole team): description, role, manager,
    mode, presence, last seen.

    \b
    Example:
      ralph-mail agents --json | jq -r 'select(.presence != "offline") | .name'
    """

    def action() -> None:
        who = identity(home, team, agent)
        bus = who.viewer()
        try:  # no identity: no "me" to leave out, so the whole team
            found = bus.agents(include_self=everyone or who.anonymous())
        finally:
            bus.close()
        if json:
            print_json_lines([info.to_dict() for info in found])
            return
        rows = [
            (a.name, a.presence + (f" until {a.until}" if a.until else ""), a.role,
             a.manager or "", a.mode, a.last_seen, a.description)
            for a in found
        ]  # fmt: skip
        columns = ["agent", "presence", "role", "manager", "mode", "last seen", "description"]
        print_table(f"team {bus.team.name}", columns, rows)

    command(action)


@app.command("presence")
def presence(
    state: Annotated[
        str | None,
        Argument(
            help="idle, working, sleeping, awaiting_approval or awaiting_delegation "
            "[default: show the team's].",
            metavar="STATE",
        ),
    ] = None,
    until: Annotated[
        str | None,
        Option("--until", help="For sleeping: an ISO-8601 time or +DURATION (+15m).", metavar="T"),
    ] = None,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
    json: JsonRecords = False,
) -> None:
    """Say what I am doing, or (with no STATE) show everyone's presence.

    \b
    Example:
      ralph-mail presence sleeping --until +15m --agent writer
      ralph-mail presence --agent lead
    """

    def action() -> None:
        who = identity(home, team, agent)
        bus = who.bus() if state is not None else who.viewer()
        try:
            if state is not None:
                bus.set_presence(state, until)
                return
            found = bus.agents(include_self=True)
        finally:
            bus.close()
        if json:
            print_json_lines([{"name": a.name, "presence": a.presence, "until": a.until,
                               "last_seen": a.last_seen} for a in found])  # fmt: skip
        else:
            rows = [(a.name, a.presence, a.until, a.last_seen) for a in found]
            print_table("presence", ["agent", "presence", "until", "last seen"], rows)

    command(action)


@team_app.command("set")
def team_set(
    name: Annotated[str, Argument(help="The team.", metavar="TEAM")],
    member: Annotated[str, Argument(help="The member to change.", metavar="AGENT")],
    description: Annotated[
        str | None, Option("--description", help="What it does.", metavar="D")
    ] = None,
    manager: Annotated[
        str | None,
        Option("--manager", help="Whom it reports to ('' clears it).", metavar="M"),
    ] = None,
    mode: Annotated[
        str | None, Option("--mode", help="autonomous, supervised or strict.", metavar="MODE")
    ] = None,
    human: Annotated[
        str | None,
        Option(
            "--human",
            help="yes: a person, who answers in 'ralph-mail serve'; no: a program.",
            metavar="yes|no",
        ),
    ] = None,
    home: Home = None,
    agent: Agent = None,
) -> None:
    """Change a member's description, manager, mode or whether it is a person: all but
    one's own description are the lead's to change.

    \b
    Example:
      ralph-mail team set demo writer --manager lead --mode supervised --agent lead
      ralph-mail team set demo alice --human yes --agent lead
    """

    def action() -> None:
        if description is None and manager is None and mode is None and human is None:
            raise MailError("nothing to change: pass --description, --manager, --mode or --human")
        if human not in (None, "yes", "no"):
            raise MailError(f"invalid --human {human!r}: give yes or no")
        who = identity(home, name, agent)
        if (
            manager is not None
            or mode is not None
            or human is not None
            or (who.agent or os.environ.get("RALPH_AGENT")) != member
        ):
            bus = who.lead("changing a member's manager, mode, kind or another's description")
        else:
            bus = who.bus()
        try:
            if description is not None or manager is not None or mode is not None:
                bus.set_member(member, description=description, manager=manager, mode=mode)
            if human is not None:
                from ralph_mail.team import change_roster

                change_roster(bus.refresh_team(), member=member, human=human == "yes")
        finally:
            bus.close()
        say(safe(f"updated {member} in team {name}", newlines=False) + "\n")

    command(action)


@team_app.command("config")
def team_config(
    name: Annotated[str, Argument(help="The team.", metavar="TEAM")],
    key: Annotated[
        str | None,
        Argument(
            help="max_depth, max_internal_exchanges, presence_timeout, channel_delay, "
            "channel_turn_timeout or task_lease "
            "[default: show them all].",
            metavar="KEY",
        ),
    ] = None,
    value: Annotated[str | None, Argument(help="The new value.", metavar="VALUE")] = None,
    home: Home = None,
    agent: Agent = None,
) -> None:
    """Show the team's settings, or set one (the lead's to do).

    \b
    Example:
      ralph-mail team config demo max_depth 4 --agent lead
    """

    def action() -> None:
        from ralph_mail.team import change_roster, load_team

        if key is not None and value is None:
            raise MailError(f"no value for {key}: write 'ralph-mail team config {name} {key} N'")
        if key is not None and value is not None:
            from ralph_mail.cli.governance import setting_value

            checked = setting_value(key, value)  # a bad value first: exit 2
            bus = identity(home, name, agent).lead("changing the team's settings")
            try:
                change_roster(bus.team, config={key: checked})
            finally:
                bus.close()
        roster = load_team(name, home)
        rows = [(k, str(roster.config.get(k, v)), "" if k in roster.config else "(default)")
                for k, v in settings.TEAM_DEFAULTS.items()]  # fmt: skip
        if sys.stdout.isatty():
            print_table(f"team {name} settings", ["setting", "value", ""], rows)
        else:
            say("".join(f"{k}\t{safe(v, newlines=False)}\n" for k, v, _ in rows))

    command(action)


@team_app.command("add-remote")
def team_add_remote(
    name: Annotated[str, Argument(help="The team.", metavar="TEAM")],
    member: Annotated[str, Argument(help="The new member's name.", metavar="AGENT")],
    url: Annotated[str, Argument(help="Its A2A address (http or https).", metavar="URL")],
    description: Annotated[
        str | None, Option("--description", help="What it does.", metavar="D")
    ] = None,
    home: Home = None,
    agent: Agent = None,
) -> None:
    """Add a member that stands for the A2A agent at URL; the lead's to do. While
    'ralph-mail serve' serves the team, what is asked of it or delegated to it goes to
    URL over A2A, and the answer comes back as the member's.

    \b
    Example:
      ralph-mail team add-remote demo translator http://10.0.0.7:8400/a2a/writer/ --agent lead
    """

    def action() -> None:
        from ralph_mail.team import add_member

        bus = identity(home, name, agent).lead("adding a member")
        try:
            add_member(bus.refresh_team(), member, description or "", remote=url)
        finally:
            bus.close()
        shown = url.partition("?")[0]  # not the token it may carry
        say(safe(f"added {member} to team {name}: it stands for {shown}", newlines=False) + "\n")

    command(action)
