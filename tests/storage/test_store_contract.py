"""The storage contract: what every backend behind `TeamStore` must do.

Each test runs once per backend (the ``backend`` parameter); a new backend joins the list
in `make_store` and must pass the same suite, as huey's backends pass its StorageTests.
It runs too on `PrimitivesOnly`: the primitives of a memory store and nothing else of it,
with the records `Records` writes over them, which is all a new backend has to provide.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest

from ralph_mail.errors import InboxBusy, MailError
from ralph_mail.message import encode_parts
from ralph_mail.store import Cursor, Primitives, TeamStore, backend
from ralph_mail.store.memory import MemoryStore
from ralph_mail.store.records import Records
from tests.helpers.backends import BACKENDS, backend_url

#: The methods a backend must write itself: everything else `Records` provides.
PRIMITIVES = frozenset(
    name for name, value in vars(Primitives).items() if callable(value) and name[0] != "_"
)


class PrimitivesOnly(Records):
    """A store that is a memory store's primitives alone plus `Records`: a record that
    used anything else of the memory store would raise AttributeError here."""

    def __init__(self, inner: MemoryStore) -> None:
        self._inner = inner
        self.team = inner.team
        self.durable = inner.durable

    def __getattr__(self, name: str) -> Any:
        if name not in PRIMITIVES:
            raise AttributeError(f"{name!r} is not a primitive")
        return getattr(self._inner, name)


@pytest.fixture(params=[*BACKENDS, "primitives"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> TeamStore:
    """A team 'c' with inboxes a and b, in a fresh place of the backend under test."""
    kind = "memory" if request.param == "primitives" else request.param
    place = backend(tmp_path / "home", backend_url(kind, tmp_path))
    place.create_team("c", ["a", "b"], b'{"name": "c", "lead": "a", "members": []}')
    made = place.team_store("c")
    request.addfinalizer(made.close)
    if request.param == "primitives":
        assert isinstance(made, MemoryStore)
        return cast(TeamStore, PrimitivesOnly(made))
    return made


def test_the_memory_store_keeps_its_records_with_the_defaults() -> None:
    """The memory backend writes the primitives and inherits every record, so the suite's
    run on it is a run of `Records`' defaults (its one override only names its place)."""
    records = {name for name, value in vars(Records).items() if callable(value)}
    assert not records & PRIMITIVES
    assert sorted(records & set(vars(MemoryStore))) == ["state_where"]


def line(text: str) -> tuple[bytes, bytes]:
    """A message line with an id of its own (a backend may store a repeated id once: a
    retried send)."""
    envelope = {"id": f"{next(_IDS):012x}", "from": "a", "to": "b", "type": "text",
                "content": text, "metadata": {}, "ts": ""}  # fmt: skip
    return encode_parts(envelope, 1 << 20)


_IDS = itertools.count(1)


def lines_from(store: TeamStore, agent: str, offset: int = 0) -> list[bytes]:
    out: list[bytes] = []
    while True:
        data, offset = store.read(agent, offset)
        if not data:
            return out
        out += data.split(b"\n")[:-1]
        offset += len(data)


def test_append_returns_increasing_timestamps_and_offsets(store: TeamStore) -> None:
    """Each append returns its ts (never decreasing) and the offset its line starts at."""
    done = [store.append("b", *line(str(n))) for n in range(50)]
    stamps = [ts for ts, _ in done]
    assert stamps == sorted(stamps) and all(s.endswith("Z") for s in stamps)
    lines = lines_from(store, "b")
    starts = [sum(len(x) + 1 for x in lines[:n]) for n in range(50)]
    assert [offset for _, offset in done] == starts


def test_read_line_returns_the_line_at_an_offset(store: TeamStore) -> None:
    """read_line(offset, length) is exactly the line appended there."""
    store.append("b", *line("first"))
    head, tail = line("second")
    _, offset = store.append("b", head, tail)
    found = store.read_line("b", offset, len(head) + 27 + len(tail))
    assert found is not None and b'"second"' in found and found.endswith(b"\n")


