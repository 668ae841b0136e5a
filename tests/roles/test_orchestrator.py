"""TeamOrchestrator: the lead's loop, its handlers, plan review, assignment, shutdown, restarts."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ralph_mail import (
    Event,
    EventKind,
    InvalidMessage,
    Message,
    MessageBus,
    MessageType,
    Team,
    TeamOrchestrator,
    UnknownAgent,
    create_team,
)
from ralph_mail.orchestrator import Plan, command_reviewer, reject_all
from tests.helpers.backends import files_only, one_process_only
from tests.helpers.protocol_helpers import (  # noqa: F401
    BOUND_S,
    Children,
    children_fixture,
    close_buses,
    inbox_messages,
    of_type,
)


@pytest.fixture
def team(team_on_every_backend: Team) -> Team:
    """This module's tests run on every backend."""
    return team_on_every_backend


def lead_of(events: list[Event] | None = None, **kwargs: object) -> TeamOrchestrator:
    """An orchestrator for team 'demo' that records its events in ``events``."""
    if events is not None:
        kwargs["on_event"] = events.append
    return TeamOrchestrator("demo", **kwargs)  # type: ignore[arg-type]


def answers(team: Team, agent: str, kind: MessageType) -> list[Message]:
    return of_type(inbox_messages(team.store.root, agent), kind)


def plan_of(text: str, task: str | None = "T-1") -> Plan:
    fake = Message("0123456789ab", "worker-1", "lead", MessageType.PLAN_SUBMISSION, text)
    return Plan("worker-1", text, task, fake)


# -- status and progress -----------------------------------------------------------------


def test_status_update_sets_the_agents_progress(team: Team) -> None:
    """A status update records state, task, progress, text and last seen for its sender."""
    sent = MessageBus("demo", "worker-1").send(
        "lead",
        MessageType.STATUS_UPDATE,
        "parsing",
        {"state": "working", "task": "T-1", "progress": "0.5"},
    )
    with lead_of() as orch:
        assert orch.handle_pending() == 1
        progress = orch.progress["worker-1"]
    assert (progress.state, progress.task, progress.progress) == ("working", "T-1", 0.5)
    assert (progress.text, progress.last_seen) == ("parsing", sent.ts)


def test_status_without_state_is_answered_with_an_error(team: Team) -> None:
    """A status update lacking metadata.state gets an error text naming the fix, not a crash
    (written as another program would: the Gate refuses to send it)."""
    worker = MessageBus("demo", "worker-1")
    bad = worker._deliver(worker.envelope("lead", MessageType.STATUS_UPDATE, "hello", None))
    worker.send("lead", MessageType.STATUS_UPDATE, "ok", {"state": "idle"})
    events: list[Event] = []
    with lead_of(events) as orch:
        orch.handle_pending()
        assert orch.progress["worker-1"].state == "idle"
    [error] = worker.poll()
    assert error.type == MessageType.TEXT and error.reply_to == bad.id
    assert "no metadata.state" in error.content and "--state" in error.content
    assert [e.kind for e in events] == [EventKind.ERROR, EventKind.STATUS]


def test_status_with_a_bad_progress_is_refused(team: Team) -> None:
    """A progress outside 0..1 is refused with an error text; the progress is unchanged.
    (The Gate refuses to send it: it comes from another program, or a hand.)"""
    worker = MessageBus("demo", "worker-1")
    with pytest.raises(InvalidMessage, match="progress"):
        worker.send("lead", "status_update", "x", {"state": "working", "progress": "150%"})
    worker._deliver(worker.envelope("lead", "status_update", "x",
                                    {"state": "working", "progress": "150%"}))  # fmt: skip
    with lead_of() as orch:
        orch.handle_pending()
        assert orch.progress["worker-1"].state == "unknown"
    assert "progress '150%'" in worker.poll()[0].content


