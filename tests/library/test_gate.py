"""The one Gate (DESIGN §7, §9.3a): every write from every face passes it, and a message
type never buys an exemption by itself."""

from __future__ import annotations

import threading
from pathlib import Path

import orjson
import pytest

from ralph_mail import (
    InvalidMessage,
    MessageBus,
    NoReply,
    PermissionDenied,
    RateLimited,
    Team,
    create_team,
)
from ralph_mail.govern.policy import KEY, Policy, Rule
from tests.helpers.processes import ralph

CREW = ("lead", "boss", "intern", "writer", "archive")
DENY_ARCHIVE = Policy((Rule("writer", "archive", "deny"),), {"writer": 2})


@pytest.fixture
def crew(home: Path) -> Team:
    """lead, boss, intern, writer, archive; writer may not contact archive (2/min)."""
    team = create_team("crew", list(CREW), home=home)
    with MessageBus("crew", "lead") as lead:
        lead.store.save_state(KEY, DENY_ARCHIVE.to_json())
    return team


@pytest.mark.parametrize(
    "kind",
    ["task_assignment", "reply", "ack", "task_result", "approval_response",
     "approval_request", "plan_submission", "shutdown_request", "shutdown_response",
     "status_update"],
)  # fmt: skip
def test_a_type_buys_no_exemption_from_a_deny_rule(crew: Team, kind: str) -> None:
    """Every type, answer or protocol, that answers nothing the sender received is
    contact: a deny rule refuses it (exit 4) and nothing reaches the inbox."""
    meta = ["--meta", "accepted=true"] if kind == "shutdown_response" else []
    meta += ["--meta", "state=working"] if kind == "status_update" else []
    meta += ["--reply-to", "0123456789ab"] if kind != "status_update" else []
    done = ralph(crew.home, "send", "archive", "x", "--type", kind, *meta,
                 "--team", "crew", "--agent", "writer")  # fmt: skip
    assert done.returncode == 4, done.stderr
    assert done.stderr.count(b"\n") == 1
    assert MessageBus("crew", "archive").peek() == []


def test_answers_count_against_nothing_but_contact_counts_against_the_rate(crew: Team) -> None:
    """A reply to a request the sender received is an answer (not judged, not counted);
    a made-up reply to a stranger's id is contact and counts against the rate."""
    writer, lead = MessageBus("crew", "writer"), MessageBus("crew", "lead")
    writer.touch()
    question = lead.send("writer", "request", "status?")
    for _ in range(3):  # answers: the rate of 2 does not count them
        writer.reply(question, "fine")
    writer.send("lead", "text", "one")
    writer.send("lead", "text", "two")
    with pytest.raises(RateLimited):
        writer.send("lead", "reply", "fake", reply_to="0123456789ab")


def test_ask_takes_the_reply_of_the_agent_asked_alone(crew: Team) -> None:
    """A reply to my request from anyone but the agent asked is not the answer."""
    lead, boss, intern = (MessageBus("crew", n) for n in ("lead", "boss", "intern"))
    boss.touch()
    answers: list[object] = []

    def asking() -> None:
        try:
            answers.append(lead.ask("boss", "ready?", timeout=3))
        except NoReply as exc:
            answers.append(exc)

    asker = threading.Thread(target=asking)
    asker.start()
    request = None
    for _ in range(300):
        request = next((m for m in boss.peek() if m.type == "request"), None)
        if request is not None:
            break
        boss.wait_for_messages(timeout=0.01, consume=False)
    assert request is not None
    intern.send("lead", "reply", "forged yes", reply_to=request.id, thread=request.id)
    boss.reply(request, "real yes")
    asker.join(10)
    assert [getattr(a, "content", a) for a in answers] == ["real yes"]


