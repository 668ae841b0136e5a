"""Storage defects, library level: each test drives the public API (`MessageBus`,
`History`, `create_team`, `delete_team`) and pins one behaviour the storage layer must keep.

The numbers in the section titles are the issue's. Faults are injected from outside the
library: ``os.pread`` wrapped with monkeypatch, the store's ``compact`` replaced on one
bus's store, files replaced or planted on disk. Costs are counted (bytes read, bytes
copied, bytes allocated, reads made), never timed.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import tracemalloc
import warnings
from pathlib import Path

import pytest

from ralph_mail import MailError, MessageBus, Team, create_team, delete_team, list_teams
from ralph_mail.govern.presence import presence_of
from ralph_mail.talk.history import History
from tests.helpers.backends import BACKENDS, backend_url
from tests.helpers.faultkit import dead_letters, record
from tests.helpers.processes import BOUND_S, Processes, cli_env, wait_until

MEMBERS: list[str | tuple[str, str]] = ["lead", ("worker-1", "parses logs"), "worker-2"]


def team_root(home: Path) -> Path:
    return home / "teams" / "demo"


def inbox(home: Path, agent: str = "lead") -> Path:
    return team_root(home) / "mailbox" / f"{agent}.jsonl"


def fill(count: int, size: int = 10, to: str = "lead", tag: str = "") -> list[str]:
    """Send ``count`` messages of about ``size`` bytes from worker-1; return their ids."""
    sender = MessageBus("demo", "worker-1")
    try:
        return [sender.send(to, "text", f"{tag}{n}:" + "x" * size).id for n in range(count)]
    finally:
        sender.close()


def put_empty_file_in_place(path: Path) -> None:
    """Replace ``path`` by a new empty 0600 file (os.replace), as a person would."""
    fresh = path.parent.parent / f".{path.name}.fresh"
    os.close(os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    os.replace(fresh, path)


# -- 2: an interrupt in the owner's automatic compaction ---------------------------------


def test_an_interrupted_automatic_compaction_loses_no_message(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every message is returned by exactly one poll when every automatic compaction
    raises KeyboardInterrupt: a poll that raises has consumed nothing."""
    monkeypatch.setenv("RALPH_GC_AUTO_BYTES", "1")  # compaction is due after every commit
    lead = MessageBus("demo", "lead")
    interrupted: list[str] = []

    def compact(agent: str, *args: object, **kwargs: object) -> None:
        interrupted.append(agent)
        raise KeyboardInterrupt

    real = lead.store.compact
    monkeypatch.setattr(lead.store, "compact", compact)
    sent: list[str] = []
    got: list[str] = []
    for round in range(4):
        sent += fill(3, tag=f"r{round}-")
        with contextlib.suppress(KeyboardInterrupt):
            got += [message.id for message in lead.poll()]
    assert interrupted, "the automatic compaction never ran: the test proves nothing"
    monkeypatch.setattr(lead.store, "compact", real)
    got += [message.id for message in lead.poll()]
    assert got == sent
    record(messages=len(sent), faults=len(interrupted))


# -- 3: an interrupt between two slices of a big read ------------------------------------


