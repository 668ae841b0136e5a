"""Messages held for approval: the team log they are kept in, folded on read.

When the team's policy says a message needs approval (a rule's ``approval`` flag, a
``supervised`` or ``strict`` sender), `MessageBus` does not deliver it: it appends the
whole envelope to the team log ``approvals`` and sends the approver (the sender's
manager, else the lead) an ``approval_request``. The approver's `MessageBus.approve`
delivers the envelope unchanged (same id) and `MessageBus.deny` refuses it; either way
the sender gets an ``approval_response`` (``reply_to`` the held message,
``metadata.approved`` "true" or "false").

The log is append-only and survives restarts of everyone. Each decision is recorded
before it is acted on, with where the recipient's inbox ended, so an approver killed
between recording and delivering delivers once when it approves again: the first
decision stands, and a message found in the inbox is not delivered twice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final

from ralph_mail import codec

if TYPE_CHECKING:
    from ralph_mail.mailbox import Mailbox

#: The team log of held messages and their decisions.
LOG: Final = "approvals"


@dataclass(frozen=True, slots=True)
class Held:
    """One message held for approval, and what became of it.

    Attributes:
        envelope: the message as it will be delivered (its ``ts`` is set then).
        approver: who decides.
        reason: why the policy held it.
        held_at: when it was held (UTC ISO-8601).
        decision: True approved, False denied, None waiting.
        decided_by: who decided ("" while waiting).
        reason_given: the approver's words ("" when none).
        since: where the recipient's inbox ended when it was decided.
        done: whether the decision was carried out (delivered, sender told).
    """

    envelope: dict[str, Any]
    approver: str
    reason: str
    held_at: str
    decision: bool | None = None
    decided_by: str = ""
    reason_given: str = ""
    since: int = 0
    done: bool = False

    @property
    def id(self) -> str:
        return str(self.envelope["id"])

    @property
    def sender(self) -> str:
        return str(self.envelope["from"])

    def to_dict(self) -> dict[str, Any]:
        """As ``ralph-mail approvals --json`` prints it (DESIGN §9.3): the envelope's own
        keys at the top level, as it will be delivered, plus ``approver``, ``reason`` and
        ``held_at``."""
        return {**self.envelope, "approver": self.approver, "reason": self.reason,
                "held_at": self.held_at}  # fmt: skip


def held(envelope: dict[str, object], approver: str, reason: str, ts: str) -> bytes:
    """The log line that holds a message."""
    record = {"e": "held", "envelope": envelope, "approver": approver, "reason": reason,
              "ts": ts}  # fmt: skip
    return codec.dumps_line(record)


def decided(message_id: str, approved: bool, by: str, reason: str, since: int) -> bytes:
    """The log line that records a decision (``since``: the recipient's inbox end)."""
    record = {"e": "decided", "id": message_id, "approved": approved, "by": by,
              "reason": reason, "since": since}  # fmt: skip
    return codec.dumps_line(record)


def done(message_id: str) -> bytes:
    """The log line that records a decision carried out."""
    return codec.dumps_line({"e": "done", "id": message_id})


def fold(log: bytes) -> dict[str, Held]:
    """The held messages the log describes, by id, oldest first; the first decision on
    each stands. Lines that do not parse are skipped."""
    found: dict[str, Held] = {}
    for line in log.splitlines():
        try:
            event = codec.loads(line)
            kind = event["e"]
            if kind == "held":
                envelope = dict(event["envelope"])
                message_id = str(envelope["id"])
                if message_id not in found:
                    found[message_id] = Held(envelope, str(event["approver"]),
                                             str(event["reason"]), str(event["ts"]))  # fmt: skip
                continue
            item = found.get(str(event["id"]))
            if item is None:
                continue
            if kind == "decided" and item.decision is None:
                found[item.id] = replace(
                    item,
                    decision=bool(event["approved"]),
                    decided_by=str(event["by"]),
                    reason_given=str(event.get("reason", "")),
                    since=int(event["since"]),
                )
            elif kind == "done" and item.decision is not None:
                found[item.id] = replace(item, done=True)
        except (codec.DecodeError, KeyError, TypeError, ValueError):
            continue
    return found


# -- the approver's and the sender's side, over a mailbox ---------------------------------


def waiting(box: Mailbox) -> list[Held]:
    """`MessageBus.approvals`: the messages held for my approval, undecided, oldest first."""
    return [h for h in fold(box.store.log_read(LOG)).values()
            if h.approver == box.agent and h.decision is None]  # fmt: skip


def approval_of(box: Mailbox, message_id: str) -> Held | None:
    """`MessageBus.approval_of`: what became of a held message, or None."""
    from ralph_mail.message import check_id

    return fold(box.store.log_read(LOG)).get(check_id(message_id, "message id"))


def decide(box: Mailbox, message_id: str, approved: bool, reason: str) -> Held:
    """`MessageBus.approve` / `MessageBus.deny`: carry out my decision on a held
    message, once, even when run again after a crash."""
    from ralph_mail.errors import InvalidMessage, MailError, PermissionDenied
    from ralph_mail.message import BROADCAST_ADDRESS, MessageType

    if not isinstance(reason, str):
        raise InvalidMessage(f"reason must be a string, not {reason.__class__.__name__}")
    held = approval_of(box, message_id)
    if held is None:
        raise MailError(
            f"no message {message_id!r} waits for {box.agent}'s approval: see "
            "'ralph-mail approvals'"
        )
    if held.approver != box.agent:
        raise PermissionDenied(
            f"message {message_id} waits for {held.approver}'s approval, not {box.agent}'s: "
            "only its approver decides"
        )
    if held.decision is None:
        target = str(held.envelope["to"])
        since = 0 if target == BROADCAST_ADDRESS else box.store.size(target)
        box.store.log_append(LOG, decided(message_id, approved, box.agent, reason, since))
        held = fold(box.store.log_read(LOG))[message_id]
    elif held.decision != approved:
        raise InvalidMessage(
            f"message {message_id} is already {'approved' if held.decision else 'denied'}"
        )
    if not held.done:
        if held.decision:
            box.release(held.envelope, held.sender, held.since)
        elif held.envelope.get("type") == MessageType.TASK_ASSIGNMENT:
            _reject_task(box, held)
        verdict = {"approved": "true" if held.decision else "false"}
        if held.reason_given:
            verdict["reason"] = held.reason_given
        box._send(held.sender, MessageType.APPROVAL_RESPONSE,
                  f"{'approved' if held.decision else 'denied'} by {box.agent}"
                  + (f": {held.reason_given}" if held.reason_given else ""),
                  verdict, message_id, None)  # fmt: skip
        box.store.log_append(LOG, done(message_id))
        held = fold(box.store.log_read(LOG))[message_id]
    return held


def _reject_task(box: Mailbox, held: Held) -> None:
    """A denied assignment's task is ``rejected``, by the approver, for the reason given."""
    from ralph_mail.govern import tasklog
    from ralph_mail.message import format_ts

    metadata = held.envelope.get("metadata")
    task_id = metadata.get("taskId") if isinstance(metadata, dict) else None
    task = tasklog.load(box.store)[0].get(str(task_id))
    if task is not None and task.assignment == held.id and task.open:
        why = held.reason_given or f"its assignment was denied by {box.agent}"
        now = format_ts(time.time_ns() // 1000)
        box.store.log_append(tasklog.LOG, tasklog.changed(task.id, "rejected", now, why,
                                                          by=box.agent))  # fmt: skip


def wait_for_decision(box: Mailbox, message_id: str, since: int, timeout: float) -> bool | None:
    """`MessageBus.wait_for_decision`: True approved, False denied, None not yet."""
    from ralph_mail.message import MessageType

    answer = box.await_answer(message_id, since, timeout, MessageType.APPROVAL_RESPONSE)
    if answer is None:
        return None
    return answer.metadata.get("approved") == "true"
