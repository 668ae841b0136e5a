"""What the lead reports and decides on: `Plan`, `AgentProgress`, `Event` and `EventKind`,
`ShutdownReport`, and the types of its review policies and message handlers."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from ralph_mail.message import Message


@dataclass(frozen=True, slots=True)
class Plan:
    """A plan submitted to the lead, as a review policy sees it.

    Attributes:
        agent: who submitted it.
        text: the plan (the message's content).
        task: the task it is for (``metadata.task``), or None.
        message: the plan_submission message itself.
    """

    agent: str
    text: str
    task: str | None
    message: Message

    @property
    def content(self) -> str:
        """The plan, as the message it wraps calls it (the same as `text`)."""
        return self.text


#: A review policy: approve (True) or reject (False), with optional feedback for the agent.
PlanReviewer = Callable[[Plan], bool | tuple[bool, str]]
#: A handler of one message type; it may call `TeamOrchestrator.reply`.
Handler = Callable[[Message], None]


@dataclass(frozen=True, slots=True)
class AgentProgress:
    """What the lead knows about one teammate.

    Attributes:
        agent: the teammate's name.
        state: the last reported state (`protocols.STATES`), or "unknown" before any.
        task: the task it works on (reported, else the last one assigned), or "".
        progress: the last reported fraction from 0 to 1, or None.
        text: the last thing it said (status text, plan, text message).
        last_seen: ts of its last message, or "".
        plan: the fate of its last plan: "", "approved" or "rejected".
        shutdown: "", "requested", "deferred", "accepted", "refused" or "no answer".
    """

    agent: str
    state: str = "unknown"
    task: str = ""
    progress: float | None = None
    text: str = ""
    last_seen: str = ""
    plan: str = ""
    shutdown: str = ""


class EventKind(StrEnum):
    """What happened, for a display or a log (see `Event`)."""

    STATUS = "status"
    PLAN_APPROVED = "plan_approved"
    PLAN_REJECTED = "plan_rejected"
    ASSIGNED = "assigned"
    TEXT = "text"
    SHUTDOWN_REQUESTED = "shutdown_requested"
    SHUTDOWN_ACCEPTED = "shutdown_accepted"
    SHUTDOWN_DEFERRED = "shutdown_deferred"
    SHUTDOWN_REFUSED = "shutdown_refused"
    SHUTDOWN_NO_ANSWER = "shutdown_no_answer"
    TASK_COMPLETED = "task_completed"
    TASK_FAILED = "task_failed"
    TASK_STALLED = "task_stalled"
    TASK_CANCELED = "task_canceled"
    ACK_OVERDUE = "ack_overdue"
    BUDGET_EXCEEDED = "budget_exceeded"
    ERROR = "error"
    IGNORED = "ignored"
    DUPLICATE = "duplicate"


@dataclass(frozen=True, slots=True)
class Event:
    """One thing the lead saw or did, passed to the ``on_event`` callback.

    Attributes:
        kind: an `EventKind`.
        agent: the teammate concerned.
        text: a one-line description.
        message: the message behind it, if any.
        time: when it happened (seconds since the epoch).

    Example:
        >>> str(Event(EventKind.STATUS, "worker-1", "working T-1 50%", time=0.0))
        'worker-1 status: working T-1 50%'
    """

    kind: EventKind
    agent: str
    text: str
    message: Message | None = None
    time: float = field(default_factory=time.time)

    def __str__(self) -> str:
        return f"{self.agent} {self.kind.value}: {self.text}"


@dataclass(frozen=True, slots=True, eq=False)
class ShutdownReport(Mapping[str, bool | None]):
    """The outcome of `TeamOrchestrator.request_shutdown`: agent -> accepted?

    A mapping from each agent asked to True (accepted), False (refused) or None (no final
    answer by the deadline, including agents that kept deferring).

    Attributes:
        answers: the mapping itself.
        reasons: what each agent said last (or why there is no answer).

    Example:
        >>> report = ShutdownReport({"w1": True, "w2": None}, {"w2": "no answer"})
        >>> report["w1"], report.accepted, report.no_answer, report.ok
        (True, ('w1',), ('w2',), False)
    """

    answers: Mapping[str, bool | None]
    reasons: Mapping[str, str] = field(default_factory=dict)

    def __getitem__(self, agent: str) -> bool | None:
        return self.answers[agent]

    def __iter__(self) -> Iterator[str]:
        return iter(self.answers)

    def __len__(self) -> int:
        return len(self.answers)

    @property
    def accepted(self) -> tuple[str, ...]:
        """The agents that accepted."""
        return tuple(agent for agent, answer in self.answers.items() if answer is True)

    @property
    def refused(self) -> tuple[str, ...]:
        """The agents that refused."""
        return tuple(agent for agent, answer in self.answers.items() if answer is False)

    @property
    def no_answer(self) -> tuple[str, ...]:
        """The agents with no final answer by the deadline."""
        return tuple(agent for agent, answer in self.answers.items() if answer is None)

    @property
    def ok(self) -> bool:
        """Whether every agent asked accepted."""
        return all(answer is True for answer in self.answers.values())
