"""The storage seam: what the library keeps, and the interface every backend implements.

`MessageBus`, `History`, the orchestrator and the faces above them use these primitives
alone; only a backend touches files (the file backend, `ralph_mail.store.files`) or the
network. `TeamStore` is a small set of `Primitives` plus records built over them: a second
backend implements `Backend` and the primitives, inherits the records from
`ralph_mail.store.records.Records` (overriding one only to do it faster), and passes the
contract suite (tests/storage/test_store_contract.py), as huey's storage backends pass its
StorageTests.

Logs. An inbox is named by its agent; a channel's log by ``#NAME``: the same primitives
keep both. A channel's compaction keeps what its least advanced member has not read.

Offsets. An inbox is a log of lines addressed by *logical* byte offsets: they start at 0
when the inbox is made and only grow, across compactions. A cursor is a floor (everything
below it is consumed) plus the starts of lines consumed out of order above it. When an
inbox is replaced by something the backend cannot relate to the old one (a team deleted
and re-created, an inbox file replaced by hand), `TeamStore.read` continues at the new
inbox's start, which is lower than the offset asked for, and `TeamStore.load_cursor`
returns that start: the owner sees the new inbox from its beginning.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

from ralph_mail.errors import InvalidName

if TYPE_CHECKING:
    from ralph_mail.store.health import Finding
    from ralph_mail.store.search import Query


class StopEvent(Protocol):
    """Anything with ``is_set()``, such as `threading.Event`: a wait returns when it is set."""

    def is_set(self) -> bool: ...


#: The longest key of a team log, a state or a rate: a prefix and a name (``held.NAME``,
#: ``orchestrator.NAME``, ``channel.NAME``, ``rate.NAME``) is longer than a name of 64.
KEY_MAX: Final = 128
_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def check_key(key: object, what: str = "key") -> str:
    """Return ``key`` if it may name a team log, a state or a rate, else raise
    `InvalidName`: like a name, but up to `KEY_MAX` characters, so that every key made
    of a prefix and a valid name is one (a path, ``../x``, never is).

    >>> check_key("held." + "a" * 64, "log name")[:7]
    'held.aa'
    """
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise InvalidName(
            f"invalid {what} {key!r}: use 1-{KEY_MAX} letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return key


@dataclass
class Cursor:
    """An owner's read position in its inbox.

    Attributes:
        floor: logical offset below which every line is consumed.
        acked: start offsets of lines above the floor consumed out of order
            (`MessageBus.wait_for_message` takes one type and leaves the rest).
    """

    floor: int = 0
    acked: set[int] = field(default_factory=set)

    def passed(self, offset: int) -> bool:
        """Whether the line at ``offset`` is consumed."""
        return offset < self.floor or offset in self.acked


@dataclass(frozen=True, slots=True)
class Compaction:
    """What one compaction of one inbox did.

    Attributes:
        agent: whose inbox.
        removed: bytes of consumed lines dropped from its front (0: nothing to do).
        kept: bytes left: the unconsumed lines.
        base: the inbox's base afterwards (the logical offset of its first byte).
        messages: how many messages (lines) were dropped.
    """

    agent: str
    removed: int
    kept: int
    base: int
    messages: int = 0


class Waiter(Protocol):
    """Blocks until one of the inboxes it was made for may have changed."""

    def wait(self, timeout: float, stop: StopEvent | None = None) -> bool:
        """Block up to ``timeout`` seconds or until ``stop``; True when something changed.

        A True is only a hint: the caller reads to the end of its inbox afterwards.
        """

    def caught_up(self) -> bool:
        """Whether a wait now returns at once for any line stored after the last one the
        waiting thread read (so that a read before the wait finds nothing it would not
        bring): only a waiter that brings the lines can say so."""

    def close(self) -> None:
        """Stop waiting and release what the waiter holds."""


class Primitives(Protocol):
    """What a backend must provide: the rest of `TeamStore` is records over these
    (`ralph_mail.store.records.Records` writes them once).

    An append-only log per name with logical offsets (`create_log`, `append`, `read`,
    `read_tail`, `size`, `read_line`); a key/value with versions (`load_state`,
    `save_state`, `update_state`, `state_version`); a rate (`take`); one consumer per
    inbox (`claim`, `release`, `consumer`); a `waiter`; the `roster`; `close`. And what
    only the backend can do well, because it owns where the bytes are: compaction and
    its archive (`compact`, `collectable`, `read_audit`, `purge_archive`) and
    the search of the audit trail (`search`, `forget_archived`).
    """

    team: str
    durable: bool

    # The roster.
    def roster(self) -> bytes:
        """The team's roster document (``team.json``) as stored."""

    def update_roster(self, change: Callable[[bytes], bytes]) -> None:
        """Replace the roster with ``change(roster)``, atomically, one change at a time."""

    # Logs: an append-only log per name (an inbox, ``#NAME``, or a record log of
    # `ralph_mail.store.records`), addressed by logical byte offsets.
    def create_log(self, key: str) -> None:
        """Make the empty log ``key`` (a channel: ``#NAME``); `FileExistsError` when it
        exists. Every inbox primitive then takes ``key`` as an agent's name."""

    def append(self, agent: str, head: bytes, tail: bytes) -> tuple[str, int]:
        """Append the line ``head + ts + tail`` to ``agent``'s inbox; return the ts and
        the logical offset the line starts at.

        The ts (`ralph_mail.message.format_ts`) is taken under the inbox's lock and never
        goes below the inbox's last one. When this returns, the line is stored (and on
        disk when ``durable``); when it raises, nothing a reader would deliver was stored.
        """

    def read(self, agent: str, offset: int, *, skip_collected: bool = False) -> tuple[bytes, int]:
        """Whole lines of ``agent``'s inbox from logical ``offset``, and the offset they
        start at (``offset``, or the new inbox's start after a replacement, or with
        ``skip_collected`` the first offset still kept). A read may return less than
        everything: call again until it returns no bytes."""

    def read_tail(self, agent: str, lines: int) -> tuple[list[bytes], int]:
        """The last ``lines`` whole lines and the logical offset after them; costs
        O(lines), not O(inbox)."""

    def size(self, agent: str) -> int:
        """The logical offset of the inbox's end."""

    def read_line(self, agent: str, offset: int, length: int) -> bytes | None:
        """The line of ``length`` bytes at logical ``offset`` of ``agent``'s inbox, or of
        its archive once gc collected it; None when it is no longer kept (purged)."""

    # What gc and the audit trail need of the backend: compaction, its archive, search.
    def compact(
        self,
        agent: str,
        min_bytes: int = 1,
        *,
        timeout: float = 0.0,
        drop_before: str | None = None,
    ) -> Compaction:
        """Drop the lines below the owner's committed floor; offsets stay valid. What is
        dropped is archived first (`read_audit`), but the lines older than
        ``drop_before`` (a ts) when nothing older is archived. ``timeout``: how long to
        wait for a sender's lock (`LockTimeout` after)."""

    def collectable(self, agent: str, floor: int) -> int:
        """Bytes below ``floor`` still kept: a cheap test of whether to compact."""

    def read_audit(self, agent: str, offset: int) -> tuple[bytes, int]:
        """Like `read`, over everything ever delivered to ``agent``: below the inbox's
        start (what gc collected) the lines come from its archive. Returns
        ``(data, start)``, ``start`` above ``offset`` when that part was purged."""

    def purge_archive(self, agent: str, before: str, *, timeout: float = 0.0) -> int:
        """Drop ``agent``'s archived lines older than ``before`` (a ts); return the
        logical offset its audit trail starts at now."""

    def search(self, query: Query) -> list[bytes]:
        """The lines of every message ever delivered in the team (the audit trail) that
        match ``query``, newest first; the derived index is brought up to date first."""

    def forget_archived(self, agent: str, offset: int) -> None:
        """Drop from the search index what ``agent``'s audit trail no longer holds below
        ``offset`` (after `purge_archive`)."""

    # A key/value with versions.
    def load_state(self, key: str) -> bytes | None:
        """The bytes last saved under ``key`` (a name), or None."""

    def save_state(self, key: str, data: bytes) -> None:
        """Replace what is saved under ``key``, atomically and durably."""

    def update_state(self, key: str, change: Callable[[bytes | None], bytes]) -> None:
        """Replace what is saved under ``key`` with ``change(what is saved now)``, with no
        other update of any key in between (what ``change`` raises is raised; nothing is
        saved then)."""

    def state_version(self, key: str) -> tuple[int, ...] | None:
        """Something that changes whenever ``key`` is saved again (its size among it),
        cheaply, or None when nothing is saved: a cache of the state checks it."""

    # Processes: a rate, one consumer per inbox, waking.
    def take(self, key: str, limit: int, window: float) -> float:
        """Count one event under ``key`` if fewer than ``limit`` were counted in the last
        ``window`` seconds, and return 0.0; else count nothing and return how many
        seconds until one leaves the window. Atomic across every process of the team.
        """

    def claim(self, agent: str) -> None:
        """Become the one consumer of ``agent``'s inbox, for this process, until
        `release`; `InboxBusy` naming the holder when another process consumes it."""

    def release(self, agent: str) -> None:
        """Stop being its consumer (a killed process stops at once, too)."""

    def consumer(self, agent: str) -> int | None:
        """The pid of a live process consuming ``agent``'s inbox now (a claim), or None."""

    def waiter(self, agents: list[str]) -> Waiter:
        """A `Waiter` woken by changes to these inboxes only (``#NAME``: a channel's log;
        ``log:NAME``: a team log; ``commits:AGENT``: the commits of that inbox's owner)."""

    def close(self) -> None:
        """Release descriptors, connections and claims; the store may be used again."""


