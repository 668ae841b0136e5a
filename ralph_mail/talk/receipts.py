"""Receipts: what became of a message at each of its recipients, read from what the team
keeps anyway, so a send costs nothing more for it.

- Where it is: a direct message's line is in its pair's index (both directions), a
  broadcast's copies in its sender's ``broadcasts+NAME`` index, a request's or an
  assignment's in its thread's; each is read back from the index's end, so the cost
  grows with what the two agents exchanged since, not with the inbox.
- Whether it was consumed: the recipient's persisted cursor (its floor, and the lines
  consumed out of order above it); when: the store's commit times
  (`TeamStore.consumed_at`, a bisection).
- Whether it was acknowledged or answered: the recipient's ``ack``, or any other message
  of the recipient's to the sender whose ``reply_to`` is it (a reply, a task's result, a
  protocol answer), among the pair's messages since.
- Held or denied: the approvals log, for a message that is in no inbox.

Example:
    >>> message = bus.send("lead", "text", "parsing done")   # doctest: +SKIP
    >>> bus.receipt(message).state                          # doctest: +SKIP
    'stored'
    >>> bus.wait_consumed(message, timeout=30)              # doctest: +SKIP
    True
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Final

from ralph_mail.errors import InvalidMessage, MailError
from ralph_mail.mailbox import ALL, pair_key
from ralph_mail.message import (
    BROADCAST_ADDRESS,
    Message,
    MessageType,
    check_id,
    check_name,
    decode_lines,
)
from ralph_mail.settings import WATCH_SAFETY_POLL_S

if TYPE_CHECKING:
    from ralph_mail.govern.approvals import Held
    from ralph_mail.mailbox import Mailbox
    from ralph_mail.store.base import Waiter

#: What a receipt's ``state`` may be, from the first a message can be in to the last.
STATES: Final = ("held", "denied", "stored", "consumed", "acked", "answered")
#: How many of an index's last entries are read, then how many more each time after.
_WINDOWS: Final = (16, 128, 1024, ALL)


@dataclass(frozen=True, slots=True)
class Receipt:
    """What became of one message at one of its recipients.

    Attributes:
        id: the message's id.
        to: the recipient.
        state: the furthest it got: ``held`` (it waits for an approver), ``denied``
            (the approver refused it: it is never delivered), ``stored`` (in the
            recipient's inbox, not consumed yet), ``consumed`` (the recipient's cursor
            passed it), ``acked`` (the recipient acknowledged it) or ``answered`` (the
            recipient replied to it, or sent the result of the task it assigned).
        stored_at: when it was stored in the recipient's inbox (its ts there), or None.
        consumed_at: when the recipient's cursor passed it; None before, and for mail
            consumed before this was recorded or whose record gc dropped.
        acked_at: when the recipient's acknowledgement was stored, or None.
        answered_by: the id of the recipient's answer (a reply, a task_result), or None.
    """

    id: str
    to: str
    state: str
    stored_at: str | None = None
    consumed_at: str | None = None
    acked_at: str | None = None
    answered_by: str | None = None

    def to_dict(self) -> dict[str, str | None]:
        """The record ``ralph-mail receipt --json`` prints."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class _Copy:
    """One stored copy of a message: the line at ``offset`` of ``to``'s inbox."""

    message: Message
    to: str
    offset: int


def receipts(box: Mailbox, message: Message | str) -> list[Receipt]:
    """`MessageBus.receipts`: a receipt per recipient of ``message`` (or of the message
    with that id between me and a teammate)."""
    message_id, copies = _find(box, message)
    if not copies:
        return _not_stored(box, message_id)
    return [_receipt(box, copy) for copy in copies]


def receipt(box: Mailbox, message: Message | str, to: str | None) -> Receipt:
    """`MessageBus.receipt`: the receipt of ``message`` at ``to`` (its only recipient)."""
    found = receipts(box, message)
    names = ", ".join(r.to for r in found)
    if to is None:
        if len(found) == 1:
            return found[0]
        raise InvalidMessage(
            f"message {found[0].id} went to {len(found)} agents ({names}): name one with "
            "to=, or take them all with receipts()"
        )
    for one in found:
        if one.to == check_name(to, "recipient"):
            return one
    raise InvalidMessage(f"message {found[0].id} did not go to {to} (it went to {names})")


