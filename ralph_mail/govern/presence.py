"""Presence and discovery: who is in the team, and who is there now (DESIGN §9.1-9.2).

An agent is *online* while a process of it consumes its inbox (the consumer claim: a
lock the kernel drops when that process dies, so a kill -9 cannot leave it looking
online) or when it was active within the team's ``presence_timeout`` (default 60 s):
any send, read or wait, even one that found no mail, and `MessageBus.set_presence`.
An explicit ``sleeping`` is reported until its ``until``, process or not. A process that
stops cleanly says so (`went_offline`): the agent is offline from then on, not for
``presence_timeout`` more, until anything of it is active again. (A process that asked
the agent within the second before trusts what it found then: asks in a loop read
presence once a second, as activity is noted.)

Example:
    >>> [(a.name, a.presence) for a in bus.agents()]        # doctest: +SKIP
    [('lead', 'idle'), ('writer', 'offline')]
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from ralph_mail import codec, settings
from ralph_mail.errors import InvalidMessage
from ralph_mail.message import format_ts
from ralph_mail.store.base import TeamStore
from ralph_mail.team import Team

if TYPE_CHECKING:  # datetime is imported where a time is parsed: a send's note needs none
    from datetime import datetime

    from ralph_mail.mailbox import Mailbox

#: What an agent may say it is doing; ``offline`` is inferred, or recorded by `went_offline`.
STATES = ("idle", "working", "sleeping", "awaiting_approval", "awaiting_delegation")


@dataclass(frozen=True, slots=True)
class AgentInfo:
    """One teammate as discovery shows it.

    Attributes:
        name: the agent's name.
        description: what it does.
        role: ``"lead"`` or ``"member"``.
        manager: whom it reports to, or None.
        mode: ``autonomous``, ``supervised`` or ``strict``.
        presence: one of `STATES`, or ``"offline"``.
        last_seen: when it was last active (UTC ISO-8601), or ``""`` when never.
        until: for ``sleeping``, when it wakes (UTC ISO-8601), else ``""``.
    """

    name: str
    description: str
    role: str
    manager: str | None
    mode: str
    presence: str
    last_seen: str
    until: str = ""

    def to_dict(self) -> dict[str, object]:
        """The record ``ralph-mail agents --json`` prints."""
        return {
            "name": self.name,
            "description": self.description,
            "role": self.role,
            "manager": self.manager,
            "mode": self.mode,
            "presence": self.presence,
            "last_seen": self.last_seen,
            "until": self.until,
        }


#: The latest ``until`` there is, in seconds since the epoch (9999-12-31T23:59:59Z): a
#: wire timestamp has a four-digit year, and compares as text.
LATEST_UNTIL: Final = 253_402_300_799


def parse_until(value: str | datetime | None) -> str:
    """``until`` as a wire timestamp: an ISO-8601 time, a datetime, or ``+DURATION``
    (``+90s``, ``+15m``, ``+2h``); ``""`` for None. A time before 1970 or after
    `LATEST_UNTIL` is refused (`InvalidMessage`): a timestamp's year must have four digits.

    >>> parse_until("2030-01-01T00:00:00Z")
    '2030-01-01T00:00:00.000000Z'
    """
    if value is None or value == "":
        return ""
    from datetime import UTC, datetime, timedelta

    given = value
    if isinstance(value, str) and value.startswith("+"):
        units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
        amount, unit = value[1:-1], value[-1:]
        if unit not in units or not (amount.isascii() and amount.isdigit()):
            raise InvalidMessage(
                f"invalid duration {value!r}: write +N followed by s, m, h or d (e.g. +15m)"
            )
        try:  # (a number thousands of digits long is a ValueError)
            value = datetime.now(UTC) + timedelta(seconds=int(amount) * units[unit])
        except (OverflowError, ValueError):
            raise _out_of_range(given) from None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise InvalidMessage(
                f"invalid time {value!r}: give ISO-8601 (2030-01-01T09:00:00Z) or +DURATION"
            ) from None
    if not isinstance(value, datetime):
        raise InvalidMessage(
            f"invalid time {value!r}: give an ISO-8601 time, +DURATION or a datetime"
        )
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    try:
        stamp = value.timestamp()
    except (OverflowError, ValueError, OSError):  # before year 1 in UTC
        stamp = -1.0
    if not 0 <= stamp <= LATEST_UNTIL:
        raise _out_of_range(given)
    return format_ts(int(stamp * 1_000_000))


def _out_of_range(given: str | datetime) -> InvalidMessage:
    shown = str(given) if len(str(given)) <= 30 else str(given)[:26] + "..."
    return InvalidMessage(
        f"invalid time {shown!r}: it is not between 1970 and 9999-12-31; give a "
        "nearer one, e.g. +15m or 2030-01-01T09:00:00Z"
    )


def record(state: str, until: str, last_seen: str) -> bytes:
    """A presence record as the store keeps it."""
    return codec.dumps({"state": state, "until": until, "last_seen": last_seen})


def read(store: TeamStore, agent: str) -> dict[str, str]:
    """An agent's presence record (empty fields when it never had one)."""
    raw = store.load_presence(agent)
    try:
        found = codec.loads(raw) if raw else {}
    except codec.DecodeError:
        found = {}
    return {key: str(found.get(key, "")) for key in ("state", "until", "last_seen")}


