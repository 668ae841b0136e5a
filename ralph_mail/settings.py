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
#: How often a wait given a stop event looks at it (s): poll(2) cannot watch the event itself.
WATCH_STOP_CHECK_S: Final = 0.05
#: Poll interval (ms) when file events are unavailable and the waiter falls back to polling.
WATCH_POLL_DELAY_MS: Final = 10
#: A polling waiter stretches its interval by this factor at each look that finds nothing,
#: up to WATCH_POLL_MAX_MS, and goes back to WATCH_POLL_DELAY_MS when something changed:
#: an idle poller costs a few stats a second, not a hundred.
WATCH_POLL_BACKOFF: Final = 1.5
WATCH_POLL_MAX_MS: Final = 500
#: The safety poll (WATCH_SAFETY_POLL_S) stretches while nothing comes, up to this (s): a
#: thousand idle waiters each re-reading every second would cost several % of a core.
WATCH_SAFETY_POLL_MAX_S: Final = 30.0
#: A wait given a stop event looks at it after WATCH_STOP_CHECK_S, then ever less often
#: while nothing happens, up to this (s).
WATCH_STOP_CHECK_MAX_S: Final = 1.0
#: How waits learn that mail came (``$RALPH_WAIT``): ``bell`` (a sender rings a FIFO the
#: waiter registered), ``inotify``, ``watchfiles`` (its public API), ``poll``; ``auto``
#: takes the first of bell, inotify, watchfiles, poll that can be had.
WAIT_MECHANISMS: Final = ("auto", "bell", "inotify", "watchfiles", "poll")

#: How long a wait on a doorbell polls without sleeping before it blocks (µs, default of
#: ``$RALPH_SPIN_US``), when its last wait was rung within `SPIN_QUICK_S`: a process in a
#: quick conversation gets the next message without being put to sleep and woken, which
#: on a machine whose idle cores halt (most virtual machines) costs 25-45 µs each way.
SPIN_US: Final = 250
#: A wait spins only when the one before was rung within this long (s): an idle waiter,
#: or one whose mail comes further apart, never spins.
SPIN_QUICK_S: Final = 0.001
#: The longest spin ``$RALPH_SPIN_US`` may ask for (µs).
SPIN_US_MAX: Final = 100_000

#: How much of an inbox `tail` reads per step backwards from the end.
TAIL_CHUNK_BYTES: Final = 64 * 1024
#: How long ``ralph-mail gc`` waits for another gc of the same team to finish (s).
MAINTENANCE_LOCK_TIMEOUT_S: Final = 30.0
#: How long gc waits for a sender's lock on one inbox before it leaves that inbox as it is
#: (s): a sender stopped with the lock held (Ctrl-Z) must not hang gc for ever.
GC_INBOX_LOCK_WAIT_S: Final = 5.0
#: An owner compacts its own inbox once this many consumed bytes sit at its front, so a
#: long-running team's inboxes stay bounded without anyone running gc (0 turns it off).
GC_AUTO_BYTES: Final = 64 * 1024 * 1024
#: How long ``ralph-mail doctor`` lets an inbox lock stay taken before calling it stuck (s).
DOCTOR_LOCK_WAIT_S: Final = 2.0
#: Below these inotify limits waits may fall back to polling in a big team (doctor warns).
INOTIFY_MIN_WATCHES: Final = 1024
INOTIFY_MIN_INSTANCES: Final = 64

#: How long a plan review command (``lead --review cmd:...``) may run before it counts as a
#: rejection (s): a hanging reviewer must not stall the lead's loop for ever.
PLAN_REVIEW_TIMEOUT_S: Final = 30.0
#: How long `TeamOrchestrator.request_shutdown` collects answers by default (s).
SHUTDOWN_TIMEOUT_S: Final = 30.0
#: How soon an agent that deferred a shutdown ("finishing current task") is asked again (s),
#: unless it reports idle or done first, which re-asks at once.
SHUTDOWN_RETRY_S: Final = 2.0
#: After how long a message the lead sent with ``ack=True`` and nobody acknowledged is
#: reported as an ``ack_overdue`` event (s); ``lead --ack-overdue`` sets it.
ACK_OVERDUE_S: Final = 300.0
#: How often, at most, the lead reads its pending acks (s): they are read from the index.
ACK_CHECK_S: Final = 1.0
#: How many handled message ids the lead remembers (and persists) to answer each message
#: once. Redelivery happens only above the committed cursor, so this bounds the retry
#: window of senders that resend under the same id, not the inbox size.
HANDLED_IDS_KEPT: Final = 4096

#: How far back (messages) ``shutdown respond`` looks in its own inbox for the newest
#: shutdown request, already consumed ones included.
RESPOND_LOOKBACK_LINES: Final = 1000

#: The longest JSON-RPC message (one line, bytes) `ralph-mail mcp` reads from its client:
#: a little above MAX_MESSAGE_BYTES, so a message the bus accepts fits with its JSON
#: escapes. A longer line is answered with an error and skipped, never held whole.
MCP_MAX_REQUEST_BYTES: Final = 4 * 1024 * 1024
#: How much of its standard input `ralph-mail mcp` reads at a time (bytes).
MCP_READ_CHUNK_BYTES: Final = 64 * 1024
#: How long an ask through `ralph-mail mcp` waits by default (s): under the 60 s most MCP
#: clients allow a call; an answer that comes later is returned by check_inbox.
MCP_ASK_TIMEOUT_S: Final = 45.0
#: How long `ralph-mail mcp` that cannot start waits for its client's initialize request,
#: to answer it with the reason (s).
MCP_REFUSAL_WAIT_S: Final = 5.0
#: The most history `ralph-mail run` puts before a request on a command's stdin (bytes):
#: the oldest messages are left out first, and the first line of the input says so.
RUN_HISTORY_MAX_BYTES: Final = 64 * 1024

