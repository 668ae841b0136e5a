"""Records: cursors, presence, dead letters, indexes and team logs, written once over the
storage primitives (`ralph_mail.store.base.Primitives`).

A backend inherits `Records`, implements the primitives, and has every record method of
`TeamStore`, as huey's storage backends inherit `BaseStorage`'s helpers. It overrides one
only to do it faster: the file and NATS backends keep their own, in their own formats;
the memory backend uses these.

What a backend built on these defaults keeps:

- Cursors are state. ``cursor.AGENT`` holds the owner's cursor of inbox AGENT as
  ``{"floor": N, "acked": [N, ...]}`` (JSON; saved empty when dropped: the key/value has
  no delete). ``cursors.NAME`` holds the cursors of channel ``#NAME``'s members as one
  map ``{"MEMBER": cursor, ...}``, changed with `update_state`: members saving at once
  never lose each other's cursor, and compaction reads them all in one load.
- Presence is state ``presence.AGENT``: the record as given.
- Record logs are logs, made by the first record that needs one (`create_log`) and named
  with a colon, which no agent's or channel's name has: ``log:NAME`` a team log (the name
  a waiter is given for it), ``dead:AGENT`` the dead letters of an inbox or a channel,
  ``index:KEY`` an index. Each line is ``TS PAYLOAD``: the ts `append` stamps, a space,
  then a team log's record, a dead letter as a JSON object, or an index entry as the JSON
  array ``[agent, offset, length]``. A backend's search and gc leave them out
  (`is_record_log`).
- Commit times are the record log ``commits:AGENT``: a line per commit of that inbox's
  owner, all of one width (`COMMIT_LINE` bytes: the ts, then the floor before, the floor
  after and the line consumed out of order, or -1, in 20 characters each, then 1 when
  the floor passed lines consumed out of order, else 0), so the k-th is at offset
  ``k * COMMIT_LINE`` and a lookup bisects (`when_consumed`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, Final

from ralph_mail import codec
from ralph_mail.message import format_ts, parse_ts
from ralph_mail.store.base import Cursor, check_key

if TYPE_CHECKING:
    from pathlib import Path

    from ralph_mail.store.base import Compaction, Primitives


#: How much earlier than a line's ts the commit that consumed it may be stamped: the
#: clocks of the sender's and the owner's processes (on NATS, hosts) may differ by that.
CLOCK_SLACK_US: Final = 1_000_000
#: How many commits made after a line was stored are searched for the one that consumed
#: it out of order; past them the time is not known (None), never guessed.
MARK_SCAN: Final = 4096
#: The width of a line of ``commits:AGENT`` (see the module docstring).
COMMIT_LINE: Final = 27 + 3 * 21 + 2 + 1


@dataclass(frozen=True, slots=True)
class Commit:
    """One commit of an inbox's owner, as `TeamStore.note_commit` records it.

    Attributes:
        before: the floor before it.
        floor: the floor after it: every line below is consumed.
        mark: the line it consumed out of order (its offset), or -1.
        time: when, in microseconds since the epoch.
        passed: whether its floor passed lines consumed out of order before it.
    """

    before: int
    floor: int
    mark: int
    time: int
    passed: bool = False


def marks(before: Cursor, after: Cursor) -> tuple[int, bool]:
    """The line a commit from ``before`` to ``after`` consumed out of order (-1: none),
    and whether its floor passed lines consumed out of order before it."""
    if not (before.acked or after.acked):  # the common case, on every commit: at once
        return -1, False
    mark = max(after.acked - before.acked, default=-1)
    return mark, any(start < after.floor for start in before.acked)


def first_where(low: int, high: int, test: Callable[[int], bool]) -> int:
    """The first ``k`` in ``[low, high)`` for which ``test(k)`` holds (it holds for every
    ``k`` after), or ``high``."""
    while low < high:
        middle = (low + high) // 2
        if test(middle):
            high = middle
        else:
            low = middle + 1
    return low


def when_consumed(
    offset: int,
    since: str,
    low: int,
    high: int,
    at: Callable[[int], Commit],
    between: Callable[[int, int], tuple[Sequence[Commit], bool]],
) -> str | None:
    """`TeamStore.consumed_at` over the commits at positions ``low`` .. ``high - 1``, in
    the order they were made (floors never go down, times neither): ``at(k)`` is the
    commit at (or first after) position ``k``; ``between(a, b)`` the commits from ``a``
    to before ``b``, `MARK_SCAN` at most, and whether that is all of them.

    The commit that passed the line is the first whose floor is above it, if its floor
    before was not (else the one that did was dropped: not known). When that commit
    passed no line consumed out of order, it is the answer; else the line may have been
    consumed out of order earlier, after it was stored: those commits are searched for
    its mark.
    """
    look = cache(at)
    passing = first_where(low, high, lambda k: look(k).floor > offset)
    passed = passing < high and look(passing).before <= offset
    if passed and not look(passing).passed:
        return format_ts(look(passing).time)
    stored = micros(since) - CLOCK_SLACK_US
    start = first_where(low, passing, lambda k: look(k).time >= stored)
    scanned, whole = between(start, passing)
    for commit in scanned:
        if commit.mark == offset:
            return format_ts(commit.time)
    return format_ts(look(passing).time) if passed and whole else None


def micros(ts: str) -> int:
    """A ts as microseconds since the epoch."""
    return round(parse_ts(ts) * 1_000_000)


def is_record_log(name: str) -> bool:
    """Whether log ``name`` holds records (a team log, dead letters, an index), not mail."""
    return ":" in name


class Records:
    """The record methods of `TeamStore`, over the primitives (see the module docstring).

    Each method is typed on `Primitives`: a subclass provides them, nothing else.
    """

    def read_tails(
        self: Primitives, agents: list[str], lines: int
    ) -> list[tuple[list[bytes], int]]:
        """`read_tail` of each of ``agents``, in order."""
        return [self.read_tail(agent, lines) for agent in agents]

    def load_cursor(self: Primitives, agent: str) -> Cursor:
        """The owner's persisted cursor (the inbox start when it never committed);
        ``#NAME@MEMBER``: a member's cursor in channel NAME's log."""
        log, member = _reader(agent)
        if member is None:
            saved = _cursor(self.load_state(f"cursor.{agent}"))
        else:
            saved = _members(self.load_state(_members_key(log))).get(member)
        return saved if saved is not None else Cursor(_start(self, log))

    def save_cursor(self: Primitives, agent: str, cursor: Cursor) -> None:
        """Persist ``cursor``: afterwards a crash leaves the old cursor or this one."""
        record = {"floor": cursor.floor, "acked": sorted(cursor.acked)}
        log, member = _reader(agent)
        if member is None:
            self.save_state(f"cursor.{agent}", codec.dumps(record))
        else:
            self.update_state(_members_key(log), lambda raw: _with(raw, member, record))

    def settle_cursor(self: Primitives, agent: str) -> None:
        """Nothing to wait for: `save_cursor` returns once it is stored."""

    def drop_cursor(self: Primitives, key: str) -> None:
        """Forget cursor ``key`` (a member leaving a channel); nothing when there is none."""
        log, member = _reader(key)
        if member is None:
            if self.load_state(f"cursor.{key}"):
                self.save_state(f"cursor.{key}", b"")
        elif member in _members(self.load_state(_members_key(log))):
            self.update_state(_members_key(log), lambda raw: _with(raw, member, None))

    def least_floor(self: Primitives, log: str) -> int:
        """The least floor of ``log``'s readers (its owner, or a channel's members), or the
        log's start when none has a cursor: what a compaction may drop below."""
        if log.startswith("#"):
            floors = [c.floor for c in _members(self.load_state(_members_key(log))).values()]
        else:
            saved = _cursor(self.load_state(f"cursor.{log}"))
            floors = [saved.floor] if saved is not None else []
        return min(floors, default=_start(self, log))

    def save_presence(self: Primitives, agent: str, record: bytes) -> None:
        """Keep ``record`` as ``agent``'s presence (cheap: called about once a second)."""
        self.save_state(f"presence.{agent}", record)

    def load_presence(self: Primitives, agent: str) -> bytes | None:
        """The last presence record of ``agent``, or None."""
        return self.load_state(f"presence.{agent}")

    def dead_letter(self: Primitives, agent: str, offset: int, line: bytes, reason: str) -> None:
        """Record a line of ``agent``'s inbox that was set aside, and why."""
        record = {"inbox": agent, "offset": offset, "reason": reason,
                  "line": line.decode("utf-8", "backslashreplace")}  # fmt: skip
        _put(self, f"dead:{agent}", codec.dumps(record))

    def dead_letters(self: Primitives, agent: str) -> list[dict[str, Any]]:
        """Every dead letter recorded for ``agent``'s inbox, oldest first (its ts first)."""
        lines = _lines(self, f"dead:{agent}")
        return [{"ts": ts, **codec.loads(payload)} for ts, payload in lines]

    def index_add(self: Primitives, key: str, agent: str, offset: int, length: int) -> None:
        """Note that the line at ``offset`` (``length`` bytes) of ``agent``'s inbox belongs
        to index ``key`` (a conversation between two agents, a thread)."""
        _put(self, f"index:{key}", codec.dumps([agent, offset, length]))

    def index_extend(self: Primitives, key: str, entries: list[tuple[str, int, int]]) -> None:
        """Note several lines of index ``key``, in order (as `index_add` does each)."""
        for agent, offset, length in entries:
            _put(self, f"index:{key}", codec.dumps([agent, offset, length]))

    def index_start(self: Primitives, key: str) -> None:
        """An index here is a log of its own: nothing before its first entry to skip."""

    def index_tail(self: Primitives, key: str, count: int) -> list[tuple[str, int, int]]:
        """The last ``count`` entries of index ``key``, oldest first, as
        ``(agent, offset, length)``: O(count), as `read_tail` is."""
        if count <= 0:
            return []
        _make(self, f"index:{key}")
        lines, _ = self.read_tail(f"index:{key}", count)
        entries = (codec.loads(line.partition(b" ")[2]) for line in lines)
        return [(agent, offset, length) for agent, offset, length in entries]

    def log_append(self: Primitives, name: str, record: bytes) -> None:
        """Append one record (a line, newline included) to the team log ``name`` (the
        task log): whole, in order, from any number of processes."""
        _put(self, f"log:{check_key(name, 'log name')}", record.removesuffix(b"\n"))

    def log_read(self: Primitives, name: str) -> bytes:
        """The team log ``name``: its whole lines (a record cut short is left out)."""
        lines = _lines(self, f"log:{check_key(name, 'log name')}")
        return b"".join(payload + b"\n" for _, payload in lines)

    def note_commit(self: Primitives, agent: str, before: Cursor, after: Cursor) -> None:
        """Record a commit of ``agent``'s owner: a line of ``commits:AGENT``, stamped now."""
        fields = (before.floor, after.floor, *marks(before, after))
        _put(self, f"commits:{agent}", b"%020d %020d %020d %d" % fields)

    def consumed(self: Primitives, agent: str, offset: int) -> bool:
        """Whether the owner's cursor passed the line at ``offset`` (saved before its
        commit time is recorded)."""
        return Records.load_cursor(self, agent).passed(offset)

    def consumed_at(self: Primitives, agent: str, offset: int, since: str) -> str | None:
        """When the owner's cursor first passed the line at ``offset`` (see `when_consumed`)."""
        log = f"commits:{agent}"
        _make(self, log)
        end = self.size(log) // COMMIT_LINE
        first = _start(self, log) // COMMIT_LINE

        def at(k: int) -> Commit:
            line = self.read_line(log, k * COMMIT_LINE, COMMIT_LINE) or b""
            stamp, before, floor, mark, passed = line.split()
            return Commit(int(before), int(floor), int(mark), micros(stamp.decode()),
                          passed == b"1")  # fmt: skip

        def between(low: int, high: int) -> tuple[list[Commit], bool]:
            return [at(k) for k in range(low, min(high, low + MARK_SCAN))], high - low <= MARK_SCAN

        return when_consumed(offset, since, first, end, at, between)

    def collect(
        self: Primitives, logs: list[str], min_bytes: int, drop_before: str | None, timeout: float
    ) -> tuple[tuple[Compaction, ...], tuple[Path, ...]]:
        """gc: `compact` each of ``logs``, one after the other; a backend with housekeeping
        of its own (runs to serialise, temp files to remove) does it here."""
        compactions = tuple(self.compact(log, min_bytes, drop_before=drop_before) for log in logs)
        return compactions, ()

    def state_where(self: Primitives, key: str) -> str:
        """Where ``key`` is kept, for a person fixing it by hand."""
        return f"state {check_key(key, 'state key')!r} of team {self.team!r}"


