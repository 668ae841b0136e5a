"""A task's life (A2A's states), run on every backend: leases and stalls, reassignment,
deadlines, cascading cancel, rejection, input_required, and logs of older versions."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from ralph_mail import (
    EventKind,
    InvalidMessage,
    MessageBus,
    PermissionDenied,
    TaskEnded,
    Team,
    TeamAgent,
    TeamOrchestrator,
)
from ralph_mail.govern.tasklog import SNAPSHOT_KEY, Task, load
from ralph_mail.team import update_team
from tests.helpers.processes import BOUND_S, wait_until


@pytest.fixture
def team(team_on_every_backend: Team) -> Team:
    """Team 'demo' (lead, worker-1, worker-2) on each backend, leases of 1 s."""
    update_team("demo", config={"task_lease": "1"})
    return team_on_every_backend


def online(*agents: str) -> None:
    for agent in agents:
        with MessageBus("demo", agent) as bus:
            bus.set_presence("idle")


def task_of(bus: MessageBus, task_id: str) -> Task:
    return next(task for task in bus.tasks() if task.id == task_id)


def of_type(bus: MessageBus, kind: str) -> list[object]:
    return [m for m in bus.poll() if m.type == kind]


def test_a_task_goes_submitted_working_completed_with_a_lease(team: Team) -> None:
    """delegate: submitted; start: working with a lease of the team's task_lease;
    heartbeat renews it; complete ends it and the lease goes."""
    online("worker-1")
    lead, worker = MessageBus("demo", "lead"), MessageBus("demo", "worker-1")
    task = lead.delegate("worker-1", "draft it", id="T-1")
    assert (task.status, task.lease_until, task.stalled) == ("submitted", "", False)
    started = worker.start("T-1")
    assert started.status == "working" and started.lease_until > started.updated
    renewed = worker.heartbeat("T-1")
    assert renewed.lease_until >= started.lease_until and renewed.status == "working"
    done = worker.complete("T-1", "drafted")
    assert (done.status, done.lease_until, done.ended_by) == ("completed", "", "worker-1")


def test_a_heartbeat_starts_a_submitted_task_and_only_the_assignee_renews(team: Team) -> None:
    """A script's first heartbeat starts its task; another agent's is refused."""
    online("worker-1")
    MessageBus("demo", "lead").delegate("worker-1", "draft it", id="T-1")
    assert MessageBus("demo", "worker-1").heartbeat("T-1").status == "working"
    with pytest.raises(InvalidMessage, match="worker-1's, not worker-2's"):
        MessageBus("demo", "worker-2").heartbeat("T-1")


def test_a_lapsed_lease_stalls_the_task_and_tells_the_delegator_once(team: Team) -> None:
    """No renewal within the lease: the tree marks the task stalled, and the delegator's
    own reads put one task_stalled in its inbox (not two, however often it reads)."""
    online("worker-1")
    lead, worker = MessageBus("demo", "lead"), MessageBus("demo", "worker-1")
    lead.delegate("worker-1", "draft it", id="T-1")
    worker.start("T-1")  # and then nothing: its process is gone
    wait_until(lambda: task_of(lead, "T-1").stalled, "the lease lapses")
    notice = lead.wait_for_message("task_stalled", timeout=BOUND_S)
    assert notice is not None and notice.metadata["taskId"] == "T-1"
    assert (notice.from_agent, notice.to_agent, notice.metadata["assignee"]) == (
        "lead", "lead", "worker-1"
    )  # fmt: skip
    assert "reassign" in notice.content
    other = MessageBus("demo", "lead")  # a second process of the delegator: told already
    other.poll()
    assert lead.wait_for_messages(timeout=1.5) == []
    assert task_of(lead, "T-1").status == "working"  # stalled is a mark, not a state


def test_a_renewal_after_a_stall_clears_it(team: Team) -> None:
    """An assignee that comes back and renews its lease is working again, not stalled."""
    online("worker-1")
    lead, worker = MessageBus("demo", "lead"), MessageBus("demo", "worker-1")
    lead.delegate("worker-1", "draft it", id="T-1")
    worker.start("T-1")
    wait_until(lambda: task_of(lead, "T-1").stalled, "the lease lapses")
    assert not worker.heartbeat("T-1").stalled


def test_reassign_moves_the_task_and_the_old_assignees_result_is_refused(team: Team) -> None:
    """reassign: the new assignee gets an assignment of the same task, the old one a
    task_canceled; the old one's result is refused (by the library and by the Gate);
    the delegator gets exactly one result, the new assignee's, waiting as it did."""
    online("worker-1", "worker-2")
    lead = MessageBus("demo", "lead")
    since = lead.store.size("lead")
    task = lead.delegate("worker-1", "draft it", id="T-1", context="Q4")
    old, new = MessageBus("demo", "worker-1"), MessageBus("demo", "worker-2")
    [first] = old.poll()
    old.start("T-1")
    moved = lead.reassign("T-1", "worker-2")
    assert (moved.assignee, moved.reassigned_from, moved.status) == (
        "worker-2", "worker-1", "submitted"
    )  # fmt: skip
    [given] = new.poll()
    assert given.type == "task_assignment" and given.metadata["taskId"] == "T-1"
    assert given.metadata["context"] == "Q4" and given.id == moved.assignment
    [canceled] = of_type(old, "task_canceled")
    assert "reassigned to worker-2" in canceled.content
    with pytest.raises(TaskEnded, match="reassigned to worker-2"):
        old.complete("T-1", "mine after all")
    with pytest.raises(InvalidMessage, match="not the assignee's"):
        old.send("lead", "task_result", "sneaked", {"taskId": "T-1", "status": "completed"},
                 reply_to=first.id)  # fmt: skip
    new.complete("T-1", "drafted by worker-2")
    result = lead.wait_for_result(task, BOUND_S, since)
    assert result is not None and (result.from_agent, result.content) == (
        "worker-2", "drafted by worker-2"
    )  # fmt: skip
    assert [m for m in lead.poll() if m.type == "task_result"] == []


