"""Conversations on the bus: reply, ask, the chain and its depth limit (DESIGN §8.2)."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from ralph_mail import Message, MessageBus, MessageType, Team
from ralph_mail.errors import DepthLimit, InvalidMessage, NoReply
from ralph_mail.team import update_team


@pytest.fixture
def team(team_on_every_backend: Team) -> Team:
    """This module's tests run on every backend."""
    return team_on_every_backend


def answer_requests(team: Team, agent: str, count: int) -> threading.Thread:
    """A thread that answers ``count`` requests to ``agent`` with 're: QUESTION'."""

    bus = MessageBus(team.name, agent)
    bus.peek()  # attached (online) before anyone asks

    def serve() -> None:
        answered = 0
        while answered < count:
            for message in bus.wait_for_messages(timeout=30):
                if message.type == MessageType.REQUEST:
                    bus.reply(message, f"re: {message.content}")
                    answered += 1
        bus.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_reply_answers_in_the_thread_of_the_message(team: Team) -> None:
    """A reply goes to the sender, with reply_to and the thread of what it answers."""
    asked = MessageBus("demo", "worker-1").send("lead", "text", "hello", thread="abcdefabcdef")
    answer = MessageBus("demo", "lead").reply(asked, "hi")
    assert (answer.to_agent, answer.type, answer.reply_to) == ("worker-1", "reply", asked.id)
    assert answer.thread == "abcdefabcdef"


def test_ask_returns_the_reply_and_consumes_it_alone(team: Team) -> None:
    """ask blocks until its reply; the reply is consumed, other mail stays unread."""
    server = answer_requests(team, "worker-1", 1)
    asker = MessageBus("demo", "lead")
    MessageBus("demo", "worker-2").send("lead", "text", "unrelated")
    answer = asker.ask("worker-1", "Q4 revenue?", context="investor update", timeout=30)
    server.join(30)
    assert (answer.content, answer.type) == ("re: Q4 revenue?", "reply")
    assert [m.content for m in asker.poll()] == ["unrelated"]


