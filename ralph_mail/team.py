"""The team roster (``team.json``): who is in a team, what each does, and who leads.

Example:
    >>> team = create_team("demo", ["lead", ("worker-1", "parses logs")])  # doctest: +SKIP
    >>> team.lead, team.names                                              # doctest: +SKIP
    ('lead', ('lead', 'worker-1'))
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import orjson

from ralph_mail import settings, store
from ralph_mail.errors import InvalidName, MailError, TeamExists, TeamNotFound, UnknownAgent
from ralph_mail.message import check_name, format_ts

MemberSpec = str | tuple[str, str]


@dataclass(frozen=True)
class Member:
    """One member of a team.

    Attributes:
        name: the agent name, also its inbox's name.
        description: what the agent does (may be empty).
        role: ``"lead"`` or ``"member"``.
    """

    name: str
    description: str = ""
    role: str = "member"


@dataclass(frozen=True)
class Team:
    """A team as its roster describes it.

    Attributes:
        name: the team name.
        lead: the lead's agent name.
        members: every member, the lead included, in creation order.
        home: the mailbox home the team lives under.
        created: when the team was created (UTC ISO-8601).
    """

    name: str
    lead: str
    members: tuple[Member, ...]
    home: Path
    created: str = ""

    @property
    def names(self) -> tuple[str, ...]:
        """The member names, in roster order."""
        return tuple(member.name for member in self.members)

    @property
    def root(self) -> Path:
        """The team's directory."""
        return store.teams_dir(self.home) / self.name

    def member(self, name: str) -> Member:
        """The member called ``name``; `UnknownAgent` naming the members otherwise."""
        for member in self.members:
            if member.name == name:
                return member
        raise UnknownAgent(
            f"unknown agent {name!r} in team {self.name!r} (members: {', '.join(self.names)})"
        )


def _member(spec: MemberSpec) -> Member:
    if isinstance(spec, str):
        return Member(check_name(spec, "agent name"))
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], str):
        return Member(check_name(spec[0], "agent name"), spec[1])
    raise InvalidName(f"invalid member {spec!r}: give a name or a (name, description) pair")


def create_team(
    name: str,
    members: Iterable[MemberSpec],
    home: str | os.PathLike[str] | None = None,
    lead: str | None = None,
) -> Team:
    """Create team ``name`` with an empty inbox for every member; return its `Team`.

    ``members`` are names or ``(name, description)`` pairs; the lead is ``lead``, or the
    first member. Nothing is written unless everything is valid.

    Example:
        >>> create_team("demo", ["lead", ("worker-1", "parses logs")], home=tmp)  # doctest: +SKIP
    """
    check_name(name, "team name")
    specs = [_member(spec) for spec in members]
    if not specs:
        raise InvalidName(f"team {name!r} needs at least one member: pass --member NAME")
    names = [member.name for member in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InvalidName(f"member {duplicates[0]!r} is listed twice: list each member once")
    lead_name = names[0] if lead is None else check_name(lead, "lead name")
    if lead_name not in names:
        raise UnknownAgent(
            f"lead {lead_name!r} is not a member of team {name!r} (members: {', '.join(names)}): "
            "add it as a member"
        )
    roster_members = tuple(
        Member(m.name, m.description, "lead" if m.name == lead_name else "member") for m in specs
    )
    created = format_ts(time.time_ns() // 1000)
    team = Team(name, lead_name, roster_members, settings.home(home), created)
    roster = {
        "name": name,
        "lead": lead_name,
        "created": created,
        "members": [
            {"name": m.name, "description": m.description, "role": m.role} for m in roster_members
        ],
    }
    try:
        store.create_team_files(
            team.home, name, names, orjson.dumps(roster, option=orjson.OPT_INDENT_2)
        )
    except FileExistsError:
        raise TeamExists(
            f"team {name!r} already exists in {team.home}: pick another name or delete it first"
        ) from None
    except OSError as exc:
        raise MailError(f"cannot create team {name!r} in {team.home}: {exc}") from None
    return team


def load_team(name: str, home: str | os.PathLike[str] | None = None) -> Team:
    """The `Team` called ``name`` under ``home``; `TeamNotFound` when it does not exist."""
    check_name(name, "team name")
    home_path = settings.home(home)
    try:
        raw = store.read_roster(home_path, name)
    except FileNotFoundError:
        known = store.team_names(home_path)
        hint = f"teams: {', '.join(known)}" if known else "no teams yet"
        raise TeamNotFound(
            f"no team {name!r} in {home_path} ({hint}): create it with "
            f"'ralph-mail team create {name} --member NAME'"
        ) from None
    except MailError:
        raise
    except OSError as exc:
        raise MailError(f"cannot read team {name!r} in {home_path}: {exc}") from None
    try:
        data = orjson.loads(raw)
        members = tuple(
            Member(m["name"], m.get("description", ""), m.get("role", "member"))
            for m in data["members"]
        )
        return Team(data["name"], data["lead"], members, home_path, data.get("created", ""))
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise MailError(
            f"roster {store.teams_dir(home_path) / name / 'team.json'} is damaged ({exc}): "
            "restore it or recreate the team"
        ) from None


def list_teams(home: str | os.PathLike[str] | None = None) -> list[Team]:
    """Every team under ``home``, sorted by name."""
    return [load_team(name, home) for name in store.team_names(settings.home(home))]


def delete_team(name: str, home: str | os.PathLike[str] | None = None) -> None:
    """Delete team ``name`` and all its mail."""
    team = load_team(name, home)
    try:
        store.remove_team_files(team.home, name)
    except OSError as exc:
        raise MailError(f"cannot delete team {name!r}: {exc}") from None
