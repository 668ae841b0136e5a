"""Commands for the team's governance: the policy (who may contact whom, rates, depth),
the approvals of held messages, and search over the audit trail."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Literal

from ralph_mail.cli import say
from ralph_mail.cli.app import Agent, Home, Json, JsonRecords, TeamName, app, command, identity
from ralph_mail.cli.command import MAX_SECONDS, Argument, Group, Option
from ralph_mail.cli.render import print_json_lines, print_messages, print_table, safe
from ralph_mail.errors import MailError

if TYPE_CHECKING:
    from ralph_mail.govern.policy import Policy
    from ralph_mail.team import Team

policy_app = Group(
    help=(
        "Show or change who may contact whom (rules, approvals), rates, budgets and depth."
        "\n\n"
        "Example:\n  ralph-mail policy deny '*' archive --team demo\n"
        "  ralph-mail policy allow intern '*' --approval --team demo\n"
        "  ralph-mail policy rate '*' 10 --team demo\n"
        "  ralph-mail policy budget writer 5 --per day --team demo"
    )
)
app.add_group(policy_app, "policy")

Party = Annotated[str, Argument(help="A member, or '*' for everyone.", metavar="AGENT")]


def _parsed(raw: bytes | None, roster: Team) -> Policy:
    """The policy in ``raw``; a `MailError` naming the file when it is broken."""
    from ralph_mail.govern import policy

    try:
        return policy.parse(raw or b"{}")
    except MailError as exc:
        where = roster.store.state_where(policy.KEY)
        raise MailError(
            f"the team's policy {where} is broken ({exc}): no agent may start contact "
            "until it is fixed or removed"
        ) from None


def _edit(
    home: str | None, team: str | None, agent: str | None, change: Callable[[Policy], Policy]
) -> None:
    """Change the team's policy with no other change in between, as its lead."""
    bus = identity(home, team, agent).lead("changing the team's policy")
    try:
        bus.change_policy(change)
    finally:
        bus.close()


def _party(name: str) -> str:
    from ralph_mail.message import check_name

    return "*" if name == "*" else check_name(name, "agent name")


@policy_app.command("show")
def policy_show(home: Home = None, team: TeamName = None, json: JsonRecords = False) -> None:
    """Show the team's rules and rates (--json: the policy as it is saved).

    \b
    Example:
      ralph-mail policy show --team demo
    """

    def action() -> None:
        from ralph_mail import settings
        from ralph_mail.govern import policy
        from ralph_mail.team import load_team

        roster = load_team(identity(home, team, None).need_team(), home)
        current = _parsed(roster.store.load_state(policy.KEY), roster)
        if json:
            say(current.to_json().decode())
            return
        rows = [(r.sender, r.target, r.permission, "yes" if r.approval else "")
                for r in current.rules]  # fmt: skip
        print_table("rules (no rule: allowed)", ("from", "to", "permission", "approval"), rows)
        rates = [(who, f"{n}/min") for who, n in sorted(current.rates.items())]
        print_table("rates (no rate: no limit)", ("agent", "messages"), rates)
        if current.budgets:
            from ralph_mail.usage import usd

            budgets = [(who, f"${usd(b.usd)}", b.per) for who, b in sorted(current.budgets.items())]
            print_table("budgets (USD)", ("agent", "budget", "per"), budgets)
        depth = settings.team_setting("max_depth", dict(roster.config))
        say(f"max depth: {depth}\n")
        say(f"require signed: {'on' if current.require_signed else 'off'}\n")

    command(action)


def _rule(permission: Literal["allow", "deny"], sender: str, target: str, approval: bool,
          home: str | None, team: str | None, agent: str | None) -> None:  # fmt: skip
    def action() -> None:
        from ralph_mail.govern.policy import Rule

        rule = Rule(_party(sender), _party(target), permission, approval)
        _edit(home, team, agent, lambda current: current.with_rule(rule))

    command(action)


@policy_app.command("allow")
def policy_allow(
    sender: Party,
    target: Party,
    approval: Annotated[
        bool, Option("--approval", help="Hold such messages for the sender's approver.")
    ] = False,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
) -> None:
    """Let FROM contact TO (replacing any rule for the same pair); the lead's to do.

    \b
    Example:
      ralph-mail policy allow intern '*' --approval --team demo --agent lead
    """
    _rule("allow", sender, target, approval, home, team, agent)


@policy_app.command("deny")
def policy_deny(
    sender: Party, target: Party, home: Home = None, team: TeamName = None, agent: Agent = None
) -> None:
    """Refuse FROM's contact with TO (replacing any rule for the same pair); the lead's
    to do.

    \b
    Example:
      ralph-mail policy deny '*' archive --team demo --agent lead
    """
    _rule("deny", sender, target, False, home, team, agent)


