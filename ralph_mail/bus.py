"""`MessageBus`: one agent's view of its team's mailboxes: send, broadcast, read, wait."""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import re
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from itertools import accumulate, repeat
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from ralph_mail import settings
from ralph_mail.errors import (
    AgentOffline,
    BroadcastError,
    DepthLimit,
    InboxBusy,
    InvalidMessage,
    LockTimeout,
    LoopGuard,
    MailError,
    NoReply,
    PermissionDenied,
    RateLimited,
    UnknownAgent,
)
from ralph_mail.govern.policy import Decision, Policy
from ralph_mail.message import (
    BROADCAST_ADDRESS,
    TS_PLACEHOLDER,
    Message,
    MessageType,
    check_chain,
    check_id,
    check_metadata,
    check_name,
    check_priority,
    check_type,
    check_visibility,
    decode_lines,
    encode_parts,
    format_ts,
    from_envelope,
    new_id,
)
from ralph_mail.settings import WATCH_SAFETY_POLL_S
from ralph_mail.store.base import Cursor, TeamStore, Waiter
from ralph_mail.team import Member, Team, load_team, parse_roster

if TYPE_CHECKING:
    from datetime import datetime

    from ralph_mail.govern.approvals import Held
    from ralph_mail.govern.presence import AgentInfo
    from ralph_mail.store.base import StopEvent
    from ralph_mail.talk.channels import Channels
    from ralph_mail.talk.tasks import Task

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
        backend: where the team is kept (default ``$RALPH_BACKEND``, else files under
            ``home``; ``memory://NAME`` keeps it in this process).
        default_rate: messages per minute this agent may start when the team's policy
            sets no rate for it (None: no limit; ``ralph-mail run`` and the MCP server
            pass 10, where LLM storms start).
    """

    def __init__(
        self,
        team: str,
        agent: str,
        home: str | os.PathLike[str] | None = None,
        *,
        durable: bool | None = None,
        max_message_bytes: int | None = None,
        backend: str | None = None,
        default_rate: int | None = None,
    ) -> None:
        self.agent = check_name(agent, "agent name")
        self._team = load_team(team, home, backend=backend)
        self._team.member(agent)
        self._members = frozenset(self._team.names)
        self._store = self._team.store
        self._store.durable = settings.durable(durable)
        self.max_message_bytes = settings.max_message_bytes(max_message_bytes)
        self._gc_auto = settings.gc_auto_bytes()
        self._compact_due = False
        self._cursor: Cursor | None = None
        self._scanned = 0  # logical offset up to which _pending is complete
        # Unconsumed (line start, message), oldest first: a deque, so that committing
        # message after message (the lead catching up) costs O(1) each, not O(pending).
        self._pending: deque[tuple[int, Message]] = deque()
        self._watcher: Waiter | None = None
        # Consuming, one thread at a time: asks from several threads, an MCP server's tools.
        self._lock = threading.RLock()
        self._ask_local = threading.local()  # each asking thread's waiter
        self._ask_waiters: list[Waiter] = []
        self._touched = -_TOUCH_EVERY_S  # when this bus last noted its agent as active
        self._policy: tuple[tuple[int, ...] | None, Policy | str] = (None, _NO_POLICY)
        # What the policy decided for (recipient, check), for this policy and roster.
        self._decisions: dict[tuple[str, str], Decision] = {}
        self._decisions_team: Team | None = None
        self._myself: tuple[Team, Member] | None = None
        self._rate_key = f"rate.{self.agent}"
        self._channels: Channels | None = None
        if default_rate is not None:
            from ralph_mail.govern.policy import check_rate

            check_rate(default_rate)
        self.default_rate = default_rate
        #: The agents the request this process handles passed through (``RALPH_CHAIN``):
        #: a request this bus sends carries it on, plus me.
        try:
            self.chain = check_chain(os.environ.get("RALPH_CHAIN", ""))
        except MailError as exc:
            raise InvalidMessage(f"RALPH_CHAIN: {exc}") from None

    # -- who ----------------------------------------------------------------------------

    @property
    def team(self) -> Team:
        """The team's roster, as loaded (see `refresh_team`)."""
        return self._team

    @property
    def store(self) -> TeamStore:
        """The team's storage (the seam every backend implements)."""
        return self._store

    @property
    def durable(self) -> bool:
        """Whether each send is fsynced before it returns."""
        return self._store.durable

    def refresh_team(self) -> Team:
        """Reload the roster from disk."""
        self._team = parse_roster(
            self._store.roster(), self._team.home, self._team.name, self._store
        )
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
        thread: str | None = None,
        priority: str | None = None,
        ack: bool = False,
        visibility: str | None = None,
    ) -> Message:
        """Append one message to ``to``'s inbox; return it as written.

        When this returns, the message is in the file (and on disk in durable mode). When
        it raises, nothing a reader would deliver was written. Pass ``id`` to retry a send
        under the same id, so a receiver that remembers ids handles it once. ``thread``,
        ``priority``, ``ack`` and ``visibility`` set the envelope keys of those names
        (omitted at their defaults: its own thread, normal, no ack, internal).

        Example:
            >>> bus.send("lead", MessageType.TEXT, "retry me", id="9f1c2e3d4b5a")  # doctest: +SKIP
        """
        return self._send(to, type, content, metadata, reply_to, id, thread, priority, ack,
                          visibility, check=_check_of(type))  # fmt: skip

    def _send(
        self,
        to: str,
        type: MessageType | str,
        content: str,
        metadata: Mapping[str, str] | None,
        reply_to: str | None,
        id: str | None,
        thread: str | None = None,
        priority: str | None = None,
        ack: bool = False,
        visibility: str | None = None,
        chain: tuple[str, ...] = (),
        *,
        check: str = "none",
        in_thread: list[Message] | None = None,
    ) -> Message:
        """Write one message. ``check`` says what the team's policy decides of it:
        "contact" (rules, modes, rate: what an agent starts), "reply" (the strict mode
        only), "none" (acks, results, protocol messages). A message the policy holds
        for approval is returned undelivered, with no ``ts``. ``in_thread``: the
        thread's messages, when the caller has just read them."""
        recipient = self._recipient(to)
        envelope = self._envelope(recipient, type, content, metadata, reply_to, id)
        _extend(envelope, thread, priority, ack, visibility, chain)
        if "thread" in envelope:
            self._loop_guard(str(envelope["thread"]), visibility, in_thread)
        if check != "none":
            reason = self._govern([recipient], check)
            if reason:
                return self._hold(envelope, reason)
        return self._deliver(envelope)

    # -- governance -----------------------------------------------------------------------

    def policy(self) -> Policy:
        """The team's policy now (read again only when it changed).

        A policy that cannot be read or parsed raises `PermissionDenied` naming it: it
        fails closed.
        """
        version = self._store.state_version(_POLICY_KEY)
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

        where = self._store.state_where(_POLICY_KEY)
        try:
            raw = self._store.load_state(_POLICY_KEY) or b"{}"
            return policy.parse(raw)
        except MailError as exc:
            return (
                f"the team's policy {where} is broken ({exc}): fix it or remove it; until "
                "then no agent may start contact"
            )

    def _govern(self, recipients: list[str], check: str) -> str:
        """Apply the policy to a message from me to ``recipients``: raise
        `PermissionDenied` or `RateLimited`, or return why it is held ("" to deliver)."""
        policy = self.policy()
        if policy is _NO_POLICY and self.default_rate is None and self._me().mode == "autonomous":
            return ""  # no rule, no rate, no mode: nothing to decide
        if self._decisions_team is not self._team:  # the roster changed: modes, managers
            self._decisions.clear()
            self._decisions_team = self._team
        held = ""
        for recipient in recipients:
            decision = self._decisions.get((recipient, check))
            if decision is None:
                decision = policy.decide(self._team, self.agent, recipient,
                                         reply=check == "reply")  # fmt: skip
                self._decisions[recipient, check] = decision
            if decision.verdict == "deny":
                raise PermissionDenied(
                    f"{decision.reason}: ask the team's lead to change the policy "
                    "('ralph-mail policy show')"
                )
            if decision.verdict == "hold" and not held:
                held = decision.reason
        rate = policy.rate_of(self.agent) or self.default_rate
        if check == "contact" and rate is not None:
            wait = self._store.take(self._rate_key, rate, _RATE_WINDOW_S)
            if wait > 0:
                raise RateLimited(
                    f"{self.agent} started {rate} messages in the last minute, its limit: "
                    f"retry in {max(wait, 0.1):.1f} s"
                )
        return held

    def _me(self) -> Member:
        """My roster entry (looked up once per roster)."""
        if self._myself is None or self._myself[0] is not self._team:
            self._myself = (self._team, self._team.member(self.agent))
        return self._myself[1]

    def _hold(self, envelope: dict[str, object], reason: str) -> Message:
        """Keep a message for approval, and ask my approver (my manager, else the lead)."""
        from ralph_mail.govern import approvals

        approver = self._me().manager or self._team.lead
        record = approvals.held(envelope, approver, reason, format_ts(time.time_ns() // 1000))
        self._store.log_append(approvals.LOG, record)
        message = from_envelope(envelope)
        first = message.content.partition("\n")[0]
        self._send(approver, MessageType.APPROVAL_REQUEST,
                   f"{self.agent} wants to send {message.to_agent} a {message.type}: {first}",
                   {"held": message.id, "from": self.agent, "to": message.to_agent,
                    "type": str(message.type), "reason": reason}, None, None)  # fmt: skip
        return message

    def approvals(self) -> list[Held]:
        """The messages held for my approval and not decided yet, oldest first."""
        from ralph_mail.govern import approvals

        return [h for h in approvals.fold(self._store.log_read(approvals.LOG)).values()
                if h.approver == self.agent and h.decision is None]  # fmt: skip

    def approval_of(self, message_id: str) -> Held | None:
        """What became of a message held for approval (`Held.decision` None: waiting),
        or None when it was never held."""
        from ralph_mail.govern import approvals

        found = approvals.fold(self._store.log_read(approvals.LOG))
        return found.get(check_id(message_id, "message id"))

    def approve(self, message_id: str) -> Held:
        """Deliver a message held for my approval, unchanged (same id), and tell its
        sender. Run again after a crash, it delivers it only if it is not there yet."""
        return self._decide(message_id, True, "")

    def deny(self, message_id: str, reason: str = "") -> Held:
        """Refuse a message held for my approval: it is never delivered; its sender is
        told (an ``approval_response`` with ``metadata.approved=false``)."""
        return self._decide(message_id, False, reason)

    def _decide(self, message_id: str, approved: bool, reason: str) -> Held:
        from ralph_mail.govern import approvals

        if not isinstance(reason, str):
            raise InvalidMessage(f"reason must be a string, not {reason.__class__.__name__}")
        held = self.approval_of(message_id)
        if held is None or held.approver != self.agent:
            raise MailError(
                f"no message {message_id!r} waits for {self.agent}'s approval: see "
                "'ralph-mail approvals'"
            )
        if held.decision is None:
            target = str(held.envelope["to"])
            since = 0 if target == BROADCAST_ADDRESS else self._store.size(target)
            self._store.log_append(approvals.LOG, approvals.decided(
                message_id, approved, self.agent, reason, since))  # fmt: skip
            held = approvals.fold(self._store.log_read(approvals.LOG))[message_id]
        elif held.decision != approved:
            raise InvalidMessage(
                f"message {message_id} is already {'approved' if held.decision else 'denied'}"
            )
        if not held.done:
            if held.decision and not self._was_delivered(held):
                self._release(held)
            verdict = {"approved": "true" if held.decision else "false"}
            if held.reason_given:
                verdict["reason"] = held.reason_given
            self._send(held.sender, MessageType.APPROVAL_RESPONSE,
                       f"{'approved' if held.decision else 'denied'} by {self.agent}"
                       + (f": {held.reason_given}" if held.reason_given else ""),
                       verdict, message_id, None)  # fmt: skip
            self._store.log_append(approvals.LOG, approvals.done(message_id))
            held = approvals.fold(self._store.log_read(approvals.LOG))[message_id]
        return held

    def _was_delivered(self, held: Held) -> bool:
        target = str(held.envelope["to"])
        if target == BROADCAST_ADDRESS:
            return False  # a broadcast's inboxes are checked one by one in _release
        return self._delivered(target, held.id, held.since)

    def _release(self, held: Held) -> None:
        envelope = dict(held.envelope)
        if envelope["to"] != BROADCAST_ADDRESS:
            self._deliver(envelope)
            return
        head, tail = encode_parts(envelope, self.max_message_bytes)
        for member in self.refresh_team().names:
            if member != held.sender and not self._delivered(member, held.id, held.since):
                self._store.append(member, head, tail)

    def wait_for_decision(self, message_id: str, since: int, timeout: float) -> bool | None:
        """Wait up to ``timeout`` seconds for the decision on my message held for
        approval: True approved (and delivered), False denied, None not decided yet.
        ``since``: where my inbox ended before sending it."""
        answer = self._await_reply(message_id, since, timeout, MessageType.APPROVAL_RESPONSE)
        if answer is None:
            return None
        return answer.metadata.get("approved") == "true"

    def _deliver(self, envelope: dict[str, object]) -> Message:
        """Append a checked envelope to its recipient's inbox, and index it."""
        head, tail = encode_parts(envelope, self.max_message_bytes)
        envelope["ts"], offset = self._store.append(str(envelope["to"]), head, tail)
        self._touch()
        message = from_envelope(envelope)
        self._index(message, offset, len(head) + len(TS_PLACEHOLDER) + len(tail))
        return message

    def _index(self, message: Message, offset: int, length: int) -> None:
        """Note where a direct message is, for `history` and `thread`.

        After the append, not under its lock: a process killed in between, or an index
        that cannot be written, leaves the message delivered but missing from history
        (never the other way round).
        """
        recipient = message.to_agent
        try:
            self._store.index_add(_pair_key(self.agent, recipient), recipient, offset, length)
            if message.thread != message.id or message.type in _THREAD_STARTERS:
                self._store.index_add(f"thread+{message.thread}", recipient, offset, length)
            if message.ack:  # for pending_acks: what I asked to be acknowledged
                self._store.index_add(f"acks+{self.agent}", recipient, offset, length)
            if message.type == MessageType.ACK:  # and what answered it, for its sender
                self._store.index_add(f"acked+{recipient}", recipient, offset, length)
        except MailError as exc:  # the message is delivered: a send that returned stays so
            warnings.warn(f"{exc}; message {message.id} is missing from history",
                          RuntimeWarning, stacklevel=4)  # fmt: skip

    def history(self, with_agent: str, limit: int = 20) -> list[Message]:
        """The last ``limit`` messages between me and ``with_agent``, both directions,
        oldest first. Costs O(limit), however much else the team's inboxes hold.

        Example:
            >>> [m.content for m in bus.history("analyst", 5)]  # doctest: +SKIP
        """
        other = self._recipient(with_agent)
        if not isinstance(limit, int) or limit < 0:
            raise InvalidMessage(f"invalid limit {limit!r}: give a count >= 0")
        return self._indexed(_pair_key(self.agent, other), limit)

    def thread(self, thread_id: str) -> list[Message]:
        """Every message of thread ``thread_id`` (a request or delegation and what answered
        it, in that thread), in order.

        Example:
            >>> [m.type for m in bus.thread(question.id)]  # doctest: +SKIP
            ['request', 'reply']
        """
        return self._indexed(f"thread+{check_id(thread_id, 'thread id')}", 1 << 62)

    def _indexed(self, key: str, limit: int) -> list[Message]:
        found: list[Message] = []
        for agent, offset, length in self._store.index_tail(key, limit):
            line = self._store.read_line(agent, offset, length)
            if line is None:
                continue  # collected by gc
            message = decode_lines([line])[0][0]
            if isinstance(message, Message):
                found.append(message)
        # Entries are written just after their message, so two senders racing can note
        # them out of order; the timestamps, taken under each inbox's lock, cannot.
        found.sort(key=lambda message: message.ts)
        return found

    def search(
        self,
        query: str = "",
        *,
        from_agent: str | None = None,
        to: str | None = None,
        type: MessageType | str | None = None,
        thread: str | None = None,
        since: str | datetime | None = None,
        limit: int = 20,
    ) -> list[Message]:
        """Every message ever sent in the team (the audit trail: inboxes, and what gc
        archived) that has all the words of ``query`` and passes the filters, newest
        first. ``since``: an ISO-8601 time, a datetime, or how long ago (``90s``,
        ``15m``, ``2h``, ``7d``).

        Example:
            >>> [m.content for m in bus.search("revenue", from_agent="analyst")]  # doctest: +SKIP
        """
        from ralph_mail.store.base import Query

        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidMessage(f"invalid limit {limit!r}: give a count >= 1")
        wanted = Query(
            query if isinstance(query, str) else _not_text(query),
            None if from_agent is None else check_name(from_agent, "agent name"),
            None if to in (None, BROADCAST_ADDRESS) else check_name(to, "agent name"),
            None if type is None else str(check_type(type)),
            None if thread is None else check_id(thread, "thread id"),
            None if since is None else parse_since(since),
            limit,
        )  # fmt: skip
        if to == BROADCAST_ADDRESS:
            wanted = replace(wanted, recipient=BROADCAST_ADDRESS)
        found = decode_lines(self._store.search(wanted))[0]
        return [message for message in found if isinstance(message, Message)]

    def purge_archive(self, before: str | datetime) -> dict[str, int]:
        """Delete, for good, the archived messages of every inbox older than ``before``
        (as ``since`` in `search`), from the audit trail and the search index; return
        where each inbox's audit trail starts now."""
        stamp = parse_since(before)
        starts = {}
        for agent in self.refresh_team().names:
            starts[agent] = self._store.purge_archive(agent, stamp, timeout=5.0)
            self._store.forget_archived(agent, starts[agent])
        return starts

    # -- presence -------------------------------------------------------------------------

    def _touch(self) -> bool:
        """Note that my agent is active (at most once a second per bus: cheap in a loop);
        return whether it did."""
        now = time.monotonic()
        if now - self._touched < _TOUCH_EVERY_S:
            return False
        self._touched = now
        try:
            raw = self._store.load_presence(self.agent)
            record = orjson.loads(raw) if raw else {}
            record["last_seen"] = format_ts(time.time_ns() // 1000)
            self._store.save_presence(self.agent, orjson.dumps(record))
        except (MailError, ValueError) as exc:  # presence is a hint: never stop mail for it
            warnings.warn(f"cannot note {self.agent!r} as active: {exc}", RuntimeWarning,
                          stacklevel=3)  # fmt: skip
        return True

    def set_presence(self, state: str, until: str | datetime | None = None) -> None:
        """Say what my agent is doing: ``idle``, ``working``, ``sleeping`` (until
        ``until``: an ISO-8601 time, a datetime or ``+DURATION``), ``awaiting_approval``
        or ``awaiting_delegation``.

        Example:
            >>> bus.set_presence("sleeping", until="+15m")  # doctest: +SKIP
        """
        from ralph_mail.govern import presence

        stamp = presence.parse_until(until)
        if presence.check_state(state) == "sleeping" and not stamp:
            raise InvalidMessage("sleeping needs until: a time or +DURATION such as +15m")
        now = format_ts(time.time_ns() // 1000)
        self._store.save_presence(self.agent, presence.record(state, stamp, now))
        self._touched = time.monotonic()

    def agents(self, include_self: bool = False) -> list[AgentInfo]:
        """The teammates (and me, with ``include_self``) with their presence.

        Example:
            >>> [(a.name, a.presence) for a in bus.agents()]  # doctest: +SKIP
            [('lead', 'idle'), ('writer', 'offline')]
        """
        from ralph_mail.govern import presence

        return presence.agents(self.refresh_team(), self.agent, include_self)

    # -- channels -------------------------------------------------------------------------

    @property
    def channels(self) -> Channels:
        """My channels: create, join, leave, pass a turn, where a mention stands."""
        if self._channels is None:
            from ralph_mail.talk.channels import Channels

            self._channels = Channels(self)
        return self._channels

    def channel_post(self, name: str, text: str, reply_to: str | None = None) -> Message:
        """Post ``text`` in channel ``name`` (I am a member); each member it mentions
        (``@name``, ``@all``) gets a `mention` in its inbox. An ``@name`` that is no
        member is refused (`InvalidMessage`, naming the members).

        Example:
            >>> bus.channel_post("standup", "@writer what are you on today?")  # doctest: +SKIP
        """
        return self.channels.post(name, text, reply_to)

    def channel_read(self, name: str) -> list[Message]:
        """Consume and return the posts of channel ``name`` I have not read (mine left
        out), oldest first."""
        return self.channels.read(name)

    def channel_history(self, name: str, limit: int = 20) -> list[Message]:
        """The last ``limit`` posts of channel ``name``, oldest first (like `history`)."""
        return self.channels.history(name, limit)

    # -- delegation -----------------------------------------------------------------------

    def delegate(
        self,
        to: str,
        description: str,
        *,
        context: str | None = None,
        priority: str | None = None,
        parent: str | None = None,
        id: str | None = None,
        visibility: str | None = None,
    ) -> Task:
        """Give ``to`` a task: record it in the team's task tree and send it a
        ``task_assignment``; return at once. Its outcome comes back as a ``task_result``.

        Refused before anything is written: delegating to myself, to an offline agent
        (`AgentOffline`), a bad id or priority. Delegating again under the same ``id``
        (a retry) sends the same assignment again, which a receiver that remembers ids
        handles once. A sleeping assignee gets the assignment when it wakes: it is held
        until the ``until`` of its sleep (or until it says it is doing something else),
        then delivered, once, by the assignee's own next read.

        Example:
            >>> task = bus.delegate("writer", "Draft the Q4 post")  # doctest: +SKIP
        """
        assignee = self._recipient(to)
        if assignee == self.agent:
            raise InvalidMessage(f"{to!r} is delegating to itself: name a teammate")
        until = self._require_online(assignee)
        return self._give(assignee, description, context, priority, parent, id, hold=until,
                          visibility=visibility)[0]  # fmt: skip

    def _give(
        self,
        assignee: str,
        description: str,
        context: str | None,
        priority: str | None,
        parent: str | None,
        id: str | None,
        *,
        strict: bool = True,
        hold: str = "",
        visibility: str | None = None,
    ) -> tuple[Task, Message]:
        """Record (unless known) and send a task; ``strict=False`` (the lead's assign)
        lets an existing id be given out again with other words, as a new assignment.
        With ``hold`` (a ts), the assignment is held for the assignee until then."""
        from ralph_mail import protocols
        from ralph_mail.talk import tasks

        task_id = protocols.check_task_id(id) if id is not None else f"t-{new_id()[:8]}"
        if priority is not None:
            check_priority(priority)
        if parent is not None:
            protocols.check_task_id(parent)
        known, _ = tasks.load(self._store)
        task = known.get(task_id)
        if task is not None and (task.assignee, task.description) != (assignee, description):
            if strict:
                raise InvalidMessage(
                    f"task {task_id} already exists (given to {task.assignee}): pick another id"
                )
            task = None  # the lead gives the same task id out again: a new assignment
        if task is None:
            now = format_ts(time.time_ns() // 1000)
            task = tasks.Task(task_id, description, self.agent, assignee, parent,
                              priority or "normal", "pending", "", now, now, new_id(),
                              held_until=hold)  # fmt: skip
            self._store.log_append(tasks.LOG, tasks.created(task))
        metadata = {protocols.TASK_ID: task_id}
        if task.parent:
            metadata["parent"] = task.parent
        if context is not None:
            metadata["context"] = context
        if not hold:
            sent = self._send(assignee, MessageType.TASK_ASSIGNMENT, description, metadata,
                              None, task.assignment, priority=priority, visibility=visibility,
                              check="contact" if strict else "none")  # fmt: skip
            return task, sent
        envelope = self._envelope(assignee, MessageType.TASK_ASSIGNMENT, description, metadata,
                                  None, task.assignment)  # fmt: skip
        _extend(envelope, None, priority, False, visibility)
        encode_parts(envelope, self.max_message_bytes)  # refuses what could never be sent
        if strict:
            reason = self._govern([assignee], "contact")
            if reason:  # held for approval: once approved, it is delivered at once
                return task, self._hold(envelope, reason)
        record = {"held": envelope, "until": hold, "since": self._store.size(assignee)}
        self._store.log_append(f"{_HELD}{assignee}", orjson.dumps(record) + b"\n")
        return task, from_envelope(envelope)

    def _release_held(self) -> None:
        """Deliver to my inbox the assignments held while I slept whose hold is over (or
        all, once I am not sleeping). Only the process consuming my inbox runs this, so
        no two release one; run again after a crash, it delivers what is not there yet."""
        from ralph_mail.govern import presence

        log = self._store.log_read(f"{_HELD}{self.agent}")
        if not log:
            return
        held: dict[str, dict[str, Any]] = {}
        for line in log.splitlines():
            try:
                record = orjson.loads(line)
                if "released" in record:
                    held.pop(str(record["released"]), None)
                else:
                    held[str(record["held"]["id"])] = record
            except (orjson.JSONDecodeError, KeyError, TypeError):
                continue  # a damaged record: the others are still released
        if not held:
            return
        state, _, _ = presence.presence_of(self._team, self.agent)
        now = format_ts(time.time_ns() // 1000)
        for message_id, record in held.items():
            if state == "sleeping" and str(record.get("until", "")) > now:
                continue
            # Where gc collected the inbox since, err on delivering twice (a receiver
            # that remembers ids handles it once), never on losing the task.
            if not self._delivered(self.agent, message_id, int(record.get("since", 0))):
                self._deliver(dict(record["held"]))
            released = orjson.dumps({"released": message_id}) + b"\n"
            self._store.log_append(f"{_HELD}{self.agent}", released)

    def start(self, task_id: str) -> Task:
        """Mark my task ``task_id`` active."""
        return self._finish(task_id, "active", "")

    def complete(self, task_id: str, result: str) -> Task:
        """Record my task ``task_id`` as completed and send its delegator the result (a
        ``task_result``, the callback). Run again after a crash, it sends the result
        only if it was not sent before.

        Example:
            >>> bus.complete(task.id, "Saved as 'Q4 Blog Post Draft'")  # doctest: +SKIP
        """
        return self._finish(task_id, "completed", result)

    def fail(self, task_id: str, error: str) -> Task:
        """Record my task ``task_id`` as failed and send its delegator the error."""
        return self._finish(task_id, "failed", error)

    def tasks(self) -> list[Task]:
        """The team's tasks, parents first, each followed by its subtasks."""
        from ralph_mail.talk import tasks

        return tasks.ordered(tasks.load(self._store)[0])

    def _finish(self, task_id: str, status: str, result: str) -> Task:
        from ralph_mail import protocols
        from ralph_mail.talk import tasks

        if not isinstance(result, str):
            raise InvalidMessage(f"result must be a string, not {result.__class__.__name__}")
        known, since = tasks.load(self._store)
        task = known.get(protocols.check_task_id(task_id))
        if task is None:
            raise MailError(
                f"no task {task_id!r} in team {self._team.name!r}: see 'ralph-mail tasks'"
            )
        if task.assignee != self.agent:
            raise InvalidMessage(
                f"task {task_id} is {task.assignee}'s, not {self.agent}'s: only the assignee "
                "starts, completes or fails it"
            )
        now = format_ts(time.time_ns() // 1000)
        if status == "active":
            if task.status == "pending":
                self._store.log_append(tasks.LOG, tasks.changed(task_id, "active", now))
            return tasks.load(self._store)[0][task_id]
        if task.status in tasks.FINISHED and task.status != status:
            raise InvalidMessage(f"task {task_id} is already {task.status}: it cannot be {status}")
        if task.status not in tasks.FINISHED:
            # The outcome first, with where the delegator's inbox ends now: a run killed
            # after this and before the result is sent finds it there and sends it once.
            since[task_id] = self._store.size(task.delegated_by)
            self._store.log_append(
                tasks.LOG, tasks.changed(task_id, status, now, result, since[task_id])
            )
            task = tasks.load(self._store)[0][task_id]
        if not task.notified:
            result_id = protocols.derived_id(task.assignment, "result")
            if not self._delivered(task.delegated_by, result_id, since.get(task_id, 0)):
                self._send(task.delegated_by, MessageType.TASK_RESULT, task.result,
                           {protocols.TASK_ID: task_id, "status": task.status},
                           task.assignment, result_id, task.assignment)  # fmt: skip
            self._store.log_append(tasks.LOG, tasks.notified(task_id))
            task = tasks.load(self._store)[0][task_id]
        return task

    def _delivered(
        self, agent: str, message_id: str, since: int, *, collected: bool = False
    ) -> bool:
        """Whether a line with ``message_id`` is in ``agent``'s inbox from ``since`` on.

        When gc has collected that part of the inbox (its owner consumed it), the answer
        is ``collected``: the caller says which way to err.
        """
        needle = b'"id":"' + message_id.encode() + b'"'
        offset = since
        while True:
            data, start = self._store.read(agent, offset, skip_collected=True)
            if start > offset:
                return collected
            offset = start
            if not data:
                return False
            if needle in data:
                return True
            offset += len(data)

    # -- conversations --------------------------------------------------------------------

    def reply(
        self,
        message: Message,
        content: str,
        metadata: Mapping[str, str] | None = None,
        *,
        priority: str | None = None,
        ack: bool = False,
        visibility: str | None = None,
    ) -> Message:
        """Answer ``message`` (any message, not only a request) with a ``reply`` to its
        sender, in its thread.

        A request gets one reply from me: replying to it again (a responder killed after
        replying and run again on the same request) sends nothing and returns the reply
        already sent.

        Example:
            >>> bus.reply(question, "Q4 revenue was $2.4M")  # doctest: +SKIP
        """
        in_thread = None
        if message.type == MessageType.REQUEST:
            in_thread = self._indexed(f"thread+{message.thread}", 1 << 62)
            for earlier in in_thread:
                mine = earlier.from_agent == self.agent and earlier.reply_to == message.id
                if mine and earlier.type == MessageType.REPLY:
                    return earlier
        return self._send(message.from_agent, MessageType.REPLY, content, metadata,
                          message.id, None, message.thread, priority, ack, visibility,
                          check="reply", in_thread=in_thread)  # fmt: skip

    def ask(
        self,
        to: str,
        question: str,
        *,
        context: str | None = None,
        timeout: float = 120.0,
        priority: str | None = None,
        metadata: Mapping[str, str] | None = None,
        id: str | None = None,
        visibility: str | None = None,
        stop: StopEvent | None = None,
    ) -> Message:
        """Send ``to`` a ``request`` and block until its ``reply`` arrives; return the reply.

        Only that reply is consumed (when this process may consume my inbox); every other
        message stays unread. The request carries the chain of agents it passed through
        (``RALPH_CHAIN`` of the request being handled, plus me), and is refused before
        anything is written when it would exceed the team's ``max_depth`` (`DepthLimit`),
        or when it asks myself. No reply within ``timeout`` seconds: `NoReply`.

        ``stop`` (an event, such as a cancelled MCP call's) ends the wait early: `NoReply`.
        ``id`` names the request, so an asker killed while it waited, run again with the
        same ``id``, gets the reply (the one that came meanwhile, or the one still to
        come) and does not ask again.

        Example:
            >>> bus.ask("analyst", "Q4 revenue?", context="investor update")  # doctest: +SKIP
        """
        if to == self.agent:
            raise InvalidMessage(f"{to!r} is asking itself: ask a teammate")
        chain = (*self.chain, self.agent)
        depth = settings.team_setting("max_depth", dict(self._team.config))
        if len(chain) > depth:
            raise DepthLimit(
                f"maximum agent communication depth ({depth}) reached: delegate instead of "
                f"asking (chain: {' -> '.join(chain)} -> {to})"
            )
        if not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise InvalidMessage(f"invalid timeout {timeout!r}: give a number of seconds >= 0")
        if id is not None:
            earlier = self._asked_before(check_id(id), to, timeout)
            if earlier is not None:
                return earlier
        self._require_online(self._recipient(to))
        extra = dict(check_metadata(metadata))
        if context is not None:
            extra["context"] = context
        # Where the reply can be from: where this bus stopped reading my inbox (no
        # round trip) or else its end.
        start = self._scanned if self._cursor is not None else self._store.size(self.agent)
        request = self._send(to, MessageType.REQUEST, question, extra, None, id,
                             priority=priority, visibility=visibility, chain=chain,
                             check="contact")  # fmt: skip
        if not request.ts:  # held for approval: the same timeout covers the decision
            deadline = time.monotonic() + timeout
            with self._awaiting_approval():
                decided = self.wait_for_decision(request.id, start, timeout)
            if decided is None:
                raise NoReply(
                    f"no decision on asking {to} within {timeout:g} s: it waits for approval "
                    "('ralph-mail approvals' on the approver's side)"
                )
            if not decided:
                raise PermissionDenied(f"asking {to} was denied by the approver")
            timeout = max(0.0, deadline - time.monotonic())
        return self._answer_of(request.id, to, start, timeout, stop, fresh=True)

    @contextlib.contextmanager
    def _awaiting_approval(self) -> Iterator[None]:
        """Presence ``awaiting_approval`` while a held message waits; then as it was."""
        before = self._store.load_presence(self.agent)
        self.set_presence("awaiting_approval")
        try:
            yield
        finally:
            with contextlib.suppress(MailError):
                if before is None:
                    self.set_presence("idle")
                else:
                    self._store.save_presence(self.agent, before)

    def _answer_of(
        self,
        request_id: str,
        to: str,
        start: int,
        timeout: float,
        stop: StopEvent | None = None,
        *,
        fresh: bool = False,
    ) -> Message:
        answer = self._await_reply(request_id, start, timeout, stop=stop, fresh=fresh)
        if answer is None and stop is not None and stop.is_set():
            raise NoReply(f"stopped waiting for {to}'s answer: it comes to the inbox")
        if answer is None:
            raise NoReply(
                f"{to} did not answer within {timeout:g} s; ask again, or delegate work "
                "that takes longer"
            )
        return answer

    def _asked_before(self, request_id: str, to: str, timeout: float) -> Message | None:
        """The reply to my request ``request_id`` if I sent it before (waiting for it if
        it has not come yet); None when I never sent it."""
        asked = False
        for message in self._indexed(f"thread+{request_id}", 1 << 62):
            if message.type == MessageType.REPLY and message.reply_to == request_id:
                self._consume_if_mine(message)
                return message
            asked = asked or (message.id == request_id and message.from_agent == self.agent)
        if not asked:
            return None
        # Not answered when the thread was read: the reply is unconsumed mail, at or above
        # my cursor's floor (a reply consumed by a run that died is in the thread above).
        return self._answer_of(request_id, to, self._store.load_cursor(self.agent).floor,
                               timeout)  # fmt: skip

    def _require_online(self, agent: str) -> str:
        """`AgentOffline` unless ``agent`` is online or sleeping (a request wakes it);
        return the ``until`` of its sleep, or ""."""
        from ralph_mail.govern import presence

        state, last_seen, until = presence.presence_of(self._team, agent)
        if state == "offline":
            seen = f"last seen {last_seen}" if last_seen else "never seen"
            raise AgentOffline(
                f"{agent} is offline ({seen}): start it, or send a note it reads later"
            )
        return until

    def ack(self, message: Message) -> Message:
        """Acknowledge ``message`` to its sender (reading never does).

        Example:
            >>> bus.ack(message)  # doctest: +SKIP
        """
        sent = self._send(message.from_agent, MessageType.ACK, "", None, message.id, None,
                          message.thread)  # fmt: skip
        return sent

    def pending_acks(self, older_than: float | None = None) -> list[Message]:
        """What I sent with ``ack=True`` that no ack has answered yet, oldest first (with
        ``older_than``: only those sent more than that many seconds ago). It survives
        restarts: it is read from the team's index, not kept in memory.

        Example:
            >>> [m.id for m in bus.pending_acks(older_than=300)]  # doctest: +SKIP
        """
        wanted = self._indexed(f"acks+{self.agent}", 1 << 62)
        acked = {m.reply_to for m in self._indexed(f"acked+{self.agent}", 1 << 62)}
        cutoff = None
        if older_than is not None:
            cutoff = format_ts(int((time.time() - older_than) * 1_000_000))
        return [m for m in wanted if m.id not in acked and (cutoff is None or m.ts <= cutoff)]

    def _loop_guard(
        self, thread: str, visibility: str | None, in_thread: list[Message] | None = None
    ) -> None:
        """`LoopGuard` when the thread's last messages are all internal, as many as the
        team's ``max_internal_exchanges``, and this one is internal too (``in_thread``:
        the thread's messages, read by the caller)."""
        if visibility == "user_visible":
            return
        limit = settings.team_setting("max_internal_exchanges", dict(self._team.config))
        if limit == 0:
            return
        if in_thread is None:
            in_thread = self._indexed(f"thread+{thread}", limit)
        recent = in_thread[-limit:]
        if len(recent) >= limit and all(m.visibility != "user_visible" for m in recent):
            raise LoopGuard(
                f"thread {thread} carried {limit} internal messages in a row: stop and "
                "answer the user (--visibility user_visible), or start a new thread"
            )

    def wait_for_result(self, task: Task, timeout: float, since: int = 0) -> Message | None:
        """Block until the ``task_result`` of ``task`` (one I delegated) is in my inbox
        from logical offset ``since`` on (``store.size(me)`` before delegating); consume
        it alone when this process may. None after ``timeout`` seconds.

        Example:
            >>> since = bus.store.size(bus.agent)                        # doctest: +SKIP
            >>> task = bus.delegate("writer", "draft it")                # doctest: +SKIP
            >>> bus.wait_for_result(task, 600, since).content            # doctest: +SKIP
        """
        return self._await_reply(task.assignment, since, timeout, MessageType.TASK_RESULT)

    def _await_reply(
        self,
        request_id: str,
        start: int,
        timeout: float,
        kind: MessageType = MessageType.REPLY,
        *,
        stop: StopEvent | None = None,
        fresh: bool = False,
    ) -> Message | None:
        """Read my inbox from ``start`` (without consuming) until the ``kind`` answering
        ``request_id`` comes; consume it alone when this process may. ``fresh``: asked
        just now, so the answer comes after this thread's waiter last woke (which wakes
        for it): the wait comes before the first read."""
        deadline = time.monotonic() + timeout
        offset = start
        # One waiter per thread, kept for the bus's life: closing an inotify descriptor
        # can take the kernel milliseconds, which a waiter per ask paid every time.
        waiter: Waiter | None = getattr(self._ask_local, "waiter", None)
        if fresh and waiter is not None:
            waiter.wait(min(timeout, WATCH_SAFETY_POLL_S), stop)
        while True:
            data, offset = self._store.read(self.agent, offset, skip_collected=True)
            if data:
                for message in decode_lines(data.split(b"\n")[:-1])[0]:
                    if (
                        isinstance(message, Message)
                        and message.reply_to == request_id
                        and message.type == kind
                    ):
                        self._consume_if_mine(message)
                        return message
                offset += len(data)
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (stop is not None and stop.is_set()):
                return None
            if waiter is None:
                waiter = self._ask_local.waiter = self._store.waiter([self.agent])
                with self._lock:
                    self._ask_waiters.append(waiter)
                continue  # read once more: the reply may have come while it started
            waiter.wait(min(remaining, WATCH_SAFETY_POLL_S), stop)

    def _consume_if_mine(self, message: Message) -> None:
        # The reply belongs to this ask: consume it when this process consumes my inbox
        # (or may start to); under another consumer (a runner) it is left to that one,
        # which starts nothing for a reply.
        with self._lock:
            try:
                for _, pending in self._refresh(until=message):
                    if pending.id == message.id and pending.ts == message.ts:
                        self.consume(pending)
                        return
            except InboxBusy:
                self._cursor = None

    def broadcast(
        self,
        content: str,
        metadata: Mapping[str, str] | None = None,
        *,
        type: MessageType | str = MessageType.BROADCAST,
        id: str | None = None,
        priority: str | None = None,
        ack: bool = False,
        visibility: str | None = None,
    ) -> Message:
        """Append one message (one id) to every member's inbox but the sender's.

        Each inbox gets the line with the ts taken under its own lock; the message
        returned carries the last of them. If an inbox cannot be written, `BroadcastError`
        names the inboxes that did and did not receive it.
        """
        envelope = self._envelope(BROADCAST_ADDRESS, type, content, metadata, None, id)
        _extend(envelope, None, priority, ack, visibility)
        head, tail = encode_parts(envelope, self.max_message_bytes)
        if _check_of(type) != "none":
            others = [name for name in self.refresh_team().names if name != self.agent]
            reason = self._govern(others, _check_of(type))
            if reason:
                return self._hold(envelope, reason)
        self._touch()
        delivered: list[str] = []
        failed: list[str] = []
        reason = ""
        for member in self.refresh_team().names:
            if member == self.agent:
                continue
            try:
                envelope["ts"], _ = self._store.append(member, head, tail)
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
            "type": str(check_type(type)),
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
            self._store.claim(self.agent)  # one consumer per inbox: InboxBusy otherwise
            self._cursor = self._store.load_cursor(self.agent)
            self._scanned = self._cursor.floor
            self._pending = deque()
        return self._cursor

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
            if self._touch():
                self._release_held()
            while True:
                data, offset = self._store.read(self.agent, self._scanned)
                if offset < self._scanned:
                    cursor = self._restart(offset)
                if not data:
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
        if self._gc_auto and self._store.collectable(self.agent, floor) >= self._gc_auto:
            # Not now: a compaction interrupted here would make a call that has consumed
            # raise. The next read runs it, before it reads anything.
            self._compact_due = True

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

    def peek(self) -> list[Message]:
        """The unconsumed messages of my inbox, oldest first, without consuming them.

        Follow with `commit` once they are handled, for at-least-once delivery.
        """
        with self._lock:
            return [message for _, message in self._refresh()]

    def poll(self) -> list[Message]:
        """Consume and return the unconsumed messages of my inbox, oldest first.

        A poll that raises consumes nothing.
        """
        with self._lock:
            messages = [message for _, message in self._refresh(starts=False)]
            if messages or self._scanned != self._load().floor:
                try:
                    self._save(self._scanned)
                except BaseException:
                    self._cursor = None  # re-read from the cursor on disk: nothing consumed
                    raise
                self._pending.clear()
            return messages

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

    def _first(self, type: MessageType | str, consume: bool) -> Message | None:
        """The first unconsumed message of ``type`` (consumed alone with ``consume``)."""
        with self._lock:
            for _, message in self._refresh():
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

    def _wait(self, attempt: Callable[[], _T], timeout: float | None, stop: StopEvent | None) -> _T:
        found = attempt()
        if found or timeout == 0:
            return found
        deadline = None if timeout is None else time.monotonic() + timeout
        look = self._watcher is None  # a watcher made now missed what came before it
        watcher = self._watch()
        while True:
            if look:  # (one that was there already is woken by it: no second read)
                found = attempt()
                if found or (stop is not None and stop.is_set()):
                    return found
            look = True
            remaining = WATCH_SAFETY_POLL_S
            if deadline is not None:
                remaining = min(remaining, deadline - time.monotonic())
                if remaining <= 0:
                    return found
            watcher.wait(remaining, stop)

    def _watch(self) -> Waiter:
        if self._watcher is None:
            self._watcher = self._store.waiter([self.agent])
        return self._watcher

    # -- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Release descriptors and stop the watcher; the bus can be used again after."""
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        with self._lock:
            for waiter in self._ask_waiters:
                waiter.close()
            self._ask_waiters.clear()
            self._ask_local = threading.local()
        self._cursor = None  # the next read claims the inbox again and starts from disk
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


#: How often one bus notes its agent as active (s); see ralph_mail.govern.presence.
_TOUCH_EVERY_S = 1.0
_POLICY_KEY = "policy"
_NO_POLICY = Policy()  # no policy saved: everything is allowed
_RATE_WINDOW_S = 60.0
#: Message types the policy never refuses nor holds: answers and the team protocols.
_EXEMPT = frozenset({
    MessageType.STATUS_UPDATE, MessageType.PLAN_SUBMISSION, MessageType.PLAN_APPROVAL,
    MessageType.SHUTDOWN_REQUEST, MessageType.SHUTDOWN_RESPONSE, MessageType.TASK_ASSIGNMENT,
    MessageType.TASK_RESULT, MessageType.ACK, MessageType.APPROVAL_REQUEST,
    MessageType.APPROVAL_RESPONSE,
})  # fmt: skip


_AGO = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(value: str | datetime) -> str:
    """A ts for ``value``: a datetime, an ISO-8601 time (UTC unless it says), or how
    long ago (``90s``, ``15m``, ``2h``, ``7d``)."""
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


def _not_text(value: object) -> str:
    raise InvalidMessage(f"the query must be text, not {value.__class__.__name__}")


def _check_of(type: MessageType | str) -> str:
    """What the policy checks of a message of ``type`` sent with `MessageBus.send`."""
    if type == MessageType.REPLY:
        return "reply"
    return "none" if type in _EXEMPT else "contact"


#: The team log of the assignments held for a sleeping agent: ``held.AGENT``.
_HELD = "held."

#: Types that start a thread of their own, indexed under their id for `thread`.
_THREAD_STARTERS = frozenset({MessageType.REQUEST, MessageType.TASK_ASSIGNMENT})


def _pair_key(a: str, b: str) -> str:
    return "pair+" + "+".join(sorted((a, b)))


def _extend(
    envelope: dict[str, object],
    thread: str | None,
    priority: str | None,
    ack: bool,
    visibility: str | None,
    chain: tuple[str, ...] = (),
) -> None:
    """Add the optional envelope keys that differ from their defaults, before ``ts``."""
    del envelope["ts"]
    if thread is not None and check_id(thread, "thread") != envelope["id"]:
        envelope["thread"] = thread
    if priority is not None and check_priority(priority) != "normal":
        envelope["priority"] = priority
    if ack is True:
        envelope["ack"] = True
    elif ack is not False:
        raise InvalidMessage(f"invalid ack {ack!r}: pass True or False")
    if visibility is not None and check_visibility(visibility) != "internal":
        envelope["visibility"] = visibility
    if chain:
        envelope["chain"] = list(chain)
    envelope["ts"] = ""


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
