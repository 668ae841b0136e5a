"""Bounded resources: a process that answers or asks for days holds a few descriptors, and
a team's files do not grow with its threads. Real processes, each under a 256-descriptor
limit set in the child (``resource.setrlimit``), as macOS sets by default."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import pytest

from ralph_mail import MessageBus, Team, create_team
from ralph_mail.store.files import FileStore
from ralph_mail.store.files.indexes import KEPT, THREAD_BUCKETS
from ralph_mail.store.files.records import PRESENCE_KEPT
from ralph_mail.store.files.team import LOGS_KEPT
from tests.helpers.backends import fresh_nats
from tests.helpers.processes import BOUND_S, Processes, cli_env

#: The descriptor limit each child runs under (macOS's default soft limit).
LIMIT = 256
#: The most descriptors a bus may hold after any number of asks: directories, its inbox,
#: its peer's, a few index files, its waiters, the state file; far under `LIMIT`.
HELD_MAX = 48

_LIMITED = f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, ({LIMIT}, {LIMIT}))\n"

RESPONDER = (
    _LIMITED
    + """
import os, sys
from ralph_mail import MessageBus, MessageType
bus = MessageBus("demo", "worker-1")
bus.set_presence("idle")
print("ready", flush=True)
answered, total = 0, int(sys.argv[1])
while answered < total:
    messages = bus.wait_for_messages(timeout=30)
    if not messages:
        sys.exit("no request within 30 s")
    for message in messages:
        bus.reply(message, message.content)
        answered += 1
print(len(os.listdir("/proc/self/fd")), flush=True)
"""
)

ASKER = (
    _LIMITED
    + """
import os, sys
from ralph_mail import MessageBus
bus = MessageBus("demo", "lead")
for n in range(int(sys.argv[1])):
    answer = bus.ask("worker-1", f"question {n}", timeout=30)
    assert answer.content == f"question {n}", (n, answer.content)
print(len(os.listdir("/proc/self/fd")), flush=True)
"""
)


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))


def _index_files(team: Team) -> list[str]:
    return sorted(os.listdir(team.home / "teams" / team.name / "index"))


def _answer_asks(procs: Processes, env: dict[str, str], asks: int) -> None:
    """`RESPONDER` answers ``asks`` asks of `ASKER`, each under `LIMIT` descriptors,
    and each ends holding fewer than `HELD_MAX`."""
    responder = procs.python(RESPONDER, str(asks), env=env)
    assert responder.stdout is not None and responder.stdout.readline() == b"ready\n"
    asker = procs.python(ASKER, str(asks), env=env)
    out, err = asker.communicate(timeout=BOUND_S * 2)
    assert asker.returncode == 0, err.decode()[-2000:]
    assert int(out) < HELD_MAX
    out, err = responder.communicate(timeout=BOUND_S)
    assert responder.returncode == 0, err.decode()[-2000:]
    assert int(out) < HELD_MAX


def test_a_responder_and_its_asker_answer_3000_asks_under_256_descriptors(
    team: Team, procs: Processes
) -> None:
    """Two long-lived buses, an asker and a responder, each limited to 256 descriptors:
    3,000 asks are answered, each ends holding fewer than HELD_MAX descriptors, and the
    team's index holds a fixed set of files, not one per thread."""
    _answer_asks(procs, cli_env(team.home), 3000)
    files = _index_files(team)
    assert len(files) <= THREAD_BUCKETS + 2, files  # the buckets, the pair, no file a thread


def test_on_nats_a_responder_and_its_asker_answer_3000_asks_under_256_descriptors(
    home: Path, procs: Processes
) -> None:
    """The same on a NATS server: each side holds its connections, its waiter's
    standing pull and the watch of the bucket, and no more after 3,000 asks."""
    url = fresh_nats()
    create_team("demo", ["lead", "worker-1"], home=home, backend=url)
    _answer_asks(procs, cli_env(home, RALPH_BACKEND=url), 3000)