@policy_app.command("remove")
def policy_remove(
    sender: Party, target: Party, home: Home = None, team: TeamName = None, agent: Agent = None
) -> None:
    """Remove the rule for FROM and TO (the pair is then as if never named); the lead's
    to do.

    \b
    Example:
      ralph-mail policy remove intern '*' --team demo --agent lead
    """

    def action() -> None:
        from dataclasses import replace

        from ralph_mail.errors import InvalidMessage

        pair = (_party(sender), _party(target))

        def without(current: Policy) -> Policy:
            kept = tuple(r for r in current.rules if (r.sender, r.target) != pair)
            if len(kept) == len(current.rules):
                raise InvalidMessage(f"no rule from {pair[0]} to {pair[1]}: nothing removed")
            return replace(current, rules=kept)

        _edit(home, team, agent, without)

    command(action)


@policy_app.command("rate")
def policy_rate(
    sender: Party,
    per_minute: Annotated[
        str, Argument(help="Messages per rolling minute, or 'off'.", metavar="N")
    ],
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
) -> None:
    """Limit the messages AGENT (or everyone: '*') starts per rolling minute; the lead's
    to do.

    \b
    Example:
      ralph-mail policy rate '*' 10 --team demo --agent lead
    """

    def action() -> None:
        from ralph_mail.govern.policy import MAX_RATE, check_rate

        rate = None
        if per_minute != "off":
            if not (per_minute.isascii() and per_minute.isdigit()) or len(per_minute) > 9:
                shown = per_minute if len(per_minute) <= 24 else per_minute[:20] + "..."
                raise MailError(f"invalid rate {shown!r}: give a whole number from 1 to "
                                f"{MAX_RATE:,}, or 'off'")  # fmt: skip
            rate = check_rate(int(per_minute))
        who = _party(sender)
        _edit(home, team, agent, lambda current: current.with_rate(who, rate))

    command(action)


@policy_app.command("budget")
def policy_budget(
    who: Party,
    amount: Annotated[str, Argument(help="US dollars, or 'off'.", metavar="AMOUNT")],
    per: Annotated[
        str, Option("--per", help="The rolling window: hour or day.", metavar="WINDOW")
    ] = "day",
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
) -> None:
    """Cap what AGENT's jobs (or each agent's: '*') may cost per rolling hour or day, as
    'ralph-mail run' records it; the lead's to do. Once reached, the agent's contact is
    refused (exit 4), its runs answer with the error, and the lead gets a
    budget_exceeded message.

    \b
    Example:
      ralph-mail policy budget writer 5 --per day --team demo --agent lead
      ralph-mail policy budget '*' 0.50 --per hour --team demo --agent lead
    """

    def action() -> None:
        import math

        from ralph_mail.govern.policy import Budget, check_budget

        if per not in ("hour", "day"):
            raise MailError(f"invalid --per {per!r}: hour or day")
        budget = None
        if amount != "off":
            try:
                value: object = float(amount.removeprefix("$"))
            except ValueError:
                value = amount
            if isinstance(value, float) and not math.isfinite(value):
                value = amount  # (named as given)
            budget = Budget(check_budget(value), "hour" if per == "hour" else "day")
        name = _party(who)
        _edit(home, team, agent, lambda current: current.with_budget(name, budget))

    command(action)


@policy_app.command("depth")
def policy_depth(
    depth: Annotated[int, Argument(help="How many agents a request may pass through.")],
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
) -> None:
    """Set the team's max_depth (as 'team config TEAM max_depth N' does); the lead's to do.

    \b
    Example:
      ralph-mail policy depth 4 --team demo --agent lead
    """

    def action() -> None:
        from ralph_mail.team import change_roster

        value = setting_value("max_depth", str(depth))  # a bad value first: exit 2
        bus = identity(home, team, agent).lead("changing the team's max_depth")
        try:
            change_roster(bus.team, config={"max_depth": value})
        finally:
            bus.close()

    command(action)


@policy_app.command("require-signed")
def policy_require_signed(
    state: Annotated[str, Argument(help="on or off.", metavar="on|off")],
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
) -> None:
    """Require every message to be signed by its sender's roster key (see 'ralph-mail
    keys'), or stop requiring it; the lead's to do. On: the writer's Gate refuses what
    it could not sign (exit 4), and readers set unsigned or badly signed messages aside
    as dead letters.

    \b
    Example:
      ralph-mail policy require-signed on --team demo --agent lead
    """

    def action() -> None:
        from dataclasses import replace

        if state not in ("on", "off"):
            raise MailError(f"invalid state {state!r}: on or off")
        _edit(home, team, agent, lambda current: replace(current, require_signed=state == "on"))

    command(action)


#: The largest value of each team setting the command line sets: depths and exchange
#: counts in the hundreds at most, the seconds settings a year.
SETTING_MOST = {
    "max_depth": 1000,
    "max_internal_exchanges": 1_000_000,
    "presence_timeout": MAX_SECONDS,
    "channel_delay": MAX_SECONDS,
    "channel_turn_timeout": MAX_SECONDS,
    "task_lease": MAX_SECONDS,
}


