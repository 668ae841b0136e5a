"""``ralph-mail keys``: agents' Ed25519 signing keys (see `ralph_mail.signing`): make one,
show it, list the roster's, publish or forget one."""

from __future__ import annotations

from typing import Annotated

from ralph_mail.cli import say
from ralph_mail.cli.app import Agent, Home, JsonRecords, TeamName, app, command, identity
from ralph_mail.cli.command import Argument, Group, Option

keys_app = Group(
    help=(
        "Agents' signing keys: the private key stays in a file on the agent's host "
        "($RALPH_KEYS, else HOME/keys), the public key goes into the roster, and every "
        "message the agent sends is signed (the sign extra: pip install "
        "'ralph-mail[sign]').\n\n"
        "Example:\n  ralph-mail keys create --team demo --agent lead\n"
        "  ralph-mail keys list --team demo"
    )
)
app.add_group(keys_app, "keys")


@keys_app.command("create")
def keys_create(
    force: Annotated[
        bool, Option("--force", help="Replace my key file if there is one (a roster key "
                     "already published is replaced only by the lead).")
    ] = False,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
) -> None:  # fmt: skip
    """Make an Ed25519 key pair for AGENT: the private key in its key file (mode 0600,
    never overwritten without --force), the public key in the roster. Prints the key's
    kid and the file.

    \b
    Example:
      ralph-mail keys create --team demo --agent lead
    """

    def action() -> None:
        from ralph_mail.govern import keys

        with identity(home, team, agent).bus() as bus:
            kid, path = keys.create(bus, force=force)
        say(f"{kid} {path}\n")

    command(action)


@keys_app.command("show")
def keys_show(home: Home = None, team: TeamName = None, agent: Agent = None) -> None:
    """Show AGENT's key: its kid, its public key, its file, and whether the roster has it.

    \b
    Example:
      ralph-mail keys show --team demo --agent lead
    """

    def action() -> None:
        from ralph_mail import signing
        from ralph_mail.errors import MailError

        with identity(home, team, agent).bus() as bus:
            signer = bus.signer()
            public = signer.public()
            if public is None:
                raise MailError(f"{bus.agent} has no key at {signer.path}: run 'ralph-mail "
                                f"keys create --agent {bus.agent}'")  # fmt: skip
            published = bus.me().key == public
        said = "in the roster" if published else "NOT in the roster: ralph-mail keys publish"
        say(f"kid {signing.kid(public)}\npublic {public}\nfile {signer.path}\n{said}\n")

    command(action)


@keys_app.command("list")
def keys_list(home: Home = None, team: TeamName = None, json: JsonRecords = False) -> None:
    """The roster's public keys: each member's kid ('-': none, its messages are unsigned).

    \b
    Example:
      ralph-mail keys list --team demo
    """

    def action() -> None:
        from ralph_mail import signing
        from ralph_mail.cli.render import print_json_lines, print_table
        from ralph_mail.team import load_team

        roster = load_team(identity(home, team, None).need_team(), home)
        rows = [(m.name, signing.kid(m.key) if m.key else "-", m.key or "")
                for m in roster.members]  # fmt: skip
        if json:
            print_json_lines([{"agent": name, "kid": kid if kid != "-" else None,
                               "key": key or None} for name, kid, key in rows])  # fmt: skip
            return
        print_table("public keys", ("agent", "kid", "key"), rows)

    command(action)


@keys_app.command("publish")
def keys_publish(home: Home = None, team: TeamName = None, agent: Agent = None) -> None:
    """Put the public half of AGENT's key file in the roster (its first key; replacing
    one is the lead's act). Prints the kid.

    \b
    Example:
      ralph-mail keys publish --team demo --agent lead
    """

    def action() -> None:
        from ralph_mail.govern import keys

        with identity(home, team, agent).bus() as bus:
            say(keys.publish(bus) + "\n")

    command(action)


@keys_app.command("forget")
def keys_forget(
    member: Annotated[str, Argument(help="The member whose key goes.", metavar="MEMBER")],
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
) -> None:
    """Remove MEMBER's public key from the roster; the lead's to do (then MEMBER can
    publish a new one).

    \b
    Example:
      ralph-mail keys forget writer --team demo --agent lead
    """

    def action() -> None:
        from ralph_mail.govern import keys

        with identity(home, team, agent).bus() as bus:
            keys.forget(bus, member)

    command(action)
