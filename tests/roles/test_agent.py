"""TeamAgent: the teammate's side of the protocols, in one process and against a lead process."""

from __future__ import annotations

import threading
import time

import pytest

from ralph_mail import InvalidMessage, MessageBus, MessageType, Team, TeamAgent
from tests.helpers.backends import one_process_only
from tests.helpers.protocol_helpers import BOUND_S, Children, children_fixture, close_buses  # noqa: F401


@pytest.fixture
def team(team_on_every_backend: Team) -> Team:
    """This module's tests run on every backend."""
    return team_on_every_backend


def lead_bus() -> MessageBus:
    return MessageBus("demo", "lead")


def assign(task_id: str, description: str = "do it", **kwargs: str) -> None:
    lead_bus().send(
        "worker-1", MessageType.TASK_ASSIGNMENT, description, {"taskId": task_id}, **kwargs
    )


# -- tasks -------------------------------------------------------------------------------


def test_a_task_assignment_sets_the_agents_task(team: Team) -> None:
    """An assignment becomes the task in hand; the agent is then working."""
    assign("T-1", "parse the logs")
    with TeamAgent("demo", "worker-1") as agent:
        assert agent.state == "idle"
        agent.process_pending_messages()
        assert agent.task is not None
        assert (agent.task.id, agent.task.description, agent.state) == (
            "T-1",
            "parse the logs",
            "working",
        )


def test_assignments_during_a_task_queue_up(team: Team) -> None:
    """A second assignment waits in the backlog and comes next after finish_task."""
    assign("T-1")
    assign("T-2")
    with TeamAgent("demo", "worker-1") as agent:
        agent.process_pending_messages()
        assert [t.id for t in agent.backlog] == ["T-2"]
        agent.finish_task("one down")
        assert agent.task is not None and agent.task.id == "T-2"
        agent.finish_task("two down")
        assert agent.task is None and agent.state == "idle"


def test_finish_task_reports_done_to_the_lead(team: Team) -> None:
    """finish_task sends a status update: state done, the task, progress 1."""
    assign("T-1")
    with TeamAgent("demo", "worker-1") as agent:
        agent.process_pending_messages()
        agent.finish_task("all parsed")
    [status] = lead_bus().poll()
    assert (status.type, status.content) == ("status_update", "all parsed")
    assert status.metadata == {"state": "done", "task": "T-1", "progress": "1"}


def test_report_status_defaults_to_the_agents_state_and_task(team: Team) -> None:
    """report_status fills in the state and task the agent is in."""
    assign("T-1")
    with TeamAgent("demo", "worker-1") as agent:
        agent.process_pending_messages()
        agent.report_status("halfway", progress=0.5)
    [status] = lead_bus().poll()
    assert status.metadata == {"state": "working", "task": "T-1", "progress": "0.5"}


def test_report_status_refuses_a_bad_state_and_sends_nothing(team: Team) -> None:
    """An unknown state or progress is an InvalidMessage naming the choices; nothing is sent."""
    with TeamAgent("demo", "worker-1") as agent:
        with pytest.raises(InvalidMessage, match="idle, working, blocked, done, failed"):
            agent.report_status("x", "sleepy")
        with pytest.raises(InvalidMessage, match="fraction from 0 to 1"):
            agent.report_status("x", progress=2)
    assert lead_bus().poll() == []


def test_next_task_waits_for_an_assignment_from_another_process(
    team: Team, children: Children
) -> None:
    """next_task blocks until a task arrives from another process."""
    one_process_only(team)
    with TeamAgent("demo", "worker-1") as agent:
        children.ralph(
            team.home,
            "send",
            "worker-1",
            "late task",
            "--type",
            "task_assignment",
            "--meta",
            "taskId=T-9",
            "--team",
            "demo",
            "--agent",
            "lead",
        )
        task = agent.next_task(timeout=BOUND_S)
    assert task is not None and task.id == "T-9"


