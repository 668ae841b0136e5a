"""Delegation and the task tree: a task recorded and assigned, its result sent back once."""

from __future__ import annotations

import pytest

from ralph_mail import (
    AgentOffline,
    Event,
    InvalidMessage,
    MessageBus,
    MessageType,
    Team,
)
from ralph_mail.talk.tasks import tree_lines
from tests.helpers.protocol_helpers import BOUND_S


@pytest.fixture
def team(team_on_every_backend: Team) -> Team:
    """This module's tests run on every backend."""
    return team_on_every_backend


def online(*agents: str) -> None:
    for agent in agents:
        MessageBus("demo", agent).set_presence("idle")


def test_delegate_records_a_task_and_sends_the_assignment(team: Team) -> None:
    """delegate returns a submitted Task and the assignee gets a task_assignment for it."""
    online("worker-1")
    task = MessageBus("demo", "lead").delegate(
        "worker-1", "draft it", context="Q4", priority="high"
    )
    assert (task.status, task.assignee, task.delegated_by, task.priority) == (
        "submitted", "worker-1", "lead", "high"
    )  # fmt: skip
    [assignment] = MessageBus("demo", "worker-1").poll()
    assert assignment.type == MessageType.TASK_ASSIGNMENT and assignment.id == task.assignment
    assert assignment.metadata == {"taskId": task.id, "context": "Q4"}


def test_complete_sends_the_result_once_in_the_thread(team: Team) -> None:
    """complete records the outcome and sends the delegator one task_result, in reply to
    the assignment; completing again sends nothing more."""
    online("worker-1")
    task = MessageBus("demo", "lead").delegate("worker-1", "draft it")
    worker = MessageBus("demo", "worker-1")
    worker.start(task.id)
    done = worker.complete(task.id, "saved as draft 3")
    again = worker.complete(task.id, "saved as draft 3")
    assert done.status == again.status == "completed" and done.notified
    [result] = MessageBus("demo", "lead").poll()
    assert (result.type, result.content, result.reply_to) == (
        "task_result", "saved as draft 3", task.assignment
    )  # fmt: skip
    assert result.metadata == {"taskId": task.id, "status": "completed"}
    assert result.thread == task.assignment


