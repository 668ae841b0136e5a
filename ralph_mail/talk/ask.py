"""Ask and reply, and acknowledgements (DESIGN §8.2, §8.5), over one `Mailbox`.

An ask sends a ``request`` and reads the asker's inbox from where the request was
written, without consuming it, until the ``reply`` from the agent asked comes; it
consumes that reply alone. The Gate judged the request (depth, policy, rate) and judges
the reply (it answers a request its sender received, or it is contact).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from ralph_mail.errors import InvalidMessage, MailError, NoReply, PermissionDenied
from ralph_mail.govern import approvals, presence
from ralph_mail.mailbox import ALL
from ralph_mail.message import Message, MessageType, check_id, check_metadata, format_ts
from ralph_mail.talk import tasks

if TYPE_CHECKING:
    from ralph_mail.mailbox import Mailbox
    from ralph_mail.store.base import StopEvent
    from ralph_mail.talk.tasks import Task


def ask(
    box: Mailbox,
    to: str,
    question: str,
    *,
    context: str | None,
    timeout: float,
    priority: str | None,
    metadata: Mapping[str, str] | None,
    id: str | None,
    visibility: str | None,
    stop: StopEvent | None,
) -> Message:
    """`MessageBus.ask`: send ``to`` a request and block until its reply comes."""
    if not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise InvalidMessage(f"invalid timeout {timeout!r}: give a number of seconds >= 0")
    if id is not None:
        earlier = _asked_before(box, check_id(id), to, timeout)
        if earlier is not None:
            return earlier
    target = box.recipient(to)
    extra = dict(check_metadata(metadata))
    if context is not None:
        extra["context"] = context
    task = _about_task(box, target, extra)
    start = box.reading_from()
    marked = box.take_marked_id() if id is None and task is None else None
    envelope = box.envelope(target, MessageType.REQUEST, question, extra, None, id or marked,
                            thread=task.assignment if task is not None else None,
                            priority=priority, visibility=visibility,
                            chain=(*box.chain, box.agent))  # fmt: skip
    request_id = str(envelope["id"])
    box.asking.add(request_id)  # before it is sent: the reply may come at once
    try:
        if task is not None:  # I wait for my delegator: the task is input_required
            tasks.waiting_for_input(box, task, True)
        request = box.write(envelope, waits=True, fresh=id is None)
        if not request.ts:  # held for approval: the same timeout covers the decision
            deadline = time.monotonic() + timeout
            with _awaiting_approval(box):
                decided = approvals.wait_for_decision(box, request.id, start, timeout)
            if decided is None:
                raise NoReply(
                    f"no decision on asking {to} within {timeout:g} s: it waits for approval "
                    "('ralph-mail approvals' on the approver's side)"
                )
            if not decided:
                raise PermissionDenied(f"asking {to} was denied by the approver")
            timeout = max(0.0, deadline - time.monotonic())
        if request.ts:
            box.premark()  # the next ask's, while the answer is on its way
        return _answer_of(box, request.id, target, start, timeout, stop, fresh=True)
    finally:
        box.asking.discard(request_id)
        if task is not None:
            tasks.waiting_for_input(box, task, False)


def _about_task(box: Mailbox, to: str, extra: dict[str, str]) -> Task | None:
    """The task an ask is about when it asks the agent that gave it to me: named by
    ``metadata.taskId`` or ``RALPH_TASK`` (the task of a ``ralph-mail run`` job). Such a
    request goes in the task's thread, and the task is ``input_required`` meanwhile."""
    task_id = extra.get("taskId") or os.environ.get("RALPH_TASK", "")
    task = tasks.asked_about(box, to, task_id) if task_id.strip() else None
    if task is not None:
        extra["taskId"] = task.id
    return task


def reply(
    box: Mailbox,
    message: Message,
    content: str,
    metadata: Mapping[str, str] | None,
    *,
    priority: str | None,
    ack: bool,
    visibility: str | None,
) -> Message:
    """`MessageBus.reply`: answer ``message``; a request is answered once."""
    in_thread = None
    if message.type == MessageType.REQUEST:
        in_thread = _thread_of_request(box, message)
        for earlier in in_thread:
            mine = earlier.from_agent == box.agent and earlier.reply_to == message.id
            if mine and earlier.type == MessageType.REPLY:
                return earlier
    sent = box._send(message.from_agent, MessageType.REPLY, content, metadata, message.id,
                     None, message.thread, priority, ack, visibility,
                     in_thread=in_thread)  # fmt: skip
    if message.type == MessageType.REQUEST:
        box.answered(message)
    return sent