def test_all_done_needs_every_teammate_finished(team: Team) -> None:
    """all_done holds once every teammate reported done or failed, not before."""
    with lead_of() as orch:
        MessageBus("demo", "worker-1").send("lead", "status_update", "", {"state": "done"})
        orch.handle_pending()
        assert not orch.all_done()
        MessageBus("demo", "worker-2").send("lead", "status_update", "", {"state": "failed"})
        orch.handle_pending()
        assert orch.all_done()


# -- plans -------------------------------------------------------------------------------


def test_plan_is_approved_by_the_review_callable(team: Team) -> None:
    """A plan the policy approves is answered approved=true, with feedback and reply_to."""
    worker = MessageBus("demo", "worker-1")
    plan = worker.send("lead", MessageType.PLAN_SUBMISSION, "1. parse", {"task": "T-1"})
    seen: list[Plan] = []

    def review(p: Plan) -> tuple[bool, str]:
        seen.append(p)
        return True, "go ahead"

    with lead_of(review_plan=review) as orch:
        orch.handle_pending()
        assert orch.progress["worker-1"].plan == "approved"
    [answer] = worker.poll()
    assert (answer.type, answer.reply_to, answer.content) == ("plan_approval", plan.id, "go ahead")
    assert answer.metadata == {"approved": "true", "task": "T-1"}
    assert (seen[0].agent, seen[0].text, seen[0].task) == ("worker-1", "1. parse", "T-1")


def test_plan_is_rejected_with_feedback(team: Team) -> None:
    """A plan the policy rejects is answered approved=false with the policy's feedback."""
    worker = MessageBus("demo", "worker-1")
    worker.send("lead", MessageType.PLAN_SUBMISSION, "1. parse")
    with lead_of(review_plan=lambda p: (False, "add tests")) as orch:
        orch.handle_pending()
    [answer] = worker.poll()
    assert (answer.metadata["approved"], answer.content) == ("false", "add tests")


def test_a_review_policy_that_raises_rejects_with_the_reason(team: Team) -> None:
    """A policy that raises rejects the plan, naming the error; the lead goes on."""

    def broken(plan: Plan) -> bool:
        raise RuntimeError("reviewer offline")

    worker = MessageBus("demo", "worker-1")
    worker.send("lead", MessageType.PLAN_SUBMISSION, "1. parse")
    with lead_of(review_plan=broken) as orch:
        orch.handle_pending()
    [answer] = worker.poll()
    assert answer.metadata["approved"] == "false" and "reviewer offline" in answer.content


def test_an_empty_plan_is_answered_with_an_error(team: Team) -> None:
    """An empty plan is not reviewed: the sender gets an error text."""
    worker = MessageBus("demo", "worker-1")
    worker.send("lead", MessageType.PLAN_SUBMISSION, "  ")
    with lead_of(review_plan=lambda p: pytest.fail("reviewed an empty plan")) as orch:
        orch.handle_pending()
    [answer] = worker.poll()
    assert answer.type == MessageType.TEXT and "is empty" in answer.content


def test_reject_policy_rejects_everything() -> None:
    """The reject policy says no, asking for a revision."""
    assert reject_all(plan_of("anything"))[0] is False


def test_command_reviewer_approves_on_exit_0_with_its_output() -> None:
    """cmd: exit status 0 approves; standard output (fed the plan) is the feedback."""
    review = command_reviewer("tr a-z A-Z")
    assert review(plan_of("run the tests")) == (True, "RUN THE TESTS")


def test_command_reviewer_sees_agent_and_task_in_its_environment() -> None:
    """cmd: RALPH_PLAN_AGENT and RALPH_PLAN_TASK name the plan's author and task."""
    review = command_reviewer('echo "$RALPH_PLAN_AGENT/$RALPH_PLAN_TASK"')
    assert review(plan_of("x")) == (True, "worker-1/T-1")


def test_command_reviewer_rejects_on_failure_with_its_output() -> None:
    """cmd: a failing command rejects, with its output (or its exit status) as feedback."""
    assert command_reviewer("echo 'no tests'; exit 1")(plan_of("x")) == (False, "no tests")
    assert command_reviewer("exit 4")(plan_of("x")) == (
        False,
        "rejected by 'exit 4' (exit status 4)",
    )


