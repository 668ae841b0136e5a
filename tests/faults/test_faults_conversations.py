"""Fault suite, conversations: asks, replies and task results across kill -9, the presence
of a killed agent, and eight processes asking one replier at once.

Every process is real and always reaped; kills land at the worst moments through hooks
in the child (between the steps that record, send and commit), never at random.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import orjson
import pytest

from ralph_mail import MessageBus, Team, create_team
from tests.helpers.faultkit import lines_of, record
from tests.helpers.processes import BOUND_S, Processes, cli_env

#: A replier that handles each request at least once (peek, reply, commit) and can kill
#: itself with SIGKILL just before replying or just after (before the commit).
REPLIER = """
import os, signal, sys
from ralph_mail import MessageBus
team, me, crash = sys.argv[1], sys.argv[2], sys.argv[3]
bus = MessageBus(team, me)
print("ready", flush=True)
while True:
    bus.wait_for_messages(timeout=60, consume=False)
    for message in bus.peek():
        if message.type == "request":
            if crash == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            bus.reply(message, "answer to " + message.content)
            if crash == "after":
                os.kill(os.getpid(), signal.SIGKILL)
        bus.commit(message)
        print("handled", message.id, flush=True)
"""

#: An asker: asks under a given request id and prints the reply.
ASKER = """
import sys
from ralph_mail import MessageBus
team, me, to, request_id = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
bus = MessageBus(team, me)
print("asking", flush=True)
print(bus.ask(to, "what is 6x7?", id=request_id, timeout=60).content, flush=True)
"""

REQUEST_ID = "0123456789ab"


def messages(home: Path, team: str, agent: str) -> list[dict[str, object]]:
    path = home / "teams" / team / "mailbox" / f"{agent}.jsonl"
    return [orjson.loads(line) for line in lines_of(path)]


def of_type(home: Path, agent: str, kind: str) -> list[dict[str, object]]:
    return [m for m in messages(home, "demo", agent) if m["type"] == kind]


def wait_until(condition: object, what: str) -> None:
    """Poll ``condition()`` (a callable) until it holds, at most BOUND_S seconds."""
    deadline = time.monotonic() + BOUND_S
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def start(procs: Processes, home: Path, code: str, *args: str) -> object:
    child = procs.python(code, *args, env=cli_env(home))
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line in (b"ready\n", b"asking\n"), child.stderr.read() if child.stderr else line
    return child


@pytest.mark.parametrize("crash", ["before", "after"])
def test_a_replier_killed_around_its_reply_answers_once_when_run_again(
    team: Team, procs: Processes, home: Path, crash: str
) -> None:
    """The replier is killed just before replying, or just after (before it commits the
    request); run again, it answers: the asker gets exactly one reply, never two."""
    MessageBus("demo", "worker-1").set_presence("idle")
    replier = start(procs, home, REPLIER, "demo", "worker-1", crash)
    asker = start(procs, home, ASKER, "demo", "lead", "worker-1", REQUEST_ID)
    assert replier.wait(timeout=BOUND_S) == -signal.SIGKILL  # type: ignore[attr-defined]
    again = start(procs, home, REPLIER, "demo", "worker-1", "")
    # The restarted replier handled the request (replied, or found its reply, and
    # committed): only then can a second reply be ruled out.
    assert again.stdout.readline() == f"handled {REQUEST_ID}\n".encode()  # type: ignore[attr-defined]
    out, err = asker.communicate(timeout=BOUND_S)  # type: ignore[attr-defined]
    assert asker.returncode == 0, err  # type: ignore[attr-defined]
    assert out == b"answer to what is 6x7?\n"
    replies = of_type(home, "lead", "reply")
    assert [(r["reply_to"], r["content"]) for r in replies] == [
        (REQUEST_ID, "answer to what is 6x7?")
    ]
    record(messages=2, kills=1)


@pytest.mark.parametrize("order", ["reply while the asker is down", "reply after restart"])
def test_an_asker_killed_while_waiting_gets_its_reply_when_run_again(
    team: Team, procs: Processes, home: Path, order: str
) -> None:
    """The asker is killed -9 while it waits; run again with the same request id it
    prints the one reply (whether it came meanwhile or comes later) and does not ask
    again: the replier's inbox holds one request."""
    MessageBus("demo", "worker-1").set_presence("idle")
    asker = start(procs, home, ASKER, "demo", "lead", "worker-1", REQUEST_ID)
    wait_until(lambda: of_type(home, "worker-1", "request"), "the request")
    asker.kill()  # type: ignore[attr-defined]
    asker.wait(timeout=BOUND_S)  # type: ignore[attr-defined]
    if order == "reply while the asker is down":
        start(procs, home, REPLIER, "demo", "worker-1", "")
        wait_until(lambda: of_type(home, "lead", "reply"), "the reply")
        again = start(procs, home, ASKER, "demo", "lead", "worker-1", REQUEST_ID)
    else:
        again = start(procs, home, ASKER, "demo", "lead", "worker-1", REQUEST_ID)
        start(procs, home, REPLIER, "demo", "worker-1", "")
    out, err = again.communicate(timeout=BOUND_S)  # type: ignore[attr-defined]
    assert again.returncode == 0, err  # type: ignore[attr-defined]
    assert out == b"answer to what is 6x7?\n"
    assert [r["id"] for r in of_type(home, "worker-1", "request")] == [REQUEST_ID]
    assert len(of_type(home, "lead", "reply")) == 1
    with MessageBus("demo", "lead") as lead:
        assert lead.poll() == []  # the restarted asker consumed the reply it returned
    record(messages=2, kills=1)