def test_a_complete_killed_before_sending_sends_once_when_run_again(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after recording the outcome and before the result went out, then run
    again: the delegator gets exactly one task_result. Killed after it went out and
    before that was recorded: run again, still one."""
    online("worker-1")
    lead = MessageBus("demo", "lead")
    first = lead.delegate("worker-1", "one")
    second = lead.delegate("worker-1", "two")
    worker = MessageBus("demo", "worker-1")

    def killed(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:  # killed between the record and the send
        patch.setattr(worker, "_send", killed)
        with pytest.raises(KeyboardInterrupt):
            worker.complete(first.id, "done one")
    MessageBus("demo", "worker-1").complete(first.id, "done one")
    real_append = worker.store.log_append

    def killed_after_send(name: str, record: bytes) -> None:
        if b'"notified"' in record:
            raise KeyboardInterrupt
        real_append(name, record)

    with monkeypatch.context() as patch:  # killed between the send and its record
        patch.setattr(worker.store, "log_append", killed_after_send)
        with pytest.raises(KeyboardInterrupt):
            worker.complete(second.id, "done two")
    MessageBus("demo", "worker-1").complete(second.id, "done two")
    results = [m.content for m in lead.poll() if m.type == "task_result"]
    assert results == ["done one", "done two"]


def test_fail_sends_the_error_and_a_finished_task_keeps_its_outcome(team: Team) -> None:
    """fail sends a task_result with status failed; completing it afterwards is refused."""
    online("worker-1")
    task = MessageBus("demo", "lead").delegate("worker-1", "try it")
    worker = MessageBus("demo", "worker-1")
    assert worker.fail(task.id, "rate limit exceeded").status == "failed"
    with pytest.raises(InvalidMessage, match="already failed"):
        worker.complete(task.id, "fine after all")
    [result] = MessageBus("demo", "lead").poll()
    assert result.metadata["status"] == "failed" and result.content == "rate limit exceeded"


def test_only_the_assignee_finishes_a_task(team: Team) -> None:
    """Another agent completing the task is refused, naming the assignee."""
    online("worker-1")
    task = MessageBus("demo", "lead").delegate("worker-1", "mine")
    with pytest.raises(InvalidMessage, match="worker-1's, not worker-2's"):
        MessageBus("demo", "worker-2").complete(task.id, "stolen")


def test_delegating_to_an_offline_agent_or_myself_is_refused(team: Team) -> None:
    """An offline assignee raises AgentOffline, myself InvalidMessage; nothing recorded."""
    lead = MessageBus("demo", "lead")
    with pytest.raises(AgentOffline):
        lead.delegate("worker-1", "nobody home")
    with pytest.raises(InvalidMessage, match="itself"):
        lead.delegate("lead", "me")
    assert lead.tasks() == []


def test_the_tree_puts_subtasks_under_their_parents(team: Team) -> None:
    """tasks() lists parents first; the tree draws subtasks under them."""
    online("worker-1", "worker-2")
    lead = MessageBus("demo", "lead")
    root = lead.delegate("worker-1", "Prepare Q4 report", id="T-100")
    lead.delegate("worker-2", "Pull revenue data", parent=root.id, id="t-1")
    lead.delegate("worker-2", "Draft summary", parent=root.id, id="t-2")
    assert [t.id for t in lead.tasks()] == ["T-100", "t-1", "t-2"]
    from ralph_mail.talk.tasks import fold

    drawn = [
        (prefix, task.id) for prefix, task in tree_lines(fold(lead.store.log_read("tasks"))[0])
    ]
    assert drawn == [("", "T-100"), ("├── ", "t-1"), ("└── ", "t-2")]


def test_a_retried_delegation_sends_the_same_assignment(team: Team) -> None:
    """delegate again under the same id: the same assignment id, one task; a different
    task under an existing id is refused."""
    online("worker-1")
    lead = MessageBus("demo", "lead")
    first = lead.delegate("worker-1", "do it", id="T-7")
    again = lead.delegate("worker-1", "do it", id="T-7")
    assert again.assignment == first.assignment and len(lead.tasks()) == 1
    ids = [m.id for m in MessageBus("demo", "worker-1").poll()]
    # Sent again on files and in memory (the receiver handles an id once); on NATS the
    # server stores a retried id once (Nats-Msg-Id).
    stored_once = lead.store.__class__.__name__ == "NatsStore"
    assert ids == [first.assignment] * (1 if stored_once else 2)
    with pytest.raises(InvalidMessage, match="already exists"):
        lead.delegate("worker-1", "something else", id="T-7")


def test_the_leads_assign_is_in_the_tree_and_its_finish_comes_back_as_an_event(
    team: Team,
) -> None:
    """The lead's assign records the task; TeamAgent.finish_task completes it; the lead
    reports a task_completed event with the result."""
    from ralph_mail import EventKind, TeamAgent, TeamOrchestrator

    events = []
    with TeamOrchestrator("demo", on_event=events.append) as orch:
        orch.assign("worker-1", "T-1", "parse the logs")
        assert [(t.id, t.assignee, t.status) for t in orch.bus.tasks()] == [
            ("T-1", "worker-1", "submitted")
        ]
        with TeamAgent("demo", "worker-1") as agent:
            assert agent.next_task(timeout=5) is not None
            agent.finish_task("parsed 1,204 files")
        orch.handle_pending()
        assert [t.status for t in orch.bus.tasks()] == ["completed"]
    finished = [e for e in events if e.kind == EventKind.TASK_COMPLETED]
    assert [(e.agent, e.text) for e in finished] == [("worker-1", "T-1: parsed 1,204 files")]


def test_the_lead_reports_an_unacknowledged_message_once_as_ack_overdue(team: Team) -> None:
    """The lead's loop reports a message it sent with ack=True and nobody acknowledged
    after ack_overdue seconds as one ack_overdue event; an acknowledged one never."""
    from ralph_mail import EventKind, TeamOrchestrator

    events: list[Event] = []
    with TeamOrchestrator("demo", on_event=events.append, ack_overdue=0) as orch:
        late = orch.bus.send("worker-1", "text", "confirm the deadline\nplease", ack=True)
        answered = orch.bus.send("worker-2", "text", "confirm the budget", ack=True)
        with MessageBus("demo", "worker-2") as worker:
            worker.ack(worker.poll()[0])

        def overdue() -> list[Event]:
            return [e for e in events if e.kind == EventKind.ACK_OVERDUE]

        assert orch.run(until=lambda o: bool(overdue()), timeout=BOUND_S)
        orch.run(timeout=0.05)  # another turn of the loop reports nothing new
    assert [(e.agent, e.message) for e in overdue()] == [("worker-1", late)]
    assert overdue()[0].text == f"{late.id} not acknowledged after 0 s: confirm the deadline"
    assert answered.id not in {e.message.id for e in overdue() if e.message}


def test_the_leads_ack_overdue_is_checked(team: Team) -> None:
    """ack_overdue must be a number of seconds >= 0 (or None): refused before anything."""
    from ralph_mail import TeamOrchestrator

    for bad in (-1, float("nan"), float("inf"), "5"):
        with pytest.raises(InvalidMessage, match="invalid ack_overdue"):
            TeamOrchestrator("demo", ack_overdue=bad)  # type: ignore[arg-type]


def test_a_team_agent_answers_requests_with_its_answer_function(team: Team) -> None:
    """TeamAgent(answer=...) replies to each request; without it they wait in questions."""
    import threading

    from ralph_mail import TeamAgent

    asked: list[str] = []
    with TeamAgent("demo", "worker-1", answer=lambda r: f"yes: {r.content}") as agent:
        agent.process_pending_messages()  # attached: online from here on
        asker = MessageBus("demo", "lead")
        thread = threading.Thread(target=lambda: asked.append(asker.ask("worker-1", "ok?").content))
        thread.start()
        while thread.is_alive():
            agent.wait_for_messages(timeout=0.1)
        thread.join()
        asker.close()
    assert asked == ["yes: ok?"]
    with TeamAgent("demo", "worker-2") as agent:
        request = MessageBus("demo", "lead").send("worker-2", "request", "when?")
        agent.process_pending_messages()
        assert [q.id for q in agent.questions] == [request.id]


def test_the_tree_draws_deep_chains_and_parents_that_name_each_other() -> None:
    """tasks.draw: a chain 5,000 deep is drawn (no recursion limit); two tasks whose
    parents name each other are still shown; columns line up."""
    from ralph_mail.talk.tasks import Task, draw

    def task(id: str, parent: str | None) -> Task:
        ts = "2026-11-23T10:00:00.000000Z"
        return Task(id, f"do {id}", "lead", "worker-1", parent, "normal", "submitted", "", ts, ts,
                    "0" * 12)  # fmt: skip

    chain = {f"t{i}": task(f"t{i}", f"t{i - 1}" if i else None) for i in range(5000)}
    lines = draw(chain).splitlines()
    assert len(lines) == 5000 and lines[1].startswith("└── t1  do t1")
    cycle = {"a": task("a", "b"), "b": task("b", "a")}
    lines = draw(cycle).splitlines()
    assert [line.split()[0] for line in lines] == ["a", "└──"]
    assert lines[0].index("worker-1") == lines[1].index("worker-1")


def test_a_task_for_a_sleeping_agent_is_held_until_it_wakes(team: Team) -> None:
    """delegate to a sleeping agent records the task (held_until set) and sends nothing;
    the agent's next read once it is awake delivers the assignment, once."""
    worker = MessageBus("demo", "worker-1")
    worker.set_presence("sleeping", until="+10m")
    worker.close()
    lead = MessageBus("demo", "lead")
    before = lead.store.size("worker-1")
    task = lead.delegate("worker-1", "draft the post", id="T-9")
    assert task.held_until and lead.tasks()[0].held_until == task.held_until
    assert lead.store.size("worker-1") == before  # held, not delivered
    with MessageBus("demo", "worker-1") as asleep:
        assert asleep.poll() == []  # still sleeping: still held
        asleep.set_presence("working")
    with MessageBus("demo", "worker-1") as awake:  # a fresh process: its first read
        got = awake.poll()
        assert [(m.type, m.metadata["taskId"], m.from_agent) for m in got] == [
            ("task_assignment", "T-9", "lead")
        ]
        assert got[0].id == task.assignment
    with MessageBus("demo", "worker-1") as again:
        assert again.poll() == []  # released once
    awake_then = MessageBus("demo", "worker-1")
    awake_then.complete("T-9", "drafted")
    assert [m.content for m in lead.poll() if m.type == "task_result"] == ["drafted"]
    awake_then.close()
    lead.close()


def test_a_held_task_is_delivered_when_the_sleep_ends(team: Team) -> None:
    """A process of the sleeping agent that waits gets the held assignment once the
    until of its sleep has passed, without anyone setting its presence."""
    from datetime import UTC, datetime, timedelta

    worker = MessageBus("demo", "worker-1")
    worker.set_presence("sleeping", until=datetime.now(UTC) + timedelta(seconds=0.5))
    lead = MessageBus("demo", "lead")
    lead.delegate("worker-1", "draft the post", id="T-10")
    got = worker.wait_for_message("task_assignment", timeout=BOUND_S)
    assert got is not None and got.metadata["taskId"] == "T-10"
    assert got.ts >= lead.tasks()[0].held_until
    worker.close()
    lead.close()


def test_the_tree_folds_from_its_snapshot_and_ignores_a_bad_one(team: Team) -> None:
    """After 1,000 events the fold is saved (state tasks.fold) and later folds start
    from it, events after it included; a damaged snapshot, or one whose log was
    replaced, is ignored: the tree is the same either way."""
    from ralph_mail.talk.tasks import SNAPSHOT_KEY, fold, load

    with MessageBus("demo", "worker-1") as worker:
        worker.set_presence("idle")
    lead = MessageBus("demo", "lead")
    for n in range(400):  # 400 created + 400 assignments' worth of status: > 1,000 events
        lead.delegate("worker-1", f"step {n}", id=f"T-{n}")
    with MessageBus("demo", "worker-1") as worker:
        for n in range(300):
            worker.complete(f"T-{n}", f"done {n}")
    truth = fold(lead.store.log_read("tasks"))[0]
    assert load(lead.store)[0] == truth
    assert lead.store.load_state(SNAPSHOT_KEY) is not None
    with MessageBus("demo", "worker-1") as worker:
        worker.complete("T-399", "late")
    truth = fold(lead.store.log_read("tasks"))[0]
    assert load(lead.store)[0] == truth and truth["T-399"].result == "late"
    for damaged in (b"{not json", b'{"offset": 5, "mark": "00", "tasks": [], "since": {}}',
                    b'{"offset": 1, "mark": "", "tasks": [[1, 2]], "since": {}}'):  # fmt: skip
        lead.store.save_state(SNAPSHOT_KEY, damaged)
        assert load(lead.store)[0] == truth
    lead.close()
