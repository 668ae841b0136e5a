"""`TeamOrchestrator`: the lead's side of the team protocols.

The lead blocks on its inbox (file events, no fixed-interval polling) and dispatches each
message by type through `TeamOrchestrator.handlers`, a table users can extend: status
updates feed the per-agent `progress`, plan submissions go through a review policy and
are answered, shutdown responses feed the shutdown protocols.

Delivery is at-least-once and handling is idempotent. For each message the lead peeks,
handles, records the message's id in its state file, then commits its cursor. (A message
that got no reply is recorded with the rest of its batch instead: handling it again would
change nothing outside the lead, and a flood of status updates then costs no fsync each.)

* killed before the commit, the message comes again and its recorded id makes it a no-op;
* killed after replying but before recording, the message comes again and the reply is
  *derived*: its id depends only on the lead and the message answered
  (`protocols.derived_id`), and the first message handled after a start looks for that id
  in the recipient's inbox before sending, so the reply is not sent twice.

The lead's state (`ralph_mail.orchestrator.state`) holds the recently handled ids, the
replies sent and the agents' progress, and the store replaces it atomically.

Example:
    >>> orch = TeamOrchestrator("demo", review_plan=lambda p: (True, "go ahead"))  # doctest: +SKIP
    >>> orch.assign("worker-1", "T-1", "parse the logs")  # doctest: +SKIP
    >>> orch.run(until=lambda o: o.all_done(), timeout=600)  # doctest: +SKIP
    >>> orch.progress["worker-1"].state  # doctest: +SKIP
    'done'
    >>> orch.request_shutdown(timeout=30).ok  # doctest: +SKIP
    True
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from types import TracebackType

from ralph_mail import protocols
from ralph_mail.bus import MessageBus
from ralph_mail.errors import InvalidMessage, MailError, ProtocolError
from ralph_mail.message import Message, MessageType, check_name, format_ts, parse_ts
from ralph_mail.orchestrator.records import (
    AgentProgress,
    Event,
    EventKind,
    Handler,
    Plan,
    PlanReviewer,
    ShutdownReport,
)
from ralph_mail.orchestrator.review import approve_all
from ralph_mail.orchestrator.shutdown import ShutdownRound
from ralph_mail.orchestrator.state import load_state, save_state, state_key
from ralph_mail.settings import (
    ACK_CHECK_S,
    ACK_OVERDUE_S,
    HANDLED_IDS_KEPT,
    SHUTDOWN_RETRY_S,
    SHUTDOWN_TIMEOUT_S,
)
from ralph_mail.store.base import StopEvent
from ralph_mail.talk import tasks
from ralph_mail.team import load_team


class TeamOrchestrator:
    """The team lead: runs the protocols over the lead's inbox.

    Not thread-safe: one thread runs it (handlers run on that thread too).

    Example:
        >>> orch = TeamOrchestrator("demo", review_plan=lambda p: (True, "ok"))  # doctest: +SKIP
        >>> orch.assign("worker-1", "T-1", "parse the logs")  # doctest: +SKIP
        >>> orch.run(until=lambda o: o.all_done(), timeout=600)  # doctest: +SKIP
        True
        >>> report = orch.request_shutdown(timeout=30)  # doctest: +SKIP
        >>> report.accepted, report.refused, report.no_answer  # doctest: +SKIP
        (('worker-1',), (), ())

    Extend the handler table to act on other messages:

        >>> def show(m): print(m.from_agent, m.content)  # doctest: +SKIP
        >>> orch.handlers[MessageType.TEXT] = show  # doctest: +SKIP

    Args:
        team: the team's name; it must exist.
        home: the mailbox home (default ``$RALPH_HOME`` or ``~/.ralph``).
        agent: the lead's agent name (default: the roster's lead).
        review_plan: the plan review policy (default `approve_all`).
        on_event: called with every `Event` (for a display or a log).
        durable: fsync each send (default ``$RALPH_DURABLE``, else off).
        ack_overdue: report each message the lead sent with ``ack=True`` that is still
            unacknowledged after this many seconds as an ``ack_overdue`` event, once,
            while the loop runs; None: never.
    """

    def __init__(
        self,
        team: str,
        home: str | os.PathLike[str] | None = None,
        *,
        agent: str | None = None,
        review_plan: PlanReviewer | None = None,
        on_event: Callable[[Event], None] | None = None,
        durable: bool | None = None,
        ack_overdue: float | None = ACK_OVERDUE_S,
    ) -> None:
        if ack_overdue is not None and not (
            isinstance(ack_overdue, (int, float)) and 0 <= ack_overdue < float("inf")
        ):
            raise InvalidMessage(
                f"invalid ack_overdue {ack_overdue!r}: give a number of seconds >= 0, or None"
            )
        lead = agent if agent is not None else load_team(team, home).lead
        self.bus = MessageBus(team, lead, home, durable=durable)
        self.agent = self.bus.agent
        self.review_plan: PlanReviewer = review_plan or approve_all
        self.on_event = on_event
        self.handlers: dict[MessageType | str, Handler] = {
            MessageType.STATUS_UPDATE: self._on_status,
            MessageType.PLAN_SUBMISSION: self._on_plan,
            MessageType.SHUTDOWN_RESPONSE: self._on_shutdown_response,
            MessageType.TEXT: self._on_text,
            MessageType.BROADCAST: self._on_text,
            MessageType.TASK_RESULT: self._on_task_result,
            MessageType.TASK_STALLED: self._on_task_notice,
            MessageType.TASK_CANCELED: self._on_task_notice,
            "budget_exceeded": self._on_budget,
        }
        self.progress: dict[str, AgentProgress] = {
            name: AgentProgress(name) for name in self.teammates
        }
        self._state_key = state_key(self.agent)
        self._handled: dict[str, None] = {}  # insertion-ordered set of "sender:id" keys
        # The replies sent: id -> where the recipient's inbox ended, recorded *before* the
        # reply is sent. A lead killed and restarted looks for the id from there on: it
        # sends the reply only if it is not there (never twice, and not lost either).
        self._sent: dict[str, int] = {}
        self._current: Message | None = None
        self._replies = 0
        self._busy = False
        self._unsaved = False  # handled ids or progress not yet in the state file
        self._shutdown: ShutdownRound | None = None  # the round request_shutdown runs
        self.ack_overdue = ack_overdue
        self._overdue: set[str] = set()  # ids already reported as ack_overdue
        self._acks_next = 0.0  # monotonic time of the next look at the pending acks
        try:
            self._load_state()
        except BaseException:
            self.bus.close()
            raise

    # -- who ----------------------------------------------------------------------------

    @property
    def teammates(self) -> tuple[str, ...]:
        """Every member but the lead, in roster order."""
        return tuple(name for name in self.bus.team.names if name != self.agent)

    def all_done(self) -> bool:
        """Whether every teammate's last reported state is done or failed."""
        return all(
            self.progress.get(name, AgentProgress(name)).state in protocols.FINISHED_STATES
            for name in self.teammates
        )

    def check_teammate(self, agent: str) -> str:
        """Return ``agent`` if it is a teammate; `UnknownAgent` naming the members, or
        `InvalidMessage` for the lead itself, otherwise."""
        check_name(agent, "agent name")
        if agent == self.agent:
            raise InvalidMessage(f"{agent!r} is the lead itself: name a teammate")
        if agent not in self.bus.team.names and agent not in self.bus.refresh_team().names:
            self.bus.team.member(agent)  # raises UnknownAgent naming the members
        return agent

    # -- the loop -------------------------------------------------------------------------

    def run(
        self,
        until: Callable[[TeamOrchestrator], bool] | None = None,
        timeout: float | None = None,
        *,
        stop: StopEvent | None = None,
    ) -> bool:
        """Handle messages as they come until ``until(self)`` holds; return whether it did.

        Blocks on the lead's inbox between messages. Returns False after ``timeout``
        seconds (None: no limit) or when ``stop`` (a `threading.Event`) is set.

        Example:
            >>> orch.run(until=lambda o: o.all_done(), timeout=600)  # doctest: +SKIP
            True
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._serve(lambda: until is not None and until(self), deadline, stop)

    def handle_pending(self) -> int:
        """Handle the messages waiting in the lead's inbox now, without blocking.

        Returns how many messages were taken (duplicates included).
        """
        self._not_in_a_handler()
        self._busy = True
        try:
            taken = 0
            for message in self.bus.peek():
                self._handle(message)
                self.bus.commit(message)
                taken += 1
            return taken
        finally:
            self._busy = False
            if self._unsaved:
                self._save_state()

    def _not_in_a_handler(self) -> None:
        if self._busy:
            raise MailError(
                "TeamOrchestrator is already handling a message: a handler must not run "
                "the loop (run, handle_pending, request_shutdown) again"
            )

    def _serve(
        self,
        done: Callable[[], bool],
        deadline: float | None,
        stop: StopEvent | None,
        tick: Callable[[], float | None] | None = None,
    ) -> bool:
        while True:
            self.handle_pending()
            if done():
                return True
            if stop is not None and stop.is_set():
                return False
            wake = tick() if tick is not None else None
            acks = self._check_acks()
            if acks is not None:
                wake = acks if wake is None else min(wake, acks)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            limit = deadline if wake is None else wake if deadline is None else min(wake, deadline)
            timeout = None if limit is None else max(0.0, limit - now)
            self.bus.wait_for_messages(timeout, stop=stop, consume=False)

    def _check_acks(self) -> float | None:
        """Report the lead's messages unacknowledged for ``ack_overdue`` seconds, each
        once; return when to look again (monotonic), or None when not looking."""
        if self.ack_overdue is None:
            return None
        now = time.monotonic()
        if now < self._acks_next:
            return self._acks_next
        wall = time.time()
        cutoff = format_ts(int((wall - self.ack_overdue) * 1_000_000))
        earliest = None
        for message in self.bus.pending_acks():
            if message.id in self._overdue:
                continue
            if message.ts <= cutoff:
                self._overdue.add(message.id)
                first = message.content.partition("\n")[0]
                self._emit(
                    EventKind.ACK_OVERDUE,
                    message.to_agent,
                    f"{message.id} not acknowledged after {self.ack_overdue:g} s: {first}",
                    message,
                )
            elif earliest is None or message.ts < earliest:
                earliest = message.ts
        self._acks_next = now + ACK_CHECK_S
        if earliest is not None:
            due = parse_ts(earliest) + self.ack_overdue - wall
            self._acks_next = now + max(ACK_CHECK_S, due)
        return self._acks_next

    def _handle(self, message: Message) -> None:
        key = f"{message.from_agent}:{message.id}"
        if key in self._handled:
            self._emit(EventKind.DUPLICATE, message.from_agent, f"{message.id} again", message)
            return
        known = self.progress.get(message.from_agent)
        if known is not None:
            self.progress[message.from_agent] = replace(known, last_seen=message.ts)
        self._current, self._replies = message, 0
        try:
            handler = self.handlers.get(message.type, self._on_unexpected)
            try:
                handler(message)
            except ProtocolError as exc:
                self._refuse(message, str(exc))
            except MailError as exc:
                self._emit(EventKind.ERROR, message.from_agent, str(exc), message)
            except Exception as exc:  # a faulty user handler must not take the lead down
                self._emit(
                    EventKind.ERROR,
                    message.from_agent,
                    f"handler for {message.type} {message.id} failed: "
                    f"{exc.__class__.__name__}: {exc}",
                    message,
                )
        finally:
            self._current = None
        self._remember(key, now=self._replies > 0)

    def _refuse(self, message: Message, reason: str) -> None:
        self._emit(EventKind.ERROR, message.from_agent, reason, message)
        try:
            self.reply(message, MessageType.TEXT, f"error: {reason}", {protocols.ERROR: "protocol"})
        except MailError as exc:  # e.g. the sender left the team: nobody to tell
            self._emit(EventKind.ERROR, message.from_agent, f"cannot answer: {exc}", message)

    # -- answering ------------------------------------------------------------------------

    def reply(
        self,
        message: Message,
        type: MessageType | str,
        content: str,
        metadata: Mapping[str, str] | None = None,
    ) -> Message | None:
        """Answer ``message`` (to its sender, with ``reply_to``); return what was sent.

        Inside a handler, the reply's id is derived from the message answered and saved
        in the lead's state before the reply is sent, so a lead restarted after a crash
        does not send a reply it already sent (then this returns None).

        Example:
            >>> def noted(m): orch.reply(m, "text", "noted")  # doctest: +SKIP
            >>> orch.handlers[MessageType.TEXT] = noted  # doctest: +SKIP
        """
        reply_id = None
        if message is self._current:
            key = f"{message.from_agent}:{message.id}"
            reply_id = protocols.derived_id(self.agent, key, str(self._replies))
            self._replies += 1
            recipient = message.from_agent
            if reply_id in self._sent:
                # Recorded by a run that died: sent, unless the recipient's inbox lacks it
                # (what gc collected there was consumed: then it was delivered).
                if self.bus.delivered(recipient, reply_id, self._sent[reply_id], collected=True):
                    return None
            else:
                self._sent[reply_id] = self.bus.store.size(recipient)
                while len(self._sent) > HANDLED_IDS_KEPT:
                    del self._sent[next(iter(self._sent))]
                self._save_state()
        return self.bus.send(
            message.from_agent, type, content, metadata, reply_to=message.id, id=reply_id
        )

    # -- default handlers -----------------------------------------------------------------

    def _on_status(self, message: Message) -> None:
        status = protocols.parse_status(message)
        agent = message.from_agent
        old = self.progress.get(agent, AgentProgress(agent))
        task = status.task or old.task
        progress = status.progress
        if progress is None and task == old.task:
            progress = old.progress
        self.progress[agent] = replace(
            old,
            state=status.state,
            task=task,
            progress=progress,
            text=message.content,
            last_seen=message.ts,
        )
        parts = [status.state, task, "" if progress is None else f"{progress:.0%}", message.content]
        self._emit(EventKind.STATUS, agent, " ".join(p for p in parts if p), message)
        if self._shutdown is not None and status.state in protocols.AVAILABLE_STATES:
            self._shutdown.available(agent)

    def _on_plan(self, message: Message) -> None:
        agent = message.from_agent
        task = message.metadata.get(protocols.TASK) or None
        if not message.content.strip():
            raise ProtocolError(
                f"plan_submission {message.id} from {agent} is empty: put the plan in the "
                "content ('ralph-mail plan submit PLAN')"
            )
        approved, feedback = self._review(Plan(agent, message.content, task, message))
        metadata = {protocols.APPROVED: "true" if approved else "false"}
        if task:
            metadata[protocols.TASK] = task
        self.reply(message, MessageType.PLAN_APPROVAL, feedback, metadata)
        old = self.progress.get(agent, AgentProgress(agent))
        self.progress[agent] = replace(
            old,
            plan="approved" if approved else "rejected",
            task=task or old.task,
            text=message.content,
            last_seen=message.ts,
        )
        kind = EventKind.PLAN_APPROVED if approved else EventKind.PLAN_REJECTED
        self._emit(kind, agent, f"{task + ': ' if task else ''}{feedback}", message)

    def _review(self, plan: Plan) -> tuple[bool, str]:
        try:
            verdict = self.review_plan(plan)
        except Exception as exc:  # a broken policy rejects, with the reason as feedback
            reason = f"plan review failed: {exc.__class__.__name__}: {exc}"
            self._emit(EventKind.ERROR, plan.agent, reason, plan.message)
            return False, reason
        if isinstance(verdict, tuple):
            approved, feedback = bool(verdict[0]), str(verdict[1])
        else:
            approved, feedback = bool(verdict), ""
        return approved, feedback or ("approved" if approved else "rejected")

    def _on_shutdown_response(self, message: Message) -> None:
        answer = protocols.parse_shutdown_response(message)
        agent = message.from_agent
        if answer.accepted:
            outcome, kind = "accepted", EventKind.SHUTDOWN_ACCEPTED
        elif answer.deferred:
            outcome, kind = "deferred", EventKind.SHUTDOWN_DEFERRED
        else:
            outcome, kind = "refused", EventKind.SHUTDOWN_REFUSED
        old = self.progress.get(agent, AgentProgress(agent))
        self.progress[agent] = replace(old, shutdown=outcome, last_seen=message.ts)
        self._emit(kind, agent, answer.reason or outcome, message)
        if self._shutdown is not None:
            self._shutdown.answer(agent, answer)

    def _on_task_result(self, message: Message) -> None:
        task = message.metadata.get(protocols.TASK_ID, "?")
        status = message.metadata.get("status", "completed")
        kind = EventKind.TASK_COMPLETED if status == "completed" else EventKind.TASK_FAILED
        said = message.content if status != "rejected" else f"rejected: {message.content}"
        self._emit(kind, message.from_agent, f"{task}: {said}", message)

    def _on_task_notice(self, message: Message) -> None:
        # A task the lead gave out stalled (its own reads tell it), or one given to the
        # lead was canceled: reported, for the program to reassign or stop.
        task = message.metadata.get(protocols.TASK_ID, "?")
        stalled = message.type == MessageType.TASK_STALLED
        kind = EventKind.TASK_STALLED if stalled else EventKind.TASK_CANCELED
        agent = message.metadata.get("assignee", message.from_agent) if stalled else ""
        self._emit(kind, agent or message.from_agent, f"{task}: {message.content}", message)

    def _on_budget(self, message: Message) -> None:
        self._emit(EventKind.BUDGET_EXCEEDED, message.from_agent, message.content, message)

    def _on_text(self, message: Message) -> None:
        agent = message.from_agent
        old = self.progress.get(agent)
        if old is not None:
            self.progress[agent] = replace(old, text=message.content, last_seen=message.ts)
        self._emit(EventKind.TEXT, agent, message.content, message)

    def _on_unexpected(self, message: Message) -> None:
        self._emit(
            EventKind.IGNORED,
            message.from_agent,
            f"{message.type} {message.id} is not for the lead; ignored",
            message,
        )

    # -- the lead's actions ---------------------------------------------------------------

    def assign(self, agent: str, task_id: str, description: str) -> Message:
        """Send ``agent`` a task assignment (``metadata.taskId``); return the message.

        Example:
            >>> orch.assign("worker-1", "T-1", "parse the logs")  # doctest: +SKIP
        """
        self.check_teammate(agent)
        protocols.check_task_id(task_id)
        # Recorded in the team's task tree too, as a delegation is, so one tree shows
        # everything given out; the agent need not be online yet (it reads it later).
        _, message = tasks.give(self.bus, agent, description, None, None, None, task_id,
                                strict=False)  # fmt: skip
        old = self.progress.get(agent, AgentProgress(agent))
        self.progress[agent] = replace(old, task=task_id, progress=None, plan="")
        self._emit(EventKind.ASSIGNED, agent, f"{task_id}: {description}", message)
        return message

    def request_shutdown(
        self,
        agents: Iterable[str] | None = None,
        reason: str = "the work is done",
        timeout: float = SHUTDOWN_TIMEOUT_S,
        *,
        retry_interval: float = SHUTDOWN_RETRY_S,
        stop: StopEvent | None = None,
        only_responses: bool = False,
    ) -> ShutdownReport:
        """Ask ``agents`` (default: every teammate) to shut down; collect their answers.

        An agent that defers ("finishing current task") is asked again when it reports
        idle, done or failed, and otherwise every ``retry_interval`` seconds, until
        ``timeout`` seconds have passed. Other mail is handled meanwhile, as `run` does;
        with ``only_responses`` only shutdown responses are consumed and the rest stays
        unread (for a lead that is not running its loop, such as a shell script).

        Example:
            >>> report = orch.request_shutdown(timeout=30)  # doctest: +SKIP
            >>> report.ok, dict(report)  # doctest: +SKIP
            (True, {'worker-1': True, 'worker-2': True})
        """
        self._not_in_a_handler()
        targets = list(dict.fromkeys(self.teammates if agents is None else agents))
        for agent in targets:
            self.check_teammate(agent)
        if not targets:
            return ShutdownReport({}, {})
        deadline = time.monotonic() + timeout
        shutdown = self._shutdown = ShutdownRound(targets, retry_interval)
        try:
            for agent in targets:
                self._ask(shutdown, agent, reason)

            def tick() -> float | None:
                return self._reask_due(shutdown, reason)

            if only_responses:
                self._collect_responses(shutdown.answered, deadline, stop, tick)
            else:
                self._serve(shutdown.answered, deadline, stop, tick)
            return self._report(shutdown)
        finally:
            self._shutdown = None

    def _ask(self, shutdown: ShutdownRound, agent: str, reason: str) -> None:
        request = self.bus.send(agent, MessageType.SHUTDOWN_REQUEST, reason)
        again = " again" if shutdown.asked(agent, request.id) else ""
        old = self.progress.get(agent, AgentProgress(agent))
        if old.shutdown != "deferred":
            self.progress[agent] = replace(old, shutdown="requested")
        self._emit(EventKind.SHUTDOWN_REQUESTED, agent, f"asked{again}: {reason}", request)

    def _reask_due(self, shutdown: ShutdownRound, reason: str) -> float | None:
        """Ask again every deferring agent whose turn has come; return the next turn."""
        ready, following = shutdown.due(time.monotonic())
        for agent in ready:
            self._ask(shutdown, agent, reason)
        return following

    def _collect_responses(
        self,
        answered: Callable[[], bool],
        deadline: float,
        stop: StopEvent | None,
        tick: Callable[[], float | None],
    ) -> None:
        while not answered():
            if stop is not None and stop.is_set():
                return
            wake = tick()
            if answered():
                return
            now = time.monotonic()
            if now >= deadline:
                return
            limit = deadline if wake is None else min(wake, deadline)
            message = self.bus.wait_for_message(
                MessageType.SHUTDOWN_RESPONSE, timeout=max(0.0, limit - now), stop=stop
            )
            if message is not None:
                self._handle(message)

    def _report(self, shutdown: ShutdownRound) -> ShutdownReport:
        report = shutdown.report()
        for agent in report.no_answer:
            old = self.progress.get(agent, AgentProgress(agent))
            self.progress[agent] = replace(old, shutdown="no answer")
            self._emit(EventKind.SHUTDOWN_NO_ANSWER, agent, report.reasons[agent])
        self._save_state()
        return report

    # -- events and state -----------------------------------------------------------------

    def _emit(self, kind: EventKind, agent: str, text: str, message: Message | None = None) -> None:
        if self.on_event is not None:
            self.on_event(Event(kind, agent, text, message))

    def _remember(self, key: str, now: bool) -> None:
        self._handled[key] = None
        while len(self._handled) > HANDLED_IDS_KEPT:
            del self._handled[next(iter(self._handled))]
        if now:
            self._save_state()
        else:
            # Handling it again would change nothing outside this process (no reply went
            # out), so one save per batch is enough: a status flood costs no fsync each.
            self._unsaved = True

    def _save_state(self) -> None:
        self._unsaved = False
        try:
            save_state(self.bus.store, self._state_key, self._handled, self._sent, self.progress)
        except MailError as exc:
            # Losing the record costs at most a duplicate answer after a restart; stopping
            # the lead would cost the whole team, so say it and go on.
            self._emit(EventKind.ERROR, self.agent, f"cannot save the lead's state: {exc}")

    def _load_state(self) -> None:
        saved = load_state(self.bus.store, self._state_key)
        if saved is not None:
            self._handled = saved.handled
            self._sent = saved.sent
            self.progress.update(saved.progress)

    # -- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop watching and release the bus; the orchestrator can be used again after."""
        if self._unsaved:
            self._save_state()
        self.bus.close()

    def __enter__(self) -> TeamOrchestrator:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TeamOrchestrator(team={self.bus.team.name!r}, agent={self.agent!r})"