def test_only_the_delegator_or_the_lead_cancels_or_reassigns(team: Team) -> None:
    """Another agent's cancel or reassign is refused (PermissionDenied), changing nothing."""
    online("worker-1", "worker-2")
    lead = MessageBus("demo", "lead")
    lead.delegate("worker-1", "draft it", id="T-1")
    MessageBus("demo", "worker-1").delegate("worker-2", "a part", id="T-2", parent="T-1")
    outsider = MessageBus("demo", "worker-2")
    with pytest.raises(PermissionDenied, match="only it or the lead"):
        outsider.cancel("T-1")
    with pytest.raises(PermissionDenied):
        outsider.reassign("T-1", "worker-2")
    assert task_of(lead, "T-1").status == "submitted"
    assert lead.cancel("T-2").status == "canceled"  # the lead cancels any task


def test_cancel_ends_a_three_level_tree_and_tells_each_assignee(team: Team) -> None:
    """Canceling the root cancels every open task below it (not one that completed);
    each assignee gets one task_canceled; a result after it is kept as late and not
    delivered; a raw task_result for it is refused by the Gate."""
    online("worker-1", "worker-2")
    lead = MessageBus("demo", "lead")
    w1, w2 = MessageBus("demo", "worker-1"), MessageBus("demo", "worker-2")
    lead.delegate("worker-1", "the report", id="T-1")
    w1.delegate("worker-2", "the numbers", id="T-2", parent="T-1")
    w2.delegate("worker-1", "the chart", id="T-3", parent="T-2")
    w1.delegate("worker-2", "the title", id="T-4", parent="T-1")
    w2.complete("T-4", "Q4")
    canceled = lead.cancel("T-1", reason="the brief changed")
    assert (canceled.status, canceled.ended_by, canceled.result) == (
        "canceled", "lead", "the brief changed"
    )  # fmt: skip
    states = {t.id: (t.status, t.ended_by) for t in lead.tasks()}
    assert states == {"T-1": ("canceled", "lead"), "T-2": ("canceled", "lead"),
                      "T-3": ("canceled", "lead"), "T-4": ("completed", "worker-2")}  # fmt: skip
    told1 = [m.metadata["taskId"] for m in of_type(w1, "task_canceled")]
    told2 = [m.metadata["taskId"] for m in of_type(w2, "task_canceled")]
    assert sorted(told1) == ["T-1", "T-3"] and told2 == ["T-2"]
    with pytest.raises(TaskEnded, match="kept as late"):
        w1.complete("T-3", "a chart nobody wants")
    assert task_of(lead, "T-3").late == "a chart nobody wants"
    assert [m.type for m in w2.poll()] == []  # T-3's delegator got no result
    with pytest.raises(InvalidMessage, match="was canceled"):
        w2.send("worker-1", "task_result", "x", {"taskId": "T-2", "status": "completed"},
                reply_to=w2.tasks()[1].assignment)  # fmt: skip
    again = lead.cancel("T-1", reason="the brief changed")  # run again: nothing twice
    assert again.status == "canceled" and of_type(w1, "task_canceled") == []


