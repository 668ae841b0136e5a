"""MessageBus in one process: sending, reading, cursors, waiting, and faults at the file level."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import orjson
import pytest

from ralph_mail import (
    InvalidMessage,
    MailError,
    Message,
    MessageBus,
    MessageType,
    RateLimited,
    StoreError,
    Team,
    UnknownAgent,
    create_team,
)
from ralph_mail.store.files import inbox as store_module
from ralph_mail.store.files import slots as slots_module
from ralph_mail.store.files.watch import Watcher
from tests.helpers.processes import BOUND_S


def inbox(team: Team, agent: str) -> Path:
    return team.store.root / "mailbox" / f"{agent}.jsonl"


def test_send_appends_one_line_and_returns_the_message(team: Team) -> None:
    """send appends exactly one line, whose envelope is the returned message."""
    message = MessageBus("demo", "worker-1").send(
        "lead", MessageType.STATUS_UPDATE, "parsing", metadata={"state": "working"}
    )
    lines = inbox(team, "lead").read_bytes().splitlines()
    assert len(lines) == 1
    assert orjson.loads(lines[0]) == message.to_dict()
    assert (message.from_agent, message.to_agent, message.metadata) == (
        "worker-1",
        "lead",
        {"state": "working"},
    )


def test_poll_consumes_and_returns_in_file_order(team: Team) -> None:
    """poll returns new messages oldest first, then nothing until more arrive."""
    sender, lead = MessageBus("demo", "worker-1"), MessageBus("demo", "lead")
    for text in ["a", "b", "c"]:
        sender.send("lead", "text", text)
    assert [m.content for m in lead.poll()] == ["a", "b", "c"]
    assert lead.poll() == []
    sender.send("lead", "text", "d")
    assert [m.content for m in lead.poll()] == ["d"]


def test_cursor_survives_a_new_bus(team: Team) -> None:
    """A new bus for the same agent starts where the last one committed."""
    sender = MessageBus("demo", "worker-1")
    sender.send("lead", "text", "old")
    MessageBus("demo", "lead").poll()
    sender.send("lead", "text", "new")
    assert [m.content for m in MessageBus("demo", "lead").poll()] == ["new"]


def test_peek_then_commit_is_at_least_once(team: Team) -> None:
    """peek does not consume; commit(m) consumes through m; uncommitted mail is redelivered."""
    sender = MessageBus("demo", "worker-1")
    for text in ["a", "b", "c"]:
        sender.send("lead", "text", text)
    lead = MessageBus("demo", "lead")
    peeked = lead.peek()
    assert [m.content for m in peeked] == ["a", "b", "c"]
    lead.commit(peeked[1])
    assert [m.content for m in MessageBus("demo", "lead").peek()] == ["c"]
    assert [m.content for m in lead.poll()] == ["c"]


def test_commit_of_an_unknown_message_is_refused(team: Team) -> None:
    """commit refuses a message that peek did not return."""
    lead = MessageBus("demo", "lead")
    stray = MessageBus("demo", "worker-1").send("worker-2", "text", "x")
    with pytest.raises(InvalidMessage, match="peek"):
        lead.commit(stray)


def test_wait_for_message_keeps_the_other_messages(team: Team) -> None:
    """wait_for_message consumes only its type; the others stay unread in memory and on disk."""
    sender = MessageBus("demo", "worker-1")
    sender.send("lead", "text", "a")
    sender.send("lead", "plan_submission", "plan")
    sender.send("lead", "text", "b")
    lead = MessageBus("demo", "lead")
    found = lead.wait_for_message(MessageType.PLAN_SUBMISSION, timeout=5)
    assert found is not None and found.content == "plan"
    assert [m.content for m in MessageBus("demo", "lead").poll()] == ["a", "b"]  # on disk
    fresh = MessageBus("demo", "lead")
    sender.send("lead", "plan_submission", "plan 2")
    assert fresh.wait_for_message("plan_submission", timeout=5).content == "plan 2"  # type: ignore[union-attr]
    assert fresh.poll() == []  # 'a' and 'b' were consumed above; plan 2 is not redelivered


def test_wait_returns_at_once_when_mail_is_waiting(team: Team) -> None:
    """wait_for_messages returns waiting mail without blocking."""
    MessageBus("demo", "worker-1").send("lead", "text", "here")
    assert [m.content for m in MessageBus("demo", "lead").wait_for_messages(timeout=0)] == ["here"]


def test_wait_times_out_with_nothing(team: Team) -> None:
    """wait_for_messages returns [] and wait_for_message None after the timeout."""
    lead = MessageBus("demo", "lead")
    assert lead.wait_for_messages(timeout=0.05) == []
    assert lead.wait_for_message("text", timeout=0.05) is None
    lead.close()


def test_broadcast_reaches_everyone_but_the_sender_with_one_id(team: Team) -> None:
    """A broadcast is one id in every other member's inbox, addressed to '*'."""
    message = MessageBus("demo", "lead").broadcast("tests are green")
    assert inbox(team, "lead").read_bytes() == b""
    for agent in ["worker-1", "worker-2"]:
        (received,) = MessageBus("demo", agent).poll()
        assert (received.id, received.to_agent, received.type) == (message.id, "*", "broadcast")


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda b: b.send("nobody", "text", "x"), UnknownAgent),
        (lambda b: b.send("../lead", "text", "x"), MailError),
        (lambda b: b.send("*", "text", "x"), InvalidMessage),
        (lambda b: b.send("lead", "Not A Type", "x"), InvalidMessage),
        (lambda b: b.send("lead", "text", 42), InvalidMessage),
        (lambda b: b.send("lead", "text", "x", metadata={"n": 1}), InvalidMessage),
        (lambda b: b.send("lead", "text", "x", id="XYZ"), InvalidMessage),
        (lambda b: b.send("lead", "text", "x", reply_to="nope"), InvalidMessage),
        (lambda b: b.send("lead", "text", "\udc80"), InvalidMessage),
        (lambda b: b.send("lead", "text", "x" * (1 << 20)), InvalidMessage),
    ],
)
def test_refused_sends_write_nothing(team: Team, call, error) -> None:  # type: ignore[no-untyped-def]
    """A refused send raises a MailError and leaves every inbox and directory untouched."""
    before = sorted((p, p.stat().st_size) for p in team.store.root.rglob("*") if p.is_file())
    with pytest.raises(error):
        call(MessageBus("demo", "worker-1"))
    after = sorted((p, p.stat().st_size) for p in team.store.root.rglob("*") if p.is_file())
    assert after == before


