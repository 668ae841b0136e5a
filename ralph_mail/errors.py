"""One exception tree: every error ralph_mail raises on purpose is a `MailError`.

Each message names the offending value and says how to fix it, so the command
line can print it as the one line a user sees.
"""

from __future__ import annotations

from pathlib import Path


class MailError(Exception):
    """Base of every error raised on purpose by ralph_mail."""


class InvalidName(MailError, ValueError):
    """A team or agent name does not match the naming rule."""


class InvalidMessage(MailError, ValueError):
    """A message (type, content, metadata, id, size) is refused before anything is written."""


class TaskEnded(InvalidMessage):
    """What was asked of a task cannot be done: it ended (completed, failed, canceled,
    rejected, its deadline passed) or was given to another agent. The command line
    exits 3: the answer is no; stop working on it."""


class TeamNotFound(MailError, LookupError):
    """The team has no `team.json` under the home."""


class TeamExists(MailError, FileExistsError):
    """`create_team` was asked for a team that already exists."""


class UnknownAgent(MailError, LookupError):
    """An agent name that is not a member of the team."""


class StoreError(MailError, OSError):
    """The file system refused an operation; `path` names the file."""

    def __init__(self, message: str, path: Path | str | None = None) -> None:
        super().__init__(message)
        self.path = Path(path) if path is not None else None


class InboxBusy(MailError):
    """Another process consumes this inbox (one consumer per inbox); `pid` names it."""

    def __init__(self, message: str, pid: int | None = None) -> None:
        super().__init__(message)
        self.pid = pid


class ClaimLost(InboxBusy):
    """This process consumed an inbox, went quiet past its claim's lease, and another
    consumer took it over since: nothing more is handed out or committed here."""


class BroadcastError(MailError):
    """A broadcast reached some inboxes but not all; both lists are attributes."""

    def __init__(self, message: str, delivered: list[str], failed: list[str]) -> None:
        super().__init__(message)
        self.delivered = delivered
        self.failed = failed


class ProtocolError(MailError, ValueError):
    """A protocol message (status, plan, shutdown) lacks metadata or has a malformed value.

    The lead answers such a message with this error's text instead of acting on it.
    """


class LockTimeout(MailError, TimeoutError):
    """A team-wide lock (the one that keeps two gc runs apart) stayed taken; `path` names it."""

    def __init__(self, message: str, path: Path | str | None = None) -> None:
        super().__init__(message)
        self.path = Path(path) if path is not None else None


class NoReply(MailError, TimeoutError):
    """An `ask` got no reply in time."""


class RefusedByRules(MailError):
    """Refused by the team's rules before anything was written (exit 4)."""


class AgentOffline(RefusedByRules):
    """The target of an ask or a delegation is offline."""


class DepthLimit(RefusedByRules):
    """A request would pass through more agents than the team's ``max_depth``."""


class LoopGuard(RefusedByRules):
    """A thread carried too many internal messages in a row."""


class PermissionDenied(RefusedByRules, PermissionError):
    """The team's policy refuses this contact."""


class RateLimited(RefusedByRules):
    """The sender went over its messages per minute."""


class BudgetExceeded(RefusedByRules):
    """An agent's jobs spent its budget (``policy budget``) in the window: its contact is
    refused and its runs answer with an error until `until` (a ts); `agent` names it."""

    def __init__(self, message: str, agent: str = "", until: str = "") -> None:
        super().__init__(message)
        self.agent = agent
        self.until = until
