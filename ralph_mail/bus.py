"""`MessageBus`: one agent's view of its team's mailboxes: send, broadcast, read, wait."""

from __future__ import annotations

import gc
import os
import time
import warnings
from collections.abc import Callable, Mapping
from itertools import accumulate, repeat
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

from ralph_mail import settings
from ralph_mail.errors import BroadcastError, InvalidMessage, MailError, UnknownAgent
from ralph_mail.message import (
    BROADCAST_ADDRESS,
    Message,
    MessageType,
    check_id,
    check_metadata,
    check_name,
    check_type,
    decode_lines,
    from_envelope,
    new_id,
)
from ralph_mail.settings import WATCH_SAFETY_POLL_S
from ralph_mail.store import Cursor, FileStore
from ralph_mail.team import Team, load_team

if TYPE_CHECKING:
    from ralph_mail.watch import StopEvent, Watcher

_T = TypeVar("_T")

#: Above this many lines a read runs with the cyclic GC paused: it is 3.5x faster on big
#: backlogs, where the GC would otherwise rescan every new message (MEASUREMENTS.md §4).
_GC_PAUSE_LINES = 2000


class MessageBus:
    """One agent of one team: send to teammates, and consume its own inbox.

    Sends are appended under the recipient's inbox lock; reads start from the agent's
    persisted cursor, so only new messages are read, and waits block on file events.

    Example:
        >>> bus = MessageBus(team="demo", agent="worker-1")          # doctest: +SKIP
        >>> bus.send("lead", MessageType.STATUS_UPDATE, "parsing done",
        ...          metadata={"state": "working"})                 # doctest: +SKIP
        >>> for message in bus.wait_for_messages(timeout=30):        # doctest: +SKIP
        ...     print(message.from_agent, message.content)

    Args:
        team: the team's name; it must exist.
        agent: who this bus speaks for; it must be a member.
        home: the mailbox home (default ``$RALPH_HOME`` or ``~/.ralph``).
        durable: fsync each send (default ``$RALPH_DURABLE``, else off).
        max_message_bytes: the largest encoded line accepted (default 1 MiB).
    """

    def __init__(
        self,
        team: str,
        agent: str,
        home: str | os.PathLike[str] | None = None,
        *,
        durable: bool | None = None,
        max_message_bytes: int | None = None,
    ) -> None:
        self.agent = check_name(agent, "agent name")
        self._team = load_team(team, home)
        self._team.member(agent)
        self._members = frozenset(self._team.names)
        self._store = FileStore(self._team.root, durable=settings.durable(durable))
        self.max_message_bytes = settings.max_message_bytes(max_message_bytes)
        self._gc_auto = settings.gc_auto_bytes()
        self._cursor: Cursor | None = None
        self._scanned = 0  # logical offset up to which _pending is complete
        self._pending: list[tuple[int, Message]] = []  # unconsumed (line start, message)
        self._watcher: Watcher | None = None

    # -- who ----------------------------------------------------------------------------

    @property
    def team(self) -> Team:
        """The team's roster, as loaded (see `refresh_team`)."""
        return self._team

    @property
    def durable(self) -> bool:
        """Whether each send is fsynced before it returns."""
        return self._store.durable

    def refresh_team(self) -> Team:
        """Reload the roster from disk."""
        self._team = load_team(self._team.name, self._team.home)
        self._members = frozenset(self._team.names)
        return self._team

    def _recipient(self, to: str) -> str:
        if to in self._members:
            return to
        if to == BROADCAST_ADDRESS:
            raise InvalidMessage("'*' is the broadcast address: use broadcast() to reach everyone")
        check_name(to, "recipient")
        if to in self.refresh_team().names:
            return to
        self._team.member(to)  # raises UnknownAgent naming the members
        raise UnknownAgent(to)  # pragma: no cover - member() raised

    # -- sending ------------------------------------------------------------------------

    def send(
        self,
        to: str,
        type: MessageType | str,
        content: str,
        metadata: Mapping[str, str] | None = None,
        *,
        reply_to: str | None = None,
        id: str | None = None,
    ) -> Message:
        """Append one message to ``to``'s inbox; return it as written.

        When this returns, the message is in the file (and on disk in durable mode). When
        it raises, nothing a reader would deliver was written. Pass ``id`` to retry a send
        under the same id, so a receiver that remembers ids handles it once.

        Example:
            >>> bus.send("lead", MessageType.TEXT, "retry me", id="9f1c2e3d4b5a")  # doctest: +SKIP
        """
        recipient = self._recipient(to)
        envelope = self._envelope(recipient, type, content, metadata, reply_to, id)
        envelope["ts"] = self._store.append(recipient, envelope, self.max_message_bytes)
        return from_envelope(envelope)

    def broadcast(
        self,
        content: str,
        metadata: Mapping[str, str] | None = None,
        *,
        type: MessageType | str = MessageType.BROADCAST,
        id: str | None = None,
    ) -> Message:
        """Append one message (one id) to every member's inbox but the sender's.

        Each inbox gets the line with the ts taken under its own lock; the message
        returned carries the last of them. If an inbox cannot be written, `BroadcastError`
        names the inboxes that did and did not receive it.
        """
        envelope = self._envelope(BROADCAST_ADDRESS, type, content, metadata, None, id)
        delivered: list[str] = []
        failed: list[str] = []
        reason = ""
        for member in self.refresh_team().names:
            if member == self.agent:
                continue
            try:
                envelope["ts"] = self._store.append(member, envelope, self.max_message_bytes)
            except InvalidMessage:
                raise  # too big or not encodable: the same for every inbox, so none has it
            except MailError as exc:
                failed.append(member)
                reason = str(exc)
            else:
                delivered.append(member)
        if failed:
            raise BroadcastError(
                f"broadcast {envelope['id']} reached {', '.join(delivered) or 'no inbox'} "
                f"but not {', '.join(failed)}: {reason}",
                delivered,
                failed,
            )
        return from_envelope(envelope)

    def _envelope(
        self,
        to: str,
        type: MessageType | str,
        content: str,
        metadata: Mapping[str, str] | None,
        reply_to: str | None,
        id: str | None,
    ) -> dict[str, object]:
        if not isinstance(content, str):
            raise InvalidMessage(
                f"content must be a string, not {content.__class__.__name__}: convert it with str()"
            )
        envelope: dict[str, object] = {
            "id": new_id() if id is None else check_id(id),
            "from": self.agent,
            "to": to,
            "type": check_type(type).value,
            "content": content,
            "metadata": check_metadata(metadata),
            "ts": "",
        }
        if reply_to is not None:
            envelope["reply_to"] = check_id(reply_to, "reply_to")
        return envelope

    # -- reading ------------------------------------------------------------------------

    def _load(self) -> Cursor:
        if self._cursor is None:
            self._cursor = self._store.load_cursor(self.agent)
            self._scanned = self._cursor.floor
            self._pending = []
        return self._cursor

    def _refresh(self, starts: bool = True) -> list[tuple[int, Message]]:
        """Read what arrived since the last read into the pending list; return it.

        With ``starts=False`` (`poll`, which consumes everything it reads) clean lines get
        no line offsets: computing them is a third of the cost of a read.
        """
        cursor = self._load()
        while True:
            data, offset = self._store.read(self.agent, self._scanned)
            if not data:
                return self._pending
            lines = data.split(b"\n")
            lines.pop()
            paused = len(lines) > _GC_PAUSE_LINES and gc.isenabled()
            if paused:
                gc.disable()
            try:
                messages, clean = decode_lines(lines)
                if clean and not cursor.acked and not starts:
                    self._scanned = offset + len(data)
                    self._pending.extend(zip(repeat(-1), messages))  # type: ignore[arg-type]
                    continue
                offsets = list(accumulate([len(line) + 1 for line in lines], initial=offset))
                self._scanned = offsets.pop()
                if clean and not cursor.acked:
                    self._pending.extend(zip(offsets, messages, strict=True))  # type: ignore[arg-type]
                    continue
                for start, line, message in zip(offsets, lines, messages, strict=True):
                    if isinstance(message, Message):
                        if start not in cursor.acked:
                            self._pending.append((start, message))
                    elif line.strip():
                        self._store.dead_letter(self.agent, start, line, message)
            finally:
                if paused:
                    gc.enable()

    def _save(self, floor: int, pending: list[tuple[int, Message]], acked: int = -1) -> None:
        # Memory changes only once the cursor is on disk: a failed save consumes nothing.
        cursor = self._load()
        marks = cursor.acked | {acked} if acked >= 0 else cursor.acked
        saved = Cursor(floor, {start for start in marks if start >= floor})
        self._store.save_cursor(self.agent, saved)
        self._cursor, self._pending = saved, pending
        if self._gc_auto and self._store.collectable(self.agent, floor) >= self._gc_auto:
            self._compact()

    def _compact(self) -> None:
        # Only an optimisation: when it fails (no room for the copy) the inbox stays as it was.
        try:
            self._store.compact(self.agent)
        except (MailError, OSError) as exc:
            message = f"could not compact the inbox of {self.agent!r}: {exc}"
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    def peek(self) -> list[Message]:
        """The unconsumed messages of my inbox, oldest first, without consuming them.

        Follow with `commit` once they are handled, for at-least-once delivery.
        """
        return [message for _, message in self._refresh()]

    def poll(self) -> list[Message]:
        """Consume and return the unconsumed messages of my inbox, oldest first."""
        messages = [message for _, message in self._refresh(starts=False)]
        if messages or self._scanned != self._load().floor:
            try:
                self._save(self._scanned, [])
            except BaseException:
                self._cursor = None  # re-read from the cursor on disk: nothing was consumed
                raise
        return messages

    def commit(self, message: Message) -> None:
        """Consume every message up to and including ``message`` (one `peek` returned).

        A process that crashes between `peek` and `commit` gets the messages again.
        """
        index = _find(self._pending, message)
        rest = self._pending[index + 1 :]
        self._save(self._next_floor(rest), rest)

    def _next_floor(self, pending: list[tuple[int, Message]]) -> int:
        # The first unconsumed line; with none, past everything read (set-aside lines too).
        return pending[0][0] if pending else self._scanned

    def _take(self, type: MessageType) -> Message | None:
        """Consume the first unconsumed message of ``type`` only; the others stay unread."""
        for index, (start, message) in enumerate(self._refresh()):
            if message.type == type:
                rest = self._pending[:index] + self._pending[index + 1 :]
                self._save(self._next_floor(rest), rest, start)
                return message
        return None

    # -- waiting ------------------------------------------------------------------------

    def wait_for_messages(
        self,
        timeout: float | None = None,
        *,
        stop: StopEvent | None = None,
        consume: bool = True,
    ) -> list[Message]:
        """Consume and return new messages, blocking until some arrive.

        Returns at once when mail is already waiting; returns ``[]`` after ``timeout``
        seconds (None: wait indefinitely) or when ``stop`` is set. With ``consume=False``
        it returns what `peek` would, for an at-least-once consumer that commits itself.

        Example:
            >>> for message in bus.wait_for_messages(timeout=30, consume=False):  # doctest: +SKIP
            ...     handle(message)
            ...     bus.commit(message)
        """
        return self._wait(self.poll if consume else self.peek, timeout, stop) or []

    def wait_for_message(
        self,
        type: MessageType | str,
        timeout: float | None = None,
        *,
        stop: StopEvent | None = None,
    ) -> Message | None:
        """Consume and return the first message of ``type``, blocking until one arrives.

        Only that message is consumed: messages of other types stay unread for the next
        `poll` or `wait_for_messages`, in memory and on disk. None after ``timeout``.

        Example:
            >>> bus.wait_for_message(MessageType.PLAN_APPROVAL, timeout=60.0)  # doctest: +SKIP
        """
        kind = check_type(type)
        return self._wait(lambda: self._take(kind), timeout, stop)

    def _wait(self, attempt: Callable[[], _T], timeout: float | None, stop: StopEvent | None) -> _T:
        found = attempt()
        if found or timeout == 0:
            return found
        deadline = None if timeout is None else time.monotonic() + timeout
        watcher = self._watch()
        while True:
            found = attempt()  # also catches what arrived while the watcher started
            if found or (stop is not None and stop.is_set()):
                return found
            remaining = WATCH_SAFETY_POLL_S
            if deadline is not None:
                remaining = min(remaining, deadline - time.monotonic())
                if remaining <= 0:
                    return found
            watcher.wait(remaining, stop)

    def _watch(self) -> Watcher:
        if self._watcher is None:
            from ralph_mail.watch import Watcher

            self._watcher = Watcher(self._store.mailbox)
        return self._watcher

    # -- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Release descriptors and stop the watcher; the bus can be used again after."""
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        self._store.close()

    def __enter__(self) -> MessageBus:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        team, home = self._team.name, str(self._team.home)
        return f"MessageBus(team={team!r}, agent={self.agent!r}, home={home!r})"


def _find(entries: list[tuple[int, Message]], message: Message) -> int:
    for index, (_, pending) in enumerate(entries):
        if pending is message:
            return index
    for index, (_, pending) in enumerate(entries):
        if pending.id == message.id and pending.ts == message.ts:
            return index
    raise InvalidMessage(
        f"message {message.id} is not among the peeked, unconsumed messages: "
        "commit only a message that peek() returned"
    )
