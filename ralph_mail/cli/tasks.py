"""Commands for delegated tasks: delegate, the assignee's and the delegator's ``task``
subcommands, and ``tasks``, the team's task tree.

A task that ended (canceled, moved to another agent, past its deadline, finished) makes
what is asked of it exit 3, the answer "no": a script's ``task heartbeat`` loop stops
there, and a ``task done`` after a cancel says its result was kept as late.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated

from ralph_mail import settings
from ralph_mail.cli import EXIT_NO, EXIT_NOTHING, error_line, say
from ralph_mail.cli.app import Agent, Home, JsonRecords, TeamName, app, command, identity
from ralph_mail.cli.command import Argument, Group, Option
from ralph_mail.cli.mail import Priority, Visibility
from ralph_mail.cli.render import is_terminal, print_json_lines, safe
from ralph_mail.cli.send import Identity, check_wait, held_exit, read_body
from ralph_mail.errors import TaskEnded

task_app = Group(
    help=(
        "Work a task given to me (start, heartbeat, done, fail, reject), or one I gave "
        "out (cancel, reassign).\n\n"
        "Example:\n  ralph-mail task done t-3f2a 'saved as draft 3' --agent writer\n"
        "  ralph-mail task cancel T-100 --reason 'the brief changed' --agent lead"
    )
)
app.add_group(task_app, "task")

TaskId = Annotated[str, Argument(help="The task.", metavar="ID")]


def _answer_no(action: Callable[[], int | None]) -> Callable[[], int | None]:
    """``action``, with a task that ended (`TaskEnded`) as exit 3 and its one line."""

    def guarded() -> int | None:
        try:
            return action()
        except TaskEnded as exc:
            error_line(str(exc))
            return EXIT_NO

    return guarded


@app.command("delegate")
def delegate(
    to: Annotated[str, Argument(help="Who does it.", metavar="AGENT")],
    description: Annotated[
        str | None, Argument(help="The task; '-' or omitted with a pipe: standard input.")
    ] = None,
    context: Annotated[
        str | None, Option("--context", help="Background it needs.", metavar="C")
    ] = None,
    priority: Priority = None,
    parent: Annotated[
        str | None, Option("--parent", help="The task this is part of.", metavar="ID")
    ] = None,
    task_id: Annotated[
        str | None, Option("--id", help="Its id [default: a new t-xxxxxxxx].", metavar="ID")
    ] = None,
    deadline: Annotated[
        str | None,
        Option(
            "--deadline",
            help="Fail it if it has not ended by then: a duration (10m, 2h) or an ISO-8601 "
            "time [default: none; a subtask's is capped at its parent's].",
            metavar="WHEN",
        ),
    ] = None,
    wait: Annotated[
        float | None,
        Option("--wait", help="Wait up to S seconds for the result.", metavar="S"),
    ] = None,
    visibility: Visibility = None,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
) -> None:
    """Give a teammate a task; prints its id. With --wait S, prints the result: exit 0
    completed, 3 failed (or canceled, rejected, past its deadline), 1 not finished in
    time; 4 refused (the agent is offline).

    \b
    Example:
      ralph-mail delegate writer 'Draft the Q4 post' --priority high --parent T-100
      ralph-mail delegate writer 'Draft the Q4 post' --deadline 2h --wait 7200
    """

    def action() -> int:
        check_wait(wait)
        left = wait
        body = read_body(description, settings.max_message_bytes())
        with identity(home, team, agent).bus() as bus:
            since = bus.store.size(bus.agent)
            task = bus.delegate(to, body, context=context, priority=priority, parent=parent,
                                id=task_id, visibility=visibility, deadline=deadline)  # fmt: skip
            held = bus.approval_of(task.assignment)
            if held is not None and held.decision is None:
                start = time.monotonic()
                code = held_exit(bus, task.assignment, since, left, f"task {task.id}")
                if code:
                    return code
                if left is not None:
                    left = max(0.0, left - (time.monotonic() - start))
            if task.held_until:
                error_line(f"{to} is sleeping: the task is held until {task.held_until}, "
                           "then delivered", "note")  # fmt: skip
            if left is None:
                say(task.id + "\n")
                return 0
            result = bus.wait_for_result(task, left, since)
            now = next((t for t in bus.tasks() if t.id == task.id), task)
        if result is None and not now.open:
            error_line(f"task {task.id} {now.status}" + (f": {now.result}" if now.result else ""))
            return EXIT_NO
        if result is None:
            error_line(f"task {task.id} did not finish within {wait:g} s; see 'ralph-mail tasks'")
            return EXIT_NOTHING
        say(safe(result.content) + "\n")
        return EXIT_NO if result.metadata.get("status") in ("failed", "rejected") else 0

    command(action)


def _finish(task_id: str, text: str | None, status: str, identity_: Identity) -> None:
    body = read_body(text, settings.max_message_bytes(), empty_ok=True)
    with identity_.bus() as bus:
        {"completed": bus.complete, "failed": bus.fail, "rejected": bus.reject}[status](
            task_id, body
        )


@task_app.command("done")
def task_done(
    task_id: TaskId,
    result: Annotated[
        str | None, Argument(help="The result; '-' or omitted with a pipe: standard input.")
    ] = None,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
) -> None:
    """Complete a task given to me; its delegator gets the result. Exit 3 when the task
    ended first (canceled: the result is kept as late) or was given to another agent.

    \b
    Example:
      ralph-mail task done t-3f2a 'saved as draft 3' --agent writer
    """
    command(_answer_no(lambda: _finish(task_id, result, "completed", identity(home, team, agent))))


@task_app.command("fail")
def task_fail(
    task_id: TaskId,
    error: Annotated[
        str | None, Argument(help="What went wrong; '-' or a pipe: standard input.")
    ] = None,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
) -> None:
    """Fail a task given to me; its delegator gets the error (exit 3: it ended first).

    \b
    Example:
      ralph-mail task fail t-3f2a 'rate limit exceeded' --agent writer
    """
    command(_answer_no(lambda: _finish(task_id, error, "failed", identity(home, team, agent))))


@task_app.command("reject")
def task_reject(
    task_id: TaskId,
    reason: Annotated[
        str | None, Argument(help="Why not; '-' or a pipe: standard input.", metavar="REASON")
    ] = None,
    reason_option: Annotated[
        str | None, Option("--reason", help="Why not (instead of REASON).", metavar="R")
    ] = None,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
) -> None:
    """Refuse a task given to me (it is rejected); its delegator gets the reason.

    \b
    Example:
      ralph-mail task reject t-3f2a --reason 'not mine: ask the analyst' --agent writer
    """
    text = reason_option if reason_option is not None else reason
    command(_answer_no(lambda: _finish(task_id, text, "rejected", identity(home, team, agent))))


@task_app.command("start")
def task_start(
    task_id: TaskId,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
) -> None:
    """Mark a task given to me working, with a lease (see task heartbeat).

    \b
    Example:
      ralph-mail task start t-3f2a --agent writer
    """

    def action() -> None:
        with identity(home, team, agent).bus() as bus:
            bus.start(task_id)

    command(_answer_no(action))


@task_app.command("heartbeat")
def task_heartbeat(
    task_id: TaskId,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
) -> None:
    """Renew the lease of a task given to me (starting it); prints when the lease ends.
    Exit 3 once the task ended (canceled, moved, past its deadline): stop working on it.
    A lease not renewed within the team's task_lease (60 s) marks the task stalled.

    \b
    Example:
      while ralph-mail task heartbeat t-3f2a --agent writer; do sleep 20; done
    """

    def action() -> None:
        with identity(home, team, agent).bus() as bus:
            task = bus.heartbeat(task_id)
        say(task.lease_until + "\n")

    command(_answer_no(action))


@task_app.command("cancel")
def task_cancel(
    task_id: TaskId,
    reason: Annotated[str | None, Option("--reason", help="Why.", metavar="R")] = None,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
) -> None:
    """Cancel a task I gave out (the lead: any task) and every open task below it;
    prints each task canceled. Each assignee gets a task_canceled (a ralph-mail run job
    on one is killed). Exit 3 when the task ended first, 4 when it is not mine to cancel.

    \b
    Example:
      ralph-mail task cancel T-100 --reason 'the brief changed' --agent lead
    """

    def action() -> None:
        from ralph_mail.talk.tasks import canceled_with

        with identity(home, team, agent).bus() as bus:
            task = bus.cancel(task_id, reason or "")
            found = bus.tasks()
        say("".join(f"{safe(t.id, newlines=False)}\n" for t in canceled_with(task, found)))

    command(_answer_no(action))


@task_app.command("reassign")
def task_reassign(
    task_id: TaskId,
    to: Annotated[str, Argument(help="Who does it now.", metavar="AGENT")],
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
) -> None:
    """Give a task I gave out (the lead: any task) to another agent: it gets a new
    assignment; the old assignee gets a task_canceled, and its result is refused.
    Exit 3 when the task ended, 4 when it is not mine or the agent is offline.

    \b
    Example:
      ralph-mail task reassign T-100 worker-2 --agent lead
    """

    def action() -> None:
        with identity(home, team, agent).bus() as bus:
            task = bus.reassign(task_id, to)
        say(safe(f"{task.id} {task.assignee}", newlines=False) + "\n")

    command(_answer_no(action))


@app.command("tasks")
def tasks_tree(
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
    json: JsonRecords = False,
) -> None:
    """Draw the team's task tree: every task given out, its assignee, its state (stalled:
    its lease lapsed), what its subtree cost when 'ralph-mail run' recorded it (--json:
    cost_usd) and notes: when it ended and who canceled it, its lease, its deadline, a
    late result.

    \b
    Example:
      ralph-mail tasks --team demo
    """

    def action() -> None:
        from ralph_mail import usage
        from ralph_mail.talk.tasks import draw, load, ordered
        from ralph_mail.team import load_team

        roster = load_team(identity(home, team, agent).need_team(), home)
        known, _ = load(roster.store)
        own = usage.task_costs(usage.load(roster.store))
        costs = usage.subtree_costs(own, {t.id: t.parent for t in known.values()}) if own else {}
        if json:
            rows = [task.to_dict() for task in ordered(known)]
            if costs:
                for row in rows:
                    row["cost_usd"] = costs.get(row["id"], 0) / 1e6
            print_json_lines(rows)
            return
        cost = (lambda task: f"${usage.usd(costs[task.id] / 1e6)}" if costs.get(task.id)
                else "") if costs else None  # fmt: skip
        say(draw(known, lambda text: safe(text, newlines=False), header=is_terminal(),
                 cost=cost))  # fmt: skip

    command(action)
