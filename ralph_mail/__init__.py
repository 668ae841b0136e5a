"""ralph_mail: a file-based mailbox for teams of agents on one machine.

Example:
    >>> from ralph_mail import MessageBus, MessageType, create_team   # doctest: +SKIP
    >>> create_team("demo", ["lead", "worker-1"])                     # doctest: +SKIP
    >>> MessageBus("demo", "worker-1").send("lead", MessageType.TEXT, "hello")  # doctest: +SKIP
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing's: importing typing here would cost start-up time
if TYPE_CHECKING:
    from typing import Any

    from ralph_mail.agent import Assignment, PlanDecision, TeamAgent
    from ralph_mail.bus import MessageBus
    from ralph_mail.errors import (
        AgentOffline,
        BroadcastError,
        BudgetExceeded,
        DepthLimit,
        InboxBusy,
        InvalidMessage,
        InvalidName,
        LockTimeout,
        LoopGuard,
        MailError,
        NoReply,
        PermissionDenied,
        ProtocolError,
        RateLimited,
        StoreError,
        TaskEnded,
        TeamExists,
        TeamNotFound,
        UnknownAgent,
    )
    from ralph_mail.govern.presence import AgentInfo
    from ralph_mail.message import Message, MessageType
    from ralph_mail.orchestrator import (
        AgentProgress,
        Event,
        EventKind,
        Plan,
        ShutdownReport,
        TeamOrchestrator,
    )
    from ralph_mail.talk.receipts import Receipt
    from ralph_mail.talk.tasks import Task
    from ralph_mail.team import Member, Team, create_team, delete_team, list_teams, load_team

# Every name is imported on first use (PEP 562): `import ralph_mail.cli` then costs
# nothing before the command line is ready to take Ctrl-C, and a program that needs only
# the bus does not pay for the lead's imports (subprocess, hashlib, ...).
_ERRORS = [
    "AgentOffline",
    "BroadcastError",
    "BudgetExceeded",
    "DepthLimit",
    "InboxBusy",
    "InvalidMessage",
    "InvalidName",
    "LockTimeout",
    "LoopGuard",
    "MailError",
    "NoReply",
    "PermissionDenied",
    "ProtocolError",
    "RateLimited",
    "StoreError",
    "TaskEnded",
    "TeamExists",
    "TeamNotFound",
    "UnknownAgent",
]
_LAZY = {
    **dict.fromkeys(_ERRORS, "ralph_mail.errors"),
    "AgentInfo": "ralph_mail.govern.presence",
    "Assignment": "ralph_mail.agent",
    "AgentProgress": "ralph_mail.orchestrator",
    "Event": "ralph_mail.orchestrator",
    "EventKind": "ralph_mail.orchestrator",
    "Flag": "ralph_mail.store.flag",
    "Member": "ralph_mail.team",
    "Message": "ralph_mail.message",
    "MessageBus": "ralph_mail.bus",
    "MessageType": "ralph_mail.message",
    "Plan": "ralph_mail.orchestrator",
    "PlanDecision": "ralph_mail.agent",
    "Receipt": "ralph_mail.talk.receipts",
    "ShutdownReport": "ralph_mail.orchestrator",
    "Task": "ralph_mail.talk.tasks",
    "Team": "ralph_mail.team",
    "TeamAgent": "ralph_mail.agent",
    "TeamOrchestrator": "ralph_mail.orchestrator",
    "create_team": "ralph_mail.team",
    "delete_team": "ralph_mail.team",
    "list_teams": "ralph_mail.team",
    "load_team": "ralph_mail.team",
}

__all__ = [
    "AgentInfo",
    "AgentOffline",
    "AgentProgress",
    "Assignment",
    "BroadcastError",
    "BudgetExceeded",
    "DepthLimit",
    "Event",
    "EventKind",
    "Flag",
    "InboxBusy",
    "InvalidMessage",
    "InvalidName",
    "LockTimeout",
    "LoopGuard",
    "MailError",
    "Member",
    "Message",
    "MessageBus",
    "MessageType",
    "NoReply",
    "PermissionDenied",
    "Plan",
    "PlanDecision",
    "ProtocolError",
    "RateLimited",
    "Receipt",
    "ShutdownReport",
    "StoreError",
    "Task",
    "TaskEnded",
    "Team",
    "TeamAgent",
    "TeamExists",
    "TeamNotFound",
    "TeamOrchestrator",
    "UnknownAgent",
    "__version__",
    "create_team",
    "delete_team",
    "list_teams",
    "load_team",
]


def __getattr__(name: str) -> Any:
    # importlib.metadata costs milliseconds: resolve the version only when asked for.
    if name == "__version__":
        from importlib.metadata import version

        return version("ralph_mail")
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ralph_mail' has no attribute {name!r}")