def test_index_tail_returns_the_last_entries_oldest_first(store: TeamStore) -> None:
    """index_tail(key, n) is the last n entries added under key, oldest first."""
    for n in range(10):
        store.index_add("pair+a+b", "b" if n % 2 else "a", n * 100, 50)
    assert store.index_tail("pair+a+b", 3) == [("b", 700, 50), ("a", 800, 50), ("b", 900, 50)]
    assert store.index_tail("pair+x+y", 3) == []


def test_read_returns_whole_lines_in_append_order(store: TeamStore) -> None:
    """A read from 0 returns every appended line, in order, each whole."""
    for n in range(20):
        store.append("b", *line(f"m{n}"))
    got = lines_from(store, "b")
    assert [b'"m%d"' % n in got[n] for n in range(20)] == [True] * 20


def test_read_from_the_end_returns_nothing(store: TeamStore) -> None:
    """Reading at the end offset returns no bytes and the same offset."""
    store.append("b", *line("x"))
    end = store.size("b")
    assert store.read("b", end) == (b"", end)


def test_read_tail_returns_the_last_lines_and_the_end(store: TeamStore) -> None:
    """read_tail(n) is the last n lines, and the offset after them is the end."""
    for n in range(30):
        store.append("b", *line(f"m{n}"))
    tail, end = store.read_tail("b", 3)
    assert [b'"m27"' in tail[0], b'"m29"' in tail[2], len(tail)] == [True, True, 3]
    assert end == store.size("b")


def test_read_tails_is_read_tail_of_each_in_order(store: TeamStore) -> None:
    """read_tails([a, b], n) is [read_tail(a, n), read_tail(b, n)], an empty inbox too."""
    for n in range(30):
        store.append("b", *line(f"m{n}"))
    assert store.read_tails(["a", "b"], 3) == [store.read_tail("a", 3), store.read_tail("b", 3)]
    store.append("a", *line("one"))
    for lines in (0, 1, 5, 40):
        expected = [store.read_tail(agent, lines) for agent in ("a", "b")]
        assert store.read_tails(["a", "b"], lines) == expected


def test_inboxes_are_separate(store: TeamStore) -> None:
    """An append to one inbox is not seen in another."""
    store.append("b", *line("for b"))
    assert lines_from(store, "a") == []


def test_cursor_round_trips(store: TeamStore) -> None:
    """A saved cursor (floor and out-of-order marks) loads back equal."""
    store.append("b", *line("x"))
    store.append("b", *line("y"))
    first = len(lines_from(store, "b")[0]) + 1
    store.save_cursor("b", Cursor(first, {first + 5}))
    assert store.load_cursor("b") == Cursor(first, {first + 5})


def test_a_holders_cursor_is_stored_once_settled_and_says_what_was_consumed(
    store: TeamStore,
) -> None:
    """The owner's commit may go out without waiting for its answer (NATS):
    `settle_cursor` returns once it is stored, and the next save goes over it. `consumed`
    says which lines a cursor passed: those below its floor and its marks."""
    for text in ("x", "y", "z"):
        store.append("b", *line(text))
    first = len(lines_from(store, "b")[0]) + 1
    store.claim("b")
    store.save_cursor("b", Cursor(first, {first + 2}))
    store.save_cursor("b", Cursor(first, {first + 2, first + 4}))
    store.settle_cursor("b")
    assert store.load_cursor("b") == Cursor(first, {first + 2, first + 4})
    assert [store.consumed("b", at) for at in (0, first, first + 2, first + 4)] == [
        True, False, True, True]  # fmt: skip
    store.release("b")


def test_a_new_cursor_starts_at_the_inbox_start(store: TeamStore) -> None:
    """With nothing saved, the cursor is at the first kept offset."""
    assert store.load_cursor("b") == Cursor(0)


def test_compaction_keeps_offsets_and_unread_lines(store: TeamStore) -> None:
    """Dropping the consumed front keeps the unread lines at their offsets."""
    for n in range(10):
        store.append("b", *line(f"m{n}"))
    before = lines_from(store, "b")
    floor = sum(len(x) + 1 for x in before[:6])
    store.save_cursor("b", Cursor(floor))
    done = store.compact("b")
    assert (done.removed, done.messages) == (floor, 6)
    assert lines_from(store, "b", floor) == before[6:]
    assert store.size("b") == sum(len(x) + 1 for x in before)