def test_next_task_gives_up_at_its_timeout(team: Team) -> None:
    """next_task returns None when no task came in time, and the agent is not stopping."""
    with TeamAgent("demo", "worker-1") as agent:
        assert agent.next_task(timeout=0.1) is None and not agent.stopping


# -- context -----------------------------------------------------------------------------


def test_text_and_broadcasts_become_context(team: Team) -> None:
    """Text and broadcasts are kept, in order, until take_context hands them over."""
    lead_bus().send("worker-1", MessageType.TEXT, "the logs are in /var/log")
    MessageBus("demo", "worker-2").broadcast("tests are green")
    with TeamAgent("demo", "worker-1") as agent:
        agent.process_pending_messages()
        assert agent.take_context() == ["the logs are in /var/log", "tests are green"]
        assert agent.take_context() == []


def test_a_message_resent_under_the_same_id_is_handled_once(team: Team) -> None:
    """A retried assignment (same id) gives one task, not two."""
    assign("T-1", id="0000000000aa")
    assign("T-1", id="0000000000aa")
    with TeamAgent("demo", "worker-1") as agent:
        assert len(agent.process_pending_messages()) == 1
        assert list(agent.backlog) == []


# -- shutdown ----------------------------------------------------------------------------


def test_shutdown_is_accepted_when_idle(team: Team) -> None:
    """An idle agent accepts a shutdown request, answering it, and is then stopping."""
    request = lead_bus().send("worker-1", MessageType.SHUTDOWN_REQUEST, "wrap up")
    with TeamAgent("demo", "worker-1") as agent:
        agent.process_pending_messages()
        assert agent.stopping
    [answer] = lead_bus().poll()
    assert (answer.type, answer.reply_to, answer.metadata) == (
        "shutdown_response",
        request.id,
        {"accepted": "true"},
    )


def test_shutdown_is_deferred_while_working(team: Team) -> None:
    """A working agent defers: accepted=false, deferred=true, 'finishing current task'."""
    assign("T-1")
    lead_bus().send("worker-1", MessageType.SHUTDOWN_REQUEST, "wrap up")
    with TeamAgent("demo", "worker-1") as agent:
        agent.process_pending_messages()
        assert not agent.stopping
    [answer] = lead_bus().poll()
    assert answer.metadata == {"accepted": "false", "deferred": "true"}
    assert answer.content == "finishing current task T-1"


def test_next_task_returns_none_once_shutdown_is_accepted(team: Team) -> None:
    """An idle agent waiting for work stops waiting when it accepts a shutdown."""
    lead_bus().send("worker-1", MessageType.SHUTDOWN_REQUEST, "wrap up")
    with TeamAgent("demo", "worker-1") as agent:
        assert agent.next_task(timeout=BOUND_S) is None and agent.stopping


def test_without_auto_shutdown_the_caller_answers(team: Team) -> None:
    """With auto_shutdown off, the request waits for accept/defer/refuse by the caller."""
    request = lead_bus().send("worker-1", MessageType.SHUTDOWN_REQUEST, "wrap up")
    with TeamAgent("demo", "worker-1", auto_shutdown=False) as agent:
        agent.process_pending_messages()
        assert agent.shutdown_request == request and lead_bus().poll() == []
        agent.refuse_shutdown("not now, not ever")
        assert agent.shutdown_request is None and not agent.stopping
    [answer] = lead_bus().poll()
    assert (answer.metadata, answer.content) == ({"accepted": "false"}, "not now, not ever")


def test_accepting_without_a_request_sends_nothing(team: Team) -> None:
    """accept_shutdown with no request received returns None and sends nothing."""
    with TeamAgent("demo", "worker-1") as agent:
        assert agent.accept_shutdown() is None and not agent.stopping
    assert lead_bus().poll() == []


# -- plans -------------------------------------------------------------------------------


