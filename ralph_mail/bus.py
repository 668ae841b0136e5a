"""`MessageBus`: the contract facade (DESIGN §5, §8-10) over a `Mailbox` and its rooms.

Each method here says what it promises and hands the work to the room that owns it:
``talk/`` (ask, tasks, channels, history) and ``govern/`` (the Gate, policy, approvals,
presence). The core it extends, `ralph_mail.mailbox.Mailbox`, sends, reads and waits;
every write it makes passes the Gate.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ralph_mail.govern.gate import Gate
from ralph_mail.mailbox import Mailbox
from ralph_mail.message import Message, MessageType

if TYPE_CHECKING:
    from datetime import datetime

    from ralph_mail.govern import approvals, policy, presence
    from ralph_mail.govern.approvals import Held
    from ralph_mail.govern.policy import Policy
    from ralph_mail.govern.presence import AgentInfo
    from ralph_mail.store.base import StopEvent
    from ralph_mail.talk import ask, history, receipts, tasks
    from ralph_mail.talk.channels import Channels
    from ralph_mail.talk.receipts import Receipt
    from ralph_mail.talk.tasks import Task
    from ralph_mail.team import Team
else:  # the rooms load on first use: a send from a shell loop pays for none of them

    class _Room:
        # A plain import at the first attribute read (one that fails, a Ctrl-C in it,
        # leaves nothing half-made, as importlib's LazyLoader would), then kept.
        def __init__(self, name: str) -> None:
            self._name, self._module = f"ralph_mail.{name}", None

        def __getattr__(self, attribute: str) -> object:
            if self._module is None:
                from importlib import import_module

                self._module = import_module(self._name)  # type: ignore[assignment]
            return getattr(self._module, attribute)

    rooms = ("govern.approvals", "govern.policy", "govern.presence", "talk.ask", "talk.history",
             "talk.receipts", "talk.tasks")  # fmt: skip
    approvals, policy, presence, ask, history, receipts, tasks = map(_Room, rooms)


class MessageBus(Mailbox):
    """One agent of one team: send to teammates, and consume its own inbox.

    Sends are appended under the recipient's inbox lock, after the team's Gate passed
    them; reads start from the persisted cursor; waits block on file events.

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
        default_rate: messages per minute this agent may start when the policy sets no
            rate for it (None: no limit; ``run`` and the MCP server pass 10).
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
        super().__init__(team, agent, home, gate=lambda box: Gate(box, default_rate),
                         durable=durable, max_message_bytes=max_message_bytes,
                         backend=backend)  # fmt: skip
        self.gate: Gate
        self._channels: Channels | None = None
        self._look_at = 0.0  # when a read next looks for my delegations' lapsed leases

    @property
    def default_rate(self) -> int | None:
        """Messages per minute my agent may start when the policy sets no rate for it."""
        return self.gate.default_rate

    # -- sending --------------------------------------------------------------------------

    def send(self, to: str, type: MessageType | str, content: str,
             metadata: Mapping[str, str] | None = None, *, reply_to: str | None = None,
             id: str | None = None, thread: str | None = None, priority: str | None = None,
             ack: bool = False, visibility: str | None = None) -> Message:  # fmt: skip
        """Append one message to ``to``'s inbox; return it as written.

        When this returns, the message is in the file (and on disk in durable mode); when
        it raises, nothing a reader would deliver was written. ``id``: retry a send under
        the same id. ``thread``, ``priority``, ``ack`` and ``visibility`` set those
        envelope keys. A message the policy holds for approval is returned with no ``ts``.

        Example:
            >>> bus.send("lead", MessageType.TEXT, "retry me", id="9f1c2e3d4b5a")  # doctest: +SKIP
        """
        return self._send(to, type, content, metadata, reply_to, id, thread, priority, ack,
                          visibility)  # fmt: skip

    # -- receipts -------------------------------------------------------------------------

    def receipts(self, message: Message | str) -> list[Receipt]:
        """What became of ``message`` (or of my message with that id) at each recipient, a
        broadcast's one by one: held, denied, stored, consumed, acked or answered.

        Example:
            >>> [(r.to, r.state) for r in bus.receipts(message)]  # doctest: +SKIP
        """
        return receipts.receipts(self, message)

    def receipt(self, message: Message | str, to: str | None = None) -> Receipt:
        """The receipt of ``message`` at ``to``, by default its only recipient."""
        return receipts.receipt(self, message, to)

    def wait_consumed(self, message: Message | str, timeout: float) -> bool:
        """Block until every recipient consumed ``message``; False after ``timeout`` s."""
        return receipts.wait_consumed(self, message, timeout)

    # -- governance -----------------------------------------------------------------------

    def policy(self) -> Policy:
        """The team's policy now (read again only when it changed). A policy that cannot
        be read or parsed raises `PermissionDenied` naming it: it fails closed."""
        return self.gate.policy()

    def change_policy(self, change: Callable[[Policy], Policy]) -> Policy:
        """Replace the team's policy with ``change(policy)``, with no other change in
        between; the lead's alone (`PermissionDenied` for anyone else).

        Example:
            >>> lead.change_policy(lambda p: p.with_rule(Rule("*", "x", "deny")))  # doctest: +SKIP
        """
        self.gate.require_lead("changing the team's policy")
        return policy.change(self.store, change)

    def set_member(self, agent: str, *, description: str | None = None,
                   manager: str | None = None, mode: str | None = None) -> Team:  # fmt: skip
        """Change a member's description, manager (``""`` clears it) or mode; a manager,
        a mode or another's description is the lead's to change (`PermissionDenied`)."""
        return policy.set_member(self, agent, description, manager, mode)

    def approvals(self) -> list[Held]:
        """The messages held for my approval and not decided yet, oldest first."""
        return approvals.waiting(self)

    def approval_of(self, message_id: str) -> Held | None:
        """What became of a held message (`Held.decision` None: waiting), or None."""
        return approvals.approval_of(self, message_id)

    def approve(self, message_id: str) -> Held:
        """Deliver a message held for my approval, unchanged (same id), and tell its
        sender. Run again after a crash, it delivers it only if it is not there yet."""
        return approvals.decide(self, message_id, True, "")

    def deny(self, message_id: str, reason: str = "") -> Held:
        """Refuse a message held for my approval: never delivered; its sender is told (an
        ``approval_response``, ``metadata.approved=false``)."""
        return approvals.decide(self, message_id, False, reason)

    def wait_for_decision(self, message_id: str, since: int, timeout: float) -> bool | None:
        """Wait up to ``timeout`` s for the decision on my held message: True approved
        (and delivered), False denied, None not yet. ``since``: my inbox's end before."""
        return approvals.wait_for_decision(self, message_id, since, timeout)

    # -- presence -------------------------------------------------------------------------

    def set_presence(self, state: str, until: str | datetime | None = None) -> None:
        """Say what my agent is doing: ``idle``, ``working``, ``sleeping`` (until
        ``until``: an ISO-8601 time, a datetime or ``+DURATION``), ``awaiting_approval``
        or ``awaiting_delegation``.

        Example:
            >>> bus.set_presence("sleeping", until="+15m")  # doctest: +SKIP
        """
        presence.set_presence(self, state, until)

    def agents(self, include_self: bool = False) -> list[AgentInfo]:
        """The teammates (and me, with ``include_self``) with their presence.

        Example:
            >>> [(a.name, a.presence) for a in bus.agents()]  # doctest: +SKIP
            [('lead', 'idle'), ('writer', 'offline')]
        """
        return presence.agents(self.refresh_team(), self.agent, include_self)

    # -- history and search ---------------------------------------------------------------

    def history(self, with_agent: str, limit: int = 20) -> list[Message]:
        """The last ``limit`` messages between me and ``with_agent``, both directions,
        oldest first. Costs O(limit), however much else the team's inboxes hold.

        Example:
            >>> [m.content for m in bus.history("analyst", 5)]  # doctest: +SKIP
        """
        return history.history(self, with_agent, limit)

    def thread(self, thread_id: str) -> list[Message]:
        """Every message of thread ``thread_id`` (its first message and what answered
        it, in that thread), in order.

        Example:
            >>> [m.type for m in bus.thread(question.id)]  # doctest: +SKIP
            ['request', 'reply']
        """
        return history.thread(self, thread_id)

    def search(self, query: str = "", *, from_agent: str | None = None, to: str | None = None,
               type: MessageType | str | None = None, thread: str | None = None,
               since: str | datetime | None = None, limit: int = 20) -> list[Message]:  # fmt: skip
        """Every message ever sent in the team (the audit trail: inboxes, and what gc
        archived) that has all the words of ``query`` and passes the filters, newest
        first. ``since``: an ISO-8601 time, a datetime, or how long ago (``90s``,
        ``15m``, ``2h``, ``7d``).

        Example:
            >>> [m.content for m in bus.search("revenue", from_agent="analyst")]  # doctest: +SKIP
        """
        return history.search(self, query, from_agent=from_agent, to=to, type=type,
                              thread=thread, since=since, limit=limit)  # fmt: skip

    def purge_archive(self, before: str | datetime) -> dict[str, int]:
        """Delete for good the archived messages older than ``before`` (as ``since`` in
        `search`); return where each inbox's audit trail starts now."""
        return history.purge_archive(self, before)

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
        """Consume the posts of channel ``name`` I have not read (not mine), oldest first."""
        return self.channels.read(name)

    def channel_history(self, name: str, limit: int = 20) -> list[Message]:
        """The last ``limit`` posts of channel ``name``, oldest first (like `history`)."""
        return self.channels.history(name, limit)

    # -- delegation -----------------------------------------------------------------------

    def delegate(self, to: str, description: str, *, context: str | None = None,
                 priority: str | None = None, parent: str | None = None, id: str | None = None,
                 visibility: str | None = None,
                 deadline: str | datetime | float | None = None) -> Task:  # fmt: skip
        """Give ``to`` a task: record it in the team's task tree and send it a
        ``task_assignment``; return at once. Its outcome comes back as a ``task_result``.
        ``deadline`` (``"10m"``, seconds, an ISO-8601 time, a datetime; capped at the
        parent's): past it the task fails, and its open subtasks are canceled.

        Refused before anything is written: delegating to myself, to an offline agent
        (`AgentOffline`), a bad id, priority or deadline, what the Gate refuses. The same
        ``id`` again (a retry) sends the same assignment again. A sleeping assignee gets
        it when its sleep ends, once, by its own next read.

        Example:
            >>> task = bus.delegate("writer", "Draft the Q4 post", deadline="2h")  # doctest: +SKIP
        """
        return tasks.delegate(self, to, description, context=context, priority=priority,
                              parent=parent, id=id, visibility=visibility,
                              deadline=deadline)  # fmt: skip

    def start(self, task_id: str) -> Task:
        """Mark my task ``task_id`` working, with a lease (the team's ``task_lease``)."""
        return tasks.start(self, task_id)

    def heartbeat(self, task_id: str) -> Task:
        """Renew the lease of my task ``task_id`` (starting it); `TaskEnded` once it ended."""
        return tasks.heartbeat(self, task_id)

    def complete(self, task_id: str, result: str, metadata: dict[str, str] | None = None) -> Task:
        """Record my task ``task_id`` as completed and send its delegator the result (a
        ``task_result``, the callback, with ``metadata``), once, even when run again after a
        crash. After the task ended (canceled) the result is kept as late: `TaskEnded`."""
        return tasks.finish(self, task_id, "completed", result, metadata)

    def fail(self, task_id: str, error: str, metadata: dict[str, str] | None = None) -> Task:
        """Record my task ``task_id`` as failed and send its delegator the error."""
        return tasks.finish(self, task_id, "failed", error, metadata)

    def reject(self, task_id: str, reason: str, metadata: dict[str, str] | None = None) -> Task:
        """Refuse my task ``task_id`` (``rejected``); its delegator gets the reason."""
        return tasks.finish(self, task_id, "rejected", reason, metadata)

    def cancel(self, task_id: str, reason: str = "") -> Task:
        """Cancel ``task_id`` (one I gave out, or any as the lead) and every open task
        below it; each assignee gets a ``task_canceled`` (a ``ralph-mail run`` job on it is
        killed), and a result after it is kept as late. `TaskEnded` when a result came first."""
        return tasks.cancel(self, task_id, reason)

    def reassign(self, task_id: str, to: str) -> Task:
        """Give ``task_id`` (as `cancel` may) to ``to`` instead: a new assignment for ``to``,
        a ``task_canceled`` for the old assignee, whose result is then refused."""
        return tasks.reassign(self, task_id, to)

    def tasks(self) -> list[Task]:
        """The team's tasks, parents first, each followed by its subtasks."""
        return tasks.ordered(tasks.load(self.store)[0])

    def wait_for_result(self, task: Task, timeout: float, since: int = 0) -> Message | None:
        """Block until the ``task_result`` of ``task`` (one I delegated) is in my inbox from
        offset ``since`` on (``store.size(me)`` before delegating); consume it alone when
        this process may. None after ``timeout`` seconds, or once the task ended with no
        result to come (canceled, its deadline passed: see `tasks`)."""
        return tasks.wait_for_result(self, task, timeout, since)

    def _before_read(self) -> None:
        self._look_at = tasks.before_read(self, self._look_at)

    # -- conversations --------------------------------------------------------------------

    def reply(self, message: Message, content: str, metadata: Mapping[str, str] | None = None,
              *, priority: str | None = None, ack: bool = False,
              visibility: str | None = None) -> Message:  # fmt: skip
        """Answer ``message`` (any message, not only a request) with a ``reply`` to its
        sender, in its thread.

        A request gets one reply from me: replying to it again (a responder killed after
        replying and run again on the same request) sends nothing and returns the reply
        already sent.

        Example:
            >>> bus.reply(question, "Q4 revenue was $2.4M")  # doctest: +SKIP
        """
        return ask.reply(self, message, content, metadata, priority=priority, ack=ack,
                         visibility=visibility)  # fmt: skip

    def ask(self, to: str, question: str, *, context: str | None = None,
            timeout: float = 120.0, priority: str | None = None,
            metadata: Mapping[str, str] | None = None, id: str | None = None,
            visibility: str | None = None, stop: StopEvent | None = None) -> Message:  # fmt: skip
        """Send ``to`` a ``request`` and block until its ``reply`` arrives; return the reply.

        Only that reply, from the agent asked, is consumed (when this process may consume
        my inbox); every other message stays unread, and a `poll` in another thread of
        this process leaves it to the ask. The request carries the chain of agents it
        passed through (``RALPH_CHAIN`` of the request being handled, plus me), and is
        refused before anything is written when it would exceed the team's ``max_depth``
        (`DepthLimit`), or when it asks myself. No reply within ``timeout`` seconds:
        `NoReply`; a reply that comes later is then mail like any other.

        ``stop`` (an event, such as a cancelled MCP call's) ends the wait early: `NoReply`.
        ``id`` names the request: an asker killed while it waited, run again with the same
        ``id``, gets the reply and does not ask again.

        Example:
            >>> bus.ask("analyst", "Q4 revenue?", context="investor update")  # doctest: +SKIP
        """
        return ask.ask(self, to, question, context=context, timeout=timeout,
                       priority=priority, metadata=metadata, id=id, visibility=visibility,
                       stop=stop)  # fmt: skip

    def ack(self, message: Message) -> Message:
        """Acknowledge ``message`` to its sender (reading never does)."""
        return ask.acknowledge(self, message)

    def pending_acks(self, older_than: float | None = None) -> list[Message]:
        """What I sent with ``ack=True`` that no ack has answered yet, oldest first (with
        ``older_than``: only those older than that many seconds), read from the team's
        index, so it survives restarts.

        Example:
            >>> [m.id for m in bus.pending_acks(older_than=300)]  # doctest: +SKIP
        """
        return ask.pending_acks(self, older_than)