def test_command_reviewer_that_cannot_run_rejects() -> None:
    """cmd: a missing program rejects, with the shell's complaint as feedback."""
    approved, feedback = command_reviewer("no-such-reviewer-xyz")(plan_of("x"))
    assert approved is False and "no-such-reviewer-xyz" in feedback


def test_command_reviewer_that_hangs_is_killed_and_rejects(tmp_path: Path) -> None:
    """cmd: a command over its timeout is killed, with its children, and rejects."""
    pidfile = tmp_path / "pid"
    review = command_reviewer(f"sleep 60 & echo $! > {pidfile}; wait", timeout=0.5)
    started = time.monotonic()
    approved, feedback = review(plan_of("x"))
    assert approved is False and "timed out after 0.5s" in feedback
    assert time.monotonic() - started < BOUND_S / 2
    assert gone_within(int(pidfile.read_text()), BOUND_S)


def gone_within(pid: int, timeout: float) -> bool:
    """Whether ``pid`` is dead (or a zombie) within ``timeout``: SIGKILL lands asynchronously."""
    stat = Path(f"/proc/{pid}/stat")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        threading.Event().wait(0.01)  # polling /proc: a killed process has no event to wait on
    return False


# -- assignment --------------------------------------------------------------------------


def test_assign_sends_a_task_assignment(team: Team) -> None:
    """assign sends the task with metadata.taskId and records it in the progress."""
    with lead_of() as orch:
        sent = orch.assign("worker-2", "T-7", "write the report")
        assert orch.progress["worker-2"].task == "T-7"
    [received] = MessageBus("demo", "worker-2").poll()
    assert received == sent
    assert (received.type, received.content, received.metadata) == (
        "task_assignment",
        "write the report",
        {"taskId": "T-7"},
    )


def test_assign_refuses_unknown_agents_and_the_lead(team: Team) -> None:
    """assign names the members for an unknown agent, and refuses the lead itself."""
    with lead_of() as orch:
        with pytest.raises(UnknownAgent, match="worker-1, worker-2"):
            orch.assign("wrker-1", "T-1", "x")
        with pytest.raises(InvalidMessage, match="the lead itself"):
            orch.assign("lead", "T-1", "x")
        with pytest.raises(InvalidMessage, match="task id"):
            orch.assign("worker-1", " ", "x")


# -- the loop and its handler table ------------------------------------------------------


def test_handler_table_can_be_extended(team: Team) -> None:
    """A handler put in the table gets its messages and can reply."""
    worker = MessageBus("demo", "worker-1")
    question = worker.send("lead", MessageType.TEXT, "ping")
    with lead_of() as orch:
        orch.handlers[MessageType.TEXT] = lambda m: orch.reply(m, MessageType.TEXT, "pong")
        orch.handle_pending()
    [answer] = worker.poll()
    assert (answer.content, answer.reply_to) == ("pong", question.id)


def test_a_failing_handler_does_not_stop_the_lead(team: Team) -> None:
    """A handler that raises becomes an error event; later messages are still handled."""
    worker = MessageBus("demo", "worker-1")
    worker.send("lead", MessageType.TEXT, "boom")
    worker.send("lead", MessageType.STATUS_UPDATE, "fine", {"state": "working"})
    events: list[Event] = []

    def explode(message: Message) -> None:
        raise ValueError("bad handler")

    with lead_of(events) as orch:
        orch.handlers[MessageType.TEXT] = explode
        assert orch.handle_pending() == 2
        assert orch.progress["worker-1"].state == "working"
    assert "ValueError: bad handler" in events[0].text