def _thread_of_request(box: Mailbox, request: Message) -> list[Message]:
    """The thread of ``request`` as its reply needs it: to find an earlier reply of mine,
    for the Gate to see what it answers and for the loop guard.

    A request that starts its thread and that nobody can have answered as me (it came
    after this mailbox claimed my inbox, and this mailbox did not answer it:
    `unanswered`) is its whole thread as far as my reply goes: nothing is looked up (on
    a network store, a round trip saved). A request this mailbox read just now, alone in
    its thread (one entry, in my inbox, or none yet: its sender notes it just after its
    append), is its whole thread too, once the thread's index says so. Anything more,
    and the thread is read."""
    key = f"thread+{request.thread}"
    if request.thread == request.id and box.unanswered(request):
        return [request]
    if box.received(request):
        entries = box.store.index_tail(key, 2)
        if len(entries) <= 1 and all(inbox == box.agent for inbox, _, _ in entries):
            return [request]
    return box.indexed(key, ALL)


def acknowledge(box: Mailbox, message: Message) -> Message:
    """`MessageBus.ack`: acknowledge ``message`` to its sender."""
    return box._send(message.from_agent, MessageType.ACK, "", None, message.id, None,
                     message.thread)  # fmt: skip


def pending_acks(box: Mailbox, older_than: float | None) -> list[Message]:
    """`MessageBus.pending_acks`: what I asked to be acknowledged and nobody did."""
    wanted = box.indexed(f"acks+{box.agent}", ALL)
    acked = {m.reply_to for m in box.indexed(f"acked+{box.agent}", ALL)}
    cutoff = None
    if older_than is not None:
        cutoff = format_ts(int((time.time() - older_than) * 1_000_000))
    return [m for m in wanted if m.id not in acked and (cutoff is None or m.ts <= cutoff)]


@contextlib.contextmanager
def _awaiting_approval(box: Mailbox) -> Iterator[None]:
    """Presence ``awaiting_approval`` while a held message waits; then as it was."""
    before = box.store.load_presence(box.agent)
    presence.set_presence(box, "awaiting_approval", None)
    try:
        yield
    finally:
        with contextlib.suppress(MailError):
            if before is None:
                presence.set_presence(box, "idle", None)
            else:
                box.store.save_presence(box.agent, before)


def _answer_of(
    box: Mailbox,
    request_id: str,
    to: str,
    start: int,
    timeout: float,
    stop: StopEvent | None = None,
    *,
    fresh: bool = False,
) -> Message:
    answer = box.await_answer(request_id, start, timeout, sender=to, stop=stop, fresh=fresh)
    if answer is None and stop is not None and stop.is_set():
        raise NoReply(f"stopped waiting for {to}'s answer: it comes to the inbox")
    if answer is None:
        raise NoReply(
            f"{to} did not answer within {timeout:g} s; ask again, or delegate work "
            "that takes longer"
        )
    return answer


def _asked_before(box: Mailbox, request_id: str, to: str, timeout: float) -> Message | None:
    """The reply to my request ``request_id`` if I sent it before (waiting for it if
    it has not come yet); None when I never sent it."""
    asked = False
    for message in box.indexed(f"thread+{request_id}", ALL):
        if (
            message.type == MessageType.REPLY
            and message.reply_to == request_id
            and message.from_agent == to
        ):
            box.consume_if_mine(message)
            return message
        asked = asked or (message.id == request_id and message.from_agent == box.agent)
    if not asked:  # a kill between the append and its index entry: in the inbox, unindexed
        sent = box.arrived(to, request_id)
        asked = sent is not None and sent.from_agent == box.agent
    if not asked:
        return None
    # Not answered when the thread was read: the reply is unconsumed mail, at or above
    # my cursor's floor (a reply consumed by a run that died is in the thread above).
    box.asking.add(request_id)
    try:
        return _answer_of(box, request_id, to, box.store.load_cursor(box.agent).floor,
                          timeout)  # fmt: skip
    finally:
        box.asking.discard(request_id)