#: Completes a task, killing itself with SIGKILL right after one step of `complete`:
#: "recorded" (the outcome is in the task log), "sent" (the result is in the
#: delegator's inbox), "notified" (the log says it went out), or "" (no kill).
COMPLETER = """
import os, signal, sys
from ralph_mail import MessageBus
team, me, task_id, step = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
bus = MessageBus(team, me)
store, send = bus.store, bus._send
appends = []

def log_append(name, record):
    store.__class__.log_append(store, name, record)
    appends.append(record)
    if (step, len(appends)) in (("recorded", 1), ("notified", 2)):
        os.kill(os.getpid(), signal.SIGKILL)

def sending(*args, **kwargs):
    sent = send(*args, **kwargs)
    if step == "sent":
        os.kill(os.getpid(), signal.SIGKILL)
    return sent

store.log_append, bus._send = log_append, sending
bus.complete(task_id, "parsed 1,204 files")
print("done", flush=True)
"""


@pytest.mark.parametrize("step", ["recorded", "sent", "notified"])
def test_an_assignee_killed_at_every_step_of_complete_sends_one_result(
    team: Team, procs: Processes, home: Path, step: str
) -> None:
    """kill -9 of the assignee right after each step of complete (outcome recorded,
    result sent, sent noted), then complete run again: the delegator gets exactly one
    task_result, and the task is completed with that result."""
    MessageBus("demo", "worker-1").set_presence("idle")
    lead = MessageBus("demo", "lead")
    task = lead.delegate("worker-1", "parse the logs", id="T-1")
    killed = procs.python(COMPLETER, "demo", "worker-1", "T-1", step, env=cli_env(home))
    assert killed.wait(timeout=BOUND_S) == -signal.SIGKILL, killed.stderr
    again = procs.python(COMPLETER, "demo", "worker-1", "T-1", "", env=cli_env(home))
    out, err = again.communicate(timeout=BOUND_S)
    assert again.returncode == 0 and out == b"done\n", err
    results = of_type(home, "lead", "task_result")
    assert [(r["reply_to"], r["content"]) for r in results] == [
        (task.assignment, "parsed 1,204 files")
    ]
    (done,) = lead.tasks()
    assert (done.status, done.result, done.notified) == ("completed", "parsed 1,204 files", True)
    lead.close()
    record(messages=2, kills=1)


WAITER = """
from ralph_mail import MessageBus
bus = MessageBus("demo", "worker-1")
bus.poll()  # claims the inbox and notes the agent active
print("ready", flush=True)
bus.wait_for_messages(timeout=60)
"""