def test_a_cancel_after_the_result_is_refused_and_changes_nothing(team: Team) -> None:
    """A task that completed cannot be canceled: TaskEnded, no task_canceled sent."""
    online("worker-1")
    lead, worker = MessageBus("demo", "lead"), MessageBus("demo", "worker-1")
    lead.delegate("worker-1", "draft it", id="T-1")
    worker.complete("T-1", "drafted")
    with pytest.raises(TaskEnded, match="already completed: nothing to cancel"):
        lead.cancel("T-1")
    assert task_of(lead, "T-1").status == "completed"
    assert of_type(worker, "task_canceled") == []


def test_cancel_racing_a_completion_has_exactly_one_outcome(team: Team) -> None:
    """A cancel and a completion started together, again and again: each time one of
    them wins, the other is told (TaskEnded), and only the winner's message goes out."""
    online("worker-1")
    lead, worker = MessageBus("demo", "lead"), MessageBus("demo", "worker-1")
    for n in range(6):
        lead.delegate("worker-1", f"round {n}", id=f"T-{n}")
        won = race({"cancel": lambda n=n: lead.cancel(f"T-{n}"),
                    "done": lambda n=n: worker.complete(f"T-{n}", "done")})  # fmt: skip
        assert sorted(won.values()) == [False, True], won
        status = task_of(lead, f"T-{n}").status
        assert status == ("canceled" if won["cancel"] else "completed")
        results = [m for m in lead.poll() if m.type == "task_result"]
        notices = of_type(worker, "task_canceled")
        assert (len(results), len(notices)) == ((0, 1) if won["cancel"] else (1, 0))


def race(acts: dict[str, Callable[[], object]]) -> dict[str, bool]:
    """Run each act on a thread of its own, let go together; which did not end TaskEnded."""
    go = threading.Barrier(len(acts))
    won: dict[str, bool] = {}

    def act(name: str) -> None:
        go.wait()
        try:
            acts[name]()
            won[name] = True
        except TaskEnded:
            won[name] = False

    racers = [threading.Thread(target=act, args=(name,)) for name in acts]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(BOUND_S)
    return won


def test_past_its_deadline_a_task_fails_and_its_open_subtasks_are_canceled(team: Team) -> None:
    """A deadline caps a subtask's; once it passes the task fails ("deadline passed")
    and its open subtask is canceled, with no process running; a result after it is late,
    and the delegator's wait ends with no result."""
    online("worker-1", "worker-2")
    lead, w1 = MessageBus("demo", "lead"), MessageBus("demo", "worker-1")
    since = lead.store.size("lead")
    task = lead.delegate("worker-1", "the report", id="T-1", deadline=1.0)
    sub = w1.delegate("worker-2", "the numbers", id="T-2", parent="T-1", deadline="2h")
    assert sub.deadline == task.deadline  # capped at its parent's
    w1.start("T-1")
    wait_until(lambda: not task_of(lead, "T-1").open, "the deadline passes")
    ended = task_of(lead, "T-1")
    assert (ended.status, ended.result, ended.updated) == ("failed", "deadline passed",
                                                           task.deadline)  # fmt: skip
    assert task_of(lead, "T-2").status == "canceled"
    assert lead.wait_for_result(task, BOUND_S, since) is None
    with pytest.raises(TaskEnded, match="deadline"):
        w1.complete("T-1", "too late")
    assert task_of(lead, "T-1").late == "too late"
    [result] = [m for m in lead.poll() if m.type == "task_result"]  # the failure, once
    assert (result.content, result.metadata["status"]) == ("deadline passed", "failed")


def test_a_deadline_is_checked_before_anything_is_written(team: Team) -> None:
    """A deadline in the past, or words that are no time, are refused; nothing recorded."""
    online("worker-1")
    lead = MessageBus("demo", "lead")
    for bad in ("2020-01-01T00:00:00Z", "soon", -5):
        with pytest.raises(InvalidMessage, match=r"deadline|time"):
            lead.delegate("worker-1", "draft it", deadline=bad)
    assert lead.tasks() == []


