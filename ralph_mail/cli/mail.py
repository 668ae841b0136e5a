"""Commands for teams and messages: team, send, broadcast, receipt, read, wait, tail."""

from __future__ import annotations

import functools
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated

from ralph_mail import settings
from ralph_mail.cli import EXIT_NO, EXIT_NOTHING, error_line, say
from ralph_mail.cli.app import Agent, Home, Json, JsonRecords, TeamName, app, command, identity
from ralph_mail.cli.command import Argument, Group, Option, confirm
from ralph_mail.cli.render import deliver, print_json_lines, print_messages, print_table, safe
from ralph_mail.cli.send import SendRequest, parse_meta, read_body
from ralph_mail.errors import MailError

if TYPE_CHECKING:
    from ralph_mail.message import Message
    from ralph_mail.talk.history import History
from ralph_mail.message import encode

team_app = Group(
    help=(
        "Create, list, show and delete teams.\n\n"
        "\b\nExample:\n  ralph-mail team create demo --member lead --member 'worker-1:parses logs'"
    ),
)
app.add_group(team_app, "team")

Priority = Annotated[
    str | None,
    Option("--priority", help="low, normal, high or urgent [default: normal].", metavar="P"),
]
ApprovalWait = Annotated[
    float | None,
    Option(
        "--wait",
        help="Held for approval: wait up to S seconds for the decision (0 approved, 3 "
        "denied, 1 none).",
        metavar="S",
    ),
]
WaitConsumed = Annotated[
    float | None,
    Option(
        "--wait-consumed",
        help="Then wait up to S seconds until every recipient consumed it (0 consumed, 1 "
        "not in time, 3 denied).",
        metavar="S",
    ),
]
Visibility = Annotated[
    str | None,
    Option(
        "--visibility",
        help="internal, user_visible or user_redacted [default: internal].",
        metavar="V",
    ),
]

Meta = Annotated[
    list[str] | None,
    Option("--meta", "-m", help="Metadata KEY=VALUE (repeatable).", metavar="KEY=VALUE"),
]


def _member_spec(text: str) -> str | tuple[str, str]:
    name, sep, description = text.partition(":")
    return (name, description) if sep else name


@team_app.command("create")
def team_create(
    name: Annotated[str, Argument(help="The team's name.")],
    member: Annotated[
        list[str],
        Option(
            "--member",
            "-m",
            help="A member, NAME or NAME:description (repeatable).",
            metavar="NAME[:DESCRIPTION]",
        ),
    ],
    lead: Annotated[
        str | None, Option("--lead", help="The lead [default: the first member].")
    ] = None,
    home: Home = None,
    json: JsonRecords = False,
) -> None:
    """Create a team with an empty inbox for every member.

    \b
    Example:
      ralph-mail team create demo --member lead --member 'worker-1:parses logs' --lead lead
    """

    def action() -> None:
        from ralph_mail.team import create_team

        team = create_team(name, [_member_spec(m) for m in member], home, lead)
        if json:
            print_json_lines([_team_record(team)])
        else:
            line = (f"created team {team.name} in {team.home}: lead {team.lead}; "
                    f"members {', '.join(team.names)}")  # fmt: skip
            sys.stdout.write(safe(line, newlines=False) + "\n")

    command(action)


def _team_record(team) -> dict[str, object]:  # type: ignore[no-untyped-def]
    return {
        "name": team.name,
        "lead": team.lead,
        "created": team.created,
        "members": [
            {"name": m.name, "description": m.description, "role": m.role} for m in team.members
        ],
    }


@team_app.command("list")
def team_list(home: Home = None, json: JsonRecords = False) -> None:
    """List the teams in the home.

    \b
    Example:
      ralph-mail team list --home /tmp/mail
    """

    def action() -> None:
        from ralph_mail.team import list_teams

        teams = list_teams(home)
        if json:
            print_json_lines([_team_record(team) for team in teams])
        else:
            rows = [(t.name, t.lead, str(len(t.members)), t.created) for t in teams]
            print_table(
                f"teams in {settings.home(home)}", ["team", "lead", "members", "created"], rows
            )

    command(action)