def test_no_agent_sends_to_itself(crew: Team) -> None:
    """send, ask and the CLI refuse a message to oneself (exit 2), writing nothing."""
    writer = MessageBus("crew", "writer")
    with pytest.raises(InvalidMessage, match="itself"):
        writer.send("writer", "text", "hi me")
    done = ralph(crew.home, "send", "writer", "hi", "--team", "crew", "--agent", "writer")
    assert done.returncode == 2 and b"itself" in done.stderr
    assert writer.peek() == []


@pytest.mark.parametrize(
    "args",
    [
        ("policy", "allow", "writer", "archive"),
        ("policy", "rate", "writer", "off"),
        ("policy", "depth", "9"),
        ("team", "set", "crew", "writer", "--mode", "autonomous"),
        ("team", "set", "crew", "intern", "--manager", "writer"),
        ("team", "config", "crew", "max_depth", "9"),
        ("team", "delete", "crew", "--yes"),
    ],
)
def test_governance_acts_are_the_leads_alone(crew: Team, args: tuple[str, ...]) -> None:
    """A member, or no identity, changing the rules is refused (exit 4), changing nothing."""
    before = crew.store.load_state(KEY), crew.store.roster()
    where = () if args[0] == "team" else ("--team", "crew")
    for who in (("--agent", "writer"), ()):
        done = ralph(crew.home, *args, *where, *who)
        assert done.returncode == 4, (who, done.stderr)
        assert done.stderr.count(b"\n") == 1 and b"lead" in done.stderr
    assert (crew.store.load_state(KEY), crew.store.roster()) == before
    assert ralph(crew.home, *args, *where, "--agent", "lead").returncode == 0


def test_only_the_approver_decides_a_held_message(crew: Team) -> None:
    """approve by anyone but the held message's approver is refused (exit 4)."""
    with MessageBus("crew", "lead") as lead:
        lead.change_policy(lambda p: p.with_rule(Rule("intern", "*", "allow", True)))
    held = MessageBus("crew", "intern").send("writer", "text", "let me out")
    assert not held.ts
    done = ralph(crew.home, "approve", held.id, "--team", "crew", "--agent", "intern")
    assert done.returncode == 4, done.stderr
    assert MessageBus("crew", "writer").peek() == []


def test_an_empty_policy_file_fails_closed(crew: Team) -> None:
    """A 0-byte policy refuses contact (PermissionDenied) instead of allowing everything."""
    crew.store.save_state(KEY, b"")
    with pytest.raises(PermissionDenied, match="broken"):
        MessageBus("crew", "intern").send("writer", "text", "hi")


def test_a_channel_post_counts_against_the_rate(crew: Team) -> None:
    """Posts without mentions are messages an agent starts: the rate counts them."""
    writer = MessageBus("crew", "writer")
    writer.channels.create("room", ["lead"])
    writer.channel_post("room", "one")
    writer.channel_post("room", "two")
    with pytest.raises(RateLimited):
        writer.channel_post("room", "three")


def test_a_poll_leaves_the_reply_an_ask_in_flight_waits_for(crew: Team) -> None:
    """While an ask of this process waits, a poll in another thread (an MCP server's
    check_inbox) does not take its reply: the ask gets it, once."""
    lead, boss = MessageBus("crew", "lead"), MessageBus("crew", "boss")
    boss.touch()
    got: list[str] = []
    asker = threading.Thread(target=lambda: got.append(lead.ask("boss", "q?", timeout=5).content))
    asker.start()
    request = None
    for _ in range(300):
        request = next((m for m in boss.poll() if m.type == "request"), None)
        if request is not None:
            break
        boss.wait_for_messages(timeout=0.01, consume=False)
    assert request is not None
    lead.send("boss", "text", "other mail")
    boss.reply(request, "answer")
    polled = []
    while asker.is_alive():
        polled += lead.poll()
        asker.join(0.01)
    polled += lead.poll()
    assert got == ["answer"]
    assert all(m.type != "reply" for m in polled)


