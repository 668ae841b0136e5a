"""Cross-process behaviour with real processes: concurrent writers, wake-ups, cursors."""

from __future__ import annotations

from pathlib import Path

import orjson

from ralph_mail import MessageBus, Team
from ralph_mail.store.files.watch import Watcher
from tests.helpers.processes import BOUND_S, Processes, cli_env

WRITER = """
import sys
from ralph_mail import MessageBus
team, agent, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
bus = MessageBus(team, agent)
print("ready", flush=True)
sys.stdin.readline()                       # start together
for seq in range(count):
    bus.send("lead", "text", f"{agent} {seq}", metadata={"seq": str(seq)})
print("done", flush=True)
"""


def test_concurrent_writers_lose_nothing_and_keep_each_writers_order(
    home: Path, procs: Processes
) -> None:
    """8 writers x 2,000 sends into one inbox: exact count, each writer's order, whole lines."""
    from ralph_mail import create_team

    writers = [f"w{i}" for i in range(8)]
    team = create_team("load", ["lead", *writers], home=home)
    count = 2000
    started = [procs.python(WRITER, "load", w, str(count), env=cli_env(home)) for w in writers]
    for proc in started:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    for proc in started:
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
    for proc in started:
        proc.wait(timeout=BOUND_S)
        assert proc.returncode == 0, proc.stderr.read() if proc.stderr else b""
    raw = (team.store.root / "mailbox" / "lead.jsonl").read_bytes().splitlines()
    assert len(raw) == 8 * count
    assert all(orjson.loads(line) for line in raw)  # every line parses: none torn or merged
    messages = MessageBus("load", "lead").poll()
    assert len(messages) == 8 * count
    for writer in writers:
        seqs = [int(m.metadata["seq"]) for m in messages if m.from_agent == writer]
        assert seqs == list(range(count))
    stamps = [m.ts for m in messages]
    assert stamps == sorted(stamps)  # ts never decreases within the inbox


WAITER = """
import sys
from ralph_mail import MessageBus
bus = MessageBus("demo", "lead")
print("ready", flush=True)
messages = bus.wait_for_messages(timeout=float(sys.argv[1]))
print(",".join(m.content for m in messages), flush=True)
"""


def test_wait_is_woken_by_a_send_from_another_process(team: Team, procs: Processes) -> None:
    """A process blocked in wait_for_messages returns the message another process sends."""
    waiter = procs.python(WAITER, str(BOUND_S), env=cli_env(team.home))
    assert waiter.stdout is not None and waiter.stdout.readline() == b"ready\n"
    MessageBus("demo", "worker-1").send("lead", "text", "wake up")
    assert waiter.stdout.readline() == b"wake up\n"
    assert waiter.wait(timeout=BOUND_S) == 0


def test_watcher_wakes_on_a_file_event_not_on_its_timeout(team: Team, procs: Processes) -> None:
    """The watcher returns True (an event, not its timeout) when another process appends."""
    watcher = Watcher(team.store.root / "mailbox")
    assert not watcher.polling  # file events, not the polling fallback
    try:
        sender = procs.python(
            "from ralph_mail import MessageBus as B; B('demo','worker-1').send('lead','text','x')",
            env=cli_env(team.home),
        )
        assert sender.wait(timeout=BOUND_S) == 0
        assert watcher.wait(BOUND_S) is True
    finally:
        watcher.close()


def test_cursor_survives_across_processes(team: Team, procs: Processes) -> None:
    """What one process consumed, the next process for the same agent does not see again."""
    reader = (
        "from ralph_mail import MessageBus; "
        "print([m.content for m in MessageBus('demo','lead').poll()])"
    )
    bus = MessageBus("demo", "worker-1")
    bus.send("lead", "text", "one")
    first = procs.python(reader, env=cli_env(team.home))
    assert first.communicate(timeout=BOUND_S)[0] == b"['one']\n"
    bus.send("lead", "text", "two")
    second = procs.python(reader, env=cli_env(team.home))
    assert second.communicate(timeout=BOUND_S)[0] == b"['two']\n"


def test_forked_child_never_shares_the_parents_lock(team: Team) -> None:
    """A bus used after fork opens its own descriptors (an inherited flock would be shared)."""
    import os

    bus = MessageBus("demo", "worker-1")
    bus.send("lead", "text", "parent")
    parent_fd = bus._store._logs["lead"]._writer
    pid = os.fork()
    if pid == 0:  # the child
        code = 0
        try:
            bus.send("lead", "text", "child")
            code = 0 if bus._store._logs["lead"]._writer != parent_fd else 3
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert [m.content for m in MessageBus("demo", "lead").poll()] == ["parent", "child"]
