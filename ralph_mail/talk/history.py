"""Reading inboxes without consuming them: the last N messages, and following new ones.

This is what ``ralph-mail tail`` and ``read --peek`` show. It never moves a cursor nor
claims an inbox, so anyone in the team can look at any inbox while its owner consumes it
(the trust boundary is the Unix user, not the agent name).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from ralph_mail.errors import InvalidMessage
from ralph_mail.mailbox import ALL, pair_key
from ralph_mail.message import (
    BROADCAST_ADDRESS,
    Message,
    MessageType,
    check_id,
    check_name,
    check_type,
    decode_lines,
    format_ts,
    may_be_signed,
)
from ralph_mail.settings import safety_poll
from ralph_mail.store.base import StopEvent
from ralph_mail.team import load_team, parse_roster

if TYPE_CHECKING:
    from datetime import datetime

    from ralph_mail.mailbox import Mailbox


class History:
    """A read-only view of some inboxes of a team.

    With several inboxes, messages are merged by timestamp and a broadcast (one id in
    every inbox it reached) is shown once.

    Example:
        >>> view = History("demo", ["lead"])         # doctest: +SKIP
        >>> [m.content for m in view.last(5)]         # doctest: +SKIP
    """

    def __init__(
        self,
        team: str,
        agents: Sequence[str],
        home: str | os.PathLike[str] | None = None,
        *,
        backend: str | None = None,
    ) -> None:
        roster = load_team(team, home, backend=backend)
        for agent in agents:
            if not agent.startswith("#"):  # a channel's log: its caller found the channel
                roster.member(agent)
        self.agents = list(agents)
        self._store = roster.store
        self._roster = roster
        self._require: bool | None = None  # the policy's require_signed, read when needed
        self._offsets: dict[str, int] = {}
        #: Bytes of each inbox that gc collected before this view could show them: a view
        #: that falls behind the owner by more than one compaction skips what is gone.
        self.skipped: dict[str, int] = {}
        self._broadcasts_seen: set[str] = set()
        #: The inboxes `last` read back to their start, where the start is past 0: gc
        #: compacted them, and what it dropped is in the team's archive.
        self.archived: list[str] = []

    def last(self, count: int) -> list[Message]:
        """The last ``count`` messages (merged over the inboxes), oldest first.

        Reads back from the end of each inbox, so it costs the same on a huge inbox.
        Afterwards `follow` continues from here.
        """
        merged: list[Message] = []
        self.archived = []
        tails = self._store.read_tails(self.agents, count)  # (at once on a server)
        for agent, (lines, end) in zip(self.agents, tails, strict=True):
            self._offsets[agent] = end
            if len(lines) < count and end - sum(len(line) + 1 for line in lines) > 0:
                self.archived.append(agent)
            merged.extend(self._decode(lines))
        merged.sort(key=lambda message: message.ts)
        return merged[-count:] if count > 0 else []

    def new(self) -> list[Message]:
        """Messages that arrived since the last call (or since `last`), merged."""
        merged: list[Message] = []
        for agent in self.agents:
            if agent not in self._offsets:
                self._offsets[agent] = self._store.size(agent)
                continue
            while True:
                wanted = self._offsets[agent]
                data, offset = self._store.read(agent, wanted, skip_collected=True)
                self.skipped[agent] = self.skipped.get(agent, 0) + offset - wanted
                self._offsets[agent] = offset + len(data)
                if not data:
                    break
                merged.extend(self._decode(data.split(b"\n")[:-1]))
        merged.sort(key=lambda message: message.ts)
        return merged

    def unread(self, agent: str) -> list[Message]:
        """What ``agent`` has not consumed yet, oldest first, without consuming it or
        claiming the inbox (``ralph-mail read --peek``)."""
        cursor = self._store.load_cursor(agent)
        offset, messages = cursor.floor, list[Message]()
        while True:
            data, offset = self._store.read(agent, offset, skip_collected=True)
            if not data:
                return messages
            start = offset
            for line, message in zip(
                data.split(b"\n")[:-1], decode_lines(data.split(b"\n")[:-1])[0], strict=True
            ):
                if isinstance(message, Message) and start not in cursor.acked:
                    messages.append(message)
                start += len(line) + 1
            offset += len(data)

    def follow(self, stop: StopEvent | None = None) -> Iterator[list[Message]]:
        """Yield each batch of new messages as it arrives, until ``stop`` is set."""
        watcher = self._store.waiter(self.agents)
        quiet = time.monotonic()  # since when nothing came
        try:
            while stop is None or not stop.is_set():
                batch = self.new()
                if batch:
                    quiet = time.monotonic()
                    yield batch
                watcher.wait(safety_poll(time.monotonic() - quiet), stop)
        finally:
            watcher.close()

    def _decode(self, lines: list[bytes]) -> list[Message]:
        messages = []
        several = len(self.agents) > 1
        for message in decode_lines(lines)[0]:
            if not isinstance(message, Message):
                continue  # set aside by the owner's reader, with the reason; not shown here
            if several and message.to_agent == BROADCAST_ADDRESS:
                if message.id in self._broadcasts_seen:
                    continue
                self._broadcasts_seen.add(message.id)
            messages.append(message)
        self._verify(messages, any(may_be_signed(line) for line in lines))
        return messages

    def _verify(self, messages: list[Message], signed: bool) -> None:
        """Set `Message.verified` (and mark the unsigned, for the human output) when
        the team signs anything: a roster key, ``require_signed``, a signed line."""
        if self._require is None:
            from ralph_mail.govern.policy import requires_signed

            self._require = requires_signed(self._store)
        if signed or self._require or any(m.key for m in self._roster.members):
            from ralph_mail import signing

            signing.verify(messages, self._roster, require=self._require)
            if any(m.verified is False for m in messages):  # a key newer than my roster?
                team = self._roster
                self._roster = parse_roster(self._store.roster(), team.home, team.name,
                                            self._store)  # fmt: skip
                signing.verify(messages, self._roster, require=self._require)

    def close(self) -> None:
        """Release the descriptors."""
        self._store.close()


# -- one agent's conversations and the team's audit trail, over its mailbox --------------


def history(box: Mailbox, with_agent: str, limit: int) -> list[Message]:
    """`MessageBus.history`: the last ``limit`` messages between me and ``with_agent``."""
    other = box.recipient(with_agent)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise InvalidMessage(f"invalid limit {limit!r}: give a count >= 0")
    return box.indexed(pair_key(box.agent, other), limit)


def thread(box: Mailbox, thread_id: str) -> list[Message]:
    """`MessageBus.thread`: every message of a thread, in order, its first one included.

    A plain message that got replies starts a thread without being indexed under it
    (only requests and assignments are, when sent): it is found among the direct
    messages of the two agents its first answer was between."""
    found = box.indexed(f"thread+{check_id(thread_id, 'thread id')}", ALL)
    if found and all(message.id != thread_id for message in found):
        answer = next((m for m in found if m.reply_to == thread_id), None)
        if answer is not None:
            first = box.find(thread_id, (answer.to_agent, answer.from_agent))
            if first is not None:
                found.insert(0, first)
    return found


def search(
    box: Mailbox,
    query: str,
    *,
    from_agent: str | None,
    to: str | None,
    type: MessageType | str | None,
    thread: str | None,
    since: str | datetime | None,
    limit: int,
) -> list[Message]:
    """`MessageBus.search`: the team's audit trail, newest first."""
    from dataclasses import replace

    from ralph_mail.store.search import Query

    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidMessage(f"invalid limit {limit!r}: give a count >= 1")
    if not isinstance(query, str):
        raise InvalidMessage(f"the query must be text, not {query.__class__.__name__}")
    wanted = Query(
        query,
        None if from_agent is None else check_name(from_agent, "agent name"),
        None if to in (None, BROADCAST_ADDRESS) else check_name(to, "agent name"),
        None if type is None else str(check_type(type)),
        None if thread is None else check_id(thread, "thread id"),
        None if since is None else parse_since(since),
        limit,
    )  # fmt: skip
    if to == BROADCAST_ADDRESS:
        wanted = replace(wanted, recipient=BROADCAST_ADDRESS)
    found = decode_lines(box.store.search(wanted))[0]
    return [message for message in found if isinstance(message, Message)]