def test_thread_of_a_plain_message_starts_with_it(crew: Team) -> None:
    """thread(first.id) of a plain message that got replies begins with that message."""
    lead, boss = MessageBus("crew", "lead"), MessageBus("crew", "boss")
    first = lead.send("boss", "text", "thoughts?")
    answer = boss.reply(first, "some")
    assert [m.id for m in boss.thread(first.id)] == [first.id, answer.id]


def test_a_result_consumed_and_collected_is_not_sent_again(crew: Team) -> None:
    """An assignee that completes again after its result was consumed and gc collected
    the delegator's inbox sends no second result (each outcome once, DESIGN §8.3)."""
    from ralph_mail.talk import tasks

    lead, writer = MessageBus("crew", "lead"), MessageBus("crew", "writer")
    writer.touch()
    task = lead.delegate("writer", "draft it")
    writer.poll()
    writer.complete(task.id, "done")
    # The run that sent it died before noting it: the log says "not notified".
    log = writer.store.log_read(tasks.LOG)
    kept = b"\n".join(line for line in log.splitlines() if b'"notified"' not in line) + b"\n"
    assert lead.poll()[0].type == "task_result"
    lead.store.compact("lead")
    writer.store.save_state("tasks.fold", b"")
    with open(crew.home / "teams" / "crew" / "logs" / "tasks.jsonl", "wb") as log_file:
        log_file.write(kept)
    writer.complete(task.id, "done")
    assert [m.type for m in lead.poll()] == []


def test_a_policy_change_by_the_lead_through_the_library(crew: Team) -> None:
    """change_policy is the lead's: another member gets PermissionDenied."""
    with pytest.raises(PermissionDenied, match="lead"):
        MessageBus("crew", "writer").change_policy(lambda p: Policy())
    with MessageBus("crew", "lead") as lead:
        assert lead.change_policy(lambda p: Policy()).rules == ()
    assert orjson.loads(crew.store.load_state(KEY) or b"{}")["rules"] == []


def test_a_job_of_run_speaks_for_its_agent_alone(crew: Team) -> None:
    """With RALPH_AGENT_FIXED (what `ralph-mail run` gives its jobs), --agent naming
    another agent is refused (exit 4): an intern's job cannot approve as its manager."""
    with MessageBus("crew", "lead") as lead:
        lead.change_policy(lambda p: p.with_rule(Rule("intern", "*", "allow", True)))
    with MessageBus("crew", "lead") as lead:
        lead.set_member("intern", manager="boss")
    held = MessageBus("crew", "intern").send("writer", "text", "let me out")
    done = ralph(crew.home, "approve", held.id, "--team", "crew", "--agent", "boss",
                 RALPH_AGENT="intern", RALPH_AGENT_FIXED="1")  # fmt: skip
    assert done.returncode == 4 and b"acts for intern" in done.stderr
    assert MessageBus("crew", "writer").peek() == []


def test_asks_in_a_loop_read_the_presence_of_the_agent_asked_once_a_second(
    crew: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent found there is trusted to be for THERE_S: two asks within it read its
    presence once, an ask after it reads it again, and one that finds it offline is
    refused."""
    from ralph_mail.errors import AgentOffline
    from ralph_mail.govern import gate, presence

    clock = [1000.0]
    monkeypatch.setattr(gate.time, "monotonic", lambda: clock[0])
    looked: list[str] = []
    real = presence.require_online
    monkeypatch.setattr(
        presence, "require_online", lambda box, to: looked.append(to) or real(box, to)
    )
    with MessageBus("crew", "boss") as boss, MessageBus("crew", "intern") as intern:
        intern.set_presence("idle")
        request = boss.envelope("intern", "request", "there?", None)
        assert boss.gate.check(dict(request), waits=True) == ""
        clock[0] += gate.THERE_S / 2
        assert boss.gate.check(dict(request), waits=True) == ""
        assert looked == ["intern"]
        presence.went_offline(intern.store, "intern")
        clock[0] += gate.THERE_S
        with pytest.raises(AgentOffline):
            boss.gate.check(dict(request), waits=True)
        assert looked == ["intern", "intern"]
