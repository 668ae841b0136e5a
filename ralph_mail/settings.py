"""Tunables and the settings that resolve from argument, environment, then default.

Every timeout, size and latency lives here, so a reader finds them in one place.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

#: The largest encoded message line (bytes, newline included) a sender accepts.
MAX_MESSAGE_BYTES: Final = 1024 * 1024

#: watchfiles groups events for at most this long once one arrived (ms). Appends to one
#: inbox collapse into one event, so this only binds when many files change at once.
WATCH_DEBOUNCE_MS: Final = 1
#: watchfiles' sleep step (ms): a change is reported within one to two steps. 1 ms is the
#: lowest value that does not spin a core (about 0.4 % of a core while idle).
WATCH_STEP_MS: Final = 1
#: A waiter re-reads its inbox at least this often even with no file event (s), so a lost
#: event (inotify queue overflow, a file system without events) delays mail, never loses it.
WATCH_SAFETY_POLL_S: Final = 1.0
#: Poll interval (ms) when file events are unavailable and the waiter falls back to polling.
WATCH_POLL_DELAY_MS: Final = 10

#: How much of an inbox `tail` reads per step backwards from the end.
TAIL_CHUNK_BYTES: Final = 64 * 1024
#: How long a team operation (create, delete) waits for the roster lock (s).
ROSTER_LOCK_TIMEOUT_S: Final = 10.0

#: Directory and file modes: mail is private to the user who owns the team.
DIR_MODE: Final = 0o700
FILE_MODE: Final = 0o600


def home(value: str | os.PathLike[str] | None = None) -> Path:
    """The mailbox home: the argument, else ``$RALPH_HOME``, else ``~/.ralph``."""
    if value is not None:
        return Path(value).expanduser()
    env = os.environ.get("RALPH_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".ralph"


def durable(value: bool | None = None) -> bool:
    """Whether sends fsync: the argument, else ``$RALPH_DURABLE`` (1/true/yes), else off."""
    if value is not None:
        return value
    return os.environ.get("RALPH_DURABLE", "").strip().lower() in {"1", "true", "yes", "on"}


def max_message_bytes(value: int | None = None) -> int:
    """The size limit: the argument, else ``$RALPH_MAX_MESSAGE_BYTES``, else 1 MiB."""
    if value is not None:
        return value
    env = os.environ.get("RALPH_MAX_MESSAGE_BYTES")
    return int(env) if env and env.isdigit() else MAX_MESSAGE_BYTES
