"""``ralph-mail channel ...``: group channels with @mentions (DESIGN §10)."""

from __future__ import annotations

from typing import Annotated

from ralph_mail.cli import say
from ralph_mail.cli.app import Agent, Home, Json, JsonRecords, TeamName, app, command, identity
from ralph_mail.cli.command import Argument, Group, Option
from ralph_mail.cli.render import deliver, print_json_lines, print_messages, print_table, safe
from ralph_mail.errors import MailError

channel_app = Group(
    help=(
        "Group channels: posts every member reads, and @mentions that ask members to "
        "answer, one after another.\n\n"
        "Example:\n  ralph-mail channel create standup --member writer --member analyst\n"
        "  ralph-mail channel post standup '@writer @analyst what are you on today?'\n"
        "  ralph-mail channel tail standup -f"
    )
)
app.add_group(channel_app, "channel")

Name = Annotated[str, Argument(help="The channel ('#' optional).", metavar="NAME")]


@channel_app.command("create")
def channel_create(
    name: Name,
    member: Annotated[
        list[str] | None,
        Option("--member", "-m", help="A member (repeat it); I am one too.", metavar="AGENT"),
    ] = None,
    everyone: Annotated[bool, Option("--all", help="Every member of the team.")] = False,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
) -> None:
    """Make a channel for some members (and me), or the whole team (--all).

    \b
    Example:
      ralph-mail channel create standup --member writer --member analyst --agent lead
      ralph-mail channel create general --all --agent lead
    """

    def action() -> None:
        if not member and not everyone:
            raise MailError("no members: pass --member AGENT (repeat it) or --all")
        bus = identity(home, team, agent).bus()
        try:
            made = bus.channels.create(name, member or [], everyone=everyone)
        finally:
            bus.close()
        say(safe(f"#{made.name}: {', '.join(made.members)}", newlines=False) + "\n")

    command(action)


@channel_app.command("list")
def channel_list(
    home: Home = None, team: TeamName = None, agent: Agent = None, json: JsonRecords = False
) -> None:
    """List the team's channels and their members (with --agent: my unread posts).

    \b
    Example:
      ralph-mail channel list --team demo
    """

    def action() -> int:
        from ralph_mail.talk.channels import listed
        from ralph_mail.team import load_team

        who = identity(home, team, agent)
        roster = load_team(who.need_team(), home)
        found = listed(roster.store)
        me = who.agent
        records: list[dict[str, object]] = []
        rows = []
        for channel in found:
            record: dict[str, object] = {"name": channel.name, "members": list(channel.members),
                                         "by": channel.by, "created": channel.created}  # fmt: skip
            unread = ""
            if me and me in channel.members:
                key = f"#{channel.name}"
                floor = roster.store.load_cursor(f"{key}@{me}").floor
                record["unread"] = roster.store.size(key) > floor
                unread = "yes" if record["unread"] else ""
            records.append(record)
            rows.append((f"#{channel.name}", ", ".join(channel.members), channel.by, unread))
        if json:
            print_json_lines(records)
        elif not records:
            say("no channels: make one with 'ralph-mail channel create NAME --member AGENT'\n")
        else:
            print_table("channels", ["channel", "members", "made by", "unread"], rows)
        return 0  # a listing that finds nothing is no failure (see the exit codes)

    command(action)


@channel_app.command("post")
def channel_post(
    name: Name,
    content: Annotated[
        str | None, Argument(help="The post; '-' or omitted with a pipe: standard input.")
    ] = None,
    reply_to: Annotated[
        str | None, Option("--reply-to", help="Id of the post this answers.", metavar="ID")
    ] = None,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
    json: Json = False,
) -> None:
    """Post in a channel; prints the post's id. Each @member mentioned (@all: everyone)
    is asked to answer, in mention order; an @name that is no member is refused (exit 2).

    \b
    Example:
      ralph-mail channel post standup '@writer @analyst what are you on today?'
      ralph-mail channel post standup 'draft is up' --reply-to 3f2a9c1d4e5b
    """

    def action() -> None:
        from ralph_mail import settings
        from ralph_mail.cli.send import read_body

        body = read_body(content, settings.max_message_bytes())
        bus = identity(home, team, agent).bus()
        try:
            post = bus.channel_post(name, body, reply_to)
        finally:
            bus.close()
        if json:
            from ralph_mail.message import encode

            say(encode(post).decode())
        else:
            say(post.id + "\n")

    command(action)