def test_messages_not_meant_for_the_lead_are_ignored(team: Team) -> None:
    """A task assignment sent to the lead is reported as ignored and consumed."""
    MessageBus("demo", "worker-1").send("lead", MessageType.TASK_ASSIGNMENT, "x", {"taskId": "1"})
    events: list[Event] = []
    with lead_of(events) as orch:
        orch.handle_pending()
        assert orch.bus.peek() == []
    assert events[0].kind == EventKind.IGNORED


def test_a_handler_may_not_rerun_the_loop(team: Team) -> None:
    """A handler that calls run again gets an error event, not a corrupted cursor."""
    MessageBus("demo", "worker-1").send("lead", MessageType.TEXT, "x")
    events: list[Event] = []
    with lead_of(events) as orch:
        orch.handlers[MessageType.TEXT] = lambda m: orch.run(timeout=0)  # type: ignore[func-returns-value]
        orch.handle_pending()
    assert "must not run the loop" in events[0].text


def test_run_returns_when_until_holds(team: Team) -> None:
    """run stops as soon as its condition holds and says so."""
    MessageBus("demo", "worker-1").send("lead", "status_update", "", {"state": "done"})
    MessageBus("demo", "worker-2").send("lead", "status_update", "", {"state": "done"})
    with lead_of() as orch:
        assert orch.run(until=lambda o: o.all_done(), timeout=BOUND_S) is True


def test_run_gives_up_at_its_timeout(team: Team) -> None:
    """run returns False when the condition does not hold by the timeout."""
    with lead_of() as orch:
        started = time.monotonic()
        assert orch.run(until=lambda o: o.all_done(), timeout=0.2) is False
        assert 0.2 <= time.monotonic() - started < BOUND_S


def test_run_returns_when_stop_is_set(team: Team) -> None:
    """Setting the stop event from another thread ends a run without a timeout."""
    stop = threading.Event()
    with lead_of() as orch:
        timer = threading.Timer(0.1, stop.set)
        timer.start()
        try:
            assert orch.run(stop=stop) is False
        finally:
            timer.cancel()


def test_run_wakes_for_mail_from_another_process(team: Team, children: Children) -> None:
    """A blocked run wakes when a worker process sends, without polling intervals."""
    one_process_only(team)
    with lead_of() as orch:
        worker = children.ralph(
            team.home, "send", "lead", "hi", "--team", "demo", "--agent", "worker-1"
        )
        assert orch.run(until=lambda o: o.progress["worker-1"].text == "hi", timeout=BOUND_S)
        assert worker.finish() == 0


# -- idempotency and restarts ------------------------------------------------------------


def test_a_message_resent_under_the_same_id_is_handled_once(team: Team) -> None:
    """A sender's retry with the same id gets one answer, and is reported as a duplicate."""
    worker = MessageBus("demo", "worker-1")
    worker.send("lead", MessageType.PLAN_SUBMISSION, "plan", id="00000000abcd")
    worker.send("lead", MessageType.PLAN_SUBMISSION, "plan", id="00000000abcd")
    events: list[Event] = []
    # On NATS the server stores a retried id once (Nats-Msg-Id): no duplicate reaches
    # the lead; elsewhere the lead recognises it.
    stored_once = team.store.__class__.__name__ == "NatsStore"
    with lead_of(events) as orch:
        assert orch.handle_pending() == (1 if stored_once else 2)
    assert len(worker.poll()) == 1
    duplicate = [] if stored_once else [EventKind.DUPLICATE]
    assert [e.kind for e in events] == [EventKind.PLAN_APPROVED, *duplicate]


def test_a_retry_is_recognised_by_a_restarted_lead(team: Team) -> None:
    """Handled ids persist: a retry arriving after a restart is not answered again."""
    worker = MessageBus("demo", "worker-1")
    worker.send("lead", MessageType.PLAN_SUBMISSION, "plan", id="00000000abcd")
    with lead_of() as orch:
        orch.handle_pending()
    worker.send("lead", MessageType.PLAN_SUBMISSION, "plan", id="00000000abcd")
    with lead_of() as orch:
        orch.handle_pending()
    assert len(worker.poll()) == 1