@team_app.command("show")
def team_show(
    name: Annotated[str | None, Argument(help="The team [default: --team].")] = None,
    team: TeamName = None,
    home: Home = None,
    json: JsonRecords = False,
) -> None:
    """Show a team's members, their roles and descriptions.

    \b
    Example:
      ralph-mail team show demo
    """

    def action() -> None:
        from ralph_mail.team import load_team

        roster = load_team(name or identity(home, team, None).need_team(), home)
        if json:
            print_json_lines([_team_record(roster)])
        else:
            rows = [(m.name, f"{m.role} (human)" if m.human else m.role, m.description)
                    for m in roster.members]  # fmt: skip
            print_table(f"team {roster.name}", ["member", "role", "description"], rows)

    command(action)


@team_app.command("delete")
def team_delete(
    name: Annotated[str, Argument(help="The team to delete.")],
    yes: Annotated[bool, Option("--yes", "-y", help="Do not ask first.")] = False,
    home: Home = None,
    agent: Agent = None,
) -> None:
    """Delete a team and all its mail, as its lead; asks first on a terminal unless --yes.

    \b
    Example:
      ralph-mail team delete demo --yes --agent lead
    """

    def action() -> int:
        from ralph_mail.team import delete_team, load_team

        load_team(name, home)  # a missing team is an error before any question
        if not yes and (sys.stdin is None or not sys.stdin.isatty()):
            raise MailError(f"refusing to delete team {name!r} without asking: pass --yes")
        identity(home, name, agent).lead(f"deleting team {name!r}").close()
        if not yes and not confirm(f"Delete team {name!r} and all its mail?"):
            error_line(f"team {name!r} kept")
            return EXIT_NO  # the answer was no
        delete_team(name, home)
        sys.stdout.write(f"deleted team {name}\n")
        return 0

    command(action)


@app.command("send")
def send(
    to: Annotated[str, Argument(help="The recipient agent.")],
    content: Annotated[
        str | None, Argument(help="The body; '-' or omitted with a pipe: standard input.")
    ] = None,
    type: Annotated[
        str, Option("--type", "-t", help="Message type (text, status_update, ...).")
    ] = "text",
    meta: Meta = None,
    reply_to: Annotated[
        str | None, Option("--reply-to", help="Id of the message this answers.")
    ] = None,
    id: Annotated[
        str | None, Option("--id", help="Use this id (12 hex), to retry a send safely.")
    ] = None,
    priority: Priority = None,
    ack: Annotated[bool, Option("--ack", help="Ask the recipient to acknowledge it.")] = False,
    visibility: Visibility = None,
    thread: Annotated[
        str | None, Option("--thread", help="The thread it belongs to (its first id).")
    ] = None,
    wait: ApprovalWait = None,
    wait_consumed: WaitConsumed = None,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
    json: Json = False,
) -> None:
    """Send a message; prints its id (or the envelope with --json).

    A message the team's policy holds for approval is not delivered yet: a note on
    stderr names the approver, and the exit code is 0 (with --wait S: 0 approved and
    delivered, 3 denied, 1 no decision in time). A recipient that is offline gets it
    later: a note on stderr says so, and the exit code is 0. --wait-consumed S waits
    until the recipient consumed it (see 'ralph-mail receipt').

    \b
    Example:
      ralph-mail send lead 'parsing done' --team demo --agent worker-1
      git log -1 | ralph-mail send lead --type text --meta topic=commit
      ralph-mail send writer 'confirm the deadline' --priority high --ack
      ralph-mail send writer 'stop the build' --wait-consumed 60
    """
    request = SendRequest(
        to, content, type, list(meta or []), reply_to, id, json, identity(home, team, agent),
        priority, ack, visibility, thread, wait, wait_consumed,
    )  # fmt: skip
    command(request.run)