#: The longest `ralph-mail demo` lets its team run before it gives up (s).
DEMO_TIMEOUT_S: Final = 120.0

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


def backend(value: str | None = None) -> str:
    """Where teams are kept: the argument, else ``$RALPH_BACKEND``, else ``""`` (files
    under the home)."""
    if value is not None:
        return value
    return os.environ.get("RALPH_BACKEND", "").strip()


def durable(value: bool | None = None) -> bool:
    """Whether sends fsync: the argument, else ``$RALPH_DURABLE`` (1/true/yes), else off."""
    if value is not None:
        return value
    return os.environ.get("RALPH_DURABLE", "").strip().lower() in {"1", "true", "yes", "on"}


def _env_count(name: str, default: int) -> int:
    """A whole number from the environment variable ``name`` (``default`` when unset);
    anything else is a `MailError` naming the variable, never silently ignored."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        from ralph_mail.errors import MailError

        raise MailError(f"invalid {name}={raw!r}: give a whole number of bytes, or unset it")
    return int(raw)


def max_message_bytes(value: int | None = None) -> int:
    """The size limit: the argument, else ``$RALPH_MAX_MESSAGE_BYTES``, else 1 MiB."""
    if value is not None:
        return value
    return _env_count("RALPH_MAX_MESSAGE_BYTES", MAX_MESSAGE_BYTES)


#: Team settings (``ralph-mail team config TEAM KEY VALUE``) and their defaults; each can
#: be overridden for one process by ``RALPH_<KEY>`` in the environment. ``channel_delay``:
#: the most seconds of the random pause between two answers to one post (1 to N; 0
#: none); ``channel_turn_timeout``: how long a mentioned member's turn waits for it;
#: ``task_lease``: how long (s) a working task's assignee may go without renewing its
#: lease before the task counts as stalled (``ralph-mail run`` and `TeamAgent` renew it
#: every third of that while the work goes on).
TEAM_DEFAULTS: Final = {
    "max_depth": 3,
    "max_internal_exchanges": 20,
    "presence_timeout": 60,
    "channel_delay": 5,
    "channel_turn_timeout": 120,
    "task_lease": 60,
}


def team_setting(key: str, config: dict[str, str] | None = None) -> int:
    """A team setting: ``$RALPH_<KEY>``, else the team's config, else the default.

    >>> team_setting("max_depth", {})
    3
    """
    env = f"RALPH_{key.upper()}"
    for source, raw in (
        (env, os.environ.get(env)),
        (f"team config {key}", (config or {}).get(key)),
    ):
        if raw is None or raw == "":
            continue
        if not (raw.strip().isascii() and raw.strip().isdigit()) or len(raw.strip()) > 12:
            from ralph_mail.errors import MailError

            raise MailError(f"invalid {source} {raw!r}: give a whole number >= 0")
        return int(raw)
    return TEAM_DEFAULTS[key]


def gc_auto_bytes(value: int | None = None) -> int:
    """When an owner compacts its inbox: the argument, else ``$RALPH_GC_AUTO_BYTES``, else
    64 MiB of consumed lines; 0 never."""
    if value is not None:
        return value
    return _env_count("RALPH_GC_AUTO_BYTES", GC_AUTO_BYTES)


def safety_poll(waited: float) -> float:
    """How long a wait that has waited ``waited`` seconds may block before it reads again
    with no event: five times what it has waited, within WATCH_SAFETY_POLL_S and
    WATCH_SAFETY_POLL_MAX_S. So a wait re-reads after 1 s, 6 s, then every 30 s: a lost
    event (a writer that did not ring) delays mail by 30 s at most, and a thousand idle
    waiters wake 2,000 times a minute in all, not 60,000 (each wake-up costs a process
    about 0.2 ms of CPU on a small virtual machine, whatever it then does).

    >>> safety_poll(0.0), safety_poll(1.0), safety_poll(3600.0)
    (1.0, 5.0, 30.0)
    """
    return min(max(waited * 5, WATCH_SAFETY_POLL_S), WATCH_SAFETY_POLL_MAX_S)


def spin_seconds(value: str | None = None) -> float:
    """How long a wait spins before it blocks (see `SPIN_US`): the argument, else
    ``$RALPH_SPIN_US``, in µs (0: never), as seconds.

    >>> spin_seconds("0")
    0.0
    """
    raw = value if value is not None else os.environ.get("RALPH_SPIN_US", "").strip()
    if not raw:
        return SPIN_US / 1e6
    micros = int(raw) if raw.isdigit() else -1
    if not 0 <= micros <= SPIN_US_MAX:
        from ralph_mail.errors import MailError

        raise MailError(
            f"invalid RALPH_SPIN_US={raw!r}: give microseconds from 0 (never spin) to {SPIN_US_MAX}"
        )
    return micros / 1e6


def wait_mechanism(value: str | None = None) -> str:
    """How waits wake: the argument, else ``$RALPH_WAIT``, else ``auto``; ``poll`` when
    ``WATCHFILES_FORCE_POLLING`` is set (watchfiles' own switch) and nothing else is.

    >>> wait_mechanism("poll")
    'poll'
    """
    raw = value if value is not None else os.environ.get("RALPH_WAIT", "").strip().lower()
    if not raw:
        forced = os.environ.get("WATCHFILES_FORCE_POLLING", "").strip().lower()
        return "poll" if forced and forced not in {"false", "disable", "disabled", "0"} else "auto"
    if raw not in WAIT_MECHANISMS:
        from ralph_mail.errors import MailError

        raise MailError(f"invalid RALPH_WAIT={raw!r}: give one of {', '.join(WAIT_MECHANISMS)}")
    return raw