def test_the_assignee_rejects_a_task_and_its_delegator_hears_why(team: Team) -> None:
    """reject: the task is rejected, and the delegator gets a task_result saying so."""
    online("worker-1")
    lead, worker = MessageBus("demo", "lead"), MessageBus("demo", "worker-1")
    lead.delegate("worker-1", "draft it", id="T-1")
    rejected = worker.reject("T-1", "not mine: ask the analyst")
    assert (rejected.status, rejected.ended_by) == ("rejected", "worker-1")
    [result] = [m for m in lead.poll() if m.type == "task_result"]
    assert result.metadata["status"] == "rejected" and result.content.startswith("not mine")


def test_an_assignment_the_approver_denies_leaves_the_task_rejected(team: Team) -> None:
    """A delegation held for approval and denied: the task is rejected by the approver."""
    online("worker-2")
    update_team("demo", member="worker-1", mode="supervised")
    worker = MessageBus("demo", "worker-1")
    task = worker.delegate("worker-2", "draft it", id="T-1")
    MessageBus("demo", "lead").deny(task.assignment, "not now")
    ended = task_of(worker, "T-1")
    assert (ended.status, ended.ended_by, ended.result) == ("rejected", "lead", "not now")


def test_asking_the_delegator_in_the_tasks_thread_is_input_required(team: Team) -> None:
    """The assignee asks its delegator about the task: the request goes in the task's
    thread, the task is input_required until the reply comes, then working again."""
    online("worker-1")
    lead, worker = MessageBus("demo", "lead"), MessageBus("demo", "worker-1")
    task = lead.delegate("worker-1", "draft it", id="T-1")
    worker.start("T-1")
    seen: list[str] = []

    def answer() -> None:
        request = lead.wait_for_message("request", timeout=BOUND_S)
        assert request is not None
        seen.append(task_of(lead, "T-1").status)
        seen.append(request.thread)
        lead.reply(request, "the long one")

    answering = threading.Thread(target=answer)
    answering.start()
    reply = worker.ask("lead", "short or long?", metadata={"taskId": "T-1"}, timeout=BOUND_S)
    answering.join(BOUND_S)
    assert reply.content == "the long one"
    assert seen == ["input_required", task.assignment]
    assert task_of(lead, "T-1").status == "working"


def test_logs_and_snapshots_of_older_versions_read_with_the_new_names(team: Team) -> None:
    """pending and active (an older log's names) read as submitted and working, from
    the log and from a snapshot an older version saved (13 fields a task)."""
    lead = MessageBus("demo", "lead")
    ts = "2026-11-23T10:00:00.000000Z"
    for n, status in ((1, None), (2, "active")):
        created = {"e": "created", "id": f"T-{n}", "description": "d", "delegated_by": "lead",
                   "assignee": "worker-1", "parent": None, "priority": "normal",
                   "status": "pending", "result": "", "created": ts, "updated": ts,
                   "held_until": "", "assignment": f"{n:012x}"}  # fmt: skip
        lead.store.log_append("tasks", orjson.dumps(created) + b"\n")
        if status:
            event = {"e": "status", "id": f"T-{n}", "status": status, "ts": ts}
            lead.store.log_append("tasks", orjson.dumps(event) + b"\n")
    assert [(t.id, t.status) for t in lead.tasks()] == [("T-1", "submitted"), ("T-2", "working")]
    log = lead.store.log_read("tasks")
    old = [["T-3", "d", "lead", "worker-1", None, "normal", "active", "", ts, ts,
            "0" * 12, False, ""]]  # fmt: skip
    snapshot = {"offset": len(log), "mark": log[-64:].hex(), "tasks": old, "since": {}}
    lead.store.save_state(SNAPSHOT_KEY, orjson.dumps(snapshot))
    assert [(t.id, t.status) for t in load(lead.store)[0].values()] == [("T-3", "working")]


def test_a_team_agent_starts_renews_and_hears_of_a_cancel(team: Team) -> None:
    """TeamAgent starts a task of the log as it takes it and renews its lease from a
    thread while it works; a cancel marks it in canceled, and finishing it then keeps
    the result as late without raising."""
    lead = MessageBus("demo", "lead")
    with TeamAgent("demo", "worker-1") as agent:
        agent.process_pending_messages()  # attached: online
        lead.delegate("worker-1", "draft it", id="T-1")
        taken = agent.next_task(timeout=BOUND_S)
        assert taken is not None and taken.id == "T-1"
        first = task_of(lead, "T-1").lease_until
        wait_until(lambda: task_of(lead, "T-1").lease_until > first, "the lease is renewed")
        assert task_of(lead, "T-1").status == "working"
        lead.cancel("T-1", reason="changed")
        agent.process_pending_messages()
        assert "T-1" in agent.canceled
        agent.finish_task("drafted anyway")
    assert task_of(lead, "T-1").late == "drafted anyway"