@app.command("broadcast")
def broadcast(
    content: Annotated[
        str | None, Argument(help="The body; '-' or omitted with a pipe: standard input.")
    ] = None,
    meta: Meta = None,
    priority: Priority = None,
    visibility: Visibility = None,
    wait: ApprovalWait = None,
    wait_consumed: WaitConsumed = None,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
    json: Json = False,
) -> None:
    """Send one message to every member but me; prints its id (held for approval, or a
    member offline: as send does).

    \b
    Example:
      ralph-mail broadcast 'tests are green' --team demo --agent lead
      ralph-mail broadcast 'freeze the branch' --wait-consumed 120 --agent lead
    """

    def action() -> int:
        from ralph_mail.cli.send import after_send, check_wait

        check_wait(wait)
        check_wait(wait_consumed, "--wait-consumed")
        metadata = parse_meta(meta or [])
        body = read_body(content, settings.max_message_bytes())
        bus = identity(home, team, agent).bus()
        try:
            since = bus.store.size(bus.agent)
            message = bus.broadcast(body, metadata, priority=priority, visibility=visibility)
            say(encode(message).decode() if json else message.id + "\n")
            return after_send(bus, message, since, wait, wait_consumed)
        finally:
            bus.close()

    command(action)


@app.command("receipt")
def receipt(
    message_id: Annotated[str, Argument(help="The id send or broadcast printed.", metavar="ID")],
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
    json: JsonRecords = False,
) -> None:
    """Show what became of a message of mine at each recipient: held (for approval),
    denied, stored, consumed, acked or answered, with when.

    One line per recipient (a broadcast has one each): the recipient, the state, when
    it was stored, consumed and acknowledged, and the id of its answer ('-': not yet).
    Exit 2 when no message of mine has that id.

    \b
    Example:
      ralph-mail receipt 3f2a9c1d4b5e --team demo --agent worker-1
      ralph-mail receipt 3f2a9c1d4b5e --json | jq -r '.to + " " + .state'
    """

    def action() -> None:
        bus = identity(home, team, agent).bus()
        try:
            found = bus.receipts(message_id)
        finally:
            bus.close()
        if json:
            print_json_lines([r.to_dict() for r in found])
            return
        rows = [(r.to, r.state, r.stored_at or "-", r.consumed_at or "-", r.acked_at or "-",
                 r.answered_by or "-") for r in found]  # fmt: skip
        columns = ["to", "state", "stored", "consumed", "acked", "answered by"]
        print_table(f"message {message_id}", columns, rows)

    command(action)


@app.command("read")
def read(
    peek: Annotated[bool, Option("--peek", help="Show without consuming.")] = False,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
    json: Json = False,
) -> None:
    """Print and consume the new messages of my inbox (with --peek: only print).

    \b
    Example:
      ralph-mail read --team demo --agent lead --json | jq .content
    """

    def action() -> int:
        who = identity(home, team, agent)
        if peek:  # looking consumes nothing and claims nothing: works beside the owner
            from ralph_mail.talk.history import History

            view = History(who.need_team(), [who.need_agent()], home)
            try:
                deliver(view.unread(who.need_agent()), json)
            finally:
                view.close()
            return 0
        bus = who.bus()
        try:
            return deliver(bus.peek(), json, hand_on=bus.hand_on)
        finally:
            bus.close()

    command(action)