def test_a_killed_agent_goes_offline_once_its_activity_window_passes(
    team: Team, procs: Processes, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 of an attached agent: it may look online for its activity window (1 s
    here), then it is offline, and stays so; nothing a dead process left keeps it up."""
    monkeypatch.setenv("RALPH_PRESENCE_TIMEOUT", "1")
    child = start(procs, home, WAITER)
    lead = MessageBus("demo", "lead")

    def presence() -> str:
        return {a.name: a.presence for a in lead.agents()}["worker-1"]

    assert presence() == "idle"
    killed_at = time.monotonic()
    child.kill()  # type: ignore[attr-defined]
    child.wait(timeout=BOUND_S)  # type: ignore[attr-defined]
    wait_until(lambda: presence() == "offline", "worker-1 to be offline")
    assert time.monotonic() - killed_at < BOUND_S
    for _ in range(3):
        assert presence() == "offline"
    lead.close()
    record(kills=1)


MANY_ASKER = """
import sys
from ralph_mail import MessageBus
team, me, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
bus = MessageBus(team, me)
print("ready", flush=True)
sys.stdin.readline()
crossed = 0
for n in range(count):
    question = f"{me}:{n}"
    if bus.ask("oracle", question, timeout=60).content != "answer to " + question:
        crossed += 1
print(crossed, flush=True)
"""


def test_eight_processes_asking_one_replier_each_get_their_own_replies(
    home: Path, procs: Processes
) -> None:
    """Eight asker processes ask one replier 25 times each, all at once: every ask gets
    the reply to its own question, none crossed, none lost, none doubled."""
    askers = [f"asker-{n}" for n in range(8)]
    create_team("many", ["oracle", *askers], home)
    count = 25
    MessageBus("many", "oracle").set_presence("idle")
    start(procs, home, REPLIER, "many", "oracle", "")
    children = [
        procs.python(MANY_ASKER, "many", name, str(count), env=cli_env(home)) for name in askers
    ]
    for child in children:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    for child in children:  # all at once
        assert child.stdin is not None
        child.stdin.write(b"go\n")
        child.stdin.flush()
    for child in children:
        out, err = child.communicate(timeout=BOUND_S)
        assert child.returncode == 0 and out == b"0\n", err
    for name in askers:
        replies = [m for m in messages(home, "many", name) if m["type"] == "reply"]
        assert sorted(str(r["content"]) for r in replies) == sorted(
            f"answer to {name}:{n}" for n in range(count)
        )
    requests = [m for m in messages(home, "many", "oracle") if m["type"] == "request"]
    assert len(requests) == len({r["id"] for r in requests}) == 8 * count
    record(messages=2 * 8 * count)


#: Approves a held message, killing itself with SIGKILL right after one step: "decided"
#: (the decision is in the log), "delivered" (the message is in the inbox), or "" (none).
APPROVER = """
import os, signal, sys
from ralph_mail import MessageBus
team, me, message_id, step = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
bus = MessageBus(team, me)
store, deliver = bus.store, bus._deliver

def log_append(name, record):
    store.__class__.log_append(store, name, record)
    if step == "decided" and b'"decided"' in record:
        os.kill(os.getpid(), signal.SIGKILL)

def delivering(envelope, **options):
    sent = deliver(envelope, **options)
    if step == "delivered":
        os.kill(os.getpid(), signal.SIGKILL)
    return sent

store.log_append, bus._deliver = log_append, delivering
bus.approve(message_id)
print("done", flush=True)
"""


@pytest.mark.parametrize("step", ["decided", "delivered"])
def test_an_approver_killed_while_approving_delivers_once_when_run_again(
    team: Team, procs: Processes, home: Path, step: str
) -> None:
    """kill -9 of the approver right after recording its decision, or right after
    delivering; approve run again: the message is delivered exactly once, unchanged, and
    the sender is told once."""
    from ralph_mail.govern.policy import Policy, Rule

    with MessageBus("demo", "lead") as lead:
        rule = Rule("worker-1", "worker-2", "allow", True)
        lead.store.save_state("policy", Policy((rule,)).to_json())
    with MessageBus("demo", "worker-1") as worker:
        held = worker.send("worker-2", "text", "review this")
    assert not held.ts
    killed = procs.python(APPROVER, "demo", "lead", held.id, step, env=cli_env(home))
    assert killed.wait(timeout=BOUND_S) == -signal.SIGKILL, killed.stderr
    again = procs.python(APPROVER, "demo", "lead", held.id, "", env=cli_env(home))
    out, err = again.communicate(timeout=BOUND_S)
    assert again.returncode == 0 and out == b"done\n", err
    delivered = of_type(home, "worker-2", "text")
    assert [(m["id"], m["content"]) for m in delivered] == [(held.id, "review this")]
    assert len(of_type(home, "worker-1", "approval_response")) == 1
    record(messages=2, kills=1)


#: Searches, killing itself with SIGKILL at one step: "indexing" (rows inserted, not yet
#: committed), "archived" (gc appended to the archive, not yet renamed the inbox).
SEARCHER = """
import os, signal, sys
from ralph_mail import MessageBus
from ralph_mail.store import search
from ralph_mail.store.files import archive
step = sys.argv[1]
def die_after(owner, name):
    original = getattr(owner, name)
    def dying(self, *args):
        original(self, *args)
        os.kill(os.getpid(), signal.SIGKILL)
    setattr(owner, name, dying)
if step == "indexing":
    die_after(search.SearchIndex, "_insert")
if step == "archived":
    die_after(archive.Archive, "append")
bus = MessageBus("demo", "worker-1")
if step == "archived":
    bus.store.compact("worker-1")
print(len(bus.search("", limit=100000)), flush=True)
"""


@pytest.mark.parametrize("step", ["indexing", "archived"])
def test_search_is_right_after_a_kill_while_indexing_or_archiving(
    team: Team, procs: Processes, home: Path, step: str
) -> None:
    """kill -9 while the search index takes a batch, or while gc archives (before the
    inbox is replaced); then gc and search run again: every message is found once."""
    count = 3000
    with MessageBus("demo", "lead") as lead:
        for n in range(count):
            lead.send("worker-1", "text", f"message {n}")
    with MessageBus("demo", "worker-1") as worker:
        assert len(worker.poll()) == count  # consumed: gc may archive them
    killed = procs.python(SEARCHER, step, env=cli_env(home))
    assert killed.wait(timeout=BOUND_S) == -signal.SIGKILL, killed.stderr
    with MessageBus("demo", "worker-1") as worker:
        worker.store.compact("worker-1")
        found = worker.search("", limit=100_000)
        assert sorted(m.content for m in found) == sorted(f"message {n}" for n in range(count))
        assert len({m.id for m in found}) == count
    record(messages=count, kills=1)


@pytest.mark.parametrize(
    ("query", "matches"),
    [('"', 1), ('"unbalanced', 0), ("AND OR NOT", 1), ("NEAR(a b)", 0), ("col:value", 1),
     ("*", 1), ("((((", 1), ("value -col", 1), ("x" * 1001, None), ("a\x00b", None)],
)  # fmt: skip
def test_hostile_search_queries_are_plain_words_or_one_clear_error(
    team: Team, query: str, matches: int | None
) -> None:
    """FTS syntax and quotes in a query are plain text: only its words count (a query
    without a word matches everything); a NUL or an overlong query is one clear error."""
    from ralph_mail import InvalidMessage

    with MessageBus("demo", "lead") as lead:
        lead.send("worker-1", "text", "AND OR NOT col value")
        if matches is None:
            with pytest.raises(InvalidMessage, match=r"NUL|characters long"):
                lead.search(query)
        else:
            assert len(lead.search(query)) == matches
    record(inputs=1)


def test_a_sender_killed_while_waiting_for_approval_loses_nothing(
    team: Team, procs: Processes, home: Path
) -> None:
    """send --wait killed -9 while its message waits for approval: the message stays
    held; approved afterwards, it is delivered once and the sender is told."""
    import subprocess
    import sys

    from ralph_mail.govern.policy import Policy, Rule

    with MessageBus("demo", "lead") as lead:
        lead.store.save_state("policy", Policy((Rule("worker-1", "*", "allow", True),)).to_json())
    waiting = subprocess.Popen(
        [sys.executable, "-m", "ralph_mail", "send", "worker-2", "ship it?", "--wait", "60",
         "--team", "demo", "--agent", "worker-1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(home),
    )  # fmt: skip
    procs.started.append(waiting)
    assert waiting.stdout is not None
    message_id = waiting.stdout.readline().decode().strip()
    wait_until(lambda: of_type(home, "lead", "approval_request"), "the approval request")
    waiting.kill()
    waiting.wait(timeout=BOUND_S)
    with MessageBus("demo", "lead") as lead:
        assert [held.id for held in lead.approvals()] == [message_id]
        lead.approve(message_id)
    assert [m["id"] for m in of_type(home, "worker-2", "text")] == [message_id]
    (told,) = of_type(home, "worker-1", "approval_response")
    assert told["reply_to"] == message_id
    record(messages=3, kills=1)
