"""ralph_mail: a file-based mailbox for teams of agents on one machine.

Example:
    >>> from ralph_mail import MessageBus, MessageType, create_team   # doctest: +SKIP
    >>> create_team("demo", ["lead", "worker-1"])                     # doctest: +SKIP
    >>> MessageBus("demo", "worker-1").send("lead", MessageType.TEXT, "hello")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from ralph_mail.bus import MessageBus
from ralph_mail.errors import (
    BroadcastError,
    InvalidMessage,
    InvalidName,
    MailError,
    StoreError,
    TeamExists,
    TeamNotFound,
    UnknownAgent,
)
from ralph_mail.message import Message, MessageType
from ralph_mail.team import Member, Team, create_team, delete_team, list_teams, load_team

__all__ = [
    "BroadcastError",
    "InvalidMessage",
    "InvalidName",
    "MailError",
    "Member",
    "Message",
    "MessageBus",
    "MessageType",
    "StoreError",
    "Team",
    "TeamExists",
    "TeamNotFound",
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
    raise AttributeError(f"module 'ralph_mail' has no attribute {name!r}")
