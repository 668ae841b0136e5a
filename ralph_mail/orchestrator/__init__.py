"""The team's lead: `TeamOrchestrator` and what it reports and decides with.

* `lead`: `TeamOrchestrator`, the loop over the lead's inbox and the lead's actions;
* `records`: `Plan`, `AgentProgress`, `Event` and `EventKind`, `ShutdownReport`;
* `review`: the plan review policies (`approve_all`, `reject_all`, `command_reviewer`);
* `shutdown`: a shutdown round's bookkeeping (who answered, whose turn it is);
* `state`: what the lead saves through the store and loads at its start.

Example:
    >>> from ralph_mail.orchestrator import TeamOrchestrator, reject_all  # doctest: +SKIP
    >>> TeamOrchestrator("demo", review_plan=reject_all)  # doctest: +SKIP
"""

from ralph_mail.orchestrator.lead import TeamOrchestrator
from ralph_mail.orchestrator.records import (
    AgentProgress,
    Event,
    EventKind,
    Handler,
    Plan,
    PlanReviewer,
    ShutdownReport,
)
from ralph_mail.orchestrator.review import approve_all, command_reviewer, reject_all
from ralph_mail.orchestrator.state import saved_progress

__all__ = [
    "AgentProgress",
    "Event",
    "EventKind",
    "Handler",
    "Plan",
    "PlanReviewer",
    "ShutdownReport",
    "TeamOrchestrator",
    "approve_all",
    "command_reviewer",
    "reject_all",
    "saved_progress",
]
