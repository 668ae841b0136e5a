"""Fault suite, processes: load, kill -9 storms, at-least-once consumers, duplicates.

Scenarios 1 (load), 2 (kill storms), the process half of 5 (cursors) and 6 (duplicates),
with real processes that are always reaped. Kills land at random moments and, through a
hook in the writer, at the two worst ones: holding the inbox lock, and mid-write.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import time
from pathlib import Path

import orjson
import pytest

from ralph_mail import MessageBus, create_team
from ralph_mail.settings import MAX_MESSAGE_BYTES
from ralph_mail.store.files import FileStore
from tests.helpers import REPO
from tests.helpers.faultkit import SCALES, dead_letters, lines_of, pick, record
from tests.helpers.processes import BOUND_S, Processes, cli_env

#: Envelope, metadata and JSON escapes of a test message stay under this.
OVERHEAD = 400

WRITER = """
import random, sys
from ralph_mail import MessageBus
sys.path.insert(0, sys.argv[5])
from tests.helpers.faultkit import body_sizes
team, agent, count, largest = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sizes = body_sizes(random.Random(agent), count, largest)
sizes[0], sizes[-1] = 10, largest          # both ends of the range, every run
bus = MessageBus(team, agent)
print("ready", flush=True)
sys.stdin.readline()
for seq, size in enumerate(sizes):
    head = f"{agent}:{seq}:{size}:"
    bus.send("lead", "text", head + "x" * (size - len(head)), metadata={"seq": str(seq)})
print("done", flush=True)
"""

READER = """
import sys, threading, time, orjson
from ralph_mail import MessageBus
from ralph_mail.talk.history import History
mode, total, bound = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
stop = threading.Event()
timer = threading.Timer(bound, stop.set)
timer.daemon = True
timer.start()
if mode == "owner":
    view = MessageBus("load", "lead")
    batches = iter(lambda: view.wait_for_messages(timeout=1.0, stop=stop), None)
else:  # what tail -f does: follow on file events, consume nothing
    view = History("load", ["lead"])
    view.last(0)
    batches = view.follow(stop)
next_seq, got, bad, polls = {}, 0, 0, 0
print("ready", flush=True)
for batch in batches:
    polls += 1
    for m in batch:
        agent, seq, size, _ = m.content.split(":", 3)
        # A body is at least its header: a drawn size below the header's length is not.
        whole = max(int(size), len(f"{agent}:{seq}:{size}:"))
        expected = next_seq.get(agent, 0)
        # A viewer more than one compaction behind the owner skips what gc collected,
        # and says so (view.skipped); anything else out of order is a fault.
        jumped = mode != "owner" and int(seq) > expected and sum(view.skipped.values())
        if (int(seq) != expected and not jumped) or len(m.content) != whole:
            bad += 1
        next_seq[agent] = int(seq) + 1
        got += 1
    if sum(next_seq.values()) >= total or stop.is_set():  # every writer's last one seen
        break
