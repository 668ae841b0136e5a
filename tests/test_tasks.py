"""Delegation and the task tree: a task recorded and assigned, its result sent back once."""

from __future__ import annotations

import pytest

from ralph_mail import AgentOffline, InvalidMessage, MessageBus, MessageType, Team
from ralph_mail.tasks import tree_lines


def online(*agents: str) -> None:
    for agent in agents:
        MessageBus("demo", agent).set_presence("idle")


def test_delegate_records_a_task_and_sends_the_assignment(team: Team) -> None:
    """delegate returns a pending Task and the assignee gets a task_assignment for it."""
    online("worker-1")
    task = MessageBus("demo", "lead").delegate(
        "worker-1", "draft it", context="Q4", priority="high"
    )
    assert (task.status, task.assignee, task.delegated_by, task.priority) == (
        "pending", "worker-1", "lead", "high"
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
    from ralph_mail.tasks import fold

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
    assert ids == [first.assignment, first.assignment]
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
            ("T-1", "worker-1", "pending")
        ]
        with TeamAgent("demo", "worker-1") as agent:
            assert agent.next_task(timeout=5) is not None
            agent.finish_task("parsed 1,204 files")
        orch.handle_pending()
        assert [t.status for t in orch.bus.tasks()] == ["completed"]
    finished = [e for e in events if e.kind == EventKind.TASK_COMPLETED]
    assert [(e.agent, e.text) for e in finished] == [("worker-1", "T-1: parsed 1,204 files")]