def test_a_team_agent_keeps_a_bounded_number_of_ended_tasks(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TeamAgent.canceled keeps the newest notes only: an agent that lives long and sees
    many tasks canceled does not hold one note a task forever."""
    monkeypatch.setattr("ralph_mail.agent.HANDLED_IDS_KEPT", 2)
    lead = MessageBus("demo", "lead")
    with TeamAgent("demo", "worker-1") as agent:
        agent.process_pending_messages()  # attached: online
        for n in (1, 2, 3):
            lead.delegate("worker-1", f"draft {n}", id=f"T-{n}")
        agent.process_pending_messages()
        for n in (1, 2, 3):
            lead.cancel(f"T-{n}", reason="changed")
        agent.process_pending_messages()
        assert list(agent.canceled) == ["T-2", "T-3"]
        assert not agent.backlog


def test_the_lead_reports_a_stalled_task_as_an_event(team: Team) -> None:
    """A task the lead gave out whose lease lapsed is reported once: task_stalled."""
    events = []
    with TeamOrchestrator("demo", on_event=events.append) as orch:
        orch.assign("worker-1", "T-1", "parse the logs")
        with MessageBus("demo", "worker-1") as worker:
            worker.start("T-1")

        def stalled() -> list[object]:
            return [e for e in events if e.kind == EventKind.TASK_STALLED]

        assert orch.run(until=lambda o: bool(stalled()), timeout=BOUND_S)
    [event] = stalled()
    assert event.agent == "worker-1" and event.text.startswith("T-1: task T-1 stalled")


def test_task_notices_need_a_task_and_a_log_that_backs_them(team: Team) -> None:
    """A task_canceled or task_stalled without metadata.taskId is refused; a
    task_stalled to myself that the log does not back is self-contact, refused."""
    online("worker-1")
    lead = MessageBus("demo", "lead")
    lead.delegate("worker-1", "draft it", id="T-1")
    with pytest.raises(InvalidMessage, match="needs metadata taskId"):
        lead.send("worker-1", "task_canceled", "stop")
    with pytest.raises(InvalidMessage, match="itself"):
        lead.send("lead", "task_stalled", "stalled?", {"taskId": "T-1"})


def test_tasks_json_names_the_lifecycle_fields(team: Team, home: Path) -> None:
    """Task.to_dict (tasks --json) carries the state, the lease, the deadline and who
    ended it, with the fields it had before."""
    online("worker-1")
    lead = MessageBus("demo", "lead")
    lead.delegate("worker-1", "draft it", id="T-1", deadline="1h")
    record = task_of(lead, "T-1").to_dict()
    assert {"status", "stalled", "deadline", "lease_until", "ended_by", "late",
            "reassigned_from", "held_until", "result"} <= set(record)  # fmt: skip
    assert record["deadline"] > record["created"] and record["status"] == "submitted"


def test_a_read_looks_for_lapsed_leases_only_once_one_can_have_lapsed(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """look says when a lapse can come at the soonest (the earliest lease of my tasks
    being worked on, else a whole lease away); a read before then does not read the
    task log at all."""
    from ralph_mail.message import parse_ts
    from ralph_mail.talk import tasks

    online("worker-1")
    lead, worker = MessageBus("demo", "lead"), MessageBus("demo", "worker-1")
    before = time.time()
    assert before + 1 <= tasks.look(lead) <= time.time() + 1  # nothing of mine: a lease away
    lead.delegate("worker-1", "draft it", id="T-1")
    lease = worker.start("T-1").lease_until
    assert tasks.look(lead) <= parse_ts(lease)
    read: list[str] = []
    real = lead.store.log_read
    monkeypatch.setattr(lead.store, "log_read", lambda name: read.append(name) or real(name))
    assert tasks.before_read(lead, time.time() + 60) > time.time()
    assert "tasks" not in read
    tasks.before_read(lead, 0.0)
    assert "tasks" in read