stop.set()
skipped = 0 if mode == "owner" else sum(view.skipped.values())
result = {"got": got, "bad": bad, "polls": polls, "skipped": skipped}
print(orjson.dumps(result).decode(), flush=True)
"""


def start_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    for proc in procs:
        if proc.stdin is not None:
            proc.stdin.write(b"go\n")
            proc.stdin.flush()


@pytest.mark.parametrize("scale", SCALES)
def test_load_16_writers_into_one_inbox_while_2_readers_poll(
    home: Path, procs: Processes, scale: str
) -> None:
    """16 writers x N messages of 10 B to 1 MiB into one inbox, an owner and a viewer reading
    meanwhile: exact count, each writer's order, every body whole, no merged or torn line."""
    writers = [f"w{i:02d}" for i in range(16)]
    count = pick(scale, 120, 10_000)
    team = create_team("load", ["lead", *writers], home=home)
    total = 16 * count
    env = cli_env(home)
    largest = MAX_MESSAGE_BYTES - OVERHEAD
    readers = [
        procs.python(READER, mode, str(total), str(BOUND_S * 4), env=env)
        for mode in ("owner", "viewer")
    ]
    for reader in readers:
        assert reader.stdout is not None and reader.stdout.readline() == b"ready\n"
    started = [
        procs.python(WRITER, "load", w, str(count), str(largest), str(REPO), env=env)
        for w in writers
    ]
    start_all(started)
    for proc in started:
        assert proc.wait(timeout=BOUND_S * 4) == 0, proc.stderr.read() if proc.stderr else b""
    for mode, reader in zip(("owner", "viewer"), readers, strict=True):
        out, err = reader.communicate(timeout=BOUND_S * 4)
        result = orjson.loads(out.splitlines()[-1])
        assert result["bad"] == 0, err
        # The owner gets everything; a viewer everything but what it reports as collected.
        assert result["got"] == total or (mode == "viewer" and result["skipped"]), result
        assert result["polls"] > 1  # it read while the writers wrote
    # What the owner consumed may be compacted away (RALPH_GC_AUTO_BYTES): the rest is whole.
    lines = lines_of(team.store.root / "mailbox" / "lead.jsonl")
    assert len(lines) <= total
    assert all(orjson.loads(line) for line in lines)
    assert dead_letters(team.store.root, "lead") == []
    record(messages=total)


STORM_WRITER = """
import os, sys
from ralph_mail import MessageBus
from ralph_mail.store.files import inbox as store
name, hook, tag = sys.argv[1], sys.argv[2], sys.argv[3]
bus = MessageBus("storm", name)
real = store.write_all
def stop_here(fd, data):
    # The fault hook: hold the lock (and with 'mid', half a line) and wait to be killed.
    if hook == "mid":
        os.write(fd, data[: len(data) // 2])
    print("stopped", flush=True)
    sys.stdin.readline()
    real(fd, data)
if hook != "none":
    store.write_all = stop_here
print("ready", flush=True)
sys.stdin.readline()
seq = 0
while True:
    size = (seq * 7919) % 200_000 if seq % 5 == 0 else 50
    bus.send("lead", "text", f"{tag}:{seq}:" + "y" * size)
    print(seq, flush=True)
    seq += 1
"""


def acked_lines(proc: subprocess.Popen[bytes], name: str) -> set[str]:
    """The messages a killed writer reported as sent (its send had returned)."""
    assert proc.stdout is not None
    out = proc.stdout.read().decode()
    return {f"{name}:{line}" for line in out.split() if line.isdigit()}


def read_line(proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    """The child's next line, within ``timeout``; for a child that writes one line, then
    waits (a child that writes faster needs `Lines`: a buffered readline hides lines from
    select)."""
    assert proc.stdout is not None
    assert readable(proc.stdout.fileno(), timeout), "no answer from the child in time"
    return proc.stdout.readline()


def readable(fd: int, timeout: float) -> bool:
    # poll, not select: a long test run may hold descriptors numbered past select's 1024.
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0.0, timeout) * 1000))


