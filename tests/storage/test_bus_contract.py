"""MessageBus's contract, run on every backend: what a user of the bus may rely on
whatever keeps the mail (DESIGN §4-5)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from ralph_mail import InvalidMessage, MessageBus, MessageType, UnknownAgent, create_team
from tests.helpers.backends import BACKENDS, backend_url


@pytest.fixture(params=BACKENDS)
def url(request: pytest.FixtureRequest, tmp_path: Path, home: Path) -> str:
    """Team 'demo' (lead, w1, w2) in a fresh place of the backend under test."""
    where = backend_url(request.param, tmp_path)
    create_team("demo", ["lead", "w1", "w2"], home=home, backend=where)
    return where


def bus(url: str, agent: str) -> MessageBus:
    return MessageBus("demo", agent, backend=url)


def test_send_then_poll_delivers_in_order_once(url: str) -> None:
    """Messages sent to an inbox are polled in send order, and only once."""
    sender = bus(url, "w1")
    for n in range(5):
        sender.send("lead", MessageType.TEXT, f"m{n}")
    lead = bus(url, "lead")
    assert [m.content for m in lead.poll()] == [f"m{n}" for n in range(5)]
    assert lead.poll() == []


def test_a_new_bus_resumes_from_the_committed_cursor(url: str) -> None:
    """A bus made anew (a restarted owner) gets only what was not consumed."""
    sender = bus(url, "w1")
    sender.send("lead", "text", "old")
    first = bus(url, "lead")
    assert [m.content for m in first.poll()] == ["old"]
    first.close()
    sender.send("lead", "text", "new")
    assert [m.content for m in bus(url, "lead").poll()] == ["new"]


def test_peek_then_commit_consumes_through_the_message(url: str) -> None:
    """commit(m) consumes m and everything before it; the rest is peeked again."""
    sender = bus(url, "w1")
    for n in range(4):
        sender.send("lead", "text", f"m{n}")
    lead = bus(url, "lead")
    peeked = lead.peek()
    lead.commit(peeked[1])
    lead.close()
    assert [m.content for m in bus(url, "lead").peek()] == ["m2", "m3"]


def test_committing_one_by_one_consumes_each(url: str) -> None:
    """Committing each peeked message in turn leaves nothing for a new bus."""
    sender = bus(url, "w1")
    for n in range(100):
        sender.send("lead", "text", str(n))
    lead = bus(url, "lead")
    for message in lead.peek():
        lead.commit(message)
    lead.close()
    assert bus(url, "lead").poll() == []


def test_wait_for_one_type_consumes_only_that_message(url: str) -> None:
    """wait_for_message(type) takes one message; the others stay unread, also on disk."""
    sender = bus(url, "w1")
    sender.send("lead", "text", "a")
    sender.send("lead", "plan_submission", "plan")
    sender.send("lead", "text", "b")
    lead = bus(url, "lead")
    found = lead.wait_for_message("plan_submission", timeout=0)
    assert found is not None and found.content == "plan"
    lead.close()
    assert [m.content for m in bus(url, "lead").poll()] == ["a", "b"]


def test_consume_false_then_consume(url: str) -> None:
    """A message found without consuming is consumed alone by consume()."""
    sender = bus(url, "w1")
    sender.send("lead", "text", "a")
    sender.send("lead", "status_update", "s", {"state": "working"})
    lead = bus(url, "lead")
    found = lead.wait_for_message("status_update", timeout=0, consume=False)
    assert found is not None
    assert [m.content for m in lead.peek()] == ["a", "s"]
    lead.consume(found)
    lead.close()
    assert [m.content for m in bus(url, "lead").poll()] == ["a"]


def test_a_wait_wakes_when_mail_arrives(url: str) -> None:
    """A blocked wait returns the message sent while it waits."""
    lead = bus(url, "lead")
    timer = threading.Timer(0.05, lambda: bus(url, "w1").send("lead", "text", "wake"))
    timer.start()
    got = lead.wait_for_messages(timeout=30)
    timer.join()
    assert [m.content for m in got] == ["wake"]


def test_a_wait_times_out_with_nothing(url: str) -> None:
    """A wait with no mail returns [] after its timeout."""
    assert bus(url, "lead").wait_for_messages(timeout=0.05) == []


def test_broadcast_reaches_everyone_but_the_sender_with_one_id(url: str) -> None:
    """A broadcast lands in every other inbox under one id, and not in the sender's."""
    sent = bus(url, "lead").broadcast("all hands")
    ids = [[m.id for m in bus(url, agent).poll()] for agent in ("w1", "w2", "lead")]
    assert ids == [[sent.id], [sent.id], []]


def test_an_unknown_recipient_is_refused_and_nothing_is_written(url: str) -> None:
    """Sending to a non-member raises UnknownAgent naming the members."""
    with pytest.raises(UnknownAgent, match="members: lead, w1, w2"):
        bus(url, "w1").send("nobody", "text", "x")


def test_an_oversized_message_is_refused(url: str) -> None:
    """A message over the size limit is refused before anything is written."""
    sender = MessageBus("demo", "w1", backend=url, max_message_bytes=200)
    with pytest.raises(InvalidMessage, match="limit"):
        sender.send("lead", "text", "x" * 300)
    assert bus(url, "lead").poll() == []


def test_unknown_types_are_carried_not_dead_lettered(url: str) -> None:
    """A line of a type this reader does not know is delivered with its type as a string."""
    sender = bus(url, "w1")
    head = b'{"id":"0123456789ab","from":"w1","to":"lead","type":"blocker","content":"x",'
    sender.store.append("lead", head + b'"metadata":{},"ts":"', b'"}\n')
    got = bus(url, "lead").poll()
    assert [(m.type, m.content) for m in got] == [("blocker", "x")]
    assert sender.store.dead_letters("lead") == []