def test_lead_dying_after_reply_before_recording_does_not_answer_twice(team: Team) -> None:
    """Killed between sending a reply and recording it, the restarted lead does not resend."""
    files_only(team)
    worker = MessageBus("demo", "worker-1")
    worker.send("lead", MessageType.PLAN_SUBMISSION, "plan A")

    def die_after_reply(event: Event) -> None:
        if event.kind == EventKind.PLAN_APPROVED:  # the approval is sent, not yet recorded
            raise KeyboardInterrupt

    with lead_of(on_event=die_after_reply) as orch, pytest.raises(KeyboardInterrupt):
        orch.handle_pending()
    assert len(answers(team, "worker-1", MessageType.PLAN_APPROVAL)) == 1
    worker.send("lead", MessageType.PLAN_SUBMISSION, "plan B")
    with lead_of() as orch:
        assert orch.handle_pending() == 2  # plan A again (redelivered), then plan B
    approvals = answers(team, "worker-1", MessageType.PLAN_APPROVAL)
    assert [a.content for a in approvals] == ["approved", "approved"]
    assert len({a.reply_to for a in approvals}) == 2


def test_lead_dying_before_commit_skips_the_redelivered_message(team: Team) -> None:
    """Killed after recording but before committing, the redelivery is a no-op."""
    files_only(team)
    worker = MessageBus("demo", "worker-1")
    worker.send("lead", MessageType.PLAN_SUBMISSION, "plan A")
    orch = lead_of()

    def crash(message: Message) -> None:
        raise KeyboardInterrupt

    orch.bus.commit = crash  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        orch.handle_pending()
    orch.close()
    events: list[Event] = []
    with lead_of(events) as again:
        assert again.handle_pending() == 1
    assert [e.kind for e in events] == [EventKind.DUPLICATE]
    assert len(answers(team, "worker-1", MessageType.PLAN_APPROVAL)) == 1


def test_progress_survives_a_restart(team: Team) -> None:
    """A restarted lead knows the progress its predecessor recorded."""
    MessageBus("demo", "worker-1").send("lead", "status_update", "x", {"state": "blocked"})
    with lead_of() as orch:
        orch.handle_pending()
    with lead_of() as orch:
        assert orch.progress["worker-1"].state == "blocked"


def test_a_damaged_state_file_is_named_with_the_fix(team: Team) -> None:
    """A state file that is not the lead's JSON stops the start with the path and the fix."""
    files_only(team)
    from ralph_mail import StoreError

    state = team.store.root / "state" / "orchestrator.lead.json"
    state.write_text("{not json")
    with pytest.raises(StoreError, match=r"delete state/orchestrator\.lead\.json .* afresh"):
        lead_of()


def test_killed_lead_process_loses_nothing_and_answers_nothing_twice(
    team: Team, children: Children
) -> None:
    """A lead process killed -9 mid-stream and restarted answers every plan exactly once."""
    files_only(team)
    worker = MessageBus("demo", "worker-1")
    plans = [worker.send("lead", MessageType.PLAN_SUBMISSION, f"plan {n}") for n in range(200)]
    first = children.program(team.home, "lead", "demo")
    first.expect("plan_approved", timeout=BOUND_S)
    first.popen.kill()  # mid-stream: some plans answered, some not
    first.popen.wait(timeout=BOUND_S)
    plans += [worker.send("lead", MessageType.PLAN_SUBMISSION, "late plan")]
    second = children.program(team.home, "lead", "demo")
    deadline = time.monotonic() + BOUND_S
    while len(answers(team, "worker-1", MessageType.PLAN_APPROVAL)) < len(plans):
        assert time.monotonic() < deadline, second.output
        worker.wait_for_messages(timeout=1.0)  # woken by each approval
    second.expect("late plan")
    replies = [a.reply_to for a in answers(team, "worker-1", MessageType.PLAN_APPROVAL)]
    assert sorted(replies) == sorted(p.id for p in plans)  # type: ignore[type-var]