@app.command("wait")
def wait(
    timeout: Annotated[
        float | None,
        Option("--timeout", help="Give up after S seconds (exit 1) [default: never].", metavar="S"),
    ] = None,
    type: Annotated[
        str | None,
        Option("--type", "-t", help="Wait for this type only; others stay unread."),
    ] = None,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
    json: Json = False,
) -> None:
    """Block until mail comes; print and consume it. Exit 1 when none came in time.

    \b
    Example:
      ralph-mail wait --timeout 30 --type task_assignment --team demo --agent worker-1
    """

    def action() -> int:
        import time

        from ralph_mail.store.outage import patient

        if timeout is not None and timeout < 0:
            raise MailError(f"invalid --timeout {timeout}: give a number of seconds >= 0")
        # A wait outlasts a server that goes away (a network backend's), until its timeout.
        until = None if timeout is None else time.monotonic() + timeout
        with patient(until=until, say=lambda line: error_line(line, "note")):
            return waited()

    def waited() -> int:
        bus = identity(home, team, agent).bus()
        try:
            if type is None:
                messages = bus.wait_for_messages(timeout, consume=False)
                deliver(messages, json, hand_on=bus.hand_on)
            else:
                found = bus.wait_for_message(type, timeout, consume=False)
                messages = [found] if found is not None else []
                alone = functools.partial(bus.hand_on, alone=True)  # only that message
                deliver(messages, json, hand_on=alone)
        finally:
            bus.close()
        return 0 if messages else EXIT_NOTHING

    command(action)


@app.command("tail")
def tail(
    inbox: Annotated[
        str | None,
        Argument(
            help="Whose inbox [default: mine; with no --agent, every inbox].", metavar="AGENT"
        ),
    ] = None,
    lines: Annotated[int, Option("-n", "--lines", help="How many messages.")] = 10,
    follow: Annotated[bool, Option("-f", "--follow", help="Then print new ones.")] = False,
    everyone: Annotated[bool, Option("--all", help="Merge every inbox of the team.")] = False,
    visible: Annotated[
        bool,
        Option(
            "--visible",
            help="Only the user-facing timeline: user_visible messages, and user_redacted "
            "ones as their first line.",
        ),
    ] = False,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
    json: Json = False,
) -> None:
    """Show the last messages of an inbox without consuming them; -f follows.

    \b
    Example:
      ralph-mail tail lead -n 20 --team demo
      ralph-mail tail --all -f --team demo
      ralph-mail tail --all --visible --team demo   # what the user sees
    """

    def action() -> None:
        from ralph_mail.talk.history import History
        from ralph_mail.team import load_team

        if lines < 0:
            raise MailError(f"invalid -n {lines}: give a count >= 0")
        who = identity(home, team, agent)
        team_name = who.need_team()
        # no AGENT and no identity: every inbox, as --all
        whole = everyone or (inbox is None and who.anonymous())
        agents = list(load_team(team_name, home).names) if whole else [inbox or who.need_agent()]
        view = History(team_name, agents, home)
        show = _user_facing if visible else list
        try:
            shown = show(_last(view, lines, visible))
            print_messages(shown, json)
            if len(shown) < lines:
                for archived in view.archived:  # older mail is not gone: say where it is
                    error_line(
                        f"older messages of {archived} are archived (gc): "
                        f"ralph-mail search '' --to {archived}",
                        "note",
                    )
            if follow:
                shown_skipped = 0
                for batch in view.follow():
                    skipped = sum(view.skipped.values())
                    if skipped > shown_skipped:  # fell behind gc: say so, never silently
                        error_line(
                            f"{skipped - shown_skipped} bytes of mail were collected by gc "
                            "before tail could show them",
                            "note",
                        )
                        shown_skipped = skipped
                    print_messages(show(batch), json)
        finally:
            view.close()

    command(action)


def _last(view: History, count: int, visible: bool) -> list[Message]:
    """The last ``count`` messages (with ``visible``: user-facing ones), reading further
    back until there are enough or the inboxes are read whole."""
    if not visible:
        return view.last(count)
    wanted = count
    while True:
        found = view.last(wanted)
        shown = [m for m in found if m.visibility != "internal"]
        if len(shown) >= count or len(found) < wanted:
            return shown[-count:] if count > 0 else []
        wanted *= 4


def _user_facing(messages: list[Message]) -> list[Message]:
    """The user_visible messages, and the user_redacted ones cut to their first line."""
    out = []
    for message in messages:
        if message.visibility == "user_redacted":
            first, _, rest = message.content.partition("\n")
            message = replace(message, content=first + (" …" if rest else ""))
        if message.visibility != "internal":
            out.append(message)
    return out
