"""Fault suite: waiting under stress (scenario 7) and locks (scenario 8)."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ralph_mail import MessageBus, Team
from ralph_mail.store.files import FileStore
from tests.helpers.faultkit import record
from tests.helpers.processes import BOUND_S, Processes, cli_env

COLLECTOR = """
import sys
from ralph_mail import MessageBus
total = int(sys.argv[1])
bus = MessageBus("demo", "lead")
got = []
print("ready", flush=True)
while len(got) < total:
    got += [m.content for m in bus.wait_for_messages(timeout=60)]
print(len(got), len(set(got)), flush=True)
"""


def test_an_inotify_queue_overflow_loses_no_message(team: Team, procs: Processes) -> None:
    """A waiter stopped while more events arrive than the kernel queues (16,384) still gets
    every message once it runs again."""
    queued = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    total = queued + 2000
    waiter = procs.python(COLLECTOR, str(total // 2), env=cli_env(team.home))
    assert waiter.stdout is not None and waiter.stdout.readline() == b"ready\n"
    waiter.send_signal(signal.SIGSTOP)
    sender = MessageBus("demo", "worker-1")
    for seq in range(total):  # alternate inboxes: identical events would be merged, not queued
        sender.send("lead" if seq % 2 else "worker-2", "text", str(seq))
    waiter.send_signal(signal.SIGCONT)
    out, err = waiter.communicate(timeout=BOUND_S)
    assert out.split() == [str(total // 2).encode()] * 2, err
    record(messages=total, faults=1)


LIMITED = """
import sys, warnings
kind = sys.argv[1]
with open(f"/proc/sys/user/max_inotify_{kind}", "w") as f:
    f.write("0")
from ralph_mail import MessageBus
bus = MessageBus("demo", "lead")
got = [m.content for m in bus.wait_for_messages(timeout=0.01)]  # the watcher starts here
print("ready", flush=True)
while len(got) < 3:
    got += [m.content for m in bus.wait_for_messages(timeout=60)]