# -- shutdown ----------------------------------------------------------------------------


def test_shutdown_of_agents_that_accept(team: Team) -> None:
    """Agents that accept are reported accepted; the report is ok."""
    with lead_of() as orch:

        def accept_all() -> None:
            for name in ("worker-1", "worker-2"):
                bus = MessageBus("demo", name)
                request = bus.wait_for_message(MessageType.SHUTDOWN_REQUEST, timeout=BOUND_S)
                assert request is not None
                bus.send(
                    "lead", "shutdown_response", "bye", {"accepted": "true"}, reply_to=request.id
                )

        helper = threading.Thread(target=accept_all)
        helper.start()
        report = orch.request_shutdown(timeout=BOUND_S)
        helper.join(BOUND_S)
        assert orch.progress["worker-1"].shutdown == "accepted"
    assert report.ok and dict(report) == {"worker-1": True, "worker-2": True}
    assert report.reasons == {"worker-1": "bye", "worker-2": "bye"}


def test_shutdown_without_an_answer_ends_at_the_deadline(team: Team) -> None:
    """An agent that never answers is reported as no answer once the timeout passes."""
    events: list[Event] = []
    with lead_of(events) as orch:
        started = time.monotonic()
        report = orch.request_shutdown(["worker-2"], timeout=0.3)
        assert 0.3 <= time.monotonic() - started < BOUND_S
    assert report.no_answer == ("worker-2",) and not report.ok
    assert report.reasons["worker-2"] == "no answer by the deadline"
    assert events[-1].kind == EventKind.SHUTDOWN_NO_ANSWER


def test_malformed_shutdown_response_is_answered_and_not_counted(team: Team) -> None:
    """A response without metadata.accepted gets an error text and counts as no answer."""
    worker = MessageBus("demo", "worker-1")

    def answer_badly(event: Event) -> None:
        if event.kind == EventKind.SHUTDOWN_REQUESTED:
            request = event.message.id  # type: ignore[union-attr]
            # Written as another program would: the Gate refuses to send it.
            worker._deliver(worker.envelope("lead", "shutdown_response", "sure", None, request))

    with lead_of(on_event=answer_badly) as orch:
        report = orch.request_shutdown(["worker-1"], timeout=0.3)
    assert report.no_answer == ("worker-1",)
    error = [m for m in worker.poll() if m.type == MessageType.TEXT]
    assert "no metadata.accepted" in error[0].content


def test_shutdown_only_responses_leaves_other_mail_unread(team: Team) -> None:
    """With only_responses, a status update waiting in the inbox stays there."""
    worker = MessageBus("demo", "worker-1")
    worker.send("lead", "status_update", "still here", {"state": "working"})

    def accept(event: Event) -> None:
        if event.kind == EventKind.SHUTDOWN_REQUESTED:
            request = event.message
            assert request is not None
            worker.send(
                "lead", "shutdown_response", "ok", {"accepted": "true"}, reply_to=request.id
            )

    with lead_of(on_event=accept) as orch:
        assert orch.request_shutdown(["worker-1"], timeout=BOUND_S, only_responses=True).ok
        assert [m.content for m in orch.bus.peek()] == ["still here"]


def test_shutdown_refuses_unknown_agents(team: Team) -> None:
    """request_shutdown names the members when asked to stop a stranger; nothing is sent."""
    with lead_of() as orch, pytest.raises(UnknownAgent, match="members"):
        orch.request_shutdown(["worker-1", "stranger"], timeout=0.1)
    assert MessageBus("demo", "worker-1").poll() == []


def test_shutdown_round_trip_with_agent_processes(team: Team, children: Children) -> None:
    """Processes: one accepts, one refuses, one never answers; the report says which."""
    one_process_only(team)
    create_team("crew", ["boss", "ok", "no", "mute"], home=team.home)
    accepter = children.program(team.home, "worker", "crew", "ok")
    refuser = children.program(team.home, "refuser", "crew", "no")
    accepter.expect("ready")
    refuser.expect("ready")
    lead = children.program(team.home, "lead-shutdown", "crew", "1", "0.2")
    assert lead.finish() == 3
    report = lead.expect("report")
    assert "'ok': True" in report and "'no': False" in report and "'mute': None" in report
    assert accepter.finish() == 0 and refuser.finish() == 0


