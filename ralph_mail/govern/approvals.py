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

from dataclasses import dataclass, replace
from typing import Any, Final

import orjson

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
        """As ``ralph-mail approvals --json`` prints it: the envelope, as it will be
        delivered, and the approval's fields."""
        return {"envelope": self.envelope, "approver": self.approver, "reason": self.reason,
                "held_at": self.held_at}  # fmt: skip


def held(envelope: dict[str, object], approver: str, reason: str, ts: str) -> bytes:
    """The log line that holds a message."""
    record = {"e": "held", "envelope": envelope, "approver": approver, "reason": reason,
              "ts": ts}  # fmt: skip
    return orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)


def decided(message_id: str, approved: bool, by: str, reason: str, since: int) -> bytes:
    """The log line that records a decision (``since``: the recipient's inbox end)."""
    record = {"e": "decided", "id": message_id, "approved": approved, "by": by,
              "reason": reason, "since": since}  # fmt: skip
    return orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)


def done(message_id: str) -> bytes:
    """The log line that records a decision carried out."""
    return orjson.dumps({"e": "done", "id": message_id}, option=orjson.OPT_APPEND_NEWLINE)


def fold(log: bytes) -> dict[str, Held]:
    """The held messages the log describes, by id, oldest first; the first decision on
    each stands. Lines that do not parse are skipped."""
    found: dict[str, Held] = {}
    for line in log.splitlines():
        try:
            event = orjson.loads(line)
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
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return found