print(",".join(got), flush=True)
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare for its own limits")
@pytest.mark.parametrize("kind", ["watches", "instances"])
def test_waits_fall_back_to_polling_at_the_inotify_limits(team: Team, kind: str) -> None:
    """Waiting on inotify with no watch or instance left, a wait warns, polls, and gets
    every message."""
    proc = subprocess.Popen(
        ["unshare", "-Ur", sys.executable, "-c", LIMITED, kind],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(team.home, RALPH_WAIT="inotify"),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line != b"ready\n":
            pytest.skip(f"no user namespace here: {proc.stderr.read() if proc.stderr else ''!r}")
        sender = MessageBus("demo", "worker-1")
        for text in ["one", "two", "three"]:
            sender.send("lead", "text", text)
        out, err = proc.communicate(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=BOUND_S)
    assert out.strip() == b"one,two,three"
    assert b"polling" in err and b"max_user_watches" in err
    record(messages=3, faults=1)


def test_forced_polling_still_delivers_everything(team: Team, procs: Processes) -> None:
    """WATCHFILES_FORCE_POLLING=1: waits poll and return every message."""
    waiter = procs.python(COLLECTOR, "50", env=cli_env(team.home, WATCHFILES_FORCE_POLLING="1"))
    assert waiter.stdout is not None and waiter.stdout.readline() == b"ready\n"
    sender = MessageBus("demo", "worker-1")
    for seq in range(50):
        sender.send("lead", "text", str(seq))
    out, _ = waiter.communicate(timeout=BOUND_S)
    assert out.split() == [b"50", b"50"]
    record(messages=50)


def test_a_wait_whose_events_are_all_lost_still_returns_the_mail(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Events that never come (a lost inotify event) delay a wait by the safety poll at most."""
    from ralph_mail.store.files import watch

    def deaf(self: watch.Watcher, timeout: float, stop: object = None) -> bool:
        time.sleep(min(timeout, 0.05))  # this fake watcher hears nothing
        return False

    monkeypatch.setattr(watch.Watcher, "wait", deaf)
    lead = MessageBus("demo", "lead")
    assert lead.wait_for_messages(timeout=0.01) == []  # the watcher is running now
    MessageBus("demo", "worker-1").send("lead", "text", "quiet")
    assert [m.content for m in lead.wait_for_messages(timeout=5)] == ["quiet"]


# -- 8. locks ---------------------------------------------------------------------------------

BLOCKED_SENDER = """
import sys
from ralph_mail import MessageBus, MailError
bus = MessageBus("demo", "worker-1")
bus.send("lead", "text", "warm-up")          # its descriptor is on the inbox now
print("ready", flush=True)
sys.stdin.readline()
try:
    bus.send("lead", "text", "late")
    print("sent", flush=True)
except MailError as exc:
    print("refused", exc, flush=True)
"""


def hold_lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def wait_for_lock_waiter(path: Path) -> None:
    """Until /proc/locks shows someone blocked on ``path``'s lock (bounded)."""
    inode = f":{path.stat().st_ino} "
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        if any(
            "->" in line and inode in line for line in Path("/proc/locks").read_text().splitlines()
        ):
            return
        time.sleep(0.005)
    pytest.fail("the sender never blocked on the lock")


@pytest.mark.parametrize("how", ["replaced", "deleted"])
def test_an_inbox_replaced_or_deleted_while_locked_never_gives_two_writers(
    team: Team, procs: Processes, how: str
) -> None:
    """A sender blocked on an inbox that is replaced moves to the new file; one whose inbox
    is deleted fails cleanly and creates nothing: no write ever lands in a dead inode."""
    path = team.store.root / "mailbox" / "lead.jsonl"
    sender = procs.python(BLOCKED_SENDER, env=cli_env(team.home))
    assert sender.stdout is not None and sender.stdout.readline() == b"ready\n"
    held = hold_lock(path)
    assert sender.stdin is not None
    sender.stdin.write(b"go\n")
    sender.stdin.flush()
    wait_for_lock_waiter(path)
    if how == "replaced":
        fresh = path.with_name(".fresh")
        shutil.copy(path, fresh)
        os.rename(fresh, path)
    else:
        path.unlink()
    os.close(held)  # releases the old inode's lock
    out, _ = sender.communicate(timeout=BOUND_S)
    if how == "replaced":
        assert out.strip() == b"sent"
        contents = [m.content for m in MessageBus("demo", "lead").poll()]
        assert contents == ["warm-up", "late"]
    else:
        assert out.startswith(b"refused") and b"missing" in out
        assert not path.exists()


LOCK_PROBE = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("free")
except BlockingIOError:
    print("held")
"""


def test_closing_another_descriptor_of_the_inbox_keeps_the_lock(
    team: Team, procs: Processes
) -> None:
    """flock belongs to the open file description: the same process opening and closing the
    inbox again (a read, a tail) does not drop a sender's lock, as fcntl locks would."""
    path = team.store.root / "mailbox" / "lead.jsonl"
    store = FileStore(team.home, team.name)
    log = store._log("lead")
    log._lock()  # the sender's lock, as append takes it
    os.close(os.open(path, os.O_RDONLY))  # as a tail or a base check would
    os.close(os.open(path, os.O_RDWR | os.O_APPEND))  # as another sender object would
    probe = procs.python(LOCK_PROBE, str(path))
    assert probe.communicate(timeout=BOUND_S)[0].strip() == b"held"
    fcntl.flock(log._writer, fcntl.LOCK_UN)
    probe = procs.python(LOCK_PROBE, str(path))
    assert probe.communicate(timeout=BOUND_S)[0].strip() == b"free"
    store.close()


def test_a_deleted_gc_lock_does_not_let_two_gc_runs_break_anything(team: Team) -> None:
    """gc.lock deleted while held gives a second gc its own lock; compaction is still safe,
    because each inbox is compacted under the inbox's own lock."""
    from ralph_mail.maintenance import collect

    sender = MessageBus("demo", "worker-1")
    for seq in range(20):
        sender.send("lead", "text", str(seq))
    lead = MessageBus("demo", "lead")
    assert len(lead.poll()) == 20
    store = FileStore(team.home, team.name)
    with store.maintenance_lock(1):
        (team.store.root / "gc.lock").unlink()
        assert collect("demo", timeout=1).removed > 0
    sender.send("lead", "text", "after")
    assert [m.content for m in lead.poll()] == ["after"]