def test_size_limit_is_configurable(team: Team, monkeypatch: pytest.MonkeyPatch) -> None:
    """RALPH_MAX_MESSAGE_BYTES lowers the limit; the error names both sizes."""
    monkeypatch.setenv("RALPH_MAX_MESSAGE_BYTES", "200")
    with pytest.raises(InvalidMessage, match="over the 200-byte limit"):
        MessageBus("demo", "worker-1").send("lead", "text", "x" * 200)


def test_malformed_lines_become_dead_letters_and_never_stop_the_reader(team: Team) -> None:
    """Bad lines are set aside with a reason; the good ones around them are delivered."""
    sender = MessageBus("demo", "worker-1")
    sender.send("lead", "text", "before")
    with open(inbox(team, "lead"), "ab") as f:
        f.write(b'garbage\n{"id": 1}\n\n')
    sender.send("lead", "text", "after")
    assert [m.content for m in MessageBus("demo", "lead").poll()] == ["before", "after"]
    letters = [
        orjson.loads(x)
        for x in (team.store.root / "deadletters" / "lead.jsonl").read_bytes().splitlines()
    ]
    assert [x["line"] for x in letters] == ["garbage", '{"id": 1}']
    assert all(x["reason"] and x["inbox"] == "lead" for x in letters)


def test_unknown_keys_are_delivered(team: Team) -> None:
    """A line with keys this version does not know is still delivered."""
    line = encode_raw(id="0123456789ab", extra={"priority": "high"})
    inbox(team, "lead").write_bytes(line)
    (message,) = MessageBus("demo", "lead").poll()
    assert message.id == "0123456789ab"


def encode_raw(id: str, extra: dict[str, str]) -> bytes:
    envelope = {
        "id": id,
        "from": "worker-1",
        "to": "lead",
        "type": "text",
        "content": "x",
        "metadata": {},
        "ts": "2026-01-01T00:00:00.000000Z",
        **extra,
    }
    return orjson.dumps(envelope) + b"\n"


def test_incomplete_last_line_is_not_delivered(team: Team) -> None:
    """A reader delivers only whole lines; a last line without newline waits."""
    line = encode_raw(id="0123456789ab", extra={})
    inbox(team, "lead").write_bytes(line[:-5])
    lead = MessageBus("demo", "lead")
    assert lead.poll() == []
    with open(inbox(team, "lead"), "ab") as f:
        f.write(line[-5:])
    assert [m.id for m in lead.poll()] == ["0123456789ab"]