def purge_archive(box: Mailbox, before: str | datetime) -> dict[str, int]:
    """`MessageBus.purge_archive`: drop archived messages older than ``before``."""
    stamp = parse_since(before)
    starts = {}
    for agent in box.refresh_team().names:
        starts[agent] = box.store.purge_archive(agent, stamp, timeout=5.0)
        box.store.forget_archived(agent, starts[agent])
    return starts


_AGO = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(value: str | datetime) -> str:
    """A ts for ``value``: a datetime, an ISO-8601 time (UTC unless it says), or how
    long ago (``90s``, ``15m``, ``2h``, ``7d``); a time outside the years 1000 to 9999
    is an `InvalidMessage` naming it."""
    try:
        stamp = _since(value)
    except (OverflowError, OSError, ValueError):  # beyond what the C time functions take
        stamp = ""
    if not _TS.fullmatch(stamp):
        shown = value if not isinstance(value, str) or len(value) <= 24 else value[:20] + "..."
        raise InvalidMessage(
            f"invalid time {shown!r}: give a time from year 1000 to 9999, e.g. 7d (ago) or "
            "2026-01-01T00:00Z"
        )
    return stamp


_TS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")


def _since(value: str | datetime) -> str:
    from datetime import UTC, datetime

    if isinstance(value, str):
        ago = _AGO.fullmatch(value.strip())
        if ago:
            seconds = float(ago.group(1)) * _SECONDS[ago.group(2)]
            return format_ts(int((time.time() - seconds) * 1_000_000))
        try:
            value = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            raise InvalidMessage(
                f"invalid time {value!r}: give an ISO-8601 time such as 2026-11-23T10:00 or "
                "how long ago, such as 15m, 2h or 7d"
            ) from None
    if not isinstance(value, datetime):
        raise InvalidMessage(f"invalid time {value!r}: give a datetime or a string")
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return format_ts(int(value.timestamp() * 1_000_000))