def test_deferred_shutdown_is_asked_again_and_accepted(team: Team, children: Children) -> None:
    """Processes: a busy agent defers; once it reports done the lead asks again; it accepts."""
    one_process_only(team)
    busy = children.program(team.home, "busy-worker", "demo", "worker-1")
    busy.expect("ready")
    lead = children.program(team.home, "lead-shutdown", "demo", str(BOUND_S), "30", "worker-1")
    lead.expect("shutdown_deferred")
    MessageBus("demo", "worker-2").send("worker-1", MessageType.TEXT, "finish")
    busy.expect("finished")
    lead.expect("asked again")  # on the done report, not after the 30 s retry interval
    assert lead.finish() == 0
    assert "{'worker-1': True}" in lead.expect("report")
    assert busy.finish() == 0


def test_a_reply_consumed_and_compacted_away_is_still_not_sent_twice(team: Team) -> None:
    """Killed after replying, with the reply consumed and gc'd before the restart, the lead
    does not answer again: it recorded the reply before sending it, and never looks in the
    recipient's inbox."""
    from ralph_mail.maintenance import collect

    worker = MessageBus("demo", "worker-1")
    worker.send("lead", MessageType.PLAN_SUBMISSION, "plan A")

    def die_after_reply(event: Event) -> None:
        if event.kind == EventKind.PLAN_APPROVED:
            raise KeyboardInterrupt

    with lead_of(on_event=die_after_reply) as orch, pytest.raises(KeyboardInterrupt):
        orch.handle_pending()
    assert [m.type for m in worker.poll()] == [MessageType.PLAN_APPROVAL]
    assert collect("demo").removed > 0  # the approval is gone from the worker's inbox
    with lead_of() as orch:
        assert orch.handle_pending() == 1  # plan A redelivered to the lead...
    assert worker.poll() == []  # ...and not answered again


def test_a_review_that_raises_rejects_and_reports_an_error(team: Team) -> None:
    """A review policy that raises rejects the plan and emits an error event naming it."""
    events: list[Event] = []

    def broken(plan: Plan) -> bool:
        raise RuntimeError("reviewer down")

    MessageBus("demo", "worker-1").send("lead", MessageType.PLAN_SUBMISSION, "plan A")
    with lead_of(events, review_plan=broken) as orch:
        orch.handle_pending()
    kinds = [e.kind for e in events]
    assert EventKind.ERROR in kinds and EventKind.PLAN_REJECTED in kinds
    assert any("reviewer down" in e.text for e in events if e.kind == EventKind.ERROR)


def test_a_plan_reads_like_its_message() -> None:
    """Plan.content is the plan text, as Message.content is."""
    message = Message("0123456789ab", "w", "lead", MessageType.PLAN_SUBMISSION, "do it")
    assert plan_of("do it").content == "do it" == message.content


def test_a_lead_killed_between_recording_and_sending_a_reply_sends_it_once(
    team: Team,
) -> None:
    """Killed after recording a reply's id and before the reply went out, the restarted
    lead finds it missing from the recipient's inbox and sends it: exactly one approval."""
    worker = MessageBus("demo", "worker-1")
    worker.send("lead", MessageType.PLAN_SUBMISSION, "plan A")
    orch = lead_of()

    def killed(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    orch.bus.send = killed  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        orch.handle_pending()
    orch.bus.close()
    with lead_of() as again:
        assert again.handle_pending() == 1
    with lead_of() as third:  # and once more: recorded and delivered, nothing new
        assert third.handle_pending() == 0
    assert [m.type for m in worker.poll()] == [MessageType.PLAN_APPROVAL]
