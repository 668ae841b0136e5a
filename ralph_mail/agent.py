"""`TeamAgent`: a teammate's side of the team protocols, for Python agent processes.

The agent processes its inbox between tasks and while idle:

* a task assignment gives it a task (or queues it behind the one in hand); a task of
  the team's task log is started when it comes into hand, and its lease renewed from a
  thread of its own until it leaves it (`TeamAgent.finish_task`);
* a ``task_canceled`` (the task log backs it) takes a queued task out of the backlog,
  or marks the one in hand in `TeamAgent.canceled`: the program stops working on it;
* a shutdown request is accepted when idle, and deferred ("finishing current task") while
  a task is in hand, so the lead asks again once the agent reports it is done;
* a plan approval reaches the `TeamAgent.submit_plan` call waiting for it;
* text and broadcasts become context for its next step (`TeamAgent.take_context`);
* a teammate's question (a ``request``, from `MessageBus.ask`) is answered by the
  ``answer`` function given to the agent, or waits in `TeamAgent.questions` for the
  program to answer with ``agent.bus.reply``.

Messages are handled at least once (peek, handle, commit) and at most once per id: the
agent remembers the ids it handled recently, so a message resent under the same id (a
sender's retry) is not acted on twice.

Example:
    >>> agent = TeamAgent("demo", "worker-1")  # doctest: +SKIP
    >>> while (task := agent.next_task()) is not None:  # doctest: +SKIP
    ...     decision = agent.submit_plan(f"1. read {task.id}", task=task.id, wait=60)
    ...     agent.report_status("halfway", progress=0.5)
    ...     agent.finish_task("all parsed")
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from ralph_mail import protocols
from ralph_mail.bus import MessageBus
from ralph_mail.errors import MailError, ProtocolError, TaskEnded
from ralph_mail.message import Message, MessageType
from ralph_mail.settings import HANDLED_IDS_KEPT
from ralph_mail.store.base import StopEvent


@dataclass(frozen=True, slots=True)
class Assignment:
    """A task in an agent's hands (its entry in the team's tree is a `ralph_mail.Task`).

    Attributes:
        id: the task id (``metadata.taskId`` of the assignment).
        description: what to do (the assignment's content).
        message: the task_assignment message, or None for a task the agent gave itself.
    """

    id: str
    description: str
    message: Message | None = None


@dataclass(frozen=True, slots=True)
class PlanDecision:
    """The lead's answer to a plan, as `TeamAgent.submit_plan` returns it.

    Attributes:
        approved: True, False, or None when no answer came in time.
        feedback: the lead's words (or why there is no answer).
        submission: the plan_submission message that was sent.
        answer: the plan_approval message, or None.

    Example:
        >>> decision = agent.submit_plan("1. parse 2. test", task="T-1", wait=60)  # doctest: +SKIP
        >>> decision.approved, decision.feedback  # doctest: +SKIP
        (False, 'add a step that runs the tests')
    """

    approved: bool | None
    feedback: str
    submission: Message
    answer: Message | None = None

    @property
    def answered(self) -> bool:
        """Whether the lead answered."""
        return self.approved is not None


class TeamAgent:
    """One teammate: takes tasks, submits plans, reports status, and answers shutdowns.

    Its state is "working" while a task is in hand, else "idle". Not thread-safe.

    Example:
        >>> agent = TeamAgent("demo", "worker-1")  # doctest: +SKIP
        >>> task = agent.next_task(timeout=30)  # doctest: +SKIP
        >>> agent.submit_plan("1. read 2. parse", task=task.id, wait=60).approved  # doctest: +SKIP
        True
        >>> agent.finish_task("parsed 2,000 lines")  # doctest: +SKIP

    Args:
        team: the team's name; it must exist.
        name: this agent's name; it must be a member.
        home: the mailbox home (default ``$RALPH_HOME`` or ``~/.ralph``).
        lead: whom to report to (default: the roster's lead).
        auto_shutdown: answer shutdown requests by the rule above; when False, a request
            waits in `shutdown_request` for `accept_shutdown` or `defer_shutdown`.
        durable: fsync each send (default ``$RALPH_DURABLE``, else off).
        answer: called with each ``request`` a teammate asks; what it returns is sent
            back as the reply. Without it, requests wait in `questions`.
    """

    def __init__(
        self,
        team: str,
        name: str,
        home: str | os.PathLike[str] | None = None,
        *,
        lead: str | None = None,
        auto_shutdown: bool = True,
        durable: bool | None = None,
        answer: Callable[[Message], str] | None = None,
    ) -> None:
        self.bus = MessageBus(team, name, home, durable=durable)
        self.answer = answer
        #: Requests not yet answered (without an ``answer`` function), oldest first.
        self.questions: deque[Message] = deque()
        self.name = self.bus.agent
        self.lead = lead if lead is not None else self.bus.team.lead
        self.auto_shutdown = auto_shutdown
        #: The task in hand, or None.
        self.task: Assignment | None = None
        #: Tasks assigned while another was in hand, oldest first.
        self.backlog: deque[Assignment] = deque()
        #: My tasks that ended before I finished them (canceled, moved to another agent,
        #: past their deadline), by id, with why: stop working on one that is here. The
        #: newest `HANDLED_IDS_KEPT` are kept, so a long-lived agent holds a bounded number.
        self.canceled: dict[str, str] = {}
        self._renewal: _Renewal | None = None
        #: Text and broadcasts not yet taken by `take_context`, oldest first.
        self.context: list[Message] = []
        #: The newest shutdown request not yet answered (with ``auto_shutdown`` off).
        self.shutdown_request: Message | None = None
        #: Whether this agent accepted a shutdown: it should stop now.
        self.stopping = False
        self._seen: dict[str, None] = {}  # insertion-ordered set of "sender:id" keys
        self._approvals: dict[str, Message] = {}  # plan_approval by the submission it answers
        self._last_request: Message | None = None

    @property
    def state(self) -> str:
        """ "working" while a task is in hand, else "idle"."""
        return "working" if self.task is not None else "idle"

    # -- the inbox ------------------------------------------------------------------------

    def process_pending_messages(self) -> list[Message]:
        """Handle what is in the inbox now, without blocking; return the messages handled.

        Example:
            >>> for message in agent.process_pending_messages():  # doctest: +SKIP
            ...     print(message.type, message.content)
        """
        handled = []
        for message in self.bus.peek():
            if self._handle(message):
                handled.append(message)
            self.bus.commit(message)
        return handled

    def wait_for_messages(
        self, timeout: float | None = None, *, stop: StopEvent | None = None
    ) -> list[Message]:
        """Block until mail comes (or ``timeout``, or ``stop``), then handle it all.

        Returns the messages handled; ``[]`` when none came in time.
        """
        self.bus.wait_for_messages(timeout, stop=stop, consume=False)
        return self.process_pending_messages()

    def next_task(
        self, timeout: float | None = None, *, stop: StopEvent | None = None
    ) -> Assignment | None:
        """The task in hand; without one, wait for an assignment while handling the inbox.

        Returns None when the agent accepted a shutdown, after ``timeout`` seconds
        (None: no limit), or when ``stop`` is set; `stopping` tells a shutdown apart.

        Example:
            >>> while not agent.stopping:                      # doctest: +SKIP
            ...     if (task := agent.next_task(timeout=30)) is not None:
            ...         work_on(task); agent.finish_task("done")
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.process_pending_messages()
            if self.stopping:
                return None
            if self.task is not None:
                return self.task
            remaining = None if deadline is None else deadline - time.monotonic()
            if (remaining is not None and remaining <= 0) or (stop is not None and stop.is_set()):
                return None
            self.bus.wait_for_messages(remaining, stop=stop, consume=False)

    def _handle(self, message: Message) -> bool:
        key = f"{message.from_agent}:{message.id}"
        if key in self._seen:
            return False
        self._seen[key] = None
        while len(self._seen) > HANDLED_IDS_KEPT:
            del self._seen[next(iter(self._seen))]
        if message.type == MessageType.TASK_ASSIGNMENT:
            task_id = message.metadata.get(protocols.TASK_ID) or message.id
            task = Assignment(task_id, message.content, message)
            if self.task is None:
                self._take(task)
            else:
                self.backlog.append(task)
        elif message.type == MessageType.TASK_CANCELED:
            self._on_canceled(message)
        elif message.type == MessageType.SHUTDOWN_REQUEST:
            self._last_request = message
            if self.auto_shutdown:
                if self.task is None:
                    self.accept_shutdown("idle: shutting down")
                else:
                    self.defer_shutdown(f"finishing current task {self.task.id}")
            else:
                self.shutdown_request = message
        elif message.type == MessageType.PLAN_APPROVAL:
            if message.reply_to is not None:
                self._approvals[message.reply_to] = message
        elif message.type in (MessageType.TEXT, MessageType.BROADCAST):
            self.context.append(message)
        elif message.type == MessageType.REQUEST:
            if self.answer is None:
                self.questions.append(message)
            else:
                self.bus.reply(message, self.answer(message))
        return True

    def take_context(self) -> list[str]:
        """The texts received since the last call, oldest first; clears them.

        Example:
            >>> notes = "\\n".join(agent.take_context())  # doctest: +SKIP
        """
        texts = [message.content for message in self.context]
        self.context.clear()
        return texts

    # -- tasks and status -----------------------------------------------------------------

    def start_task(self, task_id: str, description: str = "") -> Assignment:
        """Take a task the lead did not assign (it goes to the backlog if one is in hand)."""
        task = Assignment(protocols.check_task_id(task_id), description)
        if self.task is None:
            self._take(task)
        else:
            self.backlog.append(task)
        return task

    def _take(self, task: Assignment | None) -> None:
        """Hold ``task`` (else the next of the backlog that did not end): a task of the
        team's task log is started, and its lease renewed until it leaves my hands."""
        self._let_go()
        while task is not None:
            try:
                self.bus.start(task.id)
            except TaskEnded as exc:  # canceled (or moved) before I came to it: skip it
                self._ended(task.id, str(exc))
                task = self.backlog.popleft() if self.backlog else None
                continue
            except MailError:  # not in the team's task log (sent by hand): no lease
                pass
            else:
                self._renewal = _Renewal(self.bus, task.id)
            break
        self.task = task

    def _let_go(self) -> None:
        if self._renewal is not None:
            self._renewal.close()
            self._renewal = None

    def _on_canceled(self, message: Message) -> None:
        """A task of mine ended (the task log says so): out of the backlog, or marked in
        `canceled` when it is in hand (its lease is not renewed any more)."""
        task_id = message.metadata.get(protocols.TASK_ID, "")
        known = {task.id: task for task in self.bus.tasks()}.get(task_id)
        if known is None or (known.open and known.assignee == self.name):
            return  # the log does not back it
        self._ended(task_id, message.content)
        self.backlog = deque(task for task in self.backlog if task.id != task_id)
        if self.task is not None and self.task.id == task_id:
            self._let_go()

    def _ended(self, task_id: str, why: str) -> None:
        """Note in `canceled` that ``task_id`` ended, the oldest note dropped past
        `HANDLED_IDS_KEPT`."""
        self.canceled.pop(task_id, None)  # noted again: it is the newest now
        self.canceled[task_id] = why
        while len(self.canceled) > HANDLED_IDS_KEPT:
            del self.canceled[next(iter(self.canceled))]

    def report_status(
        self,
        text: str,
        state: str | None = None,
        *,
        task: str | None = None,
        progress: str | float | None = None,
    ) -> Message:
        """Send the lead a status update; state and task default to the agent's own.

        Example:
            >>> agent.report_status("parsed half the logs", progress=0.5)  # doctest: +SKIP
        """
        if task is None and self.task is not None:
            task = self.task.id
        metadata = protocols.status_metadata(state or self.state, task, progress)
        return self.bus.send(self.lead, MessageType.STATUS_UPDATE, text, metadata)

    def finish_task(self, text: str = "done", *, state: str = "done") -> Message:
        """Report the task in hand ``state`` (done or failed) and take the next one.

        A task the team's task tree knows is completed (or failed) there as well, and its
        delegator gets the ``task_result``. The agent is idle afterwards unless the backlog
        held a task; a lead waiting for a deferred shutdown asks again on this report.
        """
        task = self.task
        progress = "1" if state == "done" else None
        report = self.report_status(
            text, state, task=task.id if task else None, progress=progress if task else None
        )
        self._let_go()
        if task is not None:
            self._record_outcome(task.id, text, state)
        self._take(self.backlog.popleft() if self.backlog else None)
        return report

    def _record_outcome(self, task_id: str, text: str, state: str) -> None:
        # A task the team's tree knows (the lead's assign, a delegation) is completed
        # there too, and its delegator gets the result; one given out by hand is not.
        # One that ended meanwhile (canceled) keeps the result as late: `TaskEnded`.
        known = {task.id: task for task in self.bus.tasks()}
        if task_id in known and known[task_id].assignee == self.bus.agent:
            try:
                if state == "done":
                    self.bus.complete(task_id, text)
                else:
                    self.bus.fail(task_id, text)
            except TaskEnded as exc:
                if task_id not in self.canceled:
                    self._ended(task_id, str(exc))

    # -- plans ----------------------------------------------------------------------------

    def submit_plan(
        self,
        plan: str,
        *,
        task: str | None = None,
        wait: float | None = None,
        stop: StopEvent | None = None,
    ) -> PlanDecision:
        """Send the lead a plan; wait up to ``wait`` seconds (None: no limit) for its answer.

        With ``wait=0`` it returns at once, unanswered. While waiting, only the plan
        approval is consumed: other messages stay unread for `process_pending_messages`.

        Example:
            >>> decision = agent.submit_plan("1. parse 2. test", wait=60)  # doctest: +SKIP
            >>> if not decision.approved: revise(decision.feedback)  # doctest: +SKIP
        """
        if task is None and self.task is not None:
            task = self.task.id
        metadata = {protocols.TASK: protocols.check_task_id(task)} if task else {}
        submission = self.bus.send(self.lead, MessageType.PLAN_SUBMISSION, plan, metadata)
        deadline = None if wait is None else time.monotonic() + wait
        while True:
            answer = self._approvals.pop(submission.id, None)
            if answer is not None:
                return _decision(submission, answer)
            remaining = None if deadline is None else deadline - time.monotonic()
            if (remaining is not None and remaining <= 0) or (stop is not None and stop.is_set()):
                why = "stopped before an answer came" if wait is None else f"no answer in {wait:g}s"
                return PlanDecision(None, why, submission)
            found = self.bus.wait_for_message(MessageType.PLAN_APPROVAL, remaining, stop=stop)
            if found is not None:
                self._handle(found)

    # -- shutdown -------------------------------------------------------------------------

    def accept_shutdown(self, reason: str = "shutting down") -> Message | None:
        """Accept the newest shutdown request (the agent is then `stopping`).

        Returns the response, or None when no request came.
        """
        message = self._answer_shutdown(True, False, reason)
        self.stopping = message is not None or self.stopping
        return message

    def defer_shutdown(self, reason: str = "finishing current task") -> Message | None:
        """Answer the newest shutdown request "not yet": the lead asks again later."""
        return self._answer_shutdown(False, True, reason)

    def refuse_shutdown(self, reason: str) -> Message | None:
        """Refuse the newest shutdown request for good."""
        return self._answer_shutdown(False, False, reason)

    def _answer_shutdown(self, accepted: bool, deferred: bool, reason: str) -> Message | None:
        request = self._last_request
        if request is None:
            return None
        content, metadata = protocols.shutdown_answer(accepted, deferred, reason)
        self.shutdown_request = None
        return self.bus.send(
            request.from_agent,
            MessageType.SHUTDOWN_RESPONSE,
            content,
            metadata,
            reply_to=request.id,
        )

    # -- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop renewing, stop watching and release the bus; the agent can be used again
        after."""
        self._let_go()
        self.bus.close()

    def __enter__(self) -> TeamAgent:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TeamAgent(team={self.bus.team.name!r}, name={self.name!r}, state={self.state!r})"


class _Renewal:
    """Renews the lease of the task in hand every third of the team's ``task_lease``,
    from a thread (and a bus) of its own, so a program busy with the task keeps it alive;
    a process that dies stops renewing, and the task stalls."""

    def __init__(self, bus: MessageBus, task_id: str) -> None:
        from ralph_mail.govern.tasklog import lease_seconds

        self._where = (bus.team.name, bus.agent, bus.team.home)
        self._task_id = task_id
        self._interval = lease_seconds(dict(bus.team.config)) / 3
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ralph-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        team, agent, home = self._where
        with MessageBus(team, agent, home) as bus:
            while not self._stop.wait(self._interval):
                try:
                    bus.heartbeat(self._task_id)
                except TaskEnded:  # canceled, moved: the agent hears of it by its inbox
                    return
                except MailError:  # the next renewal tries again
                    continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _decision(submission: Message, answer: Message) -> PlanDecision:
    try:
        approved, feedback = protocols.parse_plan_approval(answer)
    except ProtocolError as exc:
        # A lead that cannot say yes clearly has not said yes.
        return PlanDecision(False, f"malformed approval: {exc}", submission, answer)
    return PlanDecision(approved, feedback, submission, answer)