def went_offline(store: TeamStore, agent: str) -> None:
    """Record that ``agent``'s process stopped cleanly: offline until its next activity.
    (The record's ``until`` holds when: a later ``last_seen`` ends it.)"""
    now = format_ts(time.time_ns() // 1000)
    store.save_presence(agent, record("offline", now, now))


def check_state(state: str) -> str:
    """Return ``state`` if an agent may set it."""
    if state not in STATES:
        raise InvalidMessage(f"invalid presence {state!r}: use one of {', '.join(STATES)}")
    return state


def presence_of(team: Team, agent: str, now: float | None = None) -> tuple[str, str, str]:
    """``(presence, last_seen, until)`` of ``agent`` now."""
    now = time.time() if now is None else now
    found = read(team.store, agent)
    stamp = format_ts(int(now * 1_000_000))
    if found["state"] == "sleeping" and found["until"] > stamp:
        return "sleeping", found["last_seen"], found["until"]
    if (found["state"] == "offline" and found["last_seen"] <= found["until"]
            and team.store.consumer(agent) is None):  # fmt: skip
        return "offline", found["last_seen"], ""  # stopped cleanly, nothing active since
    timeout = settings.team_setting("presence_timeout", dict(team.config))
    recent = format_ts(int((now - timeout) * 1_000_000))
    # Active within the timeout is enough: the claim is looked at (a file opened and
    # locked, on every ask) only for an agent that has not been active lately.
    online = found["last_seen"] >= recent or team.store.consumer(agent) is not None
    if not online:
        return "offline", found["last_seen"], ""
    state = found["state"] if found["state"] in STATES and found["state"] != "sleeping" else "idle"
    return state, found["last_seen"], ""


def offline(team: Team, names: list[str]) -> list[tuple[str, str]]:
    """Those of ``names`` that are offline now, each with when it was last seen ("":
    never), in the order given.

    >>> offline(team, ["lead", "writer"])  # doctest: +SKIP
    [('writer', '2026-11-24T09:12:03.000000Z')]
    """
    now = time.time()
    found = ((name, presence_of(team, name, now)) for name in names)
    return [(name, seen) for name, (state, seen, _) in found if state == "offline"]


def agents(team: Team, me: str, include_self: bool = False) -> list[AgentInfo]:
    """Every teammate (and ``me`` with ``include_self``), in roster order."""
    now = time.time()
    infos = []
    for member in team.members:
        if member.name == me and not include_self:
            continue
        presence, last_seen, until = presence_of(team, member.name, now)
        infos.append(
            AgentInfo(
                member.name,
                member.description,
                member.role,
                member.manager,
                member.mode,
                presence,
                last_seen,
                until,
            )
        )
    return infos


# -- one agent's side, over its mailbox ---------------------------------------------------


def set_presence(box: Mailbox, state: str, until: str | datetime | None) -> None:
    """`MessageBus.set_presence`: say what my agent is doing."""
    stamp = parse_until(until)
    if check_state(state) == "sleeping" and not stamp:
        raise InvalidMessage("sleeping needs until: a time or +DURATION such as +15m")
    now = format_ts(time.time_ns() // 1000)
    box.store.save_presence(box.agent, record(state, stamp, now))
    box.touched_now()


def require_online(box: Mailbox, agent: str) -> str:
    """`AgentOffline` unless ``agent`` is online or sleeping (a request wakes it);
    return the ``until`` of its sleep, or ""."""
    from ralph_mail.errors import AgentOffline

    state, last_seen, until = presence_of(box.team, agent)
    if state == "offline":
        seen = f"last seen {last_seen}" if last_seen else "never seen"
        raise AgentOffline(f"{agent} is offline ({seen}): start it, or send a note it reads later")
    return until