def test_a_runner_answers_600_asks_from_short_lived_askers_under_256_descriptors(
    team: Team, procs: Processes
) -> None:
    """`ralph-mail run` limited to 256 descriptors answers 600 asks, each from a process
    that starts, asks and exits (`ralph-mail ask` and short Python askers), and goes on."""
    env = cli_env(team.home, RALPH_TEAM="demo")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    runner = subprocess.Popen(
        [sys.executable, "-m", "ralph_mail", "run", "--agent", "worker-1", "--", "tail", "-n", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, preexec_fn=_limited,
    )  # fmt: skip
    procs.started.append(runner)
    bus = MessageBus("demo", "lead")
    assert _online(bus, "worker-1"), "the runner never came online"
    asked = 0
    for _ in range(2):  # the command line, as a shell script asks
        done = subprocess.run(
            [sys.executable, "-m", "ralph_mail", "ask", "worker-1", f"cli {asked}",
             "--timeout", "30", "--agent", "lead"],
            capture_output=True, env=env, timeout=BOUND_S,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout == f"cli {asked}\n".encode()
        asked += 1
    per_process, at_once = 50, 4  # askers side by side: the runner answers them in parallel
    while asked < 600:
        wave = []
        for _ in range(at_once):
            count = min(per_process, 600 - asked)
            if count:
                code = ASKER.replace("question", f"q{asked}-")
                wave.append(procs.python(code, str(count), env=env))
                asked += count
        for child in wave:
            _, err = child.communicate(timeout=BOUND_S)
            assert child.returncode == 0, err.decode()[-2000:]
    assert runner.poll() is None, "the runner died"
    held = len(os.listdir(f"/proc/{runner.pid}/fd"))
    assert held < LIMIT // 2, held
    files = _index_files(team)
    assert len(files) <= THREAD_BUCKETS + 2, files
    bus.close()


def _online(bus: MessageBus, agent: str) -> bool:
    import time

    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        if any(a.name == agent and a.presence != "offline" for a in bus.agents()):
            return True
        time.sleep(0.05)
    return False


def test_a_lead_of_many_agents_keeps_a_bounded_number_of_inboxes_open(home: Path) -> None:
    """Sending to 60 agents, one after the other, leaves at most LOGS_KEPT inboxes open
    (the least recently used closed first), and a send to any of them still lands."""
    names = [f"w{n}" for n in range(60)]
    create_team("many", ["lead", *names], home=home)
    bus = MessageBus("many", "lead")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(2):
        for name in names:
            bus.send(name, "text", f"to {name}")
    store = bus.store
    assert isinstance(store, FileStore)
    assert len(store._logs) <= LOGS_KEPT
    assert len(os.listdir("/proc/self/fd")) - before <= 2 * LOGS_KEPT + KEPT + 16
    assert [m.content for m in MessageBus("many", "w0").poll()] == ["to w0", "to w0"]
    bus.close()


def test_index_descriptors_are_kept_least_recently_used(team: Team) -> None:
    """Entries in 40 indexes leave at most KEPT index files open; each index reads back
    whole, the ones whose descriptor was closed included."""
    store = FileStore(team.home, team.name)
    for n in range(40):
        store.index_add(f"acks+a{n}", "lead", n * 10, 10)
        store.index_add(f"thread+{n:012x}", "lead", n * 10, 10)
    assert store._index_files.kept() <= KEPT
    assert all(store.index_tail(f"acks+a{n}", 5) == [("lead", n * 10, 10)] for n in range(40))
    assert all(store.index_tail(f"thread+{n:012x}", 5) == [("lead", n * 10, 10)] for n in range(40))
    store.close()


def test_a_thread_look_stops_at_its_start_mark_and_finds_all_after_it(team: Team) -> None:
    """A thread's bucket, shared with other threads, is read back to the thread's start
    mark: entries of the thread after it are all found, in order, and nothing before it
    is (an id of another thread that hashes alike never mixes in)."""
    store = FileStore(team.home, team.name)
    thread = "thread+0123456789ab"
    store.index_add(thread, "lead", 1, 1)  # before the mark: an older use of the id
    store.index_start(thread)
    for n in range(500):
        store.index_add(f"thread+{n:012x}", "worker-1", n, 1)
        if n % 100 == 0:
            store.index_add(thread, "lead", 1000 + n, 1)
    assert store.index_tail(thread, 1 << 40) == [("lead", 1000 + n, 1) for n in range(0, 500, 100)]
    assert store.index_tail(thread, 2) == [("lead", 1300, 1), ("lead", 1400, 1)]
    store.close()


def test_a_thread_without_a_start_mark_is_looked_up_whole(team: Team) -> None:
    """A thread whose first message was sent with a caller's id (a retry) has no start mark:
    a look at it reads its whole bucket and finds the entries of the first sending too."""
    lead, worker = MessageBus("demo", "lead"), MessageBus("demo", "worker-1")
    first = lead.send("worker-1", "request", "once", id="00000000beef")
    worker.reply(worker.poll()[0], "answered")
    again = lead.send("worker-1", "request", "once", id="00000000beef")
    assert [m.type for m in lead.thread(first.id)] == ["request", "reply", "request"]
    assert again.id == first.id
    for bus in (lead, worker):
        bus.close()


def test_asks_from_threads_that_end_leave_no_waiter_behind(team: Team, procs: Processes) -> None:
    """Each thread that asks gets a waiter; once the thread has ended its waiter is closed
    at the next ask from a new thread, so 50 short-lived asking threads hold one or two."""
    env = cli_env(team.home)
    responder = procs.python(RESPONDER, "50", env=env)
    assert responder.stdout is not None and responder.stdout.readline() == b"ready\n"
    bus = MessageBus("demo", "lead")
    answers: list[str] = []
    for n in range(50):
        worker = threading.Thread(
            target=lambda n=n: answers.append(bus.ask("worker-1", f"t{n}", timeout=30).content)
        )
        worker.start()
        worker.join(timeout=BOUND_S)
    assert answers == [f"t{n}" for n in range(50)]
    assert len(bus._ask_waiters) <= 2
    bus.close()
    responder.communicate(timeout=BOUND_S)


@pytest.mark.parametrize("kind", ["request", "task_assignment"])
def test_a_thread_started_with_a_fresh_id_is_marked(team: Team, kind: str) -> None:
    """A request or an assignment sent with an id made for it starts its thread with a mark,
    so a look at the thread reads no further back than its start."""
    lead = MessageBus("demo", "lead")
    MessageBus("demo", "worker-1").set_presence("idle")
    message = (
        lead.send("worker-1", kind, "go") if kind == "request" else lead.delegate("worker-1", "go")
    )
    thread_id = message.id if kind == "request" else message.assignment  # type: ignore[union-attr]
    name = f"threads.{zlib.crc32(thread_id.encode()) % THREAD_BUCKETS:02x}.idx"
    data = (team.home / "teams/demo/index" / name).read_bytes()
    assert data.count(thread_id.encode()) == 2  # the mark, then the entry
    lead.close()


def test_a_thread_entry_cut_short_is_stepped_over(team: Team) -> None:
    """A fragment in a thread's bucket (a write cut short by a full disk) hides no entry of
    the thread, and its start mark still bounds what is found."""
    store = FileStore(team.home, team.name)
    thread = "thread+00000000cafe"
    store.index_add(thread, "lead", 1, 1)  # before the mark: not the thread's
    store.index_start(thread)
    store.index_add(thread, "lead", 10, 20)
    bucket = f"threads.{zlib.crc32(b'00000000cafe') % THREAD_BUCKETS:02x}.idx"
    with open(team.home / "teams" / team.name / "index" / bucket, "ab") as index:
        index.write(b"\xa5\x5a" + b"\0" * 30)  # half an entry
    store.index_add(thread, "worker-1", 30, 40)
    assert store.index_tail(thread, 5) == [("lead", 10, 20), ("worker-1", 30, 40)]
    store.close()


def test_a_thread_begun_in_a_file_of_its_own_is_still_found(team: Team) -> None:
    """A team made by a release that gave each thread its own file keeps its threads: a
    look at such a thread reads that file, then what the shared file took since."""
    from ralph_mail.store.files.indexes import _CRC, _ENTRY, _MAGIC

    body = _ENTRY.pack(_MAGIC, b"lead", 0, 10)
    legacy = team.home / "teams" / team.name / "index" / "thread+0000000000aa.idx"
    legacy.write_bytes(body + _CRC.pack(zlib.crc32(body)))
    store = FileStore(team.home, team.name)
    store.index_add("thread+0000000000aa", "worker-1", 10, 20)
    assert store.index_tail("thread+0000000000aa", 5) == [("lead", 0, 10), ("worker-1", 10, 20)]
    assert store.index_tail("thread+0000000000aa", 1) == [("worker-1", 10, 20)]
    store.close()


def test_presence_descriptors_are_kept_least_recently_used(home: Path) -> None:
    """Reading the presence of 30 agents leaves at most PRESENCE_KEPT presence files open,
    and each read sees the newest record, a file deleted meanwhile included."""
    names = [f"w{n}" for n in range(30)]
    create_team("many", ["lead", *names], home=home)
    store = FileStore(home, "many")
    for name in names:
        store.save_presence(name, f'{{"state": "{name}"}}'.encode())
    reader = FileStore(home, "many")
    assert all(reader.load_presence(name) == f'{{"state": "{name}"}}'.encode() for name in names)
    assert len(reader._presence) <= PRESENCE_KEPT
    store.save_presence("w29", b'{"state": "again"}')
    assert reader.load_presence("w29") == b'{"state": "again"}'  # read through the kept one
    os.unlink(store.root / "presence" / "w29.slot")
    assert reader.load_presence("w29") is None
    store.close()
    reader.close()


def test_a_thread_look_finds_only_its_own_entries_among_lookalikes(team: Team) -> None:
    """A thread's look in its bucket matches the whole id at an entry's start: not a
    longer id it begins (in the same bucket), nor an agent named like it."""
    store = FileStore(team.home, team.name)
    short = "0123456789ab"
    bucket = zlib.crc32(short.encode()) % THREAD_BUCKETS
    longer = next(f"{short}{n:x}" for n in range(100_000)
                  if zlib.crc32(f"{short}{n:x}".encode()) % THREAD_BUCKETS == bucket)  # fmt: skip
    store.index_start(f"thread+{short}")
    store.index_add(f"thread+{short}", "lead", 10, 5)
    store.index_add(f"thread+{longer}", short, 20, 5)  # the id in the agent field too
    store.index_add(f"thread+{short}", "lead", 30, 5)
    assert store.index_tail(f"thread+{short}", 1 << 40) == [("lead", 10, 5), ("lead", 30, 5)]
    assert store.index_tail(f"thread+{longer}", 1 << 40) == [(short, 20, 5)]
    store.close()