def wait_consumed(box: Mailbox, message: Message | str, timeout: float) -> bool:
    """`MessageBus.wait_consumed`: block until every recipient consumed ``message``.

    Blocks on the store's waiter for the recipients' commits (a held message: for the
    approvals log), so it wakes when a cursor moves, and looks again at least every
    `WATCH_SAFETY_POLL_S`; False after ``timeout`` seconds, and at once when it was denied.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise InvalidMessage(f"invalid timeout {timeout!r}: give a number of seconds >= 0")
    deadline = time.monotonic() + timeout
    copies: list[_Copy] = []
    waiter: Waiter | None = None
    watched: list[str] = []
    try:
        while True:
            if not copies:  # not delivered yet (held), or not looked for yet
                message_id, copies = _find(box, message)
                if not copies and any(r.state == "denied" for r in _not_stored(box, message_id)):
                    return False
            keys = [f"commits:{c.to}" for c in copies if not _consumed(box, c)]
            if copies and not keys:
                return True
            keys = keys or ["log:approvals"]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if keys != watched:  # made before the next look: nothing is missed meanwhile
                if waiter is not None:
                    waiter.close()
                waiter, watched = box.store.waiter(keys), keys
                continue
            assert waiter is not None
            waiter.wait(min(remaining, WATCH_SAFETY_POLL_S))
    finally:
        if waiter is not None:
            waiter.close()


# -- finding a message ------------------------------------------------------------------


def _find(box: Mailbox, message: Message | str) -> tuple[str, list[_Copy]]:
    """The message's id and its stored copies, the first in each inbox ([]: none)."""
    if isinstance(message, Message):
        if not message.ts and _approved(box, message.id) is not True:
            return message.id, []  # held when it was sent, and not delivered since
        sender, to = message.from_agent, message.to_agent
        key = f"broadcasts+{sender}" if to == BROADCAST_ADDRESS else pair_key(sender, to)
        return message.id, _search(box, message.id, [key])
    message_id = check_id(message, "message id")
    keys = [f"thread+{message_id}"]  # a request or an assignment is in its own thread
    keys += [pair_key(box.agent, other) for other in box.refresh_team().names if other != box.agent]
    keys.append(f"broadcasts+{box.agent}")
    return message_id, _search(box, message_id, keys)


def _search(box: Mailbox, message_id: str, keys: list[str]) -> list[_Copy]:
    """The copies of ``message_id`` the indexes ``keys`` point at, from their ends back,
    in growing windows; in each inbox the earliest one found (a send retried under its
    id stores it twice)."""
    needle = b'"id":"' + message_id.encode() + b'"'
    for limit in _WINDOWS:
        copies: dict[str, _Copy] = {}
        full = edge = False
        for key in keys:
            entries = box.store.index_tail(key, limit)
            full = full or len(entries) >= limit
            for position, (agent, offset, length) in enumerate(entries):
                line = box.store.read_line(agent, offset, length)
                if line is None or needle not in line:
                    continue
                found = decode_lines([line])[0][0]
                if isinstance(found, Message) and found.id == message_id:
                    if agent not in copies or offset < copies[agent].offset:
                        copies[agent] = _Copy(found, agent, offset)
                    edge = edge or (position == 0 and len(entries) >= limit)
        if (copies and not edge) or not full:  # whole (a broadcast's copies are together)
            return list(copies.values())
    return list(copies.values())


def _approved(box: Mailbox, message_id: str) -> bool | None:
    """The approver's decision on a held message: True, False, or None (none yet, or
    never held)."""
    from ralph_mail.govern.approvals import approval_of

    held = approval_of(box, message_id)
    return held.decision if held is not None else None


def _not_stored(box: Mailbox, message_id: str) -> list[Receipt]:
    """The receipts of a message in no inbox: held or denied; `MailError` when the
    approvals log does not know it either."""
    from ralph_mail.govern.approvals import approval_of

    held: Held | None = approval_of(box, message_id)
    if held is None:
        raise MailError(
            f"no message {message_id} between {box.agent} and a teammate, nor one held for "
            "approval: give an id that send or broadcast printed"
        )
    to = str(held.envelope["to"])
    names = [to] if to != BROADCAST_ADDRESS else box.refresh_team().names
    state = "denied" if held.decision is False else "held"
    return [Receipt(held.id, name, state) for name in names if name != held.sender]


# -- what became of a copy ---------------------------------------------------------------


def _consumed(box: Mailbox, copy: _Copy) -> bool:
    return box.store.consumed(copy.to, copy.offset)


def _receipt(box: Mailbox, copy: _Copy) -> Receipt:
    consumed = _consumed(box, copy)
    stored = copy.message.ts
    consumed_at = box.store.consumed_at(copy.to, copy.offset, stored) if consumed else None
    acked_at, answered_by = _answers(box, copy)
    if answered_by is not None:
        state = "answered"
    elif acked_at is not None:
        state = "acked"
    else:
        state = "consumed" if consumed else "stored"
    return Receipt(copy.message.id, copy.to, state, stored, consumed_at, acked_at, answered_by)


def _answers(box: Mailbox, copy: _Copy) -> tuple[str | None, str | None]:
    """When the recipient acknowledged the copy, and the id of its first answer: the
    pair's messages read back from the end to the copy's ts (the index may hold an
    answer noted before the message it answers: their ts are in order)."""
    sender, since = copy.message.from_agent, copy.message.ts
    for limit in _WINDOWS:
        entries = box.store.index_tail(pair_key(sender, copy.to), limit)
        acked_at = answered_by = None
        for agent, offset, length in reversed(entries):
            line = box.store.read_line(agent, offset, length) or b""
            found = decode_lines([line])[0][0] if line else None
            if not isinstance(found, Message):
                continue
            if found.ts < since:
                return acked_at, answered_by
            if (agent, found.from_agent, found.reply_to) == (sender, copy.to, copy.message.id):
                if found.type == MessageType.ACK:  # read back: the first is the last seen
                    acked_at = found.ts
                else:
                    answered_by = found.id
        if len(entries) < limit:
            return acked_at, answered_by
    return None, None  # pragma: no cover - the last window is everything
