"""Channels with @mentions (DESIGN §10): a log of posts per channel, read by each member
from its own cursor, and mentions that ask members to answer one after another.

A channel is kept by the store as the log ``#NAME`` (an inbox's guarantees: locked
append, torn-tail repair, dead letters, gc, the audit trail); a member's cursor in it is
``#NAME@MEMBER``. The log holds posts alone (answers are posts that reply to the post
they answer). Membership lives in the team state ``channels``; passed turns in the team
log ``channel.NAME``.

A post that mentions members (``@name``, ``@all``) puts a ``mention`` in each one's
inbox, with its place in the order of the mentions. A mentioned member answers in turn:
after every member mentioned before it answered or passed (or their turns timed out),
and a random pause of up to ``channel_delay`` seconds after the last of them, so each
sees the earlier answers. `Channels.turn` tells where a mention stands; the runner
(`ralph_mail.runner`) and `Channels.wait_turn` follow it.

Example:
    >>> bus.channels.create("standup", ["writer", "analyst"])          # doctest: +SKIP
    >>> bus.channel_post("standup", "@writer @analyst what are you on?")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import random
import re
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

from ralph_mail import codec, settings
from ralph_mail.errors import InvalidMessage, MailError, PermissionDenied
from ralph_mail.message import (
    Message,
    MessageType,
    check_id,
    check_name,
    decode_lines,
    encode_parts,
    format_ts,
    from_envelope,
    may_be_signed,
    parse_ts,
)
from ralph_mail.store.base import Cursor

if TYPE_CHECKING:
    from ralph_mail.bus import MessageBus
    from ralph_mail.store.base import StopEvent, TeamStore

#: The team state that holds the channels and their members.
KEY: Final = "channels"
#: The team log of a channel's passed turns: ``channel.NAME``.
PASSES: Final = "channel."
#: ``@name`` not inside a word or an e-mail address.
_MENTION = re.compile(r"(?<![A-Za-z0-9_.@-])@([A-Za-z0-9][A-Za-z0-9_.-]{0,63})")

Standing = Literal["done", "wait", "go"]


@dataclass(frozen=True, slots=True)
class Channel:
    """A channel: its name (without ``#``), members, who made it and when."""

    name: str
    members: tuple[str, ...]
    by: str = ""
    created: str = ""


@dataclass(frozen=True, slots=True)
class Turn:
    """Where a mention stands: ``done`` (answered or passed already), ``wait`` (earlier
    turns go on: look again by ``until``, a `time.time`), or ``go`` (my turn)."""

    standing: Standing
    until: float = 0.0


def channel_name(name: object) -> str:
    """A channel's name without its ``#``; `InvalidName` when it is not a valid name."""
    if isinstance(name, str) and name.startswith("#"):
        name = name[1:]
    return check_name(name, "channel name")


def parse(raw: bytes | None) -> dict[str, Channel]:
    """The channels saved under `KEY`."""
    found: dict[str, Channel] = {}
    for name, record in (codec.loads(raw) if raw else {}).items():
        found[name] = Channel(name, tuple(record["members"]), record.get("by", ""),
                              record.get("created", ""))  # fmt: skip
    return found


def _dump(channels: dict[str, Channel]) -> bytes:
    # Names in order, each record's keys in order: the sorted bytes, without orjson.
    records = {name: {"by": c.by, "created": c.created, "members": list(c.members)}
               for name, c in sorted(channels.items())}  # fmt: skip
    return codec.dumps_indented(records)


def mentions(text: str, channel: Channel, poster: str) -> list[str]:
    """The members ``text`` mentions, in order, once each (``@all``: everyone but the
    poster), a name matched regardless of case (``@Writer`` is writer; the exact name
    wins where two members differ only in case); `InvalidMessage` naming the members
    for a name that is not one."""
    found: list[str] = []
    folded: dict[str, list[str]] = {}
    for member in channel.members:
        folded.setdefault(member.casefold(), []).append(member)
    for match in _MENTION.finditer(text):
        name = _member(match.group(1), channel, folded)
        if name is None:  # the end of a sentence: "... ask @writer."
            name = _member(match.group(1).rstrip(".-"), channel, folded)
        if name == "all":
            wanted = [m for m in channel.members if m != poster]
        elif name is not None:
            wanted = [name] if name != poster else []
        else:
            raise InvalidMessage(
                f"@{match.group(1)} is not a member of #{channel.name} (members: "
                f"{', '.join(channel.members)}): mention a member, or add them with "
                f"'ralph-mail channel join {channel.name} --agent NAME'"
            )
        found += [m for m in wanted if m not in found]
    return found


def _member(name: str, channel: Channel, folded: dict[str, list[str]]) -> str | None:
    """The member ``name`` means (or "all"), or None."""
    if name in channel.members:
        return name
    if name.casefold() == "all":
        return "all"
    same = folded.get(name.casefold(), [])
    return same[0] if len(same) == 1 else None


def delay_of(post_id: str, agent: str, most: int) -> float:
    """The pause before ``agent`` answers post ``post_id``: 1 to ``most`` seconds (fewer
    when ``most`` is below 1), the same for a runner started again."""
    if most <= 0:
        return 0.0
    return random.Random(f"{post_id}:{agent}").uniform(min(1.0, most), float(most))


def listed(store: TeamStore) -> list[Channel]:
    """Every channel of the team ``store`` keeps, by name."""
    return sorted(parse(store.load_state(KEY)).values(), key=lambda c: c.name)


def find(store: TeamStore, name: str) -> Channel:
    """Channel ``name`` of the team ``store`` keeps; `InvalidMessage` naming the
    channels when there is none."""
    name = channel_name(name)
    channels = parse(store.load_state(KEY))
    found = channels.get(name)
    if found is None:
        known = ", ".join(f"#{c}" for c in sorted(channels)) or "none yet"
        raise InvalidMessage(
            f"no channel #{name} (channels: {known}): make it with "
            f"'ralph-mail channel create {name} --member NAME'"
        )
    return found


def history(store: TeamStore, name: str, limit: int = 20) -> list[Message]:
    """The last ``limit`` posts of channel ``name``, oldest first: the log's tail, and
    what gc archived when the log holds fewer."""
    channel = find(store, name)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise InvalidMessage(f"invalid limit {limit!r}: give a count >= 0")
    key = f"#{channel.name}"
    lines, end = store.read_tail(key, limit)
    start = end - sum(len(line) + 1 for line in lines)
    if len(lines) < limit and start > 0:  # gc archived the rest: read it back
        kept: deque[bytes] = deque(maxlen=limit - len(lines))
        offset = 0
        while offset < start:
            data, at = store.read_audit(key, offset)
            if not data:
                break
            kept.extend(data[: max(0, start - at)].split(b"\n")[:-1])
            offset = at + len(data)
        lines = [*kept, *lines]
    decoded, _ = decode_lines(lines)
    return [post for post in decoded if isinstance(post, Message)]


class Channels:
    """One agent's channels (see the module docstring); ``bus.channels``."""

    def __init__(self, bus: MessageBus) -> None:
        self._bus = bus
        self._store = bus.store
        self._ends: dict[str, tuple[str, int]] = {}  # id -> (channel, end) of unread posts
        self._known: tuple[tuple[int, ...] | None, dict[str, Channel]] = (None, {})

    # -- membership ------------------------------------------------------------------------

    def all(self) -> list[Channel]:
        """Every channel of the team, by name."""
        return listed(self._store)

    def get(self, name: str) -> Channel:
        """Channel ``name``; `InvalidMessage` naming the channels when there is none.
        Read again only when the channels were saved since (a post costs no read)."""
        version = self._store.state_version(KEY)
        if version is None or version != self._known[0]:
            self._known = (version, parse(self._store.load_state(KEY)))
        found = self._known[1].get(channel_name(name))
        return found if found is not None else find(self._store, name)

    def create(self, name: str, members: Sequence[str] = (), *, everyone: bool = False) -> Channel:
        """Make channel ``name`` for ``members`` (and me), or the whole team."""
        name = channel_name(name)
        team = self._bus.refresh_team()
        wanted = list(team.names) if everyone else [self._bus.agent, *members]
        for member in wanted:
            team.member(member)  # UnknownAgent naming the members
        chosen = tuple(dict.fromkeys(wanted))
        made = Channel(name, chosen, self._bus.agent, format_ts(time.time_ns() // 1000))

        def change(raw: bytes | None) -> bytes:
            channels = parse(raw)
            if name in channels:
                raise InvalidMessage(f"channel #{name} exists: pick another name")
            channels[name] = made
            return _dump(channels)

        with contextlib.suppress(FileExistsError):  # a creator killed before saving it
            self._store.create_log(f"#{name}")
        self._store.update_state(KEY, change)
        for member in chosen:  # a cursor each, at the start: gc keeps what they did not read
            key = f"#{name}@{member}"
            self._store.save_cursor(key, self._store.load_cursor(key))
        return made

    def join(self, name: str, agent: str | None = None) -> Channel:
        """Add ``agent`` (me) to the channel; it reads the posts made from now on."""
        return self._membership(name, agent or self._bus.agent, True)

    def leave(self, name: str, agent: str | None = None) -> Channel:
        """Take ``agent`` (me) out of the channel; its cursor there goes."""
        return self._membership(name, agent or self._bus.agent, False)

    def _membership(self, name: str, agent: str, joining: bool) -> Channel:
        channel = self.get(name)
        self._bus.refresh_team().member(agent)
        key = f"#{channel.name}@{agent}"
        if joining:
            self._store.save_cursor(key, Cursor(self._store.size(f"#{channel.name}")))

        def change(raw: bytes | None) -> bytes:
            channels = parse(raw)
            now = channels[channel.name]
            members = [m for m in now.members if m != agent] + ([agent] if joining else [])
            channels[channel.name] = Channel(now.name, tuple(members), now.by, now.created)
            return _dump(channels)

        self._store.update_state(KEY, change)
        if not joining:
            self._store.drop_cursor(key)
        return self.get(channel.name)

    def _member_of(self, name: str) -> Channel:
        channel = self.get(name)
        if self._bus.agent not in channel.members:
            raise PermissionDenied(
                f"{self._bus.agent} is not a member of #{channel.name}: join it first "
                f"('ralph-mail channel join {channel.name}')"
            )
        return channel

    # -- posts -----------------------------------------------------------------------------

    def post(
        self,
        name: str,
        text: str,
        reply_to: str | None = None,
        *,
        chain: tuple[str, ...] | None = None,
    ) -> Message:
        """Append a post to the channel and put a `mention` in the inbox of each member it
        mentions; return the post as written. ``chain``: the agents the mention this post
        answers passed through (default `MessageBus.chain`); past the team's ``max_depth``
        a post's mentions start no more answers (the seeds' loop guard)."""
        bus = self._bus
        channel = self._member_of(name)
        mentioned = mentions(text, channel, bus.agent)
        carried = (*(bus.chain if chain is None else chain), bus.agent)
        depth = settings.team_setting("max_depth", dict(bus.team.config))
        trigger = bool(mentioned) and len(carried) <= depth
        bus.gate.check_post(channel.name, mentioned if trigger else [])
        metadata = {"mentions": ",".join(mentioned)} if mentioned else None
        envelope = bus.envelope(f"#{channel.name}", MessageType.TEXT, text, metadata, reply_to)
        bus.seal(envelope)
        head, tail = encode_parts(envelope, bus.max_message_bytes)
        envelope["ts"], offset = self._store.append(f"#{channel.name}", head, tail)
        post = from_envelope(envelope)
        for turn, member in enumerate(mentioned if trigger else []):
            # Judged with the post, above: each is delivered as the Gate passed it.
            mention = bus.envelope(member, MessageType.MENTION, text,
                                   {"channel": channel.name, "at": str(offset),
                                    "turn": str(turn), "turns": ",".join(mentioned),
                                    "posted": post.ts}, post.id, chain=carried)  # fmt: skip
            bus._deliver(mention)
        return post

    def read(self, name: str, *, consume: bool = True) -> list[Message]:
        """The posts of the channel I have not read, oldest first (mine left out);
        consumed unless ``consume`` is False (then `commit` the last one handled)."""
        channel = self._member_of(name)
        key = f"#{channel.name}"
        cursor = self._store.load_cursor(f"{key}@{self._bus.agent}")
        posts, end = self._posts(key, cursor.floor)
        mine = [post for post, _ in posts if post.from_agent != self._bus.agent]
        if consume:
            self._store.save_cursor(f"{key}@{self._bus.agent}", Cursor(end))
        else:
            for post, after in posts:
                self._ends[post.id] = (channel.name, after)
        return mine

    def commit(self, post: Message) -> None:
        """Consume the posts up to ``post`` (from ``read(consume=False)``)."""
        name, end = self._ends[post.id]
        self._store.save_cursor(f"#{name}@{self._bus.agent}", Cursor(end))
        self._ends.clear()

    def _posts(self, key: str, offset: int) -> tuple[list[tuple[Message, int]], int]:
        """The posts of log ``key`` from ``offset``, each with the offset after it."""
        found: list[tuple[Message, int]] = []
        while True:
            data, start = self._store.read(key, offset)
            if not data:
                return found, offset
            lines = data.split(b"\n")[:-1]
            decoded, _ = decode_lines(lines)
            self._bus._trust(decoded, may_be_signed(data))  # refused posts: set aside, below
            at = start
            for line, post in zip(lines, decoded, strict=True):
                at += len(line) + 1
                if isinstance(post, Message):
                    found.append((post, at))
                elif line.strip():
                    self._store.dead_letter(key, at - len(line) - 1, line, post)
            offset = at

    def history(self, name: str, limit: int = 20) -> list[Message]:
        """The last ``limit`` posts of the channel, oldest first."""
        return history(self._store, name, limit)

    # -- turns -----------------------------------------------------------------------------

    def pass_turn(self, name: str, post_id: str) -> None:
        """Decline to answer post ``post_id`` (the seeds' ``do_nothing``): the next member
        mentioned goes on at once."""
        channel = self._member_of(name)
        record = {"post": check_id(post_id, "post id"), "agent": self._bus.agent,
                  "ts": format_ts(time.time_ns() // 1000)}  # fmt: skip
        self._store.log_append(PASSES + channel.name, codec.dumps(record) + b"\n")

    def turn(self, mention: Message) -> Turn:
        """Where ``mention`` (a `mention` in my inbox) stands now."""
        meta = mention.metadata
        name, post_id = meta.get("channel", ""), mention.reply_to or ""
        turns = meta.get("turns", "").split(",")
        try:
            mine = int(meta.get("turn", "0"))
            at = int(meta.get("at", "0"))
            posted = parse_ts(meta.get("posted", mention.ts))
        except (ValueError, MailError):
            return Turn("go")  # a mention written by hand: answer it
        answered = {post.from_agent: post.ts for post, _ in self._posts(f"#{name}", at)[0]
                    if post.reply_to == post_id}  # fmt: skip
        for line in self._store.log_read(PASSES + name).splitlines():
            record = codec.loads(line)
            if record.get("post") == post_id:
                answered.setdefault(record["agent"], record["ts"])
        if self._bus.agent in answered:
            return Turn("done")
        config = dict(self._bus.team.config)
        try:
            members = set(self.get(name).members)
        except InvalidMessage:
            return Turn("go")  # the channel went: the answer is refused with the reason
        for agent in turns[:mine]:  # a member who left takes no turn
            if agent not in members:
                answered.setdefault(agent, meta.get("posted", mention.ts))
        earlier = turns[:mine]
        if any(agent not in answered for agent in earlier):
            timeout = settings.team_setting("channel_turn_timeout", config)
            most = settings.team_setting("channel_delay", config)
            give_up = posted + mine * (timeout + most)
            return Turn("wait", give_up) if time.time() < give_up else Turn("go")
        last = max((parse_ts(answered[a]) for a in earlier), default=posted)
        ready = last + delay_of(post_id, self._bus.agent, settings.team_setting(
            "channel_delay", config)) if earlier else 0.0  # fmt: skip
        return Turn("wait", ready) if time.time() < ready else Turn("go")

    def watch_keys(self, mention: Message) -> list[str]:
        """What changes when a turn before ``mention``'s ends: its channel and passes."""
        name = mention.metadata.get("channel", "")
        return [f"#{name}", f"log:{PASSES}{name}"]

    def wait_turn(
        self, mention: Message, timeout: float | None = None, stop: StopEvent | None = None
    ) -> Standing:
        """Block until it is my turn to answer ``mention`` (``go``), it was answered
        already (``done``), or ``timeout`` / ``stop`` (``wait``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        waiter = self._store.waiter(self.watch_keys(mention))
        try:
            while True:
                now = self.turn(mention)
                if now.standing != "wait" or (stop is not None and stop.is_set()):
                    return now.standing
                left = max(0.0, now.until - time.time())
                if deadline is not None:
                    left = min(left, deadline - time.monotonic())
                    if left <= 0:
                        return "wait"
                waiter.wait(min(left, settings.WATCH_SAFETY_POLL_S), stop)
        finally:
            waiter.close()


__all__ = ["Channel", "Channels", "Turn", "channel_name", "mentions"]
