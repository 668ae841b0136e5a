"""The Gate: every message any face writes passes `Gate.check` first (DESIGN §7, §9.3a).

It owns, in this order: self-contact (never), the depth of a request's chain, the loop
guard of a thread, whether an "answer" really answers something, and for everything
that is not an answer the team's policy (rules, modes, approvals), budgets and rates. Nothing
else in the package refuses or exempts a message, and a message type never buys an
exemption by itself:

- a ``reply``, ``ack``, ``shutdown_response`` or ``plan_approval`` answers only a
  message its sender received from its recipient (of the matching kind for the
  protocol answers); a ``task_result`` only a ``task_assignment`` its sender received
  from its recipient and, for a task of the team's task log, only from the task's
  assignee for its current assignment (a result after a reassignment or a cancel is
  refused); an ``approval_response`` only a message held for its sender's approval,
  sent by its recipient;
- a ``task_canceled`` or ``task_stalled`` is a notice the task log must back (the
  sender canceled the task; the task's lease lapsed, told to its delegator, even in
  its own inbox);
- anything else of those types is contact the sender starts, judged and counted as such;
- the team protocols' requests (``status_update``, ``plan_submission``,
  ``shutdown_request``, ``task_assignment``) between a member and the lead are contact
  too, with the lead standing as the manager of members that have none: the hierarchy
  lets them through, and the rates count them.

Governance acts (the policy, the roster's modes and managers, deleting the team) are the
lead's: `Gate.require_lead`.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Final

from ralph_mail import settings
from ralph_mail.errors import (
    DepthLimit,
    InvalidMessage,
    LoopGuard,
    MailError,
    PermissionDenied,
    RateLimited,
)
from ralph_mail.govern.policy import KEY as POLICY_KEY
from ralph_mail.govern.policy import RATE_WINDOW_S, Decision, Policy
from ralph_mail.message import BROADCAST_ADDRESS, Message, MessageType, format_ts, from_envelope

if TYPE_CHECKING:
    from ralph_mail.mailbox import Mailbox

_NO_POLICY: Final = Policy()  # no policy saved: everything is allowed
#: How long an ask trusts that an agent it found there is still there (s). An agent's
#: activity is noted once a second at most, so its presence is no finer than that.
THERE_S: Final = 1.0
#: The team protocols' requests, let through between a member and the lead.
PROTOCOL_REQUESTS: Final = frozenset({
    MessageType.STATUS_UPDATE, MessageType.PLAN_SUBMISSION, MessageType.SHUTDOWN_REQUEST,
    MessageType.TASK_ASSIGNMENT,
})  # fmt: skip
#: What each protocol answer answers.
_ANSWERS: Final = {
    MessageType.SHUTDOWN_RESPONSE: MessageType.SHUTDOWN_REQUEST,
    MessageType.PLAN_APPROVAL: MessageType.PLAN_SUBMISSION,
    MessageType.TASK_RESULT: MessageType.TASK_ASSIGNMENT,
}


class Gate:
    """The one place a message from ``box``'s agent is judged before it is written.

    Args:
        box: the mailbox whose agent sends.
        default_rate: messages per minute the agent may start when the policy sets no
            rate for it (``ralph-mail run`` and the MCP server pass 10).
    """

    def __init__(self, box: Mailbox, default_rate: int | None) -> None:
        # A weak reference, not the mailbox: no cycle keeps a dropped mailbox (and its
        # descriptors, its claim on the inbox) alive until the cyclic GC runs. Taken once
        # per call: a proxy would cost each attribute read four times over.
        self._ref = weakref.ref(box)
        if default_rate is not None:
            from ralph_mail.govern.policy import check_rate

            check_rate(default_rate)
        self.default_rate = default_rate
        self._policy: tuple[tuple[int, ...] | None, Policy | str] = (None, _NO_POLICY)
        # What the policy decided for (recipient, check, protocol), for this policy and roster.
        self._decisions: dict[tuple[str, str, bool], Decision] = {}
        self._decisions_team: object = None
        self._rate_key = f"rate.{box.agent}"
        self._there: dict[str, float] = {}  # agent asked -> when it was found there

    def _box(self) -> Mailbox:
        box = self._ref()
        if box is None:
            raise ReferenceError("the mailbox of this Gate is gone")
        return box

    # -- the policy ---------------------------------------------------------------------

    def policy(self) -> Policy:
        """The team's policy now (read again only when it changed).

        A policy that cannot be read or parsed, the empty file included, raises
        `PermissionDenied` naming it: it fails closed.
        """
        store = self._box().store
        version = store.state_version(POLICY_KEY)
        cached_version, cached = self._policy
        if version != cached_version or (version is None and cached is not _NO_POLICY):
            cached = _NO_POLICY if version is None else self._read_policy()
            self._policy = (version, cached)
            self._decisions.clear()
        if isinstance(cached, str):
            raise PermissionDenied(cached)
        return cached

    def _read_policy(self) -> Policy | str:
        from ralph_mail.govern import policy

        store = self._box().store
        where = store.state_where(POLICY_KEY)
        try:
            raw = store.load_state(POLICY_KEY)
            if raw is None:
                return _NO_POLICY
            return policy.parse(raw)
        except MailError as exc:
            return (
                f"the team's policy {where} is broken ({exc}): fix it or remove it; until "
                "then no agent may start contact"
            )

    def require_lead(self, act: str) -> None:
        """`PermissionDenied` unless my agent is the team's lead: ``act`` (a change of the
        rules, of the roster's modes and managers) is the lead's alone."""
        box = self._box()
        lead = box.refresh_team().lead
        if box.agent != lead:
            raise PermissionDenied(
                f"{act} is the lead's to do, and {box.agent} is not the lead of team "
                f"{box.team.name!r}: run it as {lead} (--agent {lead})"
            )

    def requires_signed(self) -> bool:
        """Whether the policy requires signed messages, for a reader. A broken policy
        does not: it would set every line aside, and whoever can break the policy can
        turn the setting off as well (the writer's Gate refuses contact meanwhile)."""
        try:
            return self.policy().require_signed
        except PermissionDenied:
            return False

    def _require_key(self) -> None:
        """`PermissionDenied` when the team requires signed messages and my agent has no
        key here, or not the one the roster gives it: what it sent would be unsigned or
        fail verification (a forged ``--agent`` lacks the agent's key file)."""
        try:
            if not self.policy().require_signed:
                return
        except PermissionDenied:
            return  # a broken policy refuses contact itself, and lets answers through
        box = self._box()
        signer = box.signer()
        mine = signer.public()
        if mine is None:
            raise PermissionDenied(
                f"team {box.team.name!r} requires signed messages and {box.agent} has no "
                f"key at {signer.path}: run 'ralph-mail keys create --agent {box.agent}' "
                "on its own host"
            )
        if mine == box.me().key:
            return
        published = box.refresh_team().member(box.agent).key
        if mine != published:
            where = f"'ralph-mail keys publish --agent {box.agent}'"
            team = f"team {box.team.name!r} requires signed messages and"
            if published is None:
                raise PermissionDenied(
                    f"{team} its roster has no public key for {box.agent}: publish the one "
                    f"at {signer.path} with {where}"
                )
            raise PermissionDenied(
                f"{team} the key at {signer.path} is not the one its roster has for "
                f"{box.agent}: publish it with {where} (replacing a key is the lead's act)"
            )

    # -- the check ------------------------------------------------------------------------

    def check(
        self,
        envelope: dict[str, object],
        *,
        in_thread: list[Message] | None = None,
        waits: bool = False,
    ) -> str:
        """Judge ``envelope`` (from my agent, not yet written): raise when it is refused
        (`InvalidMessage`, `DepthLimit`, `LoopGuard`, `AgentOffline`, `PermissionDenied`,
        `RateLimited`), return why it is held for approval, or "" to deliver it.
        ``in_thread``: the thread's messages, when the caller has just read them;
        ``waits``: the sender waits for the answer (an ask), so the recipient must be
        there (online, or sleeping: a request wakes it)."""
        box = self._box()
        sender, to, kind = box.agent, str(envelope["to"]), str(envelope["type"])
        self._require_key()
        metadata = envelope["metadata"]
        if kind in _CHECKED and isinstance(metadata, dict):  # what its reader would refuse
            from ralph_mail.protocols import check_outgoing

            check_outgoing(kind, metadata)
        about = metadata.get("taskId") if isinstance(metadata, dict) else None
        if kind in _ON_TASKS and about and self._task_answers(kind, to, envelope.get("reply_to"),
                                                              str(about)):  # fmt: skip
            return ""
        if to == sender:
            doing = "asking" if kind == MessageType.REQUEST else "sending to"
            raise InvalidMessage(f"{sender!r} is {doing} itself: name a teammate")
        chain = envelope.get("chain") if kind == MessageType.REQUEST else None
        if isinstance(chain, list):
            depth = settings.team_setting("max_depth", dict(box.team.config))
            if len(chain) > depth:
                raise DepthLimit(
                    f"maximum agent communication depth ({depth}) reached: delegate instead "
                    f"of asking (chain: {' -> '.join(chain)} -> {to})"
                )
        if "thread" in envelope:
            self._loop_guard(str(envelope["thread"]), envelope.get("visibility"), in_thread)
        if waits:  # an ask waits for its answer: not from an agent that is not there
            self._require_there(to)
        if to == BROADCAST_ADDRESS:
            recipients = [name for name in box.refresh_team().names if name != sender]
            return self._govern(recipients, "contact", False)
        if self._unruled(box):  # nothing to decide, whatever the message answers
            return ""
        answer = self._answers(envelope, in_thread)
        if answer == "answer":
            return ""
        protocol = kind in PROTOCOL_REQUESTS and box.team.lead in (sender, to)
        return self._govern([to], answer or "contact", protocol)

    def _require_there(self, to: str) -> None:
        """`AgentOffline` unless ``to`` is online or sleeping (`presence.require_online`).
        An agent found there is trusted to be for `THERE_S`: asks in a loop read its
        presence once a second, not at each ask."""
        now = time.monotonic()
        if now - self._there.get(to, -THERE_S) < THERE_S:
            return
        from ralph_mail.govern import presence

        presence.require_online(self._box(), to)
        if len(self._there) >= 64:
            self._there.clear()
        self._there[to] = now

    def check_budget(self) -> None:
        """`BudgetExceeded` when my agent's jobs spent its budget (``ralph-mail run``
        asks before each run); the lead is told once. A broken policy sets no budget
        here: it refuses contact, never an answer."""
        try:
            policy = self.policy()
        except PermissionDenied:
            return
        if policy.budgets:
            from ralph_mail.govern import budget

            budget.check(self._box(), policy)

    def check_post(self, channel: str, mentioned: list[str]) -> None:
        """Judge a post in ``channel`` that mentions ``mentioned`` (each gets a
        ``mention``, contact my agent starts): one message counted against my rate, and
        each mention judged as contact; a mention the policy would hold is refused."""
        self._require_key()
        held = self._govern(mentioned, "contact", False) if mentioned else ""
        if not mentioned:
            self._count()
        if held:
            raise PermissionDenied(
                f"mentioning {', '.join(mentioned)} needs approval ({held}): send them "
                "a direct message, which waits for it"
            )

    def _unruled(self, box: Mailbox) -> bool:
        """No policy, no rate and my mode autonomous: the common case, decided at once."""
        if self.default_rate is not None or box.me().mode != "autonomous":
            return False
        try:
            return self.policy() is _NO_POLICY
        except PermissionDenied:  # broken: `_govern` says so, or lets a protocol through
            return False

    def _answers(self, envelope: dict[str, object], in_thread: list[Message] | None) -> str:
        """What ``envelope`` is: "answer" when it answers something its sender received
        (never held), "reply" for a reply to a message received (held only in strict
        mode), "" when it answers nothing (contact)."""
        kind = envelope["type"]
        if kind not in _ANSWER_TYPES:
            return ""
        answered = envelope.get("reply_to")
        if not isinstance(answered, str):
            return ""
        box = self._box()
        sender, to = box.agent, str(envelope["to"])
        if kind == MessageType.APPROVAL_RESPONSE:
            from ralph_mail.govern import approvals

            held = approvals.fold(box.store.log_read(approvals.LOG)).get(answered)
            ok = held is not None and held.approver == sender and held.sender == to
            return "answer" if ok else ""
        original = None
        if in_thread is not None:
            original = next((m for m in in_thread if m.id == answered), None)
        if original is None:
            original = box.find(answered, (to, sender))
        if original is None or (original.from_agent, original.to_agent) != (to, sender):
            return ""
        if kind in _ANSWERS and original.type != _ANSWERS[kind]:  # type: ignore[index]
            return ""
        return "reply" if kind == MessageType.REPLY else "answer"

    def _task_answers(self, kind: str, to: str, answered: object, task_id: str) -> bool:
        """Whether a message about task ``task_id`` is what the task log backs: a
        ``task_result`` from its assignee to its delegator, for its current assignment;
        a ``task_canceled`` from the agent that canceled it (or moved it) to its
        assignee (or the one it was moved from); a ``task_stalled`` to its delegator
        while its lease has lapsed. A result for a task that was canceled, or from an
        agent that is not its assignee, is refused (`InvalidMessage`)."""
        from ralph_mail.govern import tasklog

        box = self._box()
        task = tasklog.load(box.store)[0].get(task_id)
        if task is None:
            return False  # not the team's task: judged as any other message
        sender = box.agent
        if kind == MessageType.TASK_RESULT:
            if task.assignee != sender:
                moved = f" (reassigned from {sender})" if task.reassigned_from == sender else ""
                raise InvalidMessage(
                    f"task {task_id} is {task.assignee}'s{moved}: a result from {sender} is "
                    "not the assignee's and is not taken"
                )
            if task.status == "canceled":
                raise InvalidMessage(
                    f"task {task_id} was canceled by {task.ended_by}: its result is not "
                    "taken ('ralph-mail task done' keeps it as late)"
                )
            return to == task.delegated_by and answered == task.assignment
        if kind == MessageType.TASK_CANCELED:
            if to == task.assignee:
                return task.status == "canceled" and task.ended_by == sender
            lead = box.team.lead
            return to == task.reassigned_from and sender in (task.delegated_by, lead)
        return to == task.delegated_by and task.stalled

    def _govern(self, recipients: list[str], check: str, protocol: bool) -> str:
        """Apply the policy to a message from me to ``recipients``: raise
        `PermissionDenied` or `RateLimited`, or return why it is held ("" to deliver)."""
        try:
            policy = self.policy()
        except PermissionDenied:
            if not protocol:
                raise
            policy = _NO_POLICY  # the hierarchy needs no rule: a broken one stops no protocol
        box = self._box()
        if policy is _NO_POLICY and self.default_rate is None and box.me().mode == "autonomous":
            return ""  # no rule, no rate, no mode: nothing to decide
        if self._decisions_team is not box.team:  # the roster changed: modes, managers
            self._decisions.clear()
            self._decisions_team = box.team
        held = ""
        for recipient in recipients:
            decision = self._decisions.get((recipient, check, protocol))
            if decision is None:
                if protocol:  # between a member and the lead: the hierarchy lets it through
                    decision = Decision("allow", "")
                else:
                    decision = policy.decide(box.team, box.agent, recipient,
                                             reply=check == "reply")  # fmt: skip
                self._decisions[recipient, check, protocol] = decision
            if decision.verdict == "deny":
                raise PermissionDenied(
                    f"{decision.reason}: ask the team's lead to change the policy "
                    "('ralph-mail policy show')"
                )
            if decision.verdict == "hold" and not held:
                held = decision.reason
        if check == "contact":
            self._count(policy)
        return held

    def _count(self, policy: Policy | None = None) -> None:
        """Count one message my agent starts against its rate; `RateLimited` over it,
        `BudgetExceeded` (counting nothing) when my agent's jobs spent its budget."""
        policy = self.policy() if policy is None else policy
        if policy is _NO_POLICY and self.default_rate is None:
            return
        box = self._box()
        if policy.budgets:
            from ralph_mail.govern import budget

            budget.check(box, policy)
        rate = policy.rate_of(box.agent) or self.default_rate
        if rate is None:
            return
        wait = box.store.take(self._rate_key, rate, RATE_WINDOW_S)
        if wait > 0:
            raise RateLimited(
                f"{box.agent} started {rate} messages in the last minute, its limit: "
                f"retry in {max(wait, 0.1):.1f} s"
            )

    def _loop_guard(
        self, thread: str, visibility: object, in_thread: list[Message] | None = None
    ) -> None:
        """`LoopGuard` when the thread's last messages are all internal, as many as the
        team's ``max_internal_exchanges``, and this one is internal too."""
        if visibility == "user_visible":
            return
        box = self._box()
        limit = settings.team_setting("max_internal_exchanges", dict(box.team.config))
        if limit == 0:
            return
        if in_thread is None:
            in_thread = box.indexed(f"thread+{thread}", limit)
        recent = in_thread[-limit:]
        if len(recent) >= limit and all(m.visibility != "user_visible" for m in recent):
            raise LoopGuard(
                f"thread {thread} carried {limit} internal messages in a row: stop and "
                "answer the user (--visibility user_visible), or start a new thread"
            )

    # -- holding --------------------------------------------------------------------------

    def hold(self, envelope: dict[str, object], reason: str) -> Message:
        """Keep a message for approval, and ask my approver (my manager, else the lead):
        the ``approval_request`` is the Gate's own message, written as it is."""
        from ralph_mail.govern import approvals

        box = self._box()
        box.seal(envelope)  # kept signed: its approver delivers it unchanged
        approver = box.me().manager or box.team.lead
        record = approvals.held(envelope, approver, reason, format_ts(time.time_ns() // 1000))
        box.store.log_append(approvals.LOG, record)
        message = from_envelope(envelope)
        if approver != box.agent:
            first = message.content.partition("\n")[0]
            request = box.envelope(approver, MessageType.APPROVAL_REQUEST,
                                   f"{box.agent} wants to send {message.to_agent} a "
                                   f"{message.type}: {first}",
                                   {"held": message.id, "from": box.agent,
                                    "to": message.to_agent, "type": str(message.type),
                                    "reason": reason})  # fmt: skip
            box._deliver(request)
        return message


#: The protocol messages whose metadata is checked as their reader checks it.
_CHECKED: Final = frozenset({
    MessageType.STATUS_UPDATE, MessageType.PLAN_APPROVAL, MessageType.SHUTDOWN_RESPONSE,
    MessageType.TASK_CANCELED, MessageType.TASK_STALLED,
})  # fmt: skip
#: The messages about a task that the task log can back (see `Gate._task_answers`).
_ON_TASKS: Final = frozenset({
    MessageType.TASK_RESULT, MessageType.TASK_CANCELED, MessageType.TASK_STALLED,
})  # fmt: skip
_ANSWER_TYPES: Final = frozenset({
    MessageType.REPLY, MessageType.ACK, MessageType.APPROVAL_RESPONSE, *_ANSWERS,
})  # fmt: skip