class Lines:
    """Reads a child's output line by line with a deadline, through its raw descriptor."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self.fd = proc.stdout.fileno()
        self.buffer = b""

    def next(self, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            assert readable(self.fd, remaining), "no answer from the child in time"
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return b""
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line + b"\n"

    def rest(self) -> list[bytes]:
        """Every whole line left, once the child is gone."""
        while chunk := os.read(self.fd, 65536):
            self.buffer += chunk
        return self.buffer.split(b"\n")[:-1]


@pytest.mark.parametrize("scale", SCALES)
def test_kill_storm_loses_no_returned_send_and_never_blocks_the_next_writer(
    home: Path, procs: Processes, scale: str
) -> None:
    """Writers killed at random moments, while holding the lock and mid-write, round after
    round: every send that returned is delivered exactly once, the next writer gets the lock
    at once, and each torn tail is set aside, never delivered."""
    rng = random.Random(2)
    rounds = pick(scale, 12, 200)
    team = create_team("storm", ["lead", "a", "b", "c", "d"], home=home)
    env = cli_env(home)
    lead = MessageBus("storm", "lead")
    acked: set[str] = set()
    delivered: list[str] = []
    kills = torn = 0
    for round_ in range(rounds):
        hook = ("none", "locked", "mid")[round_ % 3]
        names = [f"{n}" for n in ("a", "b", "c")]
        tags = [f"{n}{round_}" for n in names]
        victim = None
        if hook != "none":
            victim = procs.python(STORM_WRITER, "d", hook, f"d{round_}", env=env)
        writers = [
            procs.python(STORM_WRITER, n, "none", t, env=env)
            for n, t in zip(names, tags, strict=True)
        ]
        start_all(writers + ([victim] if victim else []))
        if victim is not None:
            assert read_line(victim, BOUND_S) == b"stopped\n"  # it holds the lock now
        else:
            # Random moments: let the writers run a random while (this is the fault, not a
            # synchronisation), then kill them wherever they are.
            time.sleep(rng.uniform(0.0, 0.05))
        doomed = writers if victim is None else [victim, *rng.sample(writers, 1)]
        for proc in doomed:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=BOUND_S)
            kills += 1
        torn += hook == "mid"
        # The survivors (or, after a storm, a new writer) must get on at once.
        survivor = procs.python(STORM_WRITER, "b", "none", f"s{round_}", env=env)
        start_all([survivor])
        first = read_line(survivor, BOUND_S)
        assert first.strip().isdigit(), first
        survivor.send_signal(signal.SIGKILL)
        survivor.wait(timeout=BOUND_S)
        kills += 1
        for proc in writers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=BOUND_S)
                kills += 1
        for proc, tag in [*zip(writers, tags, strict=True)] + (
            [(victim, f"d{round_}")] if victim else []
        ):
            acked |= acked_lines(proc, tag)
        acked |= acked_lines(survivor, f"s{round_}") | {f"s{round_}:{first.strip().decode()}"}
        # A reader between rounds: the torn tail (if the last writer died mid-line) is
        # still there and must not come through.
        for message in lead.poll():
            name, seq, body = message.content.split(":", 2)
            assert set(body) <= {"y"}, "a merged or torn body was delivered"
            delivered.append(f"{name}:{seq}")
    MessageBus("storm", "a").send("lead", "text", "a:final:")
    delivered += [":".join(m.content.split(":", 2)[:2]) for m in lead.poll()]
    assert len(delivered) == len(set(delivered)), "a message was delivered twice"
    lost = acked - set(delivered)
    record(messages=len(delivered), kills=kills, faults=torn, lost=len(lost))
    assert not lost, f"{len(lost)} returned sends lost: {sorted(lost)[:5]}"
    assert "a:final" in delivered
    letters = FileStore(team.home, team.name).dead_letters("lead")
    assert len([x for x in letters if "torn" in str(x["reason"])]) >= torn
    assert all(orjson.loads(line) for line in lines_of(team.store.root / "mailbox" / "lead.jsonl"))


CONSUMER = """
import sys
from ralph_mail import MessageBus
bus = MessageBus("cons", "lead")
print("ready", flush=True)
for message in bus.peek():
    print("handled", message.content, flush=True)   # handled, not yet committed
    sys.stdin.readline()                               # the parent may kill us here
    bus.commit(message)