def _reader(key: str) -> tuple[str, str | None]:
    """A cursor's key as its log and, in a channel (``#NAME@MEMBER``), the member."""
    log, _, member = key.partition("@")
    return (log, member) if log.startswith("#") and member else (key, None)


def _members_key(channel: str) -> str:
    return f"cursors.{channel.removeprefix('#')}"


def _cursor(raw: bytes | None) -> Cursor | None:
    if not raw:
        return None
    record = codec.loads(raw)
    return Cursor(record["floor"], set(record["acked"]))


def _members(raw: bytes | None) -> dict[str, Cursor]:
    found = codec.loads(raw) if raw else {}
    return {member: Cursor(c["floor"], set(c["acked"])) for member, c in found.items()}


def _with(raw: bytes | None, member: str, record: dict[str, Any] | None) -> bytes:
    """A channel's cursor map with ``member``'s cursor replaced (None: removed)."""
    found: dict[str, Any] = codec.loads(raw) if raw else {}
    if record is None:
        found.pop(member, None)
    else:
        found[member] = record
    return codec.dumps(found)


def _start(store: Primitives, log: str) -> int:
    """The first offset ``log`` still keeps: its end less what a compaction could drop."""
    end = store.size(log)
    return end - store.collectable(log, end)


def _make(store: Primitives, log: str) -> None:
    """Make record log ``log`` unless it exists (the first record made it, or another
    process did at the same time)."""
    with suppress(FileExistsError):
        store.create_log(log)


def _put(store: Primitives, log: str, payload: bytes) -> None:
    _make(store, log)
    store.append(log, b"", b" " + payload + b"\n")


def _lines(store: Primitives, log: str) -> Iterator[tuple[str, bytes]]:
    """Each line of record log ``log`` from its start, as its ts and its payload."""
    _make(store, log)
    offset = 0
    while True:
        data, offset = store.read(log, offset, skip_collected=True)
        if not data:
            return
        for line in data.splitlines():
            ts, _, payload = line.partition(b" ")
            yield ts.decode(), payload
        offset += len(data)


__all__ = ["Commit", "Records", "first_where", "is_record_log", "when_consumed"]