def setting_value(key: str, text: str) -> str:
    """``text`` if it is a whole number (ASCII digits) that team setting ``key`` takes;
    else a `MailError` naming it and the range."""
    most = SETTING_MOST.get(key)
    if most is None:  # an unknown key: the team's own check names the known ones
        return text
    if not (text.isascii() and text.isdigit()) or len(text) > 12 or int(text) > most:
        shown = text if len(text) <= 24 else text[:20] + "..."
        raise MailError(f"invalid {key} {shown!r}: give a whole number from 0 to {most:,}")
    return text


def since_ts(value: str | None, option: str) -> str | None:
    """The ts ``value`` names (ISO-8601 or how long ago, as
    `ralph_mail.talk.history.parse_since` reads it), or None; a bad or absurd time is a
    `MailError` naming ``option`` and the fix."""
    from ralph_mail.talk.history import parse_since

    if value is None:
        return None
    try:
        return parse_since(value)
    except MailError as exc:
        raise MailError(f"{option}: {exc}") from None


@app.command("approvals")
def approvals(
    home: Home = None, team: TeamName = None, agent: Agent = None, json: JsonRecords = False
) -> None:
    """List the messages held for my approval (--json: a line per held message, its
    envelope's keys as it will be delivered, plus approver, reason and held_at).

    \b
    Example:
      ralph-mail approvals --team demo --agent lead
    """

    def action() -> None:
        bus = identity(home, team, agent).bus()
        try:
            waiting = bus.approvals()
        finally:
            bus.close()
        if json:  # the envelope's own keys on top, as it will be delivered (DESIGN §9.3)
            print_json_lines([held.to_dict() for held in waiting])
            return
        rows = [(h.id, h.sender, str(h.envelope["to"]), str(h.envelope["type"]),
                 safe(str(h.envelope["content"]).partition("\n")[0][:60], newlines=False),
                 h.reason) for h in waiting]  # fmt: skip
        print_table("held for my approval", ("id", "from", "to", "type", "content", "why"), rows)

    command(action)


@app.command("approve")
def approve(
    message_id: Annotated[str, Argument(help="The held message.", metavar="ID")],
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
) -> None:
    """Deliver a message held for my approval, unchanged, and tell its sender.

    \b
    Example:
      ralph-mail approve 3f2a9c1d4b5e --team demo --agent lead
    """

    def action() -> None:
        bus = identity(home, team, agent).bus()
        try:
            held = bus.approve(message_id)
        finally:
            bus.close()
        say(safe(f"{held.id} approved: delivered to {held.envelope['to']}", newlines=False) + "\n")

    command(action)


@app.command("deny")
def deny(
    message_id: Annotated[str, Argument(help="The held message.", metavar="ID")],
    reason: Annotated[str, Option("--reason", help="Why, for the sender.", metavar="R")] = "",
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
) -> None:
    """Refuse a message held for my approval; its sender is told.

    \b
    Example:
      ralph-mail deny 3f2a9c1d4b5e --reason 'ask the lead instead' --team demo --agent lead
    """

    def action() -> None:
        bus = identity(home, team, agent).bus()
        try:
            held = bus.deny(message_id, reason)
        finally:
            bus.close()
        say(safe(f"{held.id} denied: {held.sender} is told", newlines=False) + "\n")

    command(action)


@app.command("search")
def search(
    query: Annotated[str, Argument(help="Words every message found has ('' for any).")],
    sender: Annotated[str | None, Option("--from", help="Sent by AGENT.", metavar="A")] = None,
    to: Annotated[
        str | None, Option("--to", help="Sent to AGENT ('*': broadcasts).", metavar="A")
    ] = None,
    type: Annotated[str | None, Option("--type", "-t", help="Of this type.", metavar="T")] = None,
    thread: Annotated[str | None, Option("--thread", help="In this thread.", metavar="ID")] = None,
    since: Annotated[
        str | None,
        Option("--since", help="At or after TIME (ISO-8601, or 15m, 2h, 7d ago).", metavar="TIME"),
    ] = None,
    limit: Annotated[int, Option("-n", "--lines", help="At most N messages.")] = 20,
    home: Home = None,
    team: TeamName = None,
    json: Json = False,
) -> None:
    """Search every message ever sent in the team, archived ones included; newest first.

    Words match as words (no search syntax: quotes and operators are plain text).

    \b
    Example:
      ralph-mail search 'revenue Q4' --from analyst --since 7d --team demo
      ralph-mail search '' --thread 3f2a9c1d4b5e --json --team demo
    """

    def action() -> int:
        from ralph_mail.bus import MessageBus
        from ralph_mail.team import load_team

        name = identity(home, team, None).need_team()
        bus = MessageBus(name, load_team(name, home).lead, home)  # reads, consumes nothing
        try:
            found = bus.search(query, from_agent=sender, to=to, type=type, thread=thread,
                               since=since_ts(since, "--since"), limit=limit)  # fmt: skip
        finally:
            bus.close()
        print_messages(found, json)
        return 0  # no match is an answer, not a failure (see the exit codes)

    command(action)