def test_torn_tail_is_set_aside_and_the_next_send_starts_a_fresh_line(team: Team) -> None:
    """A torn tail left by a killed writer goes to the dead letters; the next message is whole."""
    sender = MessageBus("demo", "worker-1")
    sender.send("lead", "text", "whole")
    with open(inbox(team, "lead"), "ab") as f:
        f.write(b'{"id":"0123456789ab","from":"worker-2","to":"le')
    MessageBus("demo", "worker-2").send("lead", "text", "next")
    assert [m.content for m in MessageBus("demo", "lead").poll()] == ["whole", "next"]
    (letter,) = [
        orjson.loads(x)
        for x in (team.store.root / "deadletters" / "lead.jsonl").read_bytes().splitlines()
    ]
    assert "torn" in letter["reason"] and letter["line"].startswith('{"id":"0123456789ab"')


def test_failed_write_leaves_nothing_deliverable(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails part-way raises StoreError and the inbox is cut back."""
    bus = MessageBus("demo", "worker-1")
    bus.send("lead", "text", "kept")
    size = inbox(team, "lead").stat().st_size
    real_write = os.write

    def half_then_fail(fd: int, data: bytes) -> int:
        if len(data) > 100:
            real_write(fd, bytes(data[:50]))
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    with monkeypatch.context() as patch:
        patch.setattr(store_module.os, "write", half_then_fail)
        with pytest.raises(StoreError, match="nothing was delivered"):
            bus.send("lead", "text", "y" * 200)
    assert inbox(team, "lead").stat().st_size == size
    bus.send("lead", "text", "after")
    assert [m.content for m in MessageBus("demo", "lead").poll()] == ["kept", "after"]


def test_timestamps_never_decrease_when_the_clock_steps_back(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ts is taken under the lock and never goes below the inbox's last one, across senders."""
    MessageBus("demo", "worker-1").send("lead", "text", "first")
    real = store_module.time.time_ns
    monkeypatch.setattr(store_module.time, "time_ns", lambda: real() - 3_600_000_000_000)
    second = MessageBus("demo", "worker-2").send("lead", "text", "second")
    first = MessageBus("demo", "lead").poll()[0]
    assert second.ts >= first.ts


def test_durable_mode_fsyncs_each_send(team: Team, monkeypatch: pytest.MonkeyPatch) -> None:
    """RALPH_DURABLE=1 makes every send fsync before it returns; the default does not."""
    calls: list[int] = []
    monkeypatch.setattr(store_module.os, "fsync", lambda fd: calls.append(fd))
    MessageBus("demo", "worker-1").send("lead", "text", "fast")
    assert calls == []
    monkeypatch.setenv("RALPH_DURABLE", "1")
    bus = MessageBus("demo", "worker-1")
    assert bus.durable
    bus.send("lead", "text", "safe")
    assert len(calls) == 1


def test_symlinked_inbox_is_refused(team: Team, tmp_path: Path) -> None:
    """An inbox planted as a symlink is never followed."""
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    inbox(team, "lead").unlink()
    inbox(team, "lead").symlink_to(target)
    with pytest.raises(StoreError, match="symlink"):
        MessageBus("demo", "worker-1").send("lead", "text", "x")
    assert target.read_bytes() == b""


def test_reading_the_mail_that_came_is_one_system_call_and_reading_on_one_more(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process woken after a long sleep pays tens of µs for each system call: reading
    the mail that woke it is one pread (a first slice that is not full ends at the end),
    and reading on from there, to learn that nothing more came, one fstat, as often as it
    reads on (the read before a wait, a loop of polls) until it waits."""
    store = team.store
    sender = MessageBus("demo", "worker-1")
    sender.send("lead", "text", "first")
    waiter = store.waiter(["lead"])
    data, offset = store.read("lead", 0)  # opens the reader
    end = offset + len(data)
    calls: list[str] = []
    for name in ("pread", "lseek", "fstat", "stat", "read"):
        real = getattr(os, name)
        monkeypatch.setattr(
            os, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k)
        )
    try:
        for _ in range(3):  # read on: none more (the last one right before the wait)
            calls.clear()
            assert store.read("lead", end) == (b"", end) and calls == ["fstat"]
        waiter.wait(0.001)  # (it looks before it blocks)
        sender.send("lead", "text", "second")
        calls.clear()
        data, offset = store.read("lead", end)
        assert offset == end and data.count(b"\n") == 1 and calls == ["pread"]
        calls.clear()
        assert store.read("lead", end + len(data)) == (b"", end + len(data))
        assert calls == ["fstat"]
        sender.send("lead", "text", "third")  # read on, no wait between: it grew
        calls.clear()
        assert store.read("lead", end + len(data))[0].count(b"\n") == 1
        assert calls == ["fstat", "pread"]
    finally:
        waiter.close()


def test_the_save_after_a_wake_up_leaves_the_look_at_its_cursor_to_before_the_block(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiter looks whether its kept cursor file is still linked before it blocks, so
    the save after its wake-up makes no fstat of its own (a process that slept pays tens
    of µs for each system call). A cursor deleted while it blocked takes that one save;
    the next wait's look sees it gone and the next save makes it again, whole."""
    lead, worker = MessageBus("demo", "lead"), MessageBus("demo", "worker-1")
    worker.send("lead", "text", "first")
    assert [m.content for m in lead.wait_for_messages(timeout=BOUND_S)] == ["first"]
    assert lead.wait_for_messages(timeout=0.001) == []  # (its watcher, made now)
    watcher = lead._watcher
    assert isinstance(watcher, Watcher) and watcher._before is not None
    looks: list[str] = []
    real_unlinked, real_before = slots_module.unlinked, watcher._before
    cursor = team.store.root / "cursors" / "lead.cursor"

    def unlinked(fd: int) -> bool:
        looks.append("look")
        return real_unlinked(fd)

    def before() -> None:
        real_before()
        looks.append("block")
        if gone:
            cursor.unlink()
            gone.clear()
        worker.send("lead", "text", f"m{len(looks)}")  # comes while it blocks

    gone = [True]
    monkeypatch.setattr(slots_module, "unlinked", unlinked)
    watcher._before = before
    assert len(lead.wait_for_messages(timeout=BOUND_S)) == 1
    assert looks == ["look", "block"]  # before it blocked, none at the save
    assert not cursor.exists()  # deleted, and saved into
    assert len(lead.wait_for_messages(timeout=BOUND_S)) == 1  # the look finds it gone
    assert cursor.exists()
    watcher._before = real_before
    assert MessageBus("demo", "lead").poll() == []  # the cursor made again is whole


def test_a_bus_keeps_its_attributes_inline_through_waits_asks_and_hand_ons(team: Team) -> None:
    """CPython 3.11 keeps an object's attributes inline while the instances of its class
    share at most 30 keys; past that each bus keeps them in a dict of its own, and every
    attribute on a wake-up's path costs more: a 30th attribute made one agent's wake-up
    0.02-0.03 ms slower, a tenth of it (interleaved runs). What is per thread lives in
    the mailbox's thread-local. Counted, not timed."""
    lead, worker = MessageBus("demo", "lead"), MessageBus("demo", "worker-1")
    assert worker.poll() == []  # it consumes its inbox: online before it is asked

    def answer() -> None:
        for message in worker.wait_for_messages(timeout=BOUND_S):
            worker.reply(message, "yes")

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        assert lead.ask("worker-1", "ready?", timeout=BOUND_S).content == "yes"
    finally:
        thread.join(BOUND_S)
    assert lead.wait_for_messages(timeout=0.01) == []
    worker.send("lead", "text", "news")
    lead.hand_on(lead.peek(), lambda message: None)
    lead.broadcast("all")
    for bus in (lead, worker):
        assert len(vars(bus)) < 30, sorted(vars(bus))


def test_poll_reads_only_new_bytes(team: Team, monkeypatch: pytest.MonkeyPatch) -> None:
    """poll's cost is O(new messages): it reads the new bytes, not the inbox."""
    sender = MessageBus("demo", "worker-1")
    for i in range(5000):
        sender.send("lead", "text", f"old {i}")
    lead = MessageBus("demo", "lead")
    lead.poll()
    new = [sender.send("lead", "text", f"new {i}") for i in range(3)]
    read: list[int] = []
    real_pread = os.pread

    def counting_pread(fd: int, n: int, offset: int) -> bytes:
        data = real_pread(fd, n, offset)
        read.append(len(data))
        return data

    monkeypatch.setattr(store_module.os, "pread", counting_pread)
    assert [m.id for m in MessageBus("demo", "lead").poll()] == [m.id for m in new]
    new_bytes = sum(len(line) for line in inbox(team, "lead").read_bytes().splitlines()[-3:]) + 3
    assert sum(read) <= new_bytes + 2 * 4096 * 2  # the new lines, plus the cursor file's slots
    assert inbox(team, "lead").stat().st_size > 50 * new_bytes


def test_cursor_commit_is_never_torn(team: Team) -> None:
    """A cursor slot damaged mid-write falls back to the other, older slot."""
    sender = MessageBus("demo", "worker-1")
    sender.send("lead", "text", "a")
    lead = MessageBus("demo", "lead")
    lead.poll()  # slot 1 holds the cursor after 'a'
    sender.send("lead", "text", "b")
    lead.poll()  # slot 0 holds the cursor after 'b'
    path = team.store.root / "cursors" / "lead.cursor"
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF  # a torn write of slot 0
    path.write_bytes(bytes(data))
    assert [m.content for m in MessageBus("demo", "lead").poll()] == ["b"]


def test_many_out_of_order_acks_outgrow_the_slot(team: Team) -> None:
    """More out-of-order consumptions than a cursor slot holds are kept all the same."""
    sender = MessageBus("demo", "worker-1")
    sender.send("lead", "text", "keep me")
    for i in range(700):
        sender.send("lead", "plan_submission", f"plan {i}")
    lead = MessageBus("demo", "lead")
    for _ in range(700):
        assert lead.wait_for_message("plan_submission", timeout=1) is not None
    assert [m.content for m in MessageBus("demo", "lead").poll()] == ["keep me"]


def test_bus_refuses_a_non_member(team: Team) -> None:
    """A bus for an agent outside the team is refused, naming the members."""
    with pytest.raises(UnknownAgent, match="members: lead, worker-1, worker-2"):
        MessageBus("demo", "stranger")


def test_messages_compare_and_hash(team: Team) -> None:
    """Messages read back equal the sent ones and can be kept in sets."""
    sent = MessageBus("demo", "worker-1").send("lead", "text", "x", metadata={"k": "v"})
    (got,) = MessageBus("demo", "lead").poll()
    assert got == sent and isinstance(got, Message)
    assert {got, sent} == {sent}


def test_home_accepts_str_and_path(home: Path) -> None:
    """MessageBus takes home as a string or a path."""
    create_team("t", ["a", "b"], home=str(home))
    assert MessageBus("t", "a", home=home).send("b", "text", "x").to_agent == "b"
    assert MessageBus("t", "b", home=str(home)).poll()[0].content == "x"


def test_wait_without_consuming_leaves_the_mail_for_commit(team: Team) -> None:
    """wait_for_messages(consume=False) returns what peek would and consumes nothing."""
    MessageBus("demo", "worker-1").send("lead", "text", "handle me")
    lead = MessageBus("demo", "lead")
    (message,) = lead.wait_for_messages(timeout=5, consume=False)
    assert [m.content for m in MessageBus("demo", "lead").peek()] == ["handle me"]
    lead.commit(message)
    assert MessageBus("demo", "lead").poll() == []
    assert lead.wait_for_messages(timeout=0.05, consume=False) == []


def test_an_unclosed_bus_gives_its_descriptors_back(team: Team) -> None:
    """Buses dropped without close() release their descriptors when collected."""
    import gc

    def open_descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_descriptors()
    for _ in range(100):
        MessageBus("demo", "worker-1").send("lead", "text", "x")
        MessageBus("demo", "lead").poll()
    gc.collect()
    assert open_descriptors() <= before + 2


def test_threads_of_one_process_sending_into_one_inbox_take_turns(team: Team) -> None:
    """Sends from many threads through one bus (an MCP server's tools, asks in flight)
    each write a whole line, none lost, and none waits for ever: the inbox's lock is a
    file lock, which the threads of one process share, so they also take turns inside."""
    import threading

    bus = MessageBus("demo", "lead")
    done: list[int] = []

    def send(n: int) -> None:
        for k in range(100):
            bus.send("worker-1", "text", f"{n}-{k}")
        done.append(n)

    threads = [threading.Thread(target=send, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(done) == list(range(8)), "a sending thread never finished"
    got = MessageBus("demo", "worker-1").poll()
    sent = sorted(f"{n}-{k}" for n in range(8) for k in range(100))
    assert sorted(m.content for m in got) == sent
    assert [m.ts for m in got] == sorted(m.ts for m in got)


def test_threads_of_one_process_count_each_message_against_the_rate(team: Team) -> None:
    """A rate limit shared by threads of one process (an MCP server's tools) counts each
    message once: with a rate of 50, 8 threads sending 10 each get exactly 50 through."""
    import threading

    from ralph_mail.govern.policy import KEY, Policy

    bus = MessageBus("demo", "lead")
    bus.store.save_state(KEY, Policy((), {"lead": 50}).to_json())
    passed: list[int] = []

    def send() -> None:
        for _ in range(10):
            try:
                bus.send("worker-1", "text", "x")
            except RateLimited:
                continue
            passed.append(1)

    threads = [threading.Thread(target=send) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(passed) == 50
    assert len(MessageBus("demo", "worker-1").poll()) == 50
