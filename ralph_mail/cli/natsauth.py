"""``ralph-mail nats config``: the NATS server enforces the team's policy (docs/backends.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from ralph_mail.cli import say
from ralph_mail.cli.app import Agent, Home, TeamName, app, command, identity
from ralph_mail.cli.command import Group, Option
from ralph_mail.cli.render import safe
from ralph_mail.errors import MailError

nats_app = Group(
    help=(
        "The NATS server's side of a team kept on NATS.\n\n"
        "Example:\n  ralph-mail nats config --team demo --agent lead --out /etc/nats/demo.conf"
    )
)
app.add_group(nats_app, "nats")


@nats_app.command("config")
def nats_config(
    out: Annotated[
        str | None,
        Option(
            "--out", help="Where to write it [default: HOME/nats/TEAM.auth.conf].", metavar="FILE"
        ),
    ] = None,
    answers: Annotated[
        bool,
        Option(
            "--answers",
            help="Also let each agent write into the inboxes of those that "
            "may contact it: its replies reach them (a deny then holds one way).",
        ),
    ] = False,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
) -> None:
    """Write the nats-server authorization block that enforces the team's policy: one
    user per agent, publishing only into the inboxes the policy lets it reach (and its
    own keys), subscribing only to its own inbox; and each agent's credentials
    (HOME/nats/creds/TEAM/AGENT.creds, 0600: RALPH_NATS_CREDS=FILE). The lead's act.
    Write it again, and reload the server, after every policy or membership change.

    \b
    Example:
      ralph-mail nats config --team demo --agent lead
      nats-server --signal reload=PID
    """

    def action() -> None:
        from ralph_mail import settings
        from ralph_mail.govern import policy
        from ralph_mail.store import backend
        from ralph_mail.talk import channels

        place = backend(settings.home(home), settings.backend())
        write = getattr(place, "write_authorization", None)
        if write is None:
            raise MailError(
                "'nats config' writes a NATS server's permissions: use it on a NATS "
                "backend (--backend nats://HOST:PORT or RALPH_BACKEND)"
            )
        bus = identity(home, team, agent).lead("writing the NATS server's permissions")
        try:
            roster = bus.refresh_team()
            raw = bus.store.load_state(policy.KEY)
            try:
                current = policy.parse(raw or b"{}")
            except MailError as exc:
                raise MailError(f"the team's policy {bus.store.state_where(policy.KEY)} is "
                                f"broken ({exc}): fix it first") from None  # fmt: skip
            reach = policy.reach(current, roster, answers=answers)
            names = [channel.name for channel in channels.listed(bus.store)]
            cursors = {member: [f"#{name}@{member}" for name in names] for member in roster.names}
            where, creds = write(roster.name, roster.lead, reach, cursors,
                                 Path(out) if out else None)  # fmt: skip
        finally:
            bus.close()
        folder = next(iter(creds.values())).parent
        say(safe(f"wrote {where}: {len(creds)} users ({roster.lead}, the lead: every subject; "
                 "the others: what the policy lets them reach)\n"
                 f"credentials: {folder}/AGENT.creds (0600): give each agent its own "
                 "(RALPH_NATS_CREDS=FILE)\n"
                 "next: include it in the server's configuration (include \"PATH\", relative "
                 "to that file's folder), then reload the server (nats-server --signal "
                 "reload=PID); again after every policy or membership change\n"))  # fmt: skip

    command(action)
