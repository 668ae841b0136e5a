"""The consuming side of a `Mailbox`: the owner's cursor, the messages read and not yet
consumed, and waiting for new ones.

A read starts from the persisted cursor (claiming the inbox: one consumer per inbox),
so only new messages are read; a commit saves the cursor before memory changes, so a
failed save consumes nothing; a wait blocks on the store's waiter and treats a wake-up
as a hint (it always reads to the end).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate, repeat
from typing import TYPE_CHECKING, TypeVar

from ralph_mail.errors import InboxBusy, InvalidMessage, LockTimeout, MailError
from ralph_mail.message import Message, MessageType, check_type, decode_lines, may_be_signed
from ralph_mail.settings import WATCH_SAFETY_POLL_S, safety_poll
from ralph_mail.store.base import Cursor, StopEvent, TeamStore, Waiter

_T = TypeVar("_T")

#: How many of the requests read lately a mailbox remembers (`Consuming.received`).
_RECEIVED_KEPT = 64
#: How many ids of the requests it answered a mailbox remembers (`Consuming.unanswered`).
_ANSWERED_KEPT = 1024
#: `Consuming._unseen_from` before a read after the claim reached the inbox's end.
UNKNOWN_END = 1 << 62
#: Above this many lines a read runs with the cyclic GC paused: it is 3.5x faster on big
#: backlogs, where the GC would otherwise rescan every new message (MEASUREMENTS.md §4).
_GC_PAUSE_LINES = 2000


@dataclass(frozen=True, slots=True)
class _Mark:
    """Where a mailbox's consuming stood, to go back to (`Consuming.hand_on`): the
    cursor, the messages read and not consumed with their offsets, and the offset
    reading had reached."""

    cursor: Cursor
    pending: tuple[tuple[int, Message], ...]
    scanned: int


class Consuming:
    """What `Mailbox` does as its inbox's owner: read, peek, poll, commit, wait."""

    agent: str
    asking: set[str]
    _store: TeamStore
    _gc_auto: int
    _compact_due: bool
    _cursor: Cursor | None
    _scanned: int
    _pending: deque[tuple[int, Message]]
    _watcher: Waiter | None
    _lock: threading.RLock
    _local: threading.local  # per thread (see `Mailbox.__init__`)
    _ask_waiters: list[tuple[threading.Thread, Waiter]]
    _received: dict[str, Message]
    _unseen_from: int  # where my inbox ended after this mailbox claimed it (or UNKNOWN_END)
    _fresh: set[str]  # requests read lately that came after the claim (`unanswered`)
    _answered: dict[str, None]  # the last requests this mailbox answered, oldest first

    if TYPE_CHECKING:  # given by `Mailbox`

        def touch(self) -> bool: ...

        def _before_read(self) -> None: ...

        def _trust(self, messages: list[Message | str], signed: bool) -> bool: ...

    # -- reading ------------------------------------------------------------------------

    def _load(self) -> Cursor:
        if self._cursor is None:
            self._store.claim(self.agent)  # one consumer per inbox: InboxBusy otherwise
            self._cursor = self._store.load_cursor(self.agent)
            # Where the inbox ends is learnt by the first read that reaches it: what
            # comes after that, no consumer before this one saw (`unanswered`). What was
            # read before a claim taken again (after an error, a lost claim) may have been.
            self._unseen_from = UNKNOWN_END
            self._fresh.clear()
            self._scanned = self._cursor.floor
            self._pending = deque()
        return self._cursor

    def reading_from(self) -> int:
        """Where an answer to what I send now can be: where this mailbox stopped
        reading my inbox (no round trip), or else its end."""
        return self._scanned if self._cursor is not None else self._store.size(self.agent)

    def _refresh(
        self, starts: bool = True, until: Message | None = None
    ) -> deque[tuple[int, Message]]:
        """Read what arrived since the last read into the pending list; return it.

        With ``starts=False`` (`poll`, which consumes everything it reads) clean lines get
        no line offsets: computing them is a third of the cost of a read. ``until``: stop
        reading once that message is pending (the rest is read next time). A call that
        raises (an interrupt, an I/O error) forgets what it read, so nothing half-read is
        kept: the next call reads again from the cursor on disk.
        """
        try:
            if self._compact_due:
                self._compact()
            cursor = self._load()
            if getattr(self._local, "chores_done", False):  # by this thread's wait
                self._local.chores_done = False
            else:
                self._chores()
            while True:
                data, offset = self._store.read(self.agent, self._scanned)
                if offset < self._scanned:
                    cursor = self._restart(offset)
                if not data:
                    if self._unseen_from == UNKNOWN_END:  # the end, read after the claim
                        self._unseen_from = self._scanned
                    return self._pending
                before = len(self._pending)
                self._take_lines(cursor, data, offset, starts)
                if until is not None and any(
                    (m.id, m.ts) == (until.id, until.ts)
                    for _, m in itertools.islice(
                        reversed(self._pending), len(self._pending) - before
                    )
                ):
                    return self._pending
        except BaseException:
            self._cursor = None
            raise

    def _chores(self) -> None:
        """Note my agent as active and run the rooms' deferred work (`_before_read`), at
        most once a second. A wait does them before it blocks, not when it wakes: a
        wake-up a second or more after the last (any agent of a big team, idle one) would
        otherwise pay for them, two thirds of its time, before the mail is read."""
        if self.touch():
            self._before_read()

    def _restart(self, offset: int) -> Cursor:
        # The inbox was replaced by a new one (the team re-created, a file put in place):
        # what was read of the old one stays pending, consumed at the new one's start.
        self._pending = deque((offset, message) for _, message in self._pending)
        self._cursor = Cursor(offset)
        self._scanned = offset
        return self._cursor

    def _take_lines(self, cursor: Cursor, data: bytes, offset: int, starts: bool) -> None:
        lines = data.split(b"\n")
        lines.pop()
        paused = len(lines) > _GC_PAUSE_LINES and gc.isenabled()
        if paused:
            gc.disable()
        try:
            messages, clean = decode_lines(lines)
            clean = self._trust(messages, may_be_signed(data)) and clean
            self._note_requests(messages, unseen=offset >= self._unseen_from)
            if clean and not cursor.acked and not starts:
                self._pending.extend(zip(repeat(-1), messages))  # type: ignore[arg-type]
                self._scanned = offset + len(data)
                return
            offsets = list(accumulate([len(line) + 1 for line in lines], initial=offset))
            scanned = offsets.pop()
            if clean and not cursor.acked:
                self._pending.extend(zip(offsets, messages, strict=True))  # type: ignore[arg-type]
                self._scanned = scanned
                return
            for start, line, message in zip(offsets, lines, messages, strict=True):
                if isinstance(message, Message):
                    if start not in cursor.acked:
                        self._pending.append((start, message))
                elif line.strip():
                    self._set_aside(start, line, message)
            self._scanned = scanned
        finally:
            if paused:
                gc.enable()

    def _note_requests(self, messages: list[Message | str], unseen: bool) -> None:
        """Remember the last requests read from my inbox (`received`); ``unseen``: they
        came after this mailbox claimed it (`unanswered`)."""
        for message in messages:
            if isinstance(message, Message) and message.type == MessageType.REQUEST:
                if len(self._received) >= _RECEIVED_KEPT:
                    self._received.clear()
                    self._fresh.clear()
                self._received[message.id] = message
                if unseen and message.id not in self._answered:
                    self._fresh.add(message.id)
                else:
                    self._fresh.discard(message.id)

    def received(self, message: Message) -> bool:
        """Whether ``message`` is a request this mailbox read from my inbox lately (as
        read, every field: one made up by a caller is not)."""
        return self._received.get(message.id) == message

    def unanswered(self, message: Message) -> bool:
        """Whether ``message`` is a request `received` that nobody can have answered as
        me: it came to my inbox after this mailbox claimed it (so no consumer before saw
        it: one consumer per inbox), and this mailbox answered no request of its id
        among its last `_ANSWERED_KEPT` answers (the same id sent again, a sender's
        retry, is looked up; one that came back after that many other answers would
        be answered again)."""
        return message.id in self._fresh and self.received(message)

    def answered(self, message: Message) -> None:
        """Note that this mailbox answered the request ``message``."""
        self._fresh.discard(message.id)
        self._answered[message.id] = None
        if len(self._answered) > _ANSWERED_KEPT:
            with contextlib.suppress(RuntimeError, StopIteration):  # (another thread's)
                self._answered.pop(next(iter(self._answered)), None)

    def _set_aside(self, start: int, line: bytes, reason: str) -> None:
        try:
            self._store.dead_letter(self.agent, start, line, reason)
        except MailError as exc:
            # The line stays in the inbox, where it is (it is skipped, not lost); a full disk
            # must not stop the good lines behind it.
            warnings.warn(
                f"{exc}; skipping the bad line at offset {start}", RuntimeWarning, stacklevel=5
            )

    def _save(self, floor: int, acked: int = -1) -> None:
        # The caller changes memory only once the cursor is on disk: a failed save
        # consumes nothing.
        cursor = self._load()
        marks = cursor.acked | {acked} if acked >= 0 else cursor.acked
        saved = Cursor(floor, {start for start in marks if start >= floor})
        self._store.save_cursor(self.agent, saved)
        self._cursor = saved
        held = getattr(self._local, "held", None)
        if held is not None:
            held.append((cursor, saved))
        else:
            self._note(cursor, saved)
        if self._gc_auto and self._store.collectable(self.agent, floor) >= self._gc_auto:
            # Not now: a compaction interrupted here would make a call that has consumed
            # raise. The next read runs it, before it reads anything.
            self._compact_due = True

    def _note(self, before: Cursor, after: Cursor) -> None:
        try:  # when it was consumed, for receipts: a hint, never a reason to fail a commit
            self._store.note_commit(self.agent, before, after)
        except MailError as exc:
            warnings.warn(str(exc), RuntimeWarning, stacklevel=5)

    def _compact(self) -> None:
        # Only an optimisation: when it fails (no room for the copy, a sender holding the
        # lock) the inbox stays as it was.
        self._compact_due = False
        try:
            self._store.compact(self.agent)
        except LockTimeout:
            pass
        except MailError as exc:
            message = f"could not compact the inbox of {self.agent!r}: {exc}"
            warnings.warn(message, RuntimeWarning, stacklevel=5)

    def _others(self, pending: deque[tuple[int, Message]]) -> list[Message]:
        """The pending messages but the replies my asks in flight wait for."""
        if not self.asking:
            return [message for _, message in pending]
        return [m for _, m in pending if m.reply_to not in self.asking or m.type != "reply"]

    def peek(self) -> list[Message]:
        """The unconsumed messages of my inbox, oldest first, without consuming them.

        Follow with `commit` once they are handled, for at-least-once delivery.
        """
        with self._lock:
            return self._others(self._refresh())

    def poll(self) -> list[Message]:
        """Consume and return the unconsumed messages of my inbox, oldest first.

        A poll that raises consumes nothing. The reply an ask of this process waits for
        (in another thread) is left to that ask.
        """
        with self._lock:
            if self.asking:
                return self._poll_around_asks()
            messages = [message for _, message in self._refresh(starts=False)]
            if messages or self._scanned != self._load().floor:
                try:
                    self._save(self._scanned)
                except BaseException:
                    self._cursor = None  # re-read from the cursor on disk: nothing consumed
                    raise
                self._pending.clear()
            return messages

    def _poll_around_asks(self) -> list[Message]:
        taken = self._others(self._refresh())
        for message in taken:
            self.consume(message)
        return taken

    def commit(self, message: Message) -> None:
        """Consume every message up to and including ``message`` (one `peek` returned).

        A process that crashes between `peek` and `commit` gets the messages again.
        Committing the messages of a peek one by one, in order, costs O(1) each.
        """
        with self._lock:
            index = _find(self._pending, message)
            following = index + 1
            pending = self._pending
            self._save(pending[following][0] if following < len(pending) else self._scanned)
            for _ in range(following):
                pending.popleft()

    def hand_on(
        self,
        messages: Sequence[Message],
        write: Callable[[Message], object],
        *,
        alone: bool = False,
    ) -> None:
        """Consume ``messages`` (what `peek` or a wait returned), then ``write`` each, in
        order: nothing is written that is not consumed, and what could not be written is
        not consumed. Consuming comes first (through the last of them; with ``alone``,
        each alone, as `consume`): when it raises, nothing is written. When a ``write``
        raises, what was not written is made unread again, what was stays consumed, and
        the error is raised. The commits' times (receipts) are recorded once the writing
        is done, so a message given back is never said to have been consumed.

        Example:
            >>> bus.hand_on(bus.peek(), lambda m: print(m.content))   # doctest: +SKIP
        """
        if not messages:
            with self._lock:  # only set-aside lines were read: past them, never again
                if not self._pending and self._scanned > self._load().floor:
                    self._save(self._scanned)
            return
        with self._lock:
            mark = self._mark()
            self._local.held = []
            try:
                self._take(messages, alone)
            except BaseException:
                self._local.held = None
                with contextlib.suppress(MailError):  # (alone: some may be consumed)
                    self._rewind(mark)
                raise
            held, self._local.held, written = self._local.held, None, 0
            try:
                for message in messages:
                    write(message)
                    written += 1
            except BaseException:
                self._rewind(mark)
                self._take(messages[:written], alone)
                raise
            for before, after in held:
                self._note(before, after)

    def _take(self, messages: Sequence[Message], alone: bool) -> None:
        if alone:
            for message in messages:
                self.consume(message)
        elif messages:
            self.commit(messages[-1])
        self._store.settle_cursor(self.agent)  # (stored before any is handed on)

    def _mark(self) -> _Mark:
        cursor = self._load()
        return _Mark(Cursor(cursor.floor, set(cursor.acked)), tuple(self._pending), self._scanned)

    def _rewind(self, mark: _Mark) -> None:
        """Save the cursor back as it stood at ``mark``; a save that raises changes
        nothing."""
        self._load()
        self._store.save_cursor(self.agent, Cursor(mark.cursor.floor, set(mark.cursor.acked)))
        self._cursor = Cursor(mark.cursor.floor, set(mark.cursor.acked))
        self._pending, self._scanned = deque(mark.pending), mark.scanned

    def consume(self, message: Message) -> None:
        """Consume ``message`` alone (one `peek` or ``wait_for_message(consume=False)``
        returned); the messages before and after it stay unread."""
        with self._lock:
            index = _find(self._pending, message)
            start = self._pending[index][0]
            if index:
                floor = self._pending[0][0]
            else:
                floor = self._pending[1][0] if len(self._pending) > 1 else self._scanned
            self._save(floor, start)
            del self._pending[index]

    def consume_if_mine(self, message: Message) -> None:
        """Consume ``message`` (an answer an ask waited for) when this process consumes
        my inbox (or may start to); under another consumer (a runner) it is left to that
        one, which starts nothing for an answer."""
        with self._lock:
            try:
                for _, pending in self._refresh(until=message):
                    if pending.id == message.id and pending.ts == message.ts:
                        self.consume(pending)
                        return
            except InboxBusy:
                self._cursor = None

    def _first(self, type: MessageType | str, consume: bool) -> Message | None:
        """The first unconsumed message of ``type`` (consumed alone with ``consume``)."""
        with self._lock:
            for message in self._others(self._refresh()):
                if message.type == type:
                    if consume:
                        self.consume(message)
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
        consume: bool = True,
    ) -> Message | None:
        """Consume and return the first message of ``type``, blocking until one arrives.

        Only that message is consumed: messages of other types stay unread for the next
        `poll` or `wait_for_messages`, in memory and on disk. None after ``timeout``.
        With ``consume=False`` nothing is consumed: pass the message to `consume` once
        it is handled (printed, acted on).

        Example:
            >>> bus.wait_for_message(MessageType.PLAN_APPROVAL, timeout=60.0)  # doctest: +SKIP
        """
        kind = check_type(type)
        return self._wait(lambda: self._first(kind, consume), timeout, stop)

    def _wait(
        self, attempt: Callable[[], _T], timeout: float | None, stop: StopEvent | None
    ) -> _T | None:
        """``attempt()`` until it finds something, between waits. With nothing read and
        left pending, a waiter that is caught up (`Waiter.caught_up`) is waited on before
        the first attempt: it returns at once when mail came, and a read is saved."""
        caught_up = (timeout != 0 and not self._pending and self._watcher is not None
                     and self._watcher.caught_up())  # fmt: skip
        found = None if caught_up else attempt()
        if found or timeout == 0:
            return found
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        look = self._watcher is None  # a watcher made now missed what came before it
        watcher = self._watch()
        while True:
            if look:  # (one that was there already is woken by it: no second read)
                found = attempt()
                if found or (stop is not None and stop.is_set()):
                    return found
            look = True
            remaining = safety_poll(time.monotonic() - started)
            if deadline is not None:
                remaining = min(remaining, deadline - time.monotonic())
                if remaining <= 0:
                    return found
            with self._lock:
                self._chores()
                self._local.chores_done = True  # the read of its wake-up skips them
            watcher.wait(remaining, stop)

    def _watch(self) -> Waiter:
        if self._watcher is None:
            self._watcher = self._store.waiter([self.agent])
        return self._watcher

    def await_answer(
        self,
        request_id: str,
        start: int,
        timeout: float,
        kind: MessageType = MessageType.REPLY,
        *,
        sender: str | None = None,
        stop: StopEvent | None = None,
        fresh: bool = False,
    ) -> Message | None:
        """Read my inbox from ``start`` (without consuming) until the ``kind`` answering
        ``request_id`` comes (from ``sender`` when given: an answer from anyone else is
        no answer); consume it alone when this process may. ``fresh``: asked just now,
        so the answer comes after this thread's waiter last woke (which wakes for it):
        the wait comes before the first read."""

        def answers(message: Message) -> bool:
            return (
                message.reply_to == request_id
                and message.type == kind
                and (sender is None or message.from_agent == sender)
            )

        deadline = time.monotonic() + timeout
        offset = start
        # One waiter per thread, kept for the mailbox's life: closing an inotify
        # descriptor can take the kernel milliseconds, which a waiter per ask paid.
        waiter: Waiter | None = getattr(self._local, "waiter", None)
        if fresh and waiter is not None:
            waiter.wait(min(timeout, WATCH_SAFETY_POLL_S), stop)

        while True:
            data, offset = self._store.read(self.agent, offset, skip_collected=True)
            if data:
                taken, answer = self._take_answer(data, offset, answers)
                if not taken:
                    found = decode_lines(data.split(b"\n")[:-1])[0]
                    self._trust(found, may_be_signed(data))  # one refused: set aside by a read
                    answer = next((m for m in found if isinstance(m, Message) and answers(m)),
                                  None)  # fmt: skip
                    if answer is not None:
                        self.consume_if_mine(answer)
                if answer is not None:
                    return answer
                offset += len(data)
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (stop is not None and stop.is_set()):
                return None
            if waiter is None:
                waiter = self._local.waiter = self._store.waiter([self.agent])
                with self._lock:  # the waiters of threads that ended go: they would pile up
                    for thread, gone in [kept for kept in self._ask_waiters
                                         if not kept[0].is_alive()]:  # fmt: skip
                        gone.close()
                        self._ask_waiters.remove((thread, gone))
                    self._ask_waiters.append((threading.current_thread(), waiter))
                continue  # read once more: the answer may have come while it started
            waiter.wait(min(remaining, safety_poll(timeout - remaining)), stop)

    def _take_answer(
        self, data: bytes, offset: int, answers: Callable[[Message], bool]
    ) -> tuple[bool, Message | None]:
        """When ``data`` (read from ``offset``) is what this mailbox's next read would
        read, take it as that read would (pending, unconsumed) and consume the answer in
        it, so that the answer is read and decoded once: (True, the answer or None).
        (False, None) when it is not that read (the cursor not loaded yet, another
        thread read on)."""
        with self._lock:
            if self._cursor is None or self._scanned != offset or self._compact_due:
                return False, None
            before = len(self._pending)
            try:
                self._take_lines(self._cursor, data, offset, True)
            except BaseException:
                self._cursor = None  # read again from the cursor on disk
                raise
            for _, message in itertools.islice(self._pending, before, None):
                if answers(message):
                    self.consume(message)
                    return True, message
            return True, None


def _find(entries: deque[tuple[int, Message]], message: Message) -> int:
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
