"""Fault suite, storage: failing writes, damaged inboxes, and commits cut short.

Scenarios 3 (I/O errors), 4 (damaged inboxes) and the in-process half of 5 (cursors). A
crash is simulated by stopping a write part-way, which leaves on disk exactly what a kill
at that moment leaves (a killed process loses nothing already in the page cache).
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from ralph_mail import MailError, Message, MessageBus, StoreError, Team, create_team
from ralph_mail.store import Cursor
from ralph_mail.store.files import FileStore, pid_alive
from ralph_mail.store.files import inbox as store_module
from tests.helpers.faultkit import SCALES, dead_letters, lines_of, pick, record
from tests.helpers.processes import BOUND_S, cli_env


class Crash(BaseException):
    """Stands for a kill: raised inside a write, never caught by the library."""


def inbox(team: Team, agent: str = "lead") -> Path:
    return team.store.root / "mailbox" / f"{agent}.jsonl"


def contents(messages: list[Message]) -> list[str]:
    return [m.content for m in messages]


# -- 3. I/O errors ----------------------------------------------------------------------------


def failing_write(fail_at: int, partial: bool, calls: list[int]) -> Callable[[int, bytes], int]:
    """os.write to an inbox that fails on call ``fail_at`` (writing half the buffer first if
    ``partial``); writes to other files (history's index) pass."""
    real = os.write

    def write(fd: int, data: bytes) -> int:
        if "/mailbox/" not in os.readlink(f"/proc/self/fd/{fd}"):
            return real(fd, data)
        calls[0] += 1
        if calls[0] == fail_at:
            if partial and len(data) > 1:
                real(fd, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    return write


def workload(bus: MessageBus) -> list[tuple[str, str, bool]]:
    """Sends and broadcasts of several sizes; (inbox, content, returned) for each attempt."""
    attempts: list[tuple[str, str, bool]] = []
    for index, size in enumerate([10, 300, 5000, 70_000, 20]):
        text = f"m{index}:" + "x" * size
        try:
            bus.send("lead", "text", text)
            attempts.append(("lead", text, True))
        except MailError:
            attempts.append(("lead", text, False))
    text = "broadcast:" + "y" * 1000
    try:
        bus.broadcast(text)
        attempts += [("lead", text, True), ("worker-2", text, True)]
    except MailError as exc:
        delivered = getattr(exc, "delivered", [])
        attempts += [(agent, text, agent in delivered) for agent in ("lead", "worker-2")]
    return attempts


@pytest.mark.parametrize("partial", [False, True], ids=["fails", "half-then-fails"])
def test_a_write_failing_at_every_call_in_turn_leaves_nothing_deliverable(
    home: Path, partial: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failing write call N, for every N: the send raises, readers get exactly the sends that
    returned, no line is torn, and the inbox takes the next send."""
    fail_at = 1
    while True:
        team = create_team(
            f"io{fail_at}{int(partial)}", ["lead", "worker-1", "worker-2"], home=home
        )
        bus = MessageBus(team.name, "worker-1")
        calls = [0]
        with monkeypatch.context() as patch:
            patch.setattr(store_module.os, "write", failing_write(fail_at, partial, calls))
            attempts = workload(bus)
        for agent in ("lead", "worker-2"):
            bus.send(agent, "text", "after the fault")  # the inbox is still usable
            got = contents(MessageBus(team.name, agent).poll())
            wanted = [text for to, text, ok in attempts if to == agent and ok]
            assert got == [*wanted, "after the fault"], f"fault at write {fail_at}"
            assert all(orjson.loads(line) for line in lines_of(inbox(team, agent)))
        record(messages=len(attempts) + 2, faults=1 if calls[0] >= fail_at else 0)
        if calls[0] < fail_at:  # the workload made fewer writes: every call has failed once
            break
        assert not all(ok for _, _, ok in attempts), f"write {fail_at} failed but nothing raised"
        fail_at += 1
    assert fail_at > 6


def test_a_cut_back_that_fails_too_leaves_a_torn_tail_the_next_send_sets_aside(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the write fails part-way and the cut back fails as well, the torn line is never
    delivered and the next sender moves it to the dead letters."""
    bus = MessageBus("demo", "worker-1")
    bus.send("lead", "text", "kept")
    with monkeypatch.context() as patch:
        patch.setattr(store_module.os, "write", failing_write(1, True, [0]))
        patch.setattr(store_module.os, "ftruncate", _raise_eio)
        with pytest.raises(StoreError, match="nothing was delivered"):
            bus.send("lead", "text", "z" * 500)
    assert not inbox(team).read_bytes().endswith(b"\n")  # the torn half is there
    assert contents(MessageBus("demo", "lead").peek()) == ["kept"]
    MessageBus("demo", "worker-2").send("lead", "text", "next")
    assert contents(MessageBus("demo", "lead").poll()) == ["kept", "next"]
    (letter,) = dead_letters(team.store.root, "lead")
    assert "torn" in str(letter["reason"])
    record(messages=3, faults=2)


def _raise_eio(*args: object) -> None:
    raise OSError(errno.EIO, "Input/output error")


def test_a_cursor_commit_that_fails_consumes_nothing(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """poll, commit and wait_for_message raise StoreError when the cursor cannot be saved,
    and the same bus returns the same messages on the next call: nothing is lost."""
    sender = MessageBus("demo", "worker-1")
    for text in ["a", "b", "c"]:
        sender.send("lead", "text", text)
    sender.send("lead", "plan_submission", "plan")
    lead = MessageBus("demo", "lead")
    lead.peek()  # opens the cursor file: the failures below hit the commit itself
    lead.commit(lead.peek()[0])
    for attempt in (
        lambda: lead.poll(),
        lambda: lead.commit(lead.peek()[1]),
        lambda: lead.wait_for_message("plan_submission", timeout=0),
    ):
        with monkeypatch.context() as patch:
            patch.setattr(store_module.os, "pwrite", _raise_eio)
            with pytest.raises(StoreError, match="cursor"):
                attempt()
        assert contents(lead.peek()) == ["b", "c", "plan"]
    assert contents(lead.poll()) == ["b", "c", "plan"]
    record(messages=4, faults=3)


LIMITED_WRITER = """
import resource, signal, sys
from ralph_mail import MessageBus, MailError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
bus = MessageBus("demo", "worker-1")
for i in range(20):
    try:
        bus.send("lead", "text", f"{i}:" + "x" * 300)
        print("sent", i, flush=True)
    except MailError as exc:
        print("refused", i, type(exc).__name__, flush=True)
"""


def test_rlimit_fsize_makes_sends_fail_cleanly(team: Team, procs) -> None:  # type: ignore[no-untyped-def]
    """Past RLIMIT_FSIZE the send raises StoreError; what returned is delivered, nothing torn."""
    MessageBus("demo", "worker-2").send("lead", "text", "before")
    limit = inbox(team).stat().st_size + 2000
    proc = procs.python(LIMITED_WRITER, str(limit), env=cli_env(team.home))
    out, err = proc.communicate(timeout=BOUND_S)
    assert proc.returncode == 0, err
    sent = [line.split()[1] for line in out.decode().splitlines() if line.startswith("sent")]
    refused = [line for line in out.decode().splitlines() if line.startswith("refused")]
    assert 0 < len(sent) < 20 and all("StoreError" in line for line in refused)
    assert inbox(team).stat().st_size <= limit and inbox(team).read_bytes().endswith(b"\n")
    MessageBus("demo", "worker-2").send("lead", "text", "after")
    got = contents(MessageBus("demo", "lead").poll())
    assert got == ["before", *[f"{i}:" + "x" * 300 for i in sent], "after"]
    record(messages=22, faults=len(refused))


FULL_DISK = """
import os, sys
from ralph_mail import MessageBus, MailError, create_team
from ralph_mail.maintenance import collect
create_team("demo", ["lead", "worker-1"])
lead, sender = MessageBus("demo", "lead"), MessageBus("demo", "worker-1")
sender.send("lead", "text", "warm-up"); lead.poll()   # the cursor file exists before the disk fills
sent, refused = 1, 0
while refused < 3:
    try:
        sender.send("lead", "text", f"{sent}:" + "x" * 900)
        sent += 1
    except MailError:
        refused += 1
got = lead.poll()
assert [m.content.split(":")[0] for m in got] == [str(i) for i in range(1, sent)], got[-1]
# frees the consumed space (dropping it for good, as 'gc --purge-before' does) ...
removed = collect("demo", drop_before="9999-12-31T00:00:00.000000Z").removed
assert lead.poll() == []   # ... once readers holding the old inode move on (a rename wakes them)
sender.send("lead", "text", "after")
assert [m.content for m in lead.poll()] == ["after"]
print(sent, refused, removed)
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare for a private tmpfs")
def test_a_full_file_system_refuses_sends_and_gc_frees_it(tmp_path: Path) -> None:
    """On a full (tmpfs) disk sends fail with MailError and leave nothing deliverable; after
    the owner consumes and gc compacts, sends work again."""
    mount = tmp_path / "small"
    mount.mkdir()
    script = f'mount -t tmpfs -o size=128k tmpfs {mount} && exec "$0" -c "$1"'
    try:
        done = subprocess.run(
            ["unshare", "-Urm", "sh", "-c", script, sys.executable, FULL_DISK],
            capture_output=True,
            env=cli_env(mount / "home"),
            timeout=BOUND_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("full-disk run did not finish")
    if done.returncode and b"mount" in done.stderr and b"ralph" not in done.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    assert done.returncode == 0, done.stderr.decode()
    sent, refused, removed = map(int, done.stdout.split())
    assert sent > 20 and refused == 3 and removed > 0
    record(messages=sent + 1, faults=refused)


# -- 4. damaged inboxes -----------------------------------------------------------------------


def sample_inbox(team: Team) -> tuple[bytes, list[tuple[int, str]]]:
    """An inbox of varied messages; its bytes and (line end, content) of each message."""
    bus = MessageBus("demo", "worker-1")
    bus.send("lead", "text", "plain")
    bus.send("lead", "status_update", "ünïcödé ✓ 日本", metadata={"state": "working"})
    first = bus.send("lead", "plan_submission", "line one\nline two", metadata={"task": "T-1"})
    bus.send("lead", "text", "reply", reply_to=first.id)
    bus.send("lead", "text", '{"json":"inside"}\\n')
    data = inbox(team).read_bytes()
    ends, end = [], 0
    for line in data.split(b"\n")[:-1]:
        end += len(line) + 1
        ends.append((end, orjson.loads(line)["content"]))
    return data, ends


def reset_reader(team: Team, data: bytes) -> None:
    inbox(team).write_bytes(data)
    for sub in ("cursors", "deadletters"):
        for path in (team.store.root / sub).iterdir():
            path.unlink()


def test_an_inbox_cut_at_every_byte_delivers_only_whole_messages(team: Team) -> None:
    """Truncated at every offset: the whole messages before the cut are delivered, the torn
    rest never is, and the next send sets it aside with the reason and starts a fresh line."""
    data, ends = sample_inbox(team)
    for cut in range(len(data) + 1):
        reset_reader(team, data[:cut])
        whole = [content for end, content in ends if end <= cut]
        lead, sender = MessageBus("demo", "lead"), MessageBus("demo", "worker-2")
        assert contents(lead.poll()) == whole, cut
        sender.send("lead", "text", "after")
        sender.close()
        assert contents(lead.poll()) == ["after"], cut
        torn_from = max([end for end, _ in ends if end <= cut], default=0)
        letters = dead_letters(team.store.root, "lead")
        if torn_from < cut:
            (letter,) = letters
            assert "torn" in str(letter["reason"]) and letter["offset"] == torn_from
            assert str(letter["line"]).encode() == data[torn_from:cut] or "\\x" in str(
                letter["line"]
            )
        else:
            assert letters == []
        lead.close()
    record(messages=len(ends) * (len(data) + 1), faults=len(data) + 1)


def test_nul_padding_is_never_delivered(team: Team) -> None:
    """NUL bytes (what a crash can leave in a file's last blocks) are set aside: as an
    unterminated tail by the next sender, as a line by the reader."""
    data, ends = sample_inbox(team)
    wanted = [content for _, content in ends]
    reset_reader(team, data + b"\0" * 4096)
    assert contents(MessageBus("demo", "lead").poll()) == wanted
    MessageBus("demo", "worker-2").send("lead", "text", "after")
    assert contents(MessageBus("demo", "lead").poll()) == ["after"]
    reset_reader(team, b"\0" * 100 + b"\n" + data + b"\0\0\0" + data.split(b"\n")[0] + b"\n")
    assert contents(MessageBus("demo", "lead").poll()) == wanted
    reasons = [str(letter["reason"]) for letter in dead_letters(team.store.root, "lead")]
    assert len(reasons) == 2 and all("JSON" in reason for reason in reasons)
    record(messages=2 * len(wanted) + 1, faults=3)


@pytest.mark.parametrize("scale", SCALES)
def test_random_garbage_never_crashes_the_reader(team: Team, scale: str) -> None:
    """Garbage lines, bit flips and junk bytes: the reader never raises, every intact line is
    delivered in order, and each bad line is a dead letter with its reason."""
    rng = random.Random(5)
    data, ends = sample_inbox(team)
    lines = data.split(b"\n")[:-1]
    trials = pick(scale, 150, 3000)
    faults = 0
    for trial in range(trials):
        kept: list[str] = []
        out: list[bytes] = []
        bad = 0
        for line, (_, content) in zip(lines, ends, strict=True):
            roll = rng.random()
            if roll < 0.3:  # a flipped bit somewhere in the line
                pos = rng.randrange(len(line))
                changed = (
                    line[:pos] + bytes([line[pos] ^ (1 << rng.randrange(8))]) + line[pos + 1 :]
                )
                out.append(changed.replace(b"\n", b" "))
                bad += 1
            else:
                out.append(line)
                kept.append(content)
            if rng.random() < 0.4:  # a junk line: random bytes, no newline inside
                junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
                out.append(junk.replace(b"\n", b""))
                bad += 1
        reset_reader(team, b"\n".join(out) + b"\n")
        with MessageBus("demo", "lead") as reader:
            got = reader.poll()
        assert all(isinstance(m, Message) and isinstance(m.content, str) for m in got)
        for content in kept:  # every intact line came through, in order
            assert content in contents(got), trial
        positions = [contents(got).index(c) for c in kept]
        assert positions == sorted(positions)
        letters = dead_letters(team.store.root, "lead")
        assert len(got) + len(letters) <= len(out)
        assert all(letter["reason"] for letter in letters)
        faults += bad
    record(messages=trials * len(lines), faults=faults)


# -- 5. cursors: a commit cut at every byte ---------------------------------------------------


def test_a_cursor_commit_cut_at_every_byte_leaves_the_old_or_the_new_cursor(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slot write stopped after k bytes, for every k: the cursor read back is the old one
    until the write is whole, then the new one; never a mix, never an error."""
    store = FileStore(team.home, team.name)
    old = Cursor(1000, {1200, 1500})
    new = Cursor(2000, {2100, 2300, 2400})
    real = os.pwrite
    length = 12 + 20 + 8 * len(new.acked) + 4  # seq+length, floor+inode+count, acks, crc
    for cut in range(0, 4097):
        shutil.rmtree(team.store.root / "cursors")
        store.close()
        store = FileStore(team.home, team.name)
        store.save_cursor("lead", Cursor(10))
        store.save_cursor("lead", old)

        def torn(fd: int, data: bytes, offset: int, _cut: int = cut) -> int:
            real(fd, data[:_cut], offset)
            raise Crash

        with monkeypatch.context() as patch:
            patch.setattr(store_module.os, "pwrite", torn)
            with pytest.raises(Crash):
                store.save_cursor("lead", new)
        found = FileStore(team.home, team.name).load_cursor("lead")
        assert found == (new if cut >= length else old), cut
        if cut > length:
            break
    record(faults=length)


@pytest.mark.parametrize("step", ["write", "fsync", "replace"])
def test_a_cursor_rewrite_killed_at_each_step_leaves_the_old_or_the_new_cursor(
    team: Team, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """A cursor that outgrows its slot is rewritten through temp file + rename: a crash at
    any step leaves the old cursor (before the rename) or the new one (after)."""
    store = FileStore(team.home, team.name)
    old = Cursor(100, {200})
    store.save_cursor("lead", old)
    big = Cursor(100, set(range(200, 200 + 8 * 700, 8)))  # 700 acks: over one 4 KiB slot
    targets = {"write": "write", "fsync": "fsync", "replace": "replace"}
    real = getattr(os, targets[step])

    def crash(*args: object, **kwargs: object) -> object:
        if step == "write" and len(args[1]) > 16:  # type: ignore[arg-type]
            real(args[0], args[1][: len(args[1]) // 2])  # type: ignore[index]
        raise Crash

    with monkeypatch.context() as patch:
        patch.setattr(store_module.os, targets[step], crash)
        with pytest.raises(Crash):
            store.save_cursor("lead", big)
    assert FileStore(team.home, team.name).load_cursor("lead") == old
    store.close()
    fresh = FileStore(team.home, team.name)
    fresh.save_cursor("lead", big)
    assert FileStore(team.home, team.name).load_cursor("lead") == big
    assert pid_alive(os.getpid())
    record(faults=1)


def test_a_dead_letter_record_torn_by_a_kill_does_not_swallow_the_next(team: Team) -> None:
    """A dead-letter record cut short (its writer was killed) stays a line of its own: the
    next record is whole and readable, and doctor can still list both."""
    path = team.store.root / "deadletters" / "lead.jsonl"
    path.write_bytes(b'{"ts":"2026-01-01T00:00:00.000000Z","inbox":"lead","reas')
    with open(inbox(team), "ab") as f:
        f.write(b"garbage\n")
    MessageBus("demo", "lead").poll()
    letters = FileStore(team.home, team.name).dead_letters("lead")
    assert [str(x["reason"])[:7] for x in letters] == ["damaged", "not val"]
    record(faults=1)


def test_an_index_entry_cut_short_is_stepped_over(team: Team) -> None:
    """A fragment of an index entry (a write cut short by a full disk) hides no other entry."""
    store = FileStore(team.home, team.name)
    store.index_add("pair+lead+worker-1", "lead", 0, 10)
    with open(team.store.root / "index" / "pair+lead+worker-1.idx", "ab") as index:
        index.write(b"\xa5\x5a" + b"\0" * 30)  # half an entry
    store.index_add("pair+lead+worker-1", "worker-1", 10, 20)
    assert store.index_tail("pair+lead+worker-1", 5) == [("lead", 0, 10), ("worker-1", 10, 20)]
    store.close()
    record(faults=1)


def test_a_send_whose_index_cannot_be_written_still_returns(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delivered message whose history entry fails to write is still a send that
    returned (with a warning): a send raises only when nothing was delivered."""
    real = os.write

    def no_index(fd: int, data: bytes) -> int:
        if "/index/" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    bus = MessageBus("demo", "worker-1")
    with monkeypatch.context() as patch:
        patch.setattr(store_module.os, "write", no_index)
        with pytest.warns(RuntimeWarning, match="missing from history"):
            sent = bus.send("lead", "text", "delivered")
    assert [m.id for m in MessageBus("demo", "lead").poll()] == [sent.id]
    record(messages=1, faults=1)
