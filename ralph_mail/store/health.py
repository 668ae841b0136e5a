"""What a health check finds (`Backend.doctor`, ``ralph-mail doctor``): one `Finding` each."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Level = Literal["ok", "warn", "fail"]


@dataclass(frozen=True, slots=True)
class Finding:
    """One result of a health check (`Backend.doctor`).

    Attributes:
        level: ``"ok"``, ``"warn"`` (works, but look at it) or ``"fail"`` (a guarantee
            does not hold).
        check: what was checked: filesystem, inotify, permissions, team, inbox, cursor,
            deadletters, lock, temp, server.
        message: what was found and, when it is not ok, how to fix it.
        path: the file or directory concerned, if any.
    """

    level: Level
    check: str
    message: str
    path: Path | None = None

    def to_dict(self) -> dict[str, str | None]:
        """The finding as a JSON-ready dict."""
        return {
            "level": self.level,
            "check": self.check,
            "message": self.message,
            "path": str(self.path) if self.path is not None else None,
        }
