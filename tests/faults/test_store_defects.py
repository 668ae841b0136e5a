"""What a hostile probe and a new user broke in the storage layer, pinned: interrupted
reads, replaced inboxes, stopped lock holders, FIFOs, symlinked directories, deleted
teams, second consumers, and the costs that grew without bound."""

from __future__ import annotations

import fcntl
import os
import signal
import warnings
from pathlib import Path

import pytest

from ralph_mail import MailError, MessageBus, StoreError, Team, delete_team
from ralph_mail.store.files import inbox as inbox_module
from ralph_mail.store.files import posix
from ralph_mail.talk.history import History
from tests.helpers.faultkit import record
from tests.helpers.processes import BOUND_S, Processes, cli_env, ralph

LEAD = ("--team", "demo", "--agent", "lead")


def fill(count: int, size: int = 10, to: str = "lead") -> list[str]:
    sender = MessageBus("demo", "worker-1")
    return [sender.send(to, "text", f"{n}:" + "x" * size).id for n in range(count)]


def inbox(team: Team, agent: str = "lead") -> Path:
    return team.store.root / "mailbox" / f"{agent}.jsonl"


# -- 2, 3: a call that raises consumes nothing -------------------------------------------


def test_an_interrupted_compaction_consumes_nothing_more(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner's automatic compaction runs before a read, never between a commit and
    its return: an interrupt there raises from a call that consumed nothing, and every
    message is returned by exactly one poll."""
    monkeypatch.setenv("RALPH_GC_AUTO_BYTES", "1")
    lead = MessageBus("demo", "lead")
    first = fill(3)
    assert [m.id for m in lead.poll()] == first  # returns: compaction is only due now
    second = fill(2)

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(type(lead.store), "compact", interrupted)
    with pytest.raises(KeyboardInterrupt):
        lead.poll()
    monkeypatch.undo()
    assert [m.id for m in lead.poll()] == second
    record(messages=5, faults=1)


def test_a_poll_interrupted_mid_read_forgets_what_it_read(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poll interrupted between two slices of a big read keeps nothing half-read: a
    later peek and commit, then a restarted owner, get exactly the uncommitted rest."""
    ids = fill(40, size=2000)
    monkeypatch.setattr(inbox_module, "READ_MAX_BYTES", 20_000)  # several slices
    lead = MessageBus("demo", "lead")
    real = lead.store.read
    calls = [0]

    def read_then_interrupt(*args: object, **kwargs: object) -> tuple[bytes, int]:
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(lead.store, "read", read_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        lead.poll()
    monkeypatch.setattr(lead.store, "read", real)
    peeked = lead.peek()
    assert [m.id for m in peeked] == ids
    lead.commit(peeked[9])
    lead.close()
    assert [m.id for m in MessageBus("demo", "lead").poll()] == ids[10:]
    record(messages=40, faults=1)


# -- 4, 12: a team deleted or an inbox replaced under a live owner ----------------------


def test_an_inbox_replaced_by_an_empty_file_is_read_from_its_start(team: Team) -> None:
    """A live owner whose inbox is replaced by an empty file (as doctor advises for a
    missing one) gets every new message, and none is dead-lettered."""
    lead = MessageBus("demo", "lead")
    fill(30, size=50)
    assert len(lead.poll()) == 30
    fresh = inbox(team).with_name("fresh.tmp")
    fresh.write_bytes(b"")
    fresh.chmod(0o600)
    os.replace(fresh, inbox(team))
    new = fill(80)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert [m.id for m in lead.poll()] == new
    assert lead.store.dead_letters("lead") == []
    record(messages=110, faults=1)


def test_a_line_ended_just_before_its_inbox_was_replaced_is_read(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader finds half a line; before it looks whether its inbox was replaced, the
    line gets its end and the inbox is replaced: the reader reads that line from the
    old file before it moves to the new one (a replaced file's size is final)."""
    lead = MessageBus("demo", "lead")
    fill(1)
    lead.poll()
    path = inbox(team)
    line = (
        b'{"id":"0123456789ab","from":"worker-1","to":"lead","type":"text","content":"late",'
        b'"metadata":{},"ts":"2026-01-01T00:00:00.000000Z"}\n'
    )
    with path.open("ab") as out:
        out.write(line[:40])
    old = path.stat().st_ino
    real_fstat = os.fstat

    def fstat(fd: int) -> os.stat_result:
        status = real_fstat(fd)
        if status.st_ino == old and status.st_nlink:
            with path.open("ab") as out:
                out.write(line[40:])
            fresh = path.with_name("fresh.tmp")
            fresh.write_bytes(b"")
            fresh.chmod(0o600)
            os.replace(fresh, path)
            status = real_fstat(fd)
        return status

    monkeypatch.setattr(inbox_module.os, "fstat", fstat)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = lead.poll()
    monkeypatch.setattr(inbox_module.os, "fstat", real_fstat)
    assert [m.content for m in got] == ["late"]
    new = fill(2)
    assert [m.id for m in lead.poll()] == new


def test_a_restarted_owner_whose_inbox_was_replaced_reads_the_new_one(team: Team) -> None:
    """The cursor records its inbox's inode: an owner restarted after the inbox was
    replaced reads the new inbox from its start rather than at a stale offset."""
    lead = MessageBus("demo", "lead")
    fill(30, size=50)
    lead.poll()
    lead.close()
    fresh = inbox(team).with_name("fresh.tmp")
    fresh.write_bytes(b"")
    fresh.chmod(0o600)
    os.replace(fresh, inbox(team))
    new = fill(5)
    with pytest.warns(RuntimeWarning, match="replaced"):
        assert [m.id for m in MessageBus("demo", "lead").poll()] == new


def test_a_team_deleted_and_made_again_under_a_live_owner(team: Team, home: Path) -> None:
    """A live owner of a deleted team gets TeamNotFound and re-creates nothing; once the
    team is made again it reads the new team's mail, all of it."""
    lead = MessageBus("demo", "lead")
    fill(3)
    lead.poll()
    delete_team("demo")
    with pytest.raises(MailError, match="was deleted"):
        lead.poll()
    assert not (home / "teams" / "demo").exists()
    assert (
        ralph(home, "team", "create", "demo", "--member", "lead", "--member", "worker-1").returncode
        == 0
    )
    new = fill(80)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert [m.id for m in lead.poll()] == new
    record(messages=83, faults=1)


# -- 6: one consumer per inbox -----------------------------------------------------------

WAITER = """
from ralph_mail import MessageBus
bus = MessageBus("demo", "lead")
bus.peek()
print("ready", flush=True)
import sys; sys.stdin.readline()
"""


def test_a_second_consumer_process_is_refused_naming_the_first(
    team: Team, procs: Processes
) -> None:
    """While one process consumes an inbox, another's read or wait is refused with the
    holder's pid (exit 2); tail and read --peek still look; once the holder is killed -9
    the inbox is free."""
    holder = procs.python(WAITER, env=cli_env(team.home))
    assert holder.stdout is not None and holder.stdout.readline() == b"ready\n"
    [message] = fill(1)
    for command in (("read",), ("wait", "--timeout", "1")):
        done = ralph(team.home, *command, *LEAD)
        assert done.returncode == 2 and f"process {holder.pid}".encode() in done.stderr
    assert message.encode() in ralph(team.home, "read", "--peek", *LEAD).stdout
    assert message.encode() in ralph(team.home, "tail", *LEAD).stdout
    other = procs.python(
        "from ralph_mail import InboxBusy, MessageBus\n"
        "try:\n    MessageBus('demo', 'lead').poll()\n"
        "except InboxBusy as exc:\n    print('busy', exc.pid)",
        env=cli_env(team.home),
    )
    assert other.communicate(timeout=BOUND_S)[0] == f"busy {holder.pid}\n".encode()
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=BOUND_S)
    done = ralph(team.home, "read", *LEAD)
    assert done.returncode == 0 and message.encode() in done.stdout
    record(messages=1, kills=1)


# -- 7: a stopped lock holder blocks no reader -----------------------------------------

HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
os.kill(os.getpid(), 19)  # SIGSTOP: stopped with the lock held, as Ctrl-Z does
"""


def test_a_stopped_lock_holder_blocks_no_reader(team: Team, procs: Processes) -> None:
    """With a process stopped while holding an inbox's lock: wait, read and tail finish,
    gc gives a clear error within its bound, and doctor fails naming the pid."""
    ids = fill(2)
    holder = procs.python(HOLDER, str(inbox(team)), env=cli_env(team.home))
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"locked\n"
        assert ralph(team.home, "tail", *LEAD).returncode == 0
        done = ralph(team.home, "read", *LEAD)
        assert done.returncode == 0 and all(i.encode() in done.stdout for i in ids)
        assert ralph(team.home, "wait", "--timeout", "0.5", *LEAD).returncode == 1
        gc = ralph(team.home, "gc", "--team", "demo")  # waits its bound, then says so
        assert gc.returncode == 2 and b"stayed locked" in gc.stderr
        doctor = ralph(team.home, "doctor")
        assert doctor.returncode == 3 and f"stopped process {holder.pid}".encode() in doctor.stdout
    finally:
        holder.send_signal(signal.SIGCONT)
        holder.kill()
        holder.wait(timeout=BOUND_S)
    record(messages=2, faults=1)


# -- 8, 10, 11: what is not a plain file or directory ----------------------------------


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_an_inbox_that_is_not_a_regular_file_is_refused(team: Team, kind: str) -> None:
    """An inbox replaced by a directory or a FIFO: send, read and doctor give one error
    (2, or 3 for doctor) and never hang."""
    inbox(team).unlink()
    if kind == "directory":
        inbox(team).mkdir(mode=0o700)
    else:
        os.mkfifo(inbox(team), 0o600)
    for command, code in ((("send", "lead", "x", "--agent", "worker-1"), 2), (("read",), 2)):
        done = ralph(
            team.home,
            *command,
            "--team",
            "demo",
            *(("--agent", "lead") if command == ("read",) else ()),
        )
        assert done.returncode == code and b"Traceback" not in done.stderr, done.stderr
        assert done.stderr.count(b"\n") == 1
    assert ralph(team.home, "doctor").returncode == 3
    record(faults=1)


def test_an_open_for_reading_and_writing_clears_no_flag_and_still_refuses_a_fifo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An open for reading and writing (an inbox to append to, a cursor) never blocks on
    a FIFO, so it goes without O_NONBLOCK and the call that clears it: one system call
    fewer on each cold open. A read-only open keeps it until the file is known to be
    regular. A FIFO is refused either way, at once."""
    cleared: list[int] = []
    real = posix.os.set_blocking
    monkeypatch.setattr(posix.os, "set_blocking", lambda fd, on: cleared.append(fd) or real(fd, on))
    where = posix.open_dir(str(tmp_path))
    try:
        both = posix.open_file("file", os.O_RDWR | os.O_CREAT, where)
        assert cleared == [] and not fcntl.fcntl(both, fcntl.F_GETFL) & os.O_NONBLOCK
        alone = posix.open_file("file", os.O_RDONLY, where)
        assert cleared == [alone] and not fcntl.fcntl(alone, fcntl.F_GETFL) & os.O_NONBLOCK
        for fd in (both, alone):
            os.close(fd)
        os.mkfifo("fifo", 0o600, dir_fd=where)
        for flags in (os.O_RDWR, os.O_RDONLY):
            with pytest.raises(StoreError, match="not a regular file"):
                posix.open_file("fifo", flags, where)
    finally:
        os.close(where)


@pytest.mark.parametrize("planted", ["team", "mailbox"])
def test_a_symlinked_team_or_mailbox_directory_is_refused(
    team: Team, tmp_path: Path, planted: str
) -> None:
    """A team directory or mailbox/ planted as a symlink is refused; nothing is written
    through it."""
    elsewhere = tmp_path / "elsewhere"
    source = team.store.root if planted == "team" else team.store.root / "mailbox"
    os.rename(source, elsewhere)
    os.symlink(elsewhere, source)
    before = sorted((p, p.stat().st_size) for p in elsewhere.rglob("*") if p.is_file())
    with pytest.raises(StoreError, match="symlink"):
        MessageBus("demo", "worker-1").send("lead", "text", "x")
    after = sorted((p, p.stat().st_size) for p in elsewhere.rglob("*") if p.is_file())
    assert after == before
    record(inputs=1)


def test_a_member_name_read_back_from_the_roster_is_checked(team: Team, home: Path) -> None:
    """A roster edited to hold a member called ../x is refused when loaded, naming it, so
    broadcast never writes outside the team."""
    roster = team.store.root / "team.json"
    roster.write_text(roster.read_text().replace('"worker-2"', '"../x"'))
    with pytest.raises(MailError, match=r"\.\./x"):
        MessageBus("demo", "lead").broadcast("hi")
    assert not (home / "teams" / "x.jsonl").exists()
    record(inputs=1)


def test_a_torn_tail_whose_dead_letter_cannot_be_written_never_stops_sends(
    team: Team,
) -> None:
    """A torn tail when dead letters cannot be written: the line is ended and kept (it is
    set aside when read), later sends and reads go on, and nothing is lost."""
    first = fill(1)
    with open(inbox(team), "ab") as f:
        f.write(b'{"id":"torn')
    deadletters = team.store.root / "deadletters"
    os.rmdir(deadletters)
    deadletters.write_text("not a directory")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        later = fill(2)
        got = MessageBus("demo", "lead").poll()
    assert [m.id for m in got] == first + later
    record(messages=3, faults=1)


# -- 18, 19, 20: costs that grow with what is asked, not with the inbox -----------------


def test_tail_reads_what_it_shows_not_the_inbox(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tail -n 5 on a 20 MB inbox reads about one 64 KiB chunk, not the inbox."""
    fill(2000, size=10_000)
    read: list[int] = []
    real = os.pread

    def counting(fd: int, length: int, offset: int) -> bytes:
        data = real(fd, length, offset)
        read.append(len(data))
        return data

    monkeypatch.setattr(inbox_module.os, "pread", counting)
    view = History("demo", ["lead"])
    assert len(view.last(5)) == 5
    view.close()
    assert sum(read) < 200_000


def test_committing_a_long_peek_one_by_one_is_linear(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Committing 4N peeked messages in turn costs 4x committing N (counted in pending
    entries visited), not 16x."""
    from ralph_mail.mailbox import consuming as bus_module

    visits = [0]
    real_find = bus_module._find

    def counting_find(entries, message):  # type: ignore[no-untyped-def]
        index = real_find(entries, message)
        visits[0] += index + 1
        return index

    monkeypatch.setattr(bus_module, "_find", counting_find)
    costs = []
    for count in (500, 2000):
        fill(count)
        lead = MessageBus("demo", "lead")
        visits[0] = 0
        for message in lead.peek():
            lead.commit(message)
        costs.append(visits[0])
        lead.close()
    assert costs[1] <= 4 * costs[0] + 10


def test_a_waiter_is_not_woken_by_mail_to_others(team: Team) -> None:
    """A waiter's watch is on its own inbox: 500 sends to another agent wake it not once."""
    worker2 = MessageBus("demo", "worker-2")
    waiter = worker2.store.waiter(["worker-2"])
    try:
        fill(500, to="lead")
        assert waiter.wait(0.0) is False
        fill(1, to="worker-2")
        assert waiter.wait(BOUND_S) is True
    finally:
        waiter.close()
