"""The task lifecycle through its faces: the command line's task commands and exit
codes, the tree's listing, and the MCP server's cancel_task."""

from __future__ import annotations

import json
import time
from pathlib import Path

from mcp import Client

from ralph_mail import MessageBus, Team
from ralph_mail.team import update_team
from tests.helpers.mcp_client import refused, run_in_client, text
from tests.helpers.processes import BOUND_S, ralph


def run(home: Path, *args: str, agent: str = "lead") -> tuple[int, str, str]:
    done = ralph(home, *args, "--team", "demo", "--agent", agent)
    return done.returncode, done.stdout.decode(), done.stderr.decode()


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("ralph-mail: error: "), err
    return err


def test_the_task_commands_answer_with_the_documented_exit_codes(team: Team) -> None:
    """An unknown task: 2; not mine to cancel: 4; a task that ended: 3 (a heartbeat
    loop stops there), each with one line; a bad deadline: 2, nothing recorded."""
    home = team.home
    assert run(home, "presence", "idle", agent="worker-1")[0] == 0
    assert run(home, "delegate", "worker-1", "draft it", "--id", "T-1")[:2] == (0, "T-1\n")
    code, out, _ = run(home, "task", "heartbeat", "T-1", agent="worker-1")
    assert code == 0 and out.endswith("Z\n")
    code, _, err = run(home, "task", "cancel", "T-404")
    assert code == 2 and "no task 'T-404'" in one_line(err)
    code, _, err = run(home, "task", "cancel", "T-1", agent="worker-2")
    assert code == 4 and "only it or the lead" in one_line(err)
    assert run(home, "task", "cancel", "T-1", "--reason", "changed") == (0, "T-1\n", "")
    code, _, err = run(home, "task", "heartbeat", "T-1", agent="worker-1")
    assert code == 3 and "canceled by lead (changed): stop working" in one_line(err)
    code, _, err = run(home, "task", "done", "T-1", "drafted", agent="worker-1")
    assert code == 3 and "kept as late" in one_line(err)
    code, _, err = run(home, "delegate", "worker-1", "draft it", "--deadline", "someday")
    assert code == 2 and "someday" in one_line(err)
    assert [t.id for t in MessageBus("demo", "lead").tasks()] == ["T-1"]


def test_the_tree_lists_states_leases_deadlines_and_who_canceled(team: Team) -> None:
    """tasks: a line a task with its state and notes (the lease, the deadline, who
    canceled it, a stall); --json: the lifecycle's fields."""
    home = team.home
    lease = 2.0
    update_team("demo", config={"task_lease": f"{lease:g}"})
    run(home, "presence", "idle", agent="worker-1")
    run(home, "delegate", "worker-1", "the report", "--id", "T-1", "--deadline", "1h")
    run(home, "delegate", "worker-1", "the chart", "--id", "T-2", "--parent", "T-1")
    run(home, "delegate", "worker-1", "the title", "--id", "T-3")
    started = time.monotonic()
    run(home, "task", "start", "T-2", agent="worker-1")
    run(home, "task", "cancel", "T-3")
    lines = run(home, "tasks")[1].splitlines()
    # (A machine so loaded that the lease ran out meanwhile shows it lapsed, as it should.)
    in_time = time.monotonic() - started < lease
    assert lines[0].split()[:5] == ["T-1", "the", "report", "worker-1", "submitted"]
    assert "deadline " in lines[0] and "lease" not in lines[0]
    assert lines[1].startswith("└── T-2  the chart")
    assert "lease to " in lines[1] or (not in_time and "lease lapsed" in lines[1])
    assert "canceled" in lines[2] and "by lead" in lines[2]
    end = time.monotonic() + BOUND_S
    while "stalled" not in run(home, "tasks")[1]:  # the lease of 2 s runs out
        assert time.monotonic() < end
        time.sleep(0.1)
    assert "lease lapsed" in run(home, "tasks")[1].splitlines()[1]
    records = [json.loads(line) for line in run(home, "tasks", "--json")[1].splitlines()]
    assert [(r["id"], r["status"], r["stalled"], r["ended_by"]) for r in records] == [
        ("T-1", "submitted", False, ""), ("T-2", "working", True, ""),
        ("T-3", "canceled", False, "lead"),
    ]  # fmt: skip
    assert records[1]["deadline"] == records[0]["deadline"]  # capped at its parent's


