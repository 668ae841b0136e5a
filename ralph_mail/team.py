"""The team roster (``team.json``): who is in a team, what each does, and who leads.

Example:
    >>> team = create_team("demo", ["lead", ("worker-1", "parses logs")])  # doctest: +SKIP
    >>> team.lead, team.names                                              # doctest: +SKIP
    ('lead', ('lead', 'worker-1'))
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from ralph_mail import codec, settings
from ralph_mail.errors import InvalidName, MailError, TeamExists, TeamNotFound, UnknownAgent
from ralph_mail.message import check_name, format_ts

if TYPE_CHECKING:
    from ralph_mail.store import Backend, TeamStore

MemberSpec = str | tuple[str, str]


@dataclass(frozen=True)
class Member:
    """One member of a team.

    Attributes:
        name: the agent name, also its inbox's name.
        description: what the agent does (may be empty).
        role: ``"lead"`` or ``"member"``.
        manager: the member this one reports to (None: none).
        mode: ``"autonomous"`` (the default), ``"supervised"`` or ``"strict"``.
        human: a person, not a program: what is asked of it waits for an answer typed
            in ``ralph-mail serve``'s page (or a ``reply`` from a terminal).
        remote: the A2A address of an agent elsewhere that this member stands for
            (None: none); ``ralph-mail serve`` passes what is asked of it there.
        key: the public key its messages are signed with, ``"ed25519:"`` and the raw
            32 bytes in base64 (None: it signs nothing); see `ralph_mail.signing`.
    """

    name: str
    description: str = ""
    role: str = "member"
    manager: str | None = None
    mode: str = "autonomous"
    human: bool = False
    remote: str | None = None
    key: str | None = None

    def to_dict(self) -> dict[str, str | bool]:
        """The member as ``team.json`` keeps it (manager, mode and human only when set)."""
        record: dict[str, str | bool] = {"name": self.name, "description": self.description,
                                         "role": self.role}  # fmt: skip
        if self.manager is not None:
            record["manager"] = self.manager
        if self.mode != "autonomous":
            record["mode"] = self.mode
        if self.human:
            record["human"] = True
        if self.remote is not None:
            record["remote"] = self.remote
        if self.key is not None:
            record["key"] = self.key
        return record


#: How a member's contact is governed (DESIGN §9.1).
MODES = ("autonomous", "supervised", "strict")


@dataclass(frozen=True)
class Team:
    """A team as its roster describes it.

    Attributes:
        name: the team name.
        lead: the lead's agent name.
        members: every member, the lead included, in creation order.
        home: the mailbox home the team lives under.
        created: when the team was created (UTC ISO-8601).
        config: the team's settings (``max_depth``, ``max_internal_exchanges``,
            ``presence_timeout``, ``channel_delay``), as ``ralph-mail team config`` set them.
        store: where the team's mail is kept (the storage seam); opened on first use.
    """

    name: str
    lead: str
    members: tuple[Member, ...]
    home: Path
    created: str = ""
    config: Mapping[str, str] = field(default_factory=dict)
    store: TeamStore = field(default=None, compare=False, repr=False)  # type: ignore[assignment]

    @property
    def names(self) -> tuple[str, ...]:
        """The member names, in roster order."""
        return tuple(member.name for member in self.members)

    @cached_property
    def _by_name(self) -> dict[str, Member]:
        return {member.name: member for member in self.members}

    def member(self, name: str) -> Member:
        """The member called ``name``; `UnknownAgent` naming the members otherwise."""
        found = self._by_name.get(name)
        if found is not None:
            return found
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
    *,
    backend: str | None = None,
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
    counts: dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    duplicates = sorted(n for n, count in counts.items() if count > 1)
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
    home_path = settings.home(home)
    place = _backend(home_path, backend)
    team = Team(name, lead_name, roster_members, home_path, created, {}, place.team_store(name))
    roster = {
        "name": name,
        "lead": lead_name,
        "created": created,
        "members": [m.to_dict() for m in roster_members],
    }
    try:
        place.create_team(name, names, codec.dumps_indented(roster))
    except FileExistsError:
        raise TeamExists(
            f"team {name!r} already exists in {team.home}: pick another name or delete it first"
        ) from None
    return team


def _backend(home: Path, url: str | None) -> Backend:
    from ralph_mail.store import backend

    return backend(home, settings.backend(url))


class Roster:
    """A team's roster as its store has it now: read again at each `now`, parsed again
    only when its bytes changed (a view or a broadcast looks at it often)."""

    def __init__(self, team: Team) -> None:
        self.team = team
        self._raw: bytes | None = None  # the bytes self.team was parsed from (None: unknown)

    def now(self) -> Team:
        """The roster now; the same `Team` while it did not change."""
        raw = self.team.store.roster()
        if raw != self._raw:
            team = self.team
            self.team = parse_roster(raw, team.home, team.name, team.store)
            self._raw = raw
        return self.team


def parse_roster(raw: bytes, home: Path, name: str, store: TeamStore) -> Team:
    """The `Team` a roster document describes; `MailError` naming what is wrong in it.

    Every name is checked again: a roster edited by hand must not smuggle a path (a
    member called ``../x``) into the places where names become file names.
    """
    try:
        data = codec.loads(raw)
        members = tuple(_read_member(m) for m in data["members"])
        lead = check_name(data["lead"], "lead name")
        config = {str(k): str(v) for k, v in data.get("config", {}).items()}
        return Team(name, lead, members, home, data.get("created", ""), config, store)
    except (codec.DecodeError, KeyError, TypeError, AttributeError, InvalidName) as exc:
        raise MailError(
            f"roster {home / 'teams' / name / 'team.json'} is damaged ({exc}): "
            "restore it or recreate the team"
        ) from None


def _read_member(record: dict[str, object]) -> Member:
    manager = record.get("manager")
    mode = record.get("mode", "autonomous")
    if mode not in MODES:
        raise InvalidName(f"mode {mode!r} of {record.get('name')!r} is not one of {MODES}")
    return Member(
        check_name(record["name"], "member name"),
        str(record.get("description", "")),
        str(record.get("role", "member")),
        None if manager is None else check_name(manager, "manager name"),
        str(mode),
        record.get("human") is True,
        None if record.get("remote") is None else str(record["remote"]),
        None if record.get("key") is None else str(record["key"]),
    )


def update_team(
    name: str,
    home: str | os.PathLike[str] | None = None,
    *,
    backend: str | None = None,
    member: str | None = None,
    description: str | None = None,
    manager: str | None = None,
    mode: str | None = None,
    config: Mapping[str, str] | None = None,
    human: bool | None = None,
) -> Team:
    """Change a member's ``description``, ``manager`` (``""`` clears it), ``mode`` or
    whether it is ``human``, and/or the team's ``config`` settings; return the team as
    saved.

    Everything is checked before the roster is rewritten (atomically, under its lock).

    Example:
        >>> update_team("demo", member="writer", manager="lead")  # doctest: +SKIP
        >>> update_team("demo", config={"max_depth": "4"})        # doctest: +SKIP
    """
    team = load_team(name, home, backend=backend)
    change_roster(team, member=member, description=description, manager=manager, mode=mode,
                  config=config, human=human)  # fmt: skip
    return load_team(name, home, backend=backend)


def change_roster(
    team: Team,
    *,
    member: str | None = None,
    description: str | None = None,
    manager: str | None = None,
    mode: str | None = None,
    config: Mapping[str, str] | None = None,
    human: bool | None = None,
    key: str | None = None,
) -> None:
    """`update_team` of a team already loaded: check everything, then rewrite the
    roster atomically through its store. ``human``: mark the member a person (True)
    or a program (False); ``key``: its public key (``""`` removes it; who may set it is
    `ralph_mail.signing.publish`'s to judge)."""
    if mode is not None and mode not in MODES:
        raise InvalidName(f"invalid mode {mode!r}: use one of {', '.join(MODES)}")
    if member is not None:
        team.member(member)
    if manager:
        team.member(manager)
        if manager == member:
            raise InvalidName(f"{member!r} cannot be its own manager: name another member")
    for setting, value in (config or {}).items():
        if setting not in settings.TEAM_DEFAULTS:
            known = ", ".join(settings.TEAM_DEFAULTS)
            raise InvalidName(f"unknown team setting {setting!r}: use one of {known}")
        if not (str(value).isascii() and str(value).isdigit()) or len(str(value)) > 12:
            raise InvalidName(f"invalid {setting} {value!r}: give a whole number >= 0")

    def change(raw: bytes) -> bytes:
        data = codec.loads(raw)
        for record in data["members"]:
            if record["name"] != member:
                continue
            if description is not None:
                record["description"] = description
            if manager is not None:
                record.pop("manager", None)
                if manager:
                    record["manager"] = manager
            if mode is not None:
                record.pop("mode", None)
                if mode != "autonomous":
                    record["mode"] = mode
            if human is not None:
                record.pop("human", None)
                if human:
                    record["human"] = True
            if key is not None:
                record.pop("key", None)
                if key:
                    record["key"] = key
        if config:
            data.setdefault("config", {}).update({k: str(v) for k, v in config.items()})
        return codec.dumps_indented(data)

    team.store.update_roster(change)


def add_member(team: Team, name: str, description: str = "", *, remote: str | None = None) -> None:
    """Add member ``name`` to a team already loaded: its empty inbox, then its roster
    entry (``remote``: the A2A address it stands for, http or https)."""
    check_name(name, "agent name")
    if name in team.names:
        raise InvalidName(f"{name!r} is already a member of team {team.name!r}: pick another name")
    if remote is not None and not remote.startswith(("http://", "https://")):
        raise InvalidName(f"invalid address {remote!r}: give an http:// or https:// URL")
    with contextlib.suppress(FileExistsError):  # made by an add stopped before the roster
        team.store.create_log(name)
    record = Member(name, description, remote=remote).to_dict()

    def change(raw: bytes) -> bytes:
        data = codec.loads(raw)
        if all(m["name"] != name for m in data["members"]):
            data["members"].append(record)
        return codec.dumps_indented(data)

    team.store.update_roster(change)


def load_team(
    name: str, home: str | os.PathLike[str] | None = None, *, backend: str | None = None
) -> Team:
    """The `Team` called ``name`` under ``home`` (or in ``backend``, default
    ``$RALPH_BACKEND``, else files under the home); `TeamNotFound` when it does not exist."""
    check_name(name, "team name")
    home_path = settings.home(home)
    place = _backend(home_path, backend)
    try:
        raw = place.read_roster(name)
    except FileNotFoundError:
        known = place.team_names()
        hint = f"teams: {', '.join(known)}" if known else "no teams yet"
        raise TeamNotFound(
            f"no team {name!r} in {home_path} ({hint}): create it with "
            f"'ralph-mail team create {name} --member NAME'"
        ) from None
    return parse_roster(raw, home_path, name, place.team_store(name))


def list_teams(
    home: str | os.PathLike[str] | None = None, *, backend: str | None = None
) -> list[Team]:
    """Every team under ``home``, sorted by name."""
    names = _backend(settings.home(home), backend).team_names()
    return [load_team(name, home, backend=backend) for name in names]


def delete_team(
    name: str, home: str | os.PathLike[str] | None = None, *, backend: str | None = None
) -> None:
    """Delete team ``name`` and all its mail."""
    team = load_team(name, home, backend=backend)
    _backend(team.home, backend).remove_team(name)