@channel_app.command("read")
def channel_read(
    name: Name, home: Home = None, team: TeamName = None, agent: Agent = None, json: Json = False
) -> None:
    """Print and consume the posts I have not read (mine left out); none: no output.

    \b
    Example:
      ralph-mail channel read standup --agent writer
    """

    def action() -> int:
        bus = identity(home, team, agent).bus()
        try:
            posts = bus.channels.read(name, consume=False)
            deliver(posts, json, bus.channels.commit)
            if not posts:  # my own posts read past all the same
                bus.channel_read(name)
        finally:
            bus.close()
        return 0

    command(action)


def _log(home: str | None, team: str | None, name: str) -> tuple[str, str]:
    """The team and the store key of channel ``name``, which must exist."""
    from ralph_mail.talk.channels import find
    from ralph_mail.team import load_team

    team_name = identity(home, team, None).need_team()
    return team_name, f"#{find(load_team(team_name, home).store, name).name}"


@channel_app.command("tail")
def channel_tail(
    name: Name,
    lines: Annotated[int, Option("-n", "--lines", help="How many posts.")] = 10,
    follow: Annotated[bool, Option("-f", "--follow", help="Then print new ones.")] = False,
    home: Home = None,
    team: TeamName = None,
    json: Json = False,
) -> None:
    """Show the last posts of a channel, moving no one's cursor; -f follows.

    \b
    Example:
      ralph-mail channel tail standup -n 20 -f
    """

    def action() -> None:
        from ralph_mail.talk.history import History

        if lines < 0:
            raise MailError(f"invalid -n {lines}: give a count >= 0")
        team_name, key = _log(home, team, name)
        view = History(team_name, [key], home)
        try:
            print_messages(view.last(lines), json)
            if follow:
                for batch in view.follow():
                    print_messages(batch, json)
        finally:
            view.close()

    command(action)


@channel_app.command("history")
def channel_history(
    name: Name,
    lines: Annotated[int, Option("-n", "--lines", help="How many posts.")] = 20,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
    json: Json = False,
) -> None:
    """Print the last posts of a channel, oldest first (none: no output).

    \b
    Example:
      ralph-mail channel history standup -n 5 --json
    """

    def action() -> int:
        from ralph_mail.talk.channels import history
        from ralph_mail.team import load_team

        if lines < 0:
            raise MailError(f"invalid -n {lines}: give a count >= 0")
        roster = load_team(identity(home, team, agent).need_team(), home)
        posts = history(roster.store, name, lines)
        print_messages(posts, json)
        return 0

    command(action)


def _membership(name: str, home: str | None, team: str | None, agent: str | None,
                joining: bool) -> None:  # fmt: skip
    bus = identity(home, team, agent).bus()
    try:
        now = bus.channels.join(name) if joining else bus.channels.leave(name)
    finally:
        bus.close()
    say(safe(f"#{now.name}: {', '.join(now.members) or 'no members'}", newlines=False) + "\n")


@channel_app.command("join")
def channel_join(name: Name, home: Home = None, team: TeamName = None, agent: Agent = None) -> None:
    """Join a channel: I read the posts made from now on.

    \b
    Example:
      ralph-mail channel join standup --agent data
    """
    command(lambda: _membership(name, home, team, agent, True))


@channel_app.command("leave")
def channel_leave(
    name: Name, home: Home = None, team: TeamName = None, agent: Agent = None
) -> None:
    """Leave a channel (my mentions in it are refused from then on).

    \b
    Example:
      ralph-mail channel leave standup --agent data
    """
    command(lambda: _membership(name, home, team, agent, False))


@channel_app.command("pass")
def channel_pass(
    name: Name,
    post: Annotated[str, Argument(help="The post that mentioned me.", metavar="ID")],
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
) -> None:
    """Decline my turn to answer a post (the next member mentioned goes on at once).

    \b
    Example:
      ralph-mail channel pass standup 3f2a9c1d4e5b --agent data
    """

    def action() -> None:
        bus = identity(home, team, agent).bus()
        try:
            bus.channels.pass_turn(name, post)
        finally:
            bus.close()
        say(safe(f"passed: #{name.lstrip('#')} {post}", newlines=False) + "\n")

    command(action)