def test_a_reply_to_a_request_just_read_alone_in_its_thread_reads_no_line(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replying to a request this bus just read, the only message of its thread, reads no
    line of the thread (what it needs is in hand); replying again reads the thread and
    returns the first reply; a request made up by the caller is looked up in full."""
    asker, replier = MessageBus("demo", "lead"), MessageBus("demo", "worker-1")
    asker.send("worker-1", "request", "first?")
    (request,) = replier.poll()
    lines: list[object] = []
    read_line = replier.store.read_line
    monkeypatch.setattr(replier.store, "read_line", lambda *a: lines.append(a) or read_line(*a))
    answer = replier.reply(request, "yes")
    assert lines == [] and answer.reply_to == request.id
    assert replier.reply(request, "yes again").id == answer.id  # answered once
    assert lines  # the thread held the reply: it was read
    lines.clear()
    asker.send("worker-1", "request", "second?")
    (other,) = replier.poll()
    made_up = dataclasses.replace(other, content="another question")  # never read as such
    replier.reply(made_up, "looked up")
    assert lines  # its thread was read: only what was read is taken as read


def test_an_ask_marks_the_next_asks_thread_while_it_waits_and_ids_never_repeat(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ask marks the start of the next ask's thread while it waits for its answer, so
    the next ask's write marks nothing; each thread reads back whole; and an id is used
    once, by a request held for approval too."""
    server = answer_requests(team, "worker-1", 4)
    asker = MessageBus("demo", "lead")
    writing, marks = [False], []
    index_start, write = asker.store.index_start, asker.write
    monkeypatch.setattr(asker.store, "index_start",
                        lambda key: marks.append(writing[0]) or index_start(key))  # fmt: skip

    def timed_write(*args: object, **kwargs: object) -> Message:
        writing[0] = True
        try:
            return write(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            writing[0] = False

    monkeypatch.setattr(asker, "write", timed_write)
    answers = [asker.ask("worker-1", f"question {n}", timeout=30) for n in range(3)]
    held = MessageBus("demo", "worker-2")
    held.ask("worker-1", "before", timeout=30)  # delivered: it marks its next ask's thread
    server.join(30)
    assert marks.count(True) == 1  # the first ask's own mark; then none
    assert len({answer.reply_to for answer in answers}) == 3
    for n, answer in enumerate(answers):
        assert [m.content for m in asker.thread(answer.thread)] == [
            f"question {n}",
            f"re: question {n}",
        ]
    update_team("demo", member="worker-2", mode="supervised")  # its asks are held now
    held.refresh_team()
    for _ in range(2):
        with pytest.raises(NoReply):
            held.ask("worker-1", "may I?", timeout=0.1)
    waiting = [h.envelope["id"] for h in asker.approvals()]
    assert len(waiting) == 2 and len(set(waiting)) == 2


def test_the_request_carries_context_priority_and_chain(team: Team) -> None:
    """The request has metadata.context, the priority and the chain ending in the asker."""
    server = answer_requests(team, "worker-1", 1)
    asker = MessageBus("demo", "lead")
    asker.ask("worker-1", "why?", context="because", priority="high", timeout=30)
    server.join(30)
    request = next(m for m in MessageBus("demo", "worker-1").store.read_tail("worker-1", 1)[0])
    assert b'"context":"because"' in request and b'"priority":"high"' in request
    assert b'"chain":["lead"]' in request


def test_many_asks_in_flight_each_get_their_own_reply(team: Team) -> None:
    """Asks from several threads at once are each answered with their own reply."""
    server = answer_requests(team, "worker-1", 8)
    asker = MessageBus("demo", "lead")
    answers: dict[int, str] = {}

    def ask(n: int) -> None:
        answers[n] = asker.ask("worker-1", f"q{n}", timeout=30).content

    threads = [threading.Thread(target=ask, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    server.join(30)
    assert answers == {n: f"re: q{n}" for n in range(8)}


def test_no_reply_in_time_raises_no_reply(team: Team) -> None:
    """An unanswered ask raises NoReply, a TimeoutError, naming the agent and the fix."""
    MessageBus("demo", "worker-1").set_presence("working")  # online, but it never answers
    with pytest.raises(NoReply, match=r"worker-1 did not answer within 0\.05 s") as caught:
        MessageBus("demo", "lead").ask("worker-1", "anyone?", timeout=0.05)
    assert isinstance(caught.value, TimeoutError)


def test_asking_yourself_is_refused_before_anything_is_written(team: Team) -> None:
    """ask to oneself raises InvalidMessage and writes nothing."""
    with pytest.raises(InvalidMessage, match="asking itself"):
        MessageBus("demo", "lead").ask("lead", "me?")
    assert MessageBus("demo", "lead").store.size("lead") == 0


def test_a_request_deeper_than_max_depth_is_refused(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With RALPH_CHAIN already 3 deep, a further ask raises DepthLimit; nothing written."""
    monkeypatch.setenv("RALPH_CHAIN", "worker-2,lead,worker-2")
    with pytest.raises(DepthLimit, match=r"maximum agent communication depth \(3\)"):
        MessageBus("demo", "lead").ask("worker-1", "deeper?")
    assert MessageBus("demo", "worker-1").store.size("worker-1") == 0


def test_a_bad_ralph_chain_is_a_clear_error(team: Team, monkeypatch: pytest.MonkeyPatch) -> None:
    """A RALPH_CHAIN with a bad name is refused, naming the variable."""
    monkeypatch.setenv("RALPH_CHAIN", "ok,../bad")
    with pytest.raises(InvalidMessage, match="RALPH_CHAIN"):
        MessageBus("demo", "lead")


def test_history_is_both_directions_oldest_first(team: Team) -> None:
    """history(X, n) is the last n messages between me and X, both ways, oldest first."""
    lead, worker = MessageBus("demo", "lead"), MessageBus("demo", "worker-1")
    for n in range(5):
        lead.send("worker-1", "text", f"L{n}")
        worker.send("lead", "text", f"W{n}")
        MessageBus("demo", "worker-2").send("lead", "text", "noise")
    assert [m.content for m in lead.history("worker-1", 4)] == ["L3", "W3", "L4", "W4"]
    assert [m.content for m in worker.history("lead", 2)] == ["L4", "W4"]


def test_history_reads_only_what_it_returns(team: Team, monkeypatch: pytest.MonkeyPatch) -> None:
    """history(X, 3) reads 3 index entries and 3 lines, however much other mail there is."""
    lead = MessageBus("demo", "lead")
    noise = MessageBus("demo", "worker-2")
    for n in range(3):
        MessageBus("demo", "worker-1").send("lead", "text", f"x{n}")
    for _ in range(2000):
        noise.send("lead", "text", "buried")
    reads: list[int] = []
    store = lead.store
    real = store.read_line
    monkeypatch.setattr(store, "read_line", lambda *a: reads.append(1) or real(*a))
    assert [m.content for m in lead.history("worker-1", 3)] == ["x0", "x1", "x2"]
    assert len(reads) == 3


def test_thread_gathers_a_request_and_its_reply(team: Team) -> None:
    """thread(id) of an answered ask is the request, then the reply."""
    server = answer_requests(team, "worker-1", 1)
    asker = MessageBus("demo", "lead")
    answer = asker.ask("worker-1", "which?", timeout=30)
    server.join(30)
    assert [(m.type, m.content) for m in asker.thread(answer.thread)] == [
        ("request", "which?"),
        ("reply", "re: which?"),
    ]


def test_asking_an_offline_agent_is_refused_before_anything_is_written(team: Team) -> None:
    """ask to an agent with no live process and no recent activity raises AgentOffline."""
    from ralph_mail import AgentOffline

    with pytest.raises(AgentOffline, match="worker-1 is offline"):
        MessageBus("demo", "lead").ask("worker-1", "there?")
    assert MessageBus("demo", "worker-1").store.size("worker-1") == 0


def test_asking_a_sleeping_agent_proceeds(team: Team) -> None:
    """A sleeping agent is asked anyway (a request wakes it); the ask waits for its reply."""
    MessageBus("demo", "worker-1").set_presence("sleeping", until="+1h")
    with pytest.raises(NoReply):
        MessageBus("demo", "lead").ask("worker-1", "awake?", timeout=0.05)
    assert MessageBus("demo", "worker-1").store.size("worker-1") > 0


def test_acks_are_asked_for_sent_and_pending_until_answered(team: Team) -> None:
    """A message sent with ack=True is pending until its recipient acks it; reading alone
    does not acknowledge; pending_acks survives a new bus."""
    worker = MessageBus("demo", "worker-1")
    wanted = worker.send("lead", "text", "confirm this", ack=True)
    worker.send("lead", "text", "no ack needed")
    lead = MessageBus("demo", "lead")
    got = lead.poll()
    assert [m.id for m in MessageBus("demo", "worker-1").pending_acks()] == [wanted.id]
    lead.ack(next(m for m in got if m.ack))
    assert MessageBus("demo", "worker-1").pending_acks() == []


def test_pending_acks_older_than(team: Team) -> None:
    """older_than keeps only the requests sent that long ago or more."""
    worker = MessageBus("demo", "worker-1")
    worker.send("lead", "text", "confirm", ack=True)
    assert worker.pending_acks(older_than=3600) == []
    assert len(worker.pending_acks(older_than=0)) == 1


def test_a_thread_of_internal_messages_stops_at_the_limit(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With max_internal_exchanges 3, the 4th internal message in a thread raises LoopGuard;
    a user_visible one is let through and resets the count."""
    from ralph_mail import LoopGuard

    monkeypatch.setenv("RALPH_MAX_INTERNAL_EXCHANGES", "3")
    lead, worker = MessageBus("demo", "lead"), MessageBus("demo", "worker-1")
    first = lead.send("worker-1", "request", "clarify?")
    answer = worker.reply(first, "which part?")
    again = lead.reply(answer, "the second")
    with pytest.raises(LoopGuard, match="3 internal messages in a row"):
        worker.reply(again, "and the third?")
    shown = worker.reply(again, "here is the answer", visibility="user_visible")
    assert lead.reply(shown, "thanks").thread == first.id


def test_asking_again_under_the_id_of_a_request_left_unindexed_sends_it_once(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kill between a request's append and its index entry leaves it in the inbox but
    not in the indexes; asked again under its id, it is found there, read or not, and not
    sent twice: the asker waits for the one request's answer."""
    worker = MessageBus("demo", "worker-1")
    worker.peek()  # online
    asker = MessageBus("demo", "lead")
    with monkeypatch.context() as killed:  # appended, never indexed
        killed.setattr(type(asker), "_index", lambda *args: None)
        with pytest.raises(NoReply):
            asker.ask("worker-1", "still there?", id="0123456789ab", timeout=0.05)
    assert asker.thread("0123456789ab") == []
    (request,) = worker.poll()  # read, not answered yet
    with pytest.raises(NoReply):
        asker.ask("worker-1", "still there?", id="0123456789ab", timeout=0.05)
    worker.reply(request, "yes")
    answer = asker.ask("worker-1", "still there?", id="0123456789ab", timeout=5)
    assert (answer.content, answer.reply_to) == ("yes", "0123456789ab")
    lines, _ = worker.store.read_tail("worker-1", 10)
    assert sum(b'"id":"0123456789ab"' in line for line in lines) == 1


def test_a_request_nobody_can_have_answered_is_answered_without_a_look(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that came after its replier started reading, starting a thread of its
    own, is answered without reading any index (on a network store, a round trip fewer).
    A request that was there before the replier started (one a replier killed before
    committing may have answered), a second reply of the same process, a request sent
    again under its id and one in an older thread are looked up: an earlier reply is
    returned, never sent twice."""
    lead = MessageBus(team.name, "lead")
    older = lead.send("worker-1", MessageType.REQUEST, "there before?")
    worker = MessageBus(team.name, "worker-1")
    looks: list[str] = []
    real = worker.store.index_tail

    def counted(key: str, count: int) -> list[tuple[str, int, int]]:
        looks.append(key)
        return real(key, count)

    monkeypatch.setattr(worker.store, "index_tail", counted)
    [before] = worker.wait_for_messages(timeout=30)
    assert before.id == older.id
    worker.reply(before, "yes")
    assert looks, "a request there before the replier started is looked up"
    looks.clear()
    asked = lead.send("worker-1", MessageType.REQUEST, "new?")
    [got] = worker.wait_for_messages(timeout=30)
    first = worker.reply(got, "one")
    assert looks == []
    assert worker.reply(got, "two").id == first.id and looks
    looks.clear()
    resent = lead.send("worker-1", MessageType.REQUEST, "new?", id=asked.id)
    if resent.ts != asked.ts:  # a second line (NATS stores a send again under its id once)
        [again] = worker.wait_for_messages(timeout=30)
        assert worker.reply(again, "three").id == first.id and looks
        looks.clear()
    lead.send("worker-1", MessageType.REQUEST, "and then?", thread=asked.id)
    [follow_up] = worker.wait_for_messages(timeout=30)
    worker.reply(follow_up, "four")
    assert looks
    replies = [m.content for m in lead.wait_for_messages(timeout=30) if m.type == "reply"]
    assert sorted(replies) == ["four", "one", "yes"]
    lead.close()
    worker.close()