class TeamStore(Primitives, Protocol):
    """Everything one team keeps: the `Primitives`, and records built over them.

    The records: the tails of several logs at once (`read_tails`), cursors
    (`load_cursor`, `save_cursor`, `drop_cursor`), presence
    (`save_presence`, `load_presence`), set-aside lines (`dead_letter`, `dead_letters`),
    indexes of lines (conversations, threads: `index_add`, `index_extend`,
    `index_start`, `index_tail`),
    team logs (the task log: `log_append`, `log_read`), commit times (`note_commit`,
    `consumed_at`), gc over `compact` (`collect`) and `state_where`. `Records` implements
    each over the primitives; a backend overrides one only to do it faster (the file and
    NATS backends keep their own, in their own formats).
    """

    # Reading several logs at once.
    def read_tails(self, agents: list[str], lines: int) -> list[tuple[list[bytes], int]]:
        """`read_tail` of each of ``agents``, in order: at once where the backend can
        (a network backend in a round trip or two, not two each)."""

    # Cursors (keyed state).
    def load_cursor(self, agent: str) -> Cursor:
        """The owner's persisted cursor (the inbox start when it never committed);
        ``#NAME@MEMBER``: a member's cursor in channel NAME's log."""

    def save_cursor(self, agent: str, cursor: Cursor) -> None:
        """Persist ``cursor``: afterwards a crash leaves the old cursor or this one. A
        backend may send it and go on (NATS: its answer is read with the next request);
        a save it could not make then raises at the next save, read or `settle_cursor`
        of the owner's inbox."""

    def settle_cursor(self, agent: str) -> None:
        """Return once the last `save_cursor` of ``agent``'s owner is stored, raising as
        it would have: what must not be handed on before its cursor is (a command that
        prints what it consumed)."""

    def drop_cursor(self, key: str) -> None:
        """Forget cursor ``key`` (a member leaving a channel); nothing when there is none."""

    # Presence (keyed state).
    def save_presence(self, agent: str, record: bytes) -> None:
        """Keep ``record`` as ``agent``'s presence (cheap: called about once a second)."""

    def load_presence(self, agent: str) -> bytes | None:
        """The last presence record of ``agent``, or None."""

    # Record logs: dead letters, indexes of lines, team logs.
    def dead_letter(self, agent: str, offset: int, line: bytes, reason: str) -> None:
        """Record a line of ``agent``'s inbox that was set aside, and why."""

    def dead_letters(self, agent: str) -> list[dict[str, Any]]:
        """Every dead letter recorded for ``agent``'s inbox, oldest first."""

    def index_add(self, key: str, agent: str, offset: int, length: int) -> None:
        """Note that the line at ``offset`` (``length`` bytes) of ``agent``'s inbox belongs
        to index ``key`` (a conversation between two agents, a thread)."""

    def index_extend(self, key: str, entries: list[tuple[str, int, int]]) -> None:
        """`index_add` each of ``entries``, ``(agent, offset, length)``, in order: a
        broadcast's copies, in one write where the backend can."""

    def index_start(self, key: str) -> None:
        """Note that index ``key`` (a thread) begins now: nothing added before belongs
        to it, so `index_tail` need not look further back (a backend whose indexes are
        one per key has nothing to do)."""

    def index_tail(self, key: str, count: int) -> list[tuple[str, int, int]]:
        """The last ``count`` entries of index ``key``, oldest first, as
        ``(agent, offset, length)``: O(count), whatever else the team holds (a thread:
        at most what was indexed since its `index_start`)."""

    def log_append(self, name: str, record: bytes) -> None:
        """Append one record (a line, newline included) to the team log ``name`` (the
        task log): whole, in order, from any number of processes."""

    def log_read(self, name: str) -> bytes:
        """The team log ``name``: its whole lines (a record cut short is left out)."""

    # Commit times: when each line of an inbox was consumed (receipts).
    def note_commit(self, agent: str, before: Cursor, after: Cursor) -> None:
        """Record, once `save_cursor` is done, that the cursor of ``agent``'s owner just
        went from ``before`` to ``after``, now: its floors, the line it consumed out of
        order (if one), and whether the floor passed lines consumed so before. One small
        append; a waiter for ``commits:AGENT`` wakes on it. What `consumed_at` reads."""

    def consumed(self, agent: str, offset: int) -> bool:
        """Whether the owner of ``agent``'s inbox consumed the line at ``offset``: its
        cursor passed it, or, where a commit's cursor is stored a moment after its commit
        time (NATS: a commit does not wait for its cursor's write), the last commit did.
        What a waiter woken by ``commits:AGENT`` looks at."""

    def consumed_at(self, agent: str, offset: int, since: str) -> str | None:
        """When the owner's cursor first passed the line at ``offset`` of ``agent``'s
        inbox (stored at ts ``since``), as a ts; None when the commits kept do not say
        (not consumed yet, consumed before commit times were kept, or their record was
        dropped with the lines gc collected). Costs O(log commits), whatever the inbox
        holds."""

    # gc, over `compact`.
    def collect(
        self, logs: list[str], min_bytes: int, drop_before: str | None, timeout: float
    ) -> tuple[tuple[Compaction, ...], tuple[Path, ...]]:
        """gc: `compact` each of ``logs`` (inboxes and ``#NAME`` channel logs), with the
        backend's own housekeeping around it (the file backend: one run at a time per
        team, waited for up to ``timeout`` seconds, and the temp files of killed runs
        removed); return the compactions and what was removed."""

    def state_where(self, key: str) -> str:
        """Where ``key`` is kept, for a person fixing it by hand."""


class Backend(Protocol):
    """Where teams live: one per home (the file backend) or server (a network backend)."""

    def create_team(self, name: str, agents: list[str], roster: bytes) -> None:
        """Create a team with an empty inbox per agent, whole or not at all;
        `FileExistsError` when it exists."""

    def read_roster(self, name: str) -> bytes:
        """A team's roster; `FileNotFoundError` when there is no such team."""

    def team_names(self) -> list[str]:
        """The names of the teams, sorted."""

    def remove_team(self, name: str) -> None:
        """Delete a team and all it keeps, at once and whole."""

    def doctor(self, team: str | None, lock_wait: float) -> list[Finding]:
        """Check what this backend's guarantees rest on, for every team (or ``team``),
        changing nothing: each problem with its fix."""

    def where(self) -> str:
        """What `doctor` checked, as a person names it (a home, a server's URL)."""

    def team_store(self, name: str, *, durable: bool = False) -> TeamStore:
        """The `TeamStore` of team ``name`` (its files are opened when first used)."""