print("idle", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("scale", SCALES)
def test_a_consumer_killed_around_its_commits_gets_every_message_at_least_once(
    home: Path, procs: Processes, scale: str
) -> None:
    """peek, handle, commit under repeated kill -9: every message is handled at least once,
    and a message is handled again only when a kill hit between its handling and commit."""
    total = pick(scale, 300, 5000)
    create_team("cons", ["lead", "w"], home=home)
    sender = MessageBus("cons", "w")
    for seq in range(total):
        sender.send("lead", "text", str(seq))
    env = cli_env(home)
    rng = random.Random(3)
    handled: list[str] = []
    kills = 0
    while len(set(handled)) < total:
        consumer = procs.python(CONSUMER, env=env)
        lines = Lines(consumer)
        assert lines.next(BOUND_S) == b"ready\n"
        assert consumer.stdin is not None
        while (line := lines.next(BOUND_S)) != b"idle\n":
            handled.append(line.split()[1].decode())
            roll = rng.random()
            if roll < 0.1:  # killed after handling, before the commit
                break
            consumer.stdin.write(b"go\n")
            consumer.stdin.flush()
            if roll < 0.2:  # killed somewhere in or after the commit
                break
        consumer.send_signal(signal.SIGKILL)
        consumer.wait(timeout=BOUND_S)
        kills += 1
        rest = [line.split() for line in lines.rest()]
        handled += [w[1].decode() for w in rest if len(w) == 2 and w[0] == b"handled"]
    duplicates = len(handled) - len(set(handled))
    assert set(handled) == {str(seq) for seq in range(total)}
    assert duplicates <= kills  # at most the one message in flight per kill comes again
    in_flight = [m.content for m in MessageBus("cons", "lead").poll()]
    assert len(in_flight) <= 1 and set(in_flight) <= set(handled)  # the last one, if killed
    record(messages=total, kills=kills, lost=total - len(set(handled)))


LEAD = """
from ralph_mail.orchestrator import TeamOrchestrator
orch = TeamOrchestrator("dup", review_plan=lambda plan: (True, "go"))
print("ready", flush=True)
orch.run(timeout=120)
"""


def test_retries_under_one_id_are_answered_once_by_a_lead_killed_again_and_again(
    home: Path, procs: Processes
) -> None:
    """Each plan is submitted three times under one id while the lead process is killed and
    restarted: every plan gets exactly one approval."""
    create_team("dup", ["lead", "w"], home=home)
    env = cli_env(home)
    worker = MessageBus("dup", "w")
    plans = 40
    submissions = [worker.send("lead", "plan_submission", f"plan {i}") for i in range(plans)]
    kills = 0
    answers: dict[str, int] = {}
    for attempt in range(3):
        for message in submissions:  # the retry: same id, same content
            worker.send("lead", "plan_submission", message.content, id=message.id)
        lead = procs.python(LEAD, env=env)
        assert read_line(lead, BOUND_S) == b"ready\n"
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline and lead.poll() is None:
            for reply in worker.wait_for_messages(timeout=0.5):
                answers[reply.reply_to or ""] = answers.get(reply.reply_to or "", 0) + 1
            # Kill it a third of the way in, two thirds, then once everything is answered.
            if sum(answers.values()) >= (attempt + 1) * plans // 3 and attempt < 2:
                break
            if attempt == 2 and len(answers) == plans:
                break
        lead.send_signal(signal.SIGKILL)
        lead.wait(timeout=BOUND_S)
        kills += 1
    for reply in worker.poll():
        answers[reply.reply_to or ""] = answers.get(reply.reply_to or "", 0) + 1
    assert set(answers) == {m.id for m in submissions}
    assert set(answers.values()) == {1}, "a plan was answered twice"
    record(messages=plans * 4, kills=kills, lost=plans - len(answers))


TASKED = """
from ralph_mail.agent import TeamAgent
agent = TeamAgent("dup", "w")
print("ready", flush=True)
seen = []
while (task := agent.next_task(timeout=0)) is not None:  # all mail is there before it starts
    seen.append(task.id)
    agent.finish_task("done")
print(",".join(seen), flush=True)
"""


def test_an_agent_handles_a_task_resent_under_one_id_once(home: Path, procs: Processes) -> None:
    """Task assignments resent three times under the same id give the agent each task once."""
    create_team("dup", ["lead", "w"], home=home)
    lead = MessageBus("dup", "lead")
    for index in range(5):
        first = lead.send(
            "w", "task_assignment", f"task {index}", metadata={"taskId": f"T-{index}"}
        )
        for _ in range(2):
            lead.send("w", "task_assignment", first.content, dict(first.metadata), id=first.id)
    agent = procs.python(TASKED, env=cli_env(home))
    out, err = agent.communicate(timeout=BOUND_S)
    assert out.decode().split()[-1] == "T-0,T-1,T-2,T-3,T-4", err
    record(messages=15)