def test_reject_and_reassign_from_the_command_line(team: Team) -> None:
    """task reject sends the delegator the reason ('delegate --wait' exits 3);
    task reassign moves a task, and the old assignee's 'task done' exits 3."""
    home = team.home
    for agent in ("worker-1", "worker-2"):
        run(home, "presence", "idle", agent=agent)
    run(home, "delegate", "worker-1", "draft it", "--id", "T-1")
    assert run(home, "task", "reassign", "T-1", "worker-2") == (0, "T-1 worker-2\n", "")
    code, _, err = run(home, "task", "done", "T-1", "mine", agent="worker-1")
    assert code == 3 and "reassigned to worker-2" in one_line(err)
    assert run(home, "task", "reject", "T-1", "--reason", "not mine", agent="worker-2")[0] == 0
    [result] = [m for m in MessageBus("demo", "lead").poll() if m.type == "task_result"]
    assert (result.from_agent, result.content, result.metadata["status"]) == (
        "worker-2", "not mine", "rejected"
    )  # fmt: skip


def test_mcp_cancel_task_cancels_what_the_agent_delegated(team: Team, home: Path) -> None:
    """cancel_task cancels a task the agent gave out (with its open subtasks: the
    assignees are told); one it did not give out is refused in one line."""
    worker2 = MessageBus("demo", "worker-2", home)
    worker2.set_presence("idle")
    lead = MessageBus("demo", "lead", home)
    lead.delegate("worker-2", "not yours", id="T-9")

    async def body(client: Client) -> None:
        delegated = text(await client.call_tool("contact_agent", {
            "action": "delegate", "agentId": "worker-2", "message": "sum it"}))  # fmt: skip
        task = delegated.split("(subtask ")[1].split(")")[0]
        worker2.delegate("lead", "check the sum", parent=task)
        said = text(await client.call_tool("cancel_task", {"task_id": task, "reason": "moot"}))
        assert said == f"Task {task} canceled with 1 open subtask; worker-2 was told to stop."
        not_mine = await client.call_tool("cancel_task", {"task_id": "T-9"})
        assert "only it or the lead" in refused(not_mine)

    run_in_client(home, "worker-1", body)
    notices = [m for m in worker2.poll() if m.type == "task_canceled"]
    assert next(m.content for m in notices).endswith("moot; stop working on it")
    assert [m.type for m in lead.poll()] == ["task_assignment", "task_canceled"]


def test_top_shows_every_state_whole_in_its_80_column_layout() -> None:
    """Each state top shows (stalled for a lapsed lease, input_required shortened) fits
    the roster's state column and the tree's status column at 80 columns."""
    from ralph_mail.dashboard import layout_for, shown_state
    from ralph_mail.govern.tasklog import STATES, Task

    layout = layout_for(80)
    room = min(dict(layout.roster)["state"], dict(layout.tasks)["status"])
    ts = "2026-11-26T10:00:00.000000Z"
    words = {shown_state(Task("T-1", "d", "lead", "w", None, "normal", state, "", ts, ts,
                              "0" * 12, stalled=stalled))
             for state in STATES for stalled in (False, True)}  # fmt: skip
    assert words == {"submitted", "working", "input req", "completed", "failed",
                     "canceled", "rejected", "stalled"}  # fmt: skip
    assert max(len(word) for word in words) <= room


def test_the_tree_has_a_header_row_on_a_terminal_only(team: Team) -> None:
    """tasks on a terminal puts the columns' names first; in a pipe it does not."""
    from tests.helpers.processes import on_terminal

    home = team.home
    run(home, "presence", "idle", agent="worker-1")
    run(home, "delegate", "worker-1", "draft it", "--id", "T-1")
    shown = on_terminal(home, "tasks").decode().splitlines()
    assert shown[0].split() == ["TASK", "ASSIGNEE", "STATE", "NOTES"]
    assert shown[1].split()[:4] == ["T-1", "draft", "it", "worker-1"]
    assert run(home, "tasks")[1].splitlines()[0].startswith("T-1  draft it")