def test_a_poll_interrupted_between_slices_of_a_big_read_keeps_commits_exact(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a poll interrupted between two slices of a read of more than 16 MiB, a peek
    and a commit, a restarted owner gets exactly the messages after the committed one."""
    ids = fill(40, size=600_000)  # 24 MB: more than one 16 MiB slice
    real = os.pread
    big_reads = [0]

    def pread(fd: int, length: int, offset: int) -> bytes:
        if length >= 1 << 20:
            big_reads[0] += 1
            if big_reads[0] == 2:  # the second slice of the inbox
                raise KeyboardInterrupt
        return real(fd, length, offset)

    lead = MessageBus("demo", "lead")
    monkeypatch.setattr(os, "pread", pread)
    with pytest.raises(KeyboardInterrupt):
        lead.poll()
    monkeypatch.setattr(os, "pread", real)
    assert big_reads[0] == 2, "the poll was not interrupted between two slices"
    peeked = lead.peek()
    assert [message.id for message in peeked] == ids
    lead.commit(peeked[9])
    lead.close()
    restarted = MessageBus("demo", "lead")
    assert [message.id for message in restarted.poll()] == ids[10:]
    record(messages=40, faults=1)


# -- 4: a live owner whose inbox or team was replaced ------------------------------------


def test_a_live_owner_gets_every_message_of_an_inbox_replaced_by_an_empty_file(
    team: Team, home: Path
) -> None:
    """A live owner whose inbox is replaced by an empty 0600 file gets all 80 new messages
    and sets none aside, or its poll raises MailError: nothing is lost silently."""
    lead = MessageBus("demo", "lead")
    fill(30, size=50, tag="old-")
    assert len(lead.poll()) == 30
    put_empty_file_in_place(inbox(home))
    new = fill(80, tag="new-")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a warning that the inbox was replaced is welcome
        try:
            got = [message.id for message in lead.poll()]
        except MailError:
            got = new  # loud, not silent: acceptable
    assert got == new
    assert dead_letters(team_root(home), "lead") == []
    record(messages=110, faults=1)


def test_a_live_owner_gets_every_message_of_a_team_deleted_and_made_again(
    team: Team, home: Path
) -> None:
    """A live owner whose team is deleted and created again (same names) gets all 80 new
    messages and sets none aside, or its poll raises MailError: nothing is lost silently."""
    lead = MessageBus("demo", "lead")
    fill(30, size=50, tag="old-")
    assert len(lead.poll()) == 30
    delete_team("demo", home)
    create_team("demo", MEMBERS, home=home)
    new = fill(80, tag="new-")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            got = [message.id for message in lead.poll()]
        except MailError:
            got = new  # loud, not silent: acceptable
    assert got == new
    assert dead_letters(team_root(home), "lead") == []
    record(messages=110, faults=1)


# -- 12: a lingering process after its team was deleted ----------------------------------


@pytest.mark.parametrize("before", ["nothing read", "peeked"])
def test_a_lingering_poll_after_team_delete_raises_and_recreates_nothing(
    team: Team, home: Path, before: str
) -> None:
    """A bus whose team was deleted gets a MailError saying so from poll, and nothing
    appears again under teams/ (whether or not it had read before)."""
    lead = MessageBus("demo", "lead")
    fill(3)
    if before == "peeked":
        lead.peek()  # read, not yet consumed: the poll below would commit
    delete_team("demo", home)
    with pytest.raises(MailError) as raised:
        lead.poll()
    assert not team_root(home).exists(), "the deleted team's directory was made again"
    assert list_teams(home) == []
    assert "deleted" in str(raised.value)
    create_team("demo", MEMBERS, home=home)  # not "exists"
    record(faults=1)


def test_a_lingering_commit_after_team_delete_raises_and_recreates_nothing(
    team: Team, home: Path
) -> None:
    """A bus whose team was deleted gets a MailError saying so from commit, and nothing
    appears again under teams/."""
    lead = MessageBus("demo", "lead")
    fill(3)
    peeked = lead.peek()
    delete_team("demo", home)
    with pytest.raises(MailError) as raised:
        lead.commit(peeked[0])
    assert not team_root(home).exists(), "the deleted team's directory was made again"
    assert list_teams(home) == []
    assert "deleted" in str(raised.value)
    create_team("demo", MEMBERS, home=home)
    record(faults=1)


# -- 11: names read back from team.json ---------------------------------------------------


def test_a_roster_member_named_outside_the_team_is_refused_when_loaded(
    team: Team, home: Path
) -> None:
    """A roster edited by hand to hold a member '../x' is refused with a MailError naming
    it, and broadcast writes nothing outside mailbox/."""
    roster = team_root(home) / "team.json"
    roster.write_text(roster.read_text().replace('"worker-2"', '"../x"'))
    target = team_root(home) / "x.jsonl"  # where mailbox/../x.jsonl leads
    target.write_bytes(b"")
    with pytest.raises(MailError, match=re.escape("'../x'")):
        MessageBus("demo", "lead").broadcast("hi")
    assert target.read_bytes() == b""
    assert [p for p in home.rglob("x.jsonl") if p != target] == []
    record(inputs=1)


# -- 18: tail costs what it shows ---------------------------------------------------------


def count_preads(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int]]:
    """Wrap os.pread: count the bytes it returns and the bytes copied by concatenating
    what it returned (each ``a + b`` with a pread result copies len(a) + len(b))."""
    read = [0]
    copied = [0]

    class Counted(bytes):
        def __add__(self, other: bytes) -> bytes:  # type: ignore[override]
            copied[0] += len(self) + len(other)
            return bytes.__add__(self, other)

        def __radd__(self, other: bytes) -> bytes:
            copied[0] += len(self) + len(other)
            return bytes.__add__(other, self)

    real = os.pread

    def pread(fd: int, length: int, offset: int) -> bytes:
        data = real(fd, length, offset)
        read[0] += len(data)
        return Counted(data)

    monkeypatch.setattr(os, "pread", pread)
    return read, copied


def test_tail_of_a_20_mb_inbox_reads_a_few_chunks(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """History.last(5) on a 20 MB inbox of 10 KB messages reads at most 256 KiB."""
    ids = fill(2000, size=10_000)
    view = History("demo", ["lead"])
    read, _ = count_preads(monkeypatch)
    assert [message.id for message in view.last(5)] == ids[-5:]
    monkeypatch.undo()
    view.close()
    assert read[0] <= 256 * 1024, f"read {read[0]:,} bytes to show 5 messages"


def test_tail_copies_what_it_reads_a_bounded_number_of_times(
    team: Team, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """History.last(5) whose 5 messages span 4.5 MB (many 64 KiB steps) reads about
    those bytes and copies them a bounded number of times, not once per step."""
    fill(1000, size=10_000)
    big = fill(6, size=900_000, tag="big-")
    shown = sum(len(line) + 1 for line in inbox(home).read_bytes().splitlines()[-6:])
    view = History("demo", ["lead"])
    read, copied = count_preads(monkeypatch)
    assert [message.id for message in view.last(5)] == big[-5:]
    monkeypatch.undo()
    view.close()
    assert read[0] <= shown + 256 * 1024, f"read {read[0]:,} bytes for {shown:,}"
    assert copied[0] <= 2 * read[0], f"copied {copied[0]:,} bytes while reading {read[0]:,}"


# -- 19: committing a long peek one message at a time -------------------------------------


def commit_churn(count: int) -> int:
    """Bytes allocated transiently (peak over the start, summed) while committing one by
    one the ``count`` messages a peek returned: a copy of the pending list per commit
    shows up here, whatever the clock says."""
    fill(count)
    lead = MessageBus("demo", "lead")
    peeked = lead.peek()
    assert len(peeked) == count
    churn = 0
    tracemalloc.start()
    try:
        for message in peeked:
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            lead.commit(message)
            churn += tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
        lead.close()
    return churn


def test_committing_a_peek_message_by_message_is_linear(team: Team) -> None:
    """Committing 4N peeked messages one by one allocates about 4x what N do (linear),
    not 16x (a copy of what is pending at every commit)."""
    small = commit_churn(1000)
    large = commit_churn(4000)
    assert large <= 6 * small, f"N: {small:,} bytes, 4N: {large:,} bytes ({large / small:.1f}x)"


# -- 20: a waiter wakes for its own inbox only --------------------------------------------

SENDER = """
import sys
from ralph_mail import MessageBus
bus = MessageBus("demo", "worker-1")
for n in range(int(sys.argv[1])):
    bus.send("lead", "text", f"not for worker-2 {n}")
print(bus.send("worker-2", "text", "for worker-2").id, flush=True)
"""


def test_a_waiter_is_not_woken_by_mail_to_another_agent(
    team: Team, home: Path, procs: Processes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While another process sends 3,000 messages to lead, worker-2's wait_for_messages
    reads its inbox a few times (counted through poll, on the instance), not per send."""
    waiter = MessageBus("demo", "worker-2")
    polls = [0]
    armed = threading.Event()
    real_poll = waiter.poll

    def counting_poll() -> list:  # type: ignore[type-arg]
        polls[0] += 1
        if polls[0] >= 2:  # the second attempt runs once the watch is in place
            armed.set()
        return real_poll()

    monkeypatch.setattr(waiter, "poll", counting_poll)
    stop = threading.Event()
    got: list[str] = []
    thread = threading.Thread(
        target=lambda: got.extend(m.id for m in waiter.wait_for_messages(BOUND_S, stop=stop))
    )
    thread.start()
    try:
        assert armed.wait(BOUND_S), "the waiter never started waiting"
        armed_at = polls[0]
        sender = procs.python(SENDER, "3000", env=cli_env(home))
        out, err = sender.communicate(timeout=BOUND_S)
        assert sender.returncode == 0, err
        thread.join(BOUND_S)
        assert not thread.is_alive()
    finally:
        stop.set()
        thread.join(BOUND_S)
        waiter.close()
    assert got == [out.decode().strip()]
    # The wait re-reads once a second as a safety net: 20 covers a very slow machine.
    assert polls[0] - armed_at <= 20, f"{polls[0] - armed_at} reads for 3,000 sends to lead"
    record(messages=3001)


# -- 5: every valid name works everywhere, on every backend ------------------------------

#: Names of 64 characters, the longest valid: one plain, one with ``..`` and a final ``.``.
LONG_LEAD = "l" * 64
LONG_A = "a" * 63 + "z"
LONG_B = "b.." + "b" * 60 + "."
LONG_CHANNEL = "c" * 62 + ".."


@pytest.mark.parametrize("kind", BACKENDS)
def test_the_longest_names_work_for_every_command_on_every_backend(
    kind: str, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Agents and a channel named with 64 characters (dots anywhere included) send, read,
    wait, ask, reply, delegate (held for a sleep too), finish tasks, post, read, pass and
    list channels, keep history and threads, hold and approve, rate-limit and run a lead:
    no key derived from a name (``held.NAME``, ``orchestrator.NAME``, ``#NAME@MEMBER``...)
    is refused, on any backend."""
    from datetime import UTC, datetime, timedelta

    from ralph_mail import TeamOrchestrator
    from ralph_mail.govern.policy import Policy, Rule

    url = backend_url(kind, tmp_path)
    if url:
        monkeypatch.setenv("RALPH_BACKEND", url)
    create_team("demo", [LONG_LEAD, LONG_A, LONG_B], home=home)
    with contextlib.ExitStack() as stack:
        lead, a, b = (stack.enter_context(MessageBus("demo", name))
                      for name in (LONG_LEAD, LONG_A, LONG_B))  # fmt: skip

        sent = lead.send(LONG_A, "text", "hi")
        assert [m.id for m in a.poll()] == [sent.id]
        sent = b.send(LONG_A, "text", "again")
        assert [m.id for m in a.wait_for_messages(BOUND_S)] == [sent.id]
        assert [m.id for m in b.history(LONG_A)] == [sent.id]
        assert [m.id for m in lead.search("again", to=LONG_A)] == [sent.id]

        answered = threading.Event()

        def answer() -> None:
            for message in a.wait_for_messages(BOUND_S):
                if message.type == "request":
                    a.reply(message, f"re: {message.content}")
                    answered.set()

        thread = threading.Thread(target=answer)
        thread.start()
        reply = b.ask(LONG_A, "what?", timeout=BOUND_S)
        thread.join(BOUND_S)
        assert answered.is_set() and reply.content == "re: what?"
        assert [m.type for m in b.thread(reply.thread)] == ["request", "reply"]

        task = lead.delegate(LONG_A, "draft it")
        (assignment,) = a.poll()
        assert assignment.metadata["taskId"] == task.id
        a.complete(task.id, "drafted")
        assert [m.content for m in lead.poll() if m.type == "task_result"] == ["drafted"]
        # Asleep far longer than the delegation can take under load; woken by hand after.
        b.set_presence("sleeping", until=datetime.now(UTC) + timedelta(seconds=BOUND_S))
        # (on NATS the lead learns of it from its bucket's watch, a moment later)
        wait_until(lambda: presence_of(lead.team, LONG_B)[0] == "sleeping", "the lead to see it")
        held = lead.delegate(LONG_B, "when you wake")  # held in the log held.LONG_B
        b.set_presence("idle")  # awake: its next read releases what was held
        woke = b.wait_for_message("task_assignment", timeout=BOUND_S)
        assert held.held_until and woke is not None and woke.metadata["taskId"] == held.id
        assert [m.id for m in lead.search("wake", to=LONG_B)] == [woke.id]

        lead.channels.create(LONG_CHANNEL, everyone=True)
        post = lead.channel_post(LONG_CHANNEL, f"@{LONG_A} @{LONG_B} go")
        assert [m.id for m in a.channel_read(LONG_CHANNEL)] == [post.id]
        a.channels.pass_turn(LONG_CHANNEL, post.id)
        b.channels.pass_turn(LONG_CHANNEL, post.id)
        assert [m.id for m in b.channel_history(LONG_CHANNEL)] == [post.id]
        assert post.id in [m.id for m in lead.search("go")]
        b.channels.leave(LONG_CHANNEL)
        b.channels.join(LONG_CHANNEL)

        rules = (Rule(LONG_A, LONG_B, "allow", True),)
        lead.store.save_state("policy", Policy(rules, {LONG_A: 100}).to_json())
        with MessageBus("demo", LONG_A) as sender:  # a fresh one sees the policy at once
            kept = sender.send(LONG_B, "text", "may I?")
        assert [h.id for h in lead.approvals()] == [kept.id]
        lead.approve(kept.id)
        assert kept.id in [m.id for m in b.poll()]

        errors: list[str] = []
        orchestrator = TeamOrchestrator("demo", home, on_event=lambda e: errors.append(str(e)))
        a.send(LONG_LEAD, "text", "to the lead")
        orchestrator.handle_pending()
        orchestrator.close()
        assert not [e for e in errors if "cannot save" in e]
        assert lead.store.load_state(f"orchestrator.{LONG_LEAD}") is not None