@pytest.mark.parametrize("kind", BACKENDS)
def test_ts_and_offsets_never_decrease_across_a_compaction_that_empties_the_inbox(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a compaction has dropped every line of an inbox and the wall clock has stepped
    back, the next append (by the store that compacted, or by a fresh one) is stamped no
    earlier than the inbox's last line ever was, at an offset past its end."""
    place = backend(tmp_path / "home", backend_url(kind, tmp_path))
    place.create_team("c", ["a", "b"], b'{"name": "c", "lead": "a", "members": []}')
    compacting, fresh = place.team_store("c"), place.team_store("c")
    try:
        last = ""
        for n in range(3):
            last, _ = compacting.append("b", *line(f"m{n}"))
        end = compacting.size("b")
        compacting.save_cursor("b", Cursor(end))
        assert compacting.compact("b").removed == end and compacting.read("b", end)[0] == b""
        now = time.time_ns
        monkeypatch.setattr(time, "time_ns", lambda: now() - 3600 * 10**9)  # an hour back
        for writer in (compacting, fresh):
            ts, offset = writer.append("b", *line("after"))
            assert ts >= last and offset >= end, (writer, ts, last, offset, end)
            last, end = ts, writer.size("b")
    finally:
        compacting.close()
        fresh.close()


def test_state_round_trips_and_replaces(store: TeamStore) -> None:
    """save_state replaces the bytes under a key; load_state returns None for none."""
    assert store.load_state("lead.state") is None
    store.save_state("lead.state", b"one")
    store.save_state("lead.state", b"two")
    assert store.load_state("lead.state") == b"two"


def test_state_keys_are_names(store: TeamStore) -> None:
    """A key that is not a name (a path) is refused."""
    with pytest.raises(MailError):
        store.save_state("../x", b"no")


def test_claim_is_reentrant_in_a_process(store: TeamStore) -> None:
    """The one consumer is a process: claiming twice from it works."""
    store.claim("b")
    store.claim("b")
    store.release("b")


def test_claim_is_refused_to_a_second_process(store: TeamStore, tmp_path: Path) -> None:
    """A second process's claim is refused with InboxBusy naming this process."""
    import multiprocessing
    import os

    if isinstance(store, MemoryStore | PrimitivesOnly):
        pytest.skip("an in-memory place lives in one process")
    store.claim("b")
    context = multiprocessing.get_context("spawn")
    result = context.Queue()
    url = getattr(store, "url", "")
    child = context.Process(target=_claim_in_child, args=(str(tmp_path / "home"), url, result))
    child.start()
    child.join(60)
    assert result.get(timeout=60) == f"busy {os.getpid()}"
    store.release("b")


def _claim_in_child(home: str, url: str, result: object) -> None:
    place = backend(Path(home), url)
    try:
        place.team_store("c").claim("b")
        result.put("claimed")  # type: ignore[attr-defined]
    except InboxBusy as exc:
        result.put(f"busy {exc.pid}")  # type: ignore[attr-defined]


def test_waiter_wakes_on_its_inbox(store: TeamStore) -> None:
    """A waiter on b wakes when b gets a line."""
    waiter = store.waiter(["b"])
    try:
        timer = threading.Timer(0.05, lambda: store.append("b", *line("wake")))
        timer.start()
        assert waiter.wait(30.0)
        timer.join()
    finally:
        waiter.close()


def test_reads_are_the_same_while_a_waiter_watches(store: TeamStore) -> None:
    """A backend may answer reads from what it pushes to a waiter (NATS does): reads of
    lines that came while a waiter watched return what they return without one."""
    store.append("b", *line("before"))
    waiter = store.waiter(["b"])
    try:
        parts = [line(f"after {n}") for n in range(5)]
        done = [store.append("b", *part) for part in parts]
        assert waiter.wait(30.0)
        while waiter.wait(0.2):  # until every line has been pushed
            pass
        wanted = [(head + ts.encode() + tail).rstrip(b"\n") for (ts, _), (head, tail)
                  in zip(done, parts, strict=True)]  # fmt: skip
        assert lines_from(store, "b")[1:] == wanted
        for (_, offset), text in zip(done, wanted, strict=True):
            assert store.read_line("b", offset, len(text) + 1) == text + b"\n"
            data, start = store.read("b", offset)
            assert start == offset and data.startswith(text + b"\n")
        end = store.size("b")
        assert end == done[-1][1] + len(wanted[-1]) + 1
        assert store.read("b", end) == (b"", end)
    finally:
        waiter.close()


def test_waiter_ignores_other_inboxes(store: TeamStore) -> None:
    """A waiter on b is not woken by appends to a."""
    waiter = store.waiter(["b"])
    try:
        for n in range(20):
            store.append("a", *line(str(n)))
        assert not waiter.wait(0.2)
    finally:
        waiter.close()


def test_a_team_log_keeps_whole_records_in_order(store: TeamStore) -> None:
    """log_append adds records in order; log_read returns them all, whole."""
    for n in range(5):
        store.log_append("tasks", b'{"n":%d}\n' % n)
    assert store.log_read("tasks").splitlines() == [b'{"n":%d}' % n for n in range(5)]
    assert store.log_read("other") == b""


def test_dead_letters_keep_each_set_aside_line_and_why(store: TeamStore) -> None:
    """dead_letter records a line, where it was and why; dead_letters returns them oldest
    first, with a ts, per inbox."""
    store.dead_letter("b", 0, b"not json", "unparseable")
    store.dead_letter("b", 9, b"\xff", "not utf-8")
    found = store.dead_letters("b")
    assert [(d["inbox"], d["offset"], d["reason"]) for d in found] == [
        ("b", 0, "unparseable"),
        ("b", 9, "not utf-8"),
    ]
    assert found[0]["line"] == "not json" and found[0]["ts"].endswith("Z")
    assert store.dead_letters("a") == []


def test_presence_is_the_last_record_saved(store: TeamStore) -> None:
    """load_presence returns the last record save_presence kept, or None."""
    assert store.load_presence("a") is None
    store.save_presence("a", b'{"state": "idle"}')
    store.save_presence("a", b'{"state": "working"}')
    assert store.load_presence("a") == b'{"state": "working"}'
    assert store.load_presence("b") is None


def envelope_line(message_id: str, sender: str, to: str, text: str) -> tuple[bytes, bytes]:
    envelope = {"id": message_id, "from": sender, "to": to, "type": "text",
                "content": text, "metadata": {}, "ts": ""}  # fmt: skip
    return encode_parts(envelope, 1 << 20)


def test_gc_archives_what_it_drops_and_the_audit_trail_keeps_every_line(
    store: TeamStore,
) -> None:
    """After compaction, read_audit from 0 returns every line ever appended, at the same
    offsets, and read_line finds an archived line; a second compaction appends on."""
    starts = [store.append("b", *line(f"m{n}"))[1] for n in range(6)]
    lines = lines_from(store, "b")
    store.save_cursor("b", Cursor(starts[4]))
    assert store.compact("b").messages == 4
    store.append("b", *line("m6"))
    store.save_cursor("b", Cursor(store.size("b")))
    assert store.compact("b").messages == 3
    audit, offset = [], 0
    while True:
        data, offset = store.read_audit("b", offset)
        if not data:
            break
        audit += data.split(b"\n")[:-1]
        offset += len(data)
    assert audit[:6] == lines and len(audit) == 7
    assert store.read_line("b", starts[1], len(lines[1]) + 1) == lines[1] + b"\n"


def test_purge_drops_archived_lines_older_than_a_time(store: TeamStore) -> None:
    """purge_archive removes archived lines before the time, keeps the rest and the inbox."""
    first = store.append("b", *line("old"))
    second = store.append("b", *line("new"))
    store.save_cursor("b", Cursor(store.size("b")))
    store.compact("b")
    start = store.purge_archive("b", second[0])
    assert start == second[1]
    data, at = store.read_audit("b", 0)
    assert at == second[1] and b'"new"' in data and b'"old"' not in data
    assert store.read_line("b", first[1], second[1] - first[1]) is None


def test_purge_never_drops_a_line_not_yet_consumed(store: TeamStore) -> None:
    """purge_archive drops the consumed lines older than the time, never an unread one."""
    store.append("b", *line("read"))
    unread = store.append("b", *line("unread"))
    later = store.append("b", *line("later"))
    store.save_cursor("b", Cursor(unread[1]))
    store.compact("b")
    assert store.purge_archive("b", later[0]) == unread[1]
    data, at = store.read("b", unread[1])
    assert at == unread[1] and b'"unread"' in data and b'"later"' in data


def test_search_finds_words_newest_first_archived_too(store: TeamStore) -> None:
    """search: every word must match, as a word; FTS syntax is plain text; filters; a
    broadcast copied into two inboxes is one result; archived lines are found."""
    from ralph_mail.store.search import Query

    store.append("b", *envelope_line("0000000000a1", "a", "b", "Q4 revenue was 2.4M"))
    store.append("b", *envelope_line("0000000000a2", "a", "b", 'a "quoted" AND (op) x*'))
    for inbox in ("a", "b"):
        store.append(inbox, *envelope_line("0000000000a3", "c", "*", "revenue meeting"))
    store.save_cursor("b", Cursor(store.size("b")))
    store.compact("b")
    found = [ln for ln in store.search(Query("revenue"))]
    assert [b"0000000000a3" in ln for ln in found] == [True, False]
    assert len(store.search(Query('"quoted" AND (op)'))) == 1
    assert store.search(Query("revenue", sender="c")) == found[:1]
    assert store.search(Query("", recipient="*")) == found[:1]
    assert store.search(Query("nothing-like-this")) == []
    with pytest.raises(MailError, match="NUL"):
        store.search(Query("a\x00b"))


def test_a_channel_log_is_an_inbox_with_a_cursor_per_member(store: TeamStore) -> None:
    """``#NAME`` is made by create_log (once), appended and read like an inbox; each member
    has its own cursor ``#NAME@MEMBER``; compaction keeps what the least advanced member
    has not read, and a dropped cursor holds nothing back."""
    store.create_log("#general")
    with pytest.raises(FileExistsError):
        store.create_log("#general")
    _, first = store.append("#general", *line("one"))
    _, second = store.append("#general", *line("two"))
    assert [b'"one"' in x for x in lines_from(store, "#general")] == [True, False]
    assert store.load_cursor("#general@a") == Cursor(0)
    store.save_cursor("#general@a", Cursor(second))
    store.save_cursor("#general@b", Cursor(first))
    assert store.load_cursor("#general@a") == Cursor(second)
    assert store.compact("#general").removed == 0  # b read nothing yet
    store.drop_cursor("#general@b")
    assert store.compact("#general").removed == second
    assert lines_from(store, "#general", second)[0].endswith(b"}") and store.size("#general") > 0
    assert store.size("a") == 0  # the inboxes are untouched


def test_waiter_wakes_on_a_channel_and_a_team_log(store: TeamStore) -> None:
    """A waiter on ``#NAME`` wakes on a post; one on ``log:NAME`` on a team log record;
    neither wakes for an inbox."""
    store.create_log("#general")
    for key, write in (
        ("#general", lambda: store.append("#general", *line("post"))),
        ("log:passes", lambda: store.log_append("passes", b'{"n":1}\n')),
    ):
        waiter = store.waiter([key])
        try:
            store.append("a", *line("not for it"))
            assert not waiter.wait(0.1)
            timer = threading.Timer(0.05, write)
            timer.start()
            assert waiter.wait(30.0), key
            timer.join()
        finally:
            waiter.close()


def test_a_claim_is_not_refused_because_someone_looked(store: TeamStore) -> None:
    """`consumer` (who consumes this inbox? presence asks it) while a claim is made: the
    claim never fails for it, and the look says no one or the claimer."""
    stop = threading.Event()
    seen: list[int | None] = []

    def look() -> None:
        while not stop.is_set():
            seen.append(store.consumer("b"))

    looker = threading.Thread(target=look)
    looker.start()
    try:
        for _ in range(100):
            store.claim("b")
            store.release("b")
    finally:
        stop.set()
        looker.join(30)
    assert seen and set(seen) <= {None, os.getpid(), -1}  # -1: held, its pid not yet written