def answer_plans(approve: bool, feedback: str, extra: list[str] | None = None) -> threading.Thread:
    """A thread playing the lead: answers the next plan (after sending ``extra`` texts)."""

    def lead() -> None:
        bus = lead_bus()
        plan = bus.wait_for_message(MessageType.PLAN_SUBMISSION, timeout=BOUND_S)
        assert plan is not None
        for text in extra or []:
            bus.send("worker-1", MessageType.TEXT, text)
        flag = "true" if approve else "false"
        bus.send("worker-1", "plan_approval", feedback, {"approved": flag}, reply_to=plan.id)

    thread = threading.Thread(target=lead)
    thread.start()
    return thread


def test_submit_plan_waits_for_the_approval(team: Team) -> None:
    """submit_plan returns the lead's approval and feedback."""
    lead = answer_plans(True, "go ahead")
    with TeamAgent("demo", "worker-1") as agent:
        decision = agent.submit_plan("1. parse", task="T-1", wait=BOUND_S)
    lead.join(BOUND_S)
    assert (decision.approved, decision.feedback, decision.answered) == (True, "go ahead", True)
    assert decision.submission.metadata == {"task": "T-1"}


def test_submit_plan_returns_a_rejection_with_feedback(team: Team) -> None:
    """A rejection comes back as approved=False with the lead's feedback."""
    lead = answer_plans(False, "add a test step")
    with TeamAgent("demo", "worker-1") as agent:
        decision = agent.submit_plan("1. parse", wait=BOUND_S)
    lead.join(BOUND_S)
    assert (decision.approved, decision.feedback) == (False, "add a test step")


def test_submit_plan_leaves_other_mail_for_later(team: Team) -> None:
    """Text arriving while a plan waits is not lost: the next processing sees it."""
    lead = answer_plans(True, "ok", extra=["meanwhile"])
    with TeamAgent("demo", "worker-1") as agent:
        assert agent.submit_plan("1. parse", wait=BOUND_S).approved
        agent.process_pending_messages()
        assert agent.take_context() == ["meanwhile"]
    lead.join(BOUND_S)


def test_submit_plan_without_an_answer_times_out(team: Team) -> None:
    """With no lead answering, submit_plan returns unanswered after its wait."""
    with TeamAgent("demo", "worker-1") as agent:
        started = time.monotonic()
        decision = agent.submit_plan("1. parse", wait=0.2)
        assert time.monotonic() - started >= 0.2
    assert (decision.approved, decision.answered) == (None, False)
    assert decision.feedback == "no answer in 0.2s"


def test_a_malformed_approval_counts_as_a_rejection(team: Team) -> None:
    """An approval without metadata.approved is not a yes: rejected, saying why."""
    lead = threading.Thread(target=lambda: _answer_without_flag())
    lead.start()
    with TeamAgent("demo", "worker-1") as agent:
        decision = agent.submit_plan("1. parse", wait=BOUND_S)
    lead.join(BOUND_S)
    assert decision.approved is False and "no metadata.approved" in decision.feedback


def _answer_without_flag() -> None:
    bus = lead_bus()
    plan = bus.wait_for_message(MessageType.PLAN_SUBMISSION, timeout=BOUND_S)
    assert plan is not None
    # The Gate refuses to send it: written as another program (or a hand) would.
    bus._deliver(bus.envelope("worker-1", "plan_approval", "sure", None, plan.id))


def test_team_of_agent_processes_with_a_lead_process(team: Team, children: Children) -> None:
    """Processes: lead rejects a plan without tests; the agent revises, works, and stops."""
    one_process_only(team)
    lead = children.program(team.home, "lead", "demo", "test-required")
    worker = children.program(team.home, "worker", "demo", "worker-1", "2")
    assign("T-1", "parse the logs")
    assert "add a test step" in worker.expect("rejected")
    assert worker.expect("decision").startswith("decision True")
    worker.expect("finished T-1")
    lead.expect("worker-1 status: done T-1 100%")
    MessageBus("demo", "worker-2").send("worker-1", "shutdown_request", "bye")
    assert worker.expect("stopping") == "stopping True"
    assert worker.finish() == 0
