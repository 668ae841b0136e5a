"""The protocol commands: status, plan submit, assign, shutdown request/respond, lead.

Commands whose behaviour lives in one process run in-process through `cli.main` (fast);
everything that needs another party (a lead, a teammate, a signal) runs as real processes.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections import deque
from pathlib import Path

import orjson
import pytest

from ralph_mail import Message, MessageBus, MessageType, Team
from ralph_mail.cli import main
from ralph_mail.cli.lead import prompt_reviewer
from ralph_mail.orchestrator import Plan
from tests.helpers.processes import held_job, signal_until_ended
from tests.helpers.protocol_helpers import (  # noqa: F401
    BOUND_S,
    Child,
    Children,
    Terminal,
    children_fixture,
    close_buses,
    inbox_messages,
    of_type,
    ralph_env,
    readable,
)


class Run:
    """The result of one in-process command: exit code and output."""

    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, team: Team):  # type: ignore[no-untyped-def]
    """Run ``ralph-mail ARGS`` in this process as worker-1 of team demo."""
    monkeypatch.setenv("RALPH_TEAM", "demo")
    monkeypatch.setenv("RALPH_AGENT", "worker-1")

    def run(*args: str) -> Run:
        code = main(list(args))
        captured = capsys.readouterr()
        return Run(code, captured.out, captured.err)

    return run


def one_line_error(result: Run, code: int = 2) -> str:
    assert result.code == code
    assert result.err.count("\n") == 1 and "Traceback" not in result.err
    return result.err


def unread(agent: str) -> list[Message]:
    return MessageBus("demo", agent).peek()


# -- status ------------------------------------------------------------------------------


def test_status_sends_a_status_update_to_the_lead(cli) -> None:  # type: ignore[no-untyped-def]
    """status sends the lead a status_update with state, task and progress; prints its id."""
    result = cli("status", "half way", "--state", "working", "--task", "T-1", "--progress", "0.5")
    [update] = unread("lead")
    assert result.code == 0 and result.out == f"{update.id}\n"
    assert (update.type, update.content, update.from_agent) == (
        "status_update",
        "half way",
        "worker-1",
    )
    assert update.metadata == {"state": "working", "task": "T-1", "progress": "0.5"}


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--state", "sleepy"], "invalid state 'sleepy'"),
        (["--progress", "1.5"], "invalid progress '1.5'"),
        (["--progress", "half"], "invalid progress 'half'"),
        (["--task", ""], "invalid task id"),
    ],
)
def test_status_refuses_bad_metadata_and_sends_nothing(cli, args: list[str], fragment: str) -> None:  # type: ignore[no-untyped-def]
    """A bad state, progress or task is exit 2 with one line, and nothing is sent."""
    assert fragment in one_line_error(cli("status", "x", *args))
    assert unread("lead") == []


# -- plan submit -------------------------------------------------------------------------


def test_plan_submit_without_wait_prints_the_id(cli) -> None:  # type: ignore[no-untyped-def]
    """plan submit sends the plan (with its task) and prints its id at once."""
    result = cli("plan", "submit", "1. parse", "--task", "T-1")
    [plan] = unread("lead")
    assert result.code == 0 and result.out == f"{plan.id}\n"
    assert (plan.type, plan.metadata) == ("plan_submission", {"task": "T-1"})


def test_plan_submit_with_no_answer_exits_1(cli) -> None:  # type: ignore[no-untyped-def]
    """plan submit --wait exits 1, saying so, when the lead does not answer in time."""
    assert "no answer to plan" in one_line_error(cli("plan", "submit", "x", "--wait", "0.1"), 1)


def test_plan_submit_refuses_an_empty_plan(cli) -> None:  # type: ignore[no-untyped-def]
    """An empty plan is exit 2 and nothing is sent."""
    assert "empty plan" in one_line_error(cli("plan", "submit", " "))
    assert unread("lead") == []


def test_plan_approval_and_rejection_from_a_lead_process(team: Team, children: Children) -> None:
    """With `lead --review cmd:...` running: exit 0 approved, 3 rejected, with feedback."""
    review = "cmd:grep -q test && echo 'ship it' || { echo 'add a test step'; exit 1; }"
    children.ralph(team.home, "lead", "--team", "demo", "--review", review)
    as_worker = ("--team", "demo", "--agent", "worker-1")
    rejected = children.ralph(
        team.home, "plan", "submit", "1. parse", "--wait", str(BOUND_S), *as_worker
    )
    assert rejected.finish() == 3 and rejected.output == "add a test step"
    approved = children.ralph(
        team.home, "plan", "submit", "1. parse 2. test", "--wait", str(BOUND_S), *as_worker
    )
    assert approved.finish() == 0 and approved.output == "ship it"


def test_plan_submit_json_prints_the_approval(team: Team, children: Children) -> None:
    """plan submit --wait --json prints the lead's plan_approval envelope."""
    children.ralph(team.home, "lead", "--team", "demo", "--review", "reject")
    waiter = children.ralph(
        team.home, "plan", "submit", "x", "--wait", str(BOUND_S), "--json",
        "--team", "demo", "--agent", "worker-2",
    )  # fmt: skip
    assert waiter.finish() == 3
    answer = orjson.loads(waiter.output)
    assert answer["type"] == "plan_approval" and answer["metadata"]["approved"] == "false"


def test_a_hanging_review_command_rejects_within_its_timeout(
    team: Team, children: Children
) -> None:
    """A cmd: review that hangs is a rejection saying it timed out, and the lead goes on."""
    children.ralph(
        team.home, "lead", "--team", "demo", "--review", "cmd:sleep 600", "--review-timeout", "0.3"
    )
    waiter = children.ralph(
        team.home,
        "plan",
        "submit",
        "x",
        "--wait",
        str(BOUND_S),
        "--team",
        "demo",
        "--agent",
        "worker-1",
    )
    assert waiter.finish() == 3 and "timed out after 0.3s" in waiter.output


# -- assign ------------------------------------------------------------------------------


def test_assign_sends_from_the_lead_whoever_i_am(cli) -> None:  # type: ignore[no-untyped-def]
    """assign sends a task_assignment from the team's lead, even with RALPH_AGENT a worker."""
    result = cli("assign", "worker-2", "T-2", "write the report")
    [task] = unread("worker-2")
    assert result.code == 0 and result.out == f"{task.id}\n"
    assert (task.from_agent, task.type, task.content) == (
        "lead",
        "task_assignment",
        "write the report",
    )
    assert task.metadata == {"taskId": "T-2"}


def test_assign_to_a_stranger_is_refused(cli) -> None:  # type: ignore[no-untyped-def]
    """assign to an unknown agent is exit 2 naming the members; nothing is written."""
    assert "members: lead, worker-1, worker-2" in one_line_error(
        cli("assign", "wrker-2", "T-2", "x")
    )
    assert unread("worker-2") == []


# -- shutdown request and respond --------------------------------------------------------


def test_shutdown_request_all_prints_one_id_per_teammate(cli) -> None:  # type: ignore[no-untyped-def]
    """shutdown request --all (no --wait) sends every teammate a request, from the lead."""
    result = cli("shutdown", "request", "--all", "--reason", "release is out")
    sent = [unread(name)[0] for name in ("worker-1", "worker-2")]
    assert result.code == 0 and result.out == "".join(f"{m.id}\n" for m in sent)
    assert {(m.from_agent, m.type, m.content) for m in sent} == {
        ("lead", "shutdown_request", "release is out")
    }


@pytest.mark.parametrize(
    "args, fragment",
    [
        ([], "or pass --all"),
        (["worker-1", "--all"], "or pass --all"),
        (["worker-1", "stranger"], "unknown agent 'stranger'"),
        (["lead"], "the lead itself"),
        (["worker-1", "--wait", "-1"], "invalid --wait"),
    ],
)
def test_shutdown_request_refuses_bad_targets_and_sends_nothing(
    cli, args: list[str], fragment: str
) -> None:  # type: ignore[no-untyped-def]
    """No target, both forms, a stranger, the lead or a bad wait: exit 2, nothing sent."""
    assert fragment in one_line_error(cli("shutdown", "request", *args))
    assert unread("worker-1") == [] and unread("worker-2") == []


def test_shutdown_respond_answers_a_request_already_read(cli) -> None:  # type: ignore[no-untyped-def]
    """respond finds the newest request even after `read` consumed it, and answers it."""
    MessageBus("demo", "lead").send("worker-1", "shutdown_request", "old")
    newest = MessageBus("demo", "lead").send("worker-1", "shutdown_request", "new")
    assert cli("read").code == 0
    result = cli("shutdown", "respond", "--accept", "--reason", "bye")
    [answer] = unread("lead")
    assert result.code == 0 and result.out == f"{answer.id}\n"
    assert (answer.type, answer.reply_to, answer.content) == ("shutdown_response", newest.id, "bye")
    assert answer.metadata == {"accepted": "true"}


def test_shutdown_respond_consumes_the_unread_request(cli) -> None:  # type: ignore[no-untyped-def]
    """Answering an unread request consumes it: it is not read again later."""
    MessageBus("demo", "lead").send("worker-1", "shutdown_request", "stop")
    MessageBus("demo", "worker-2").send("worker-1", "text", "hello")
    assert cli("shutdown", "respond", "--defer").code == 0
    assert [m.content for m in unread("worker-1")] == ["hello"]


@pytest.mark.parametrize(
    "flag, metadata, reason",
    [
        ("--accept", {"accepted": "true"}, "shutting down"),
        ("--reject", {"accepted": "false"}, "no"),
        ("--defer", {"accepted": "false", "deferred": "true"}, "finishing current task"),
    ],
)
def test_shutdown_respond_flags(cli, flag: str, metadata: dict[str, str], reason: str) -> None:  # type: ignore[no-untyped-def]
    """--accept, --reject and --defer set the answer's metadata, with a default reason."""
    MessageBus("demo", "lead").send("worker-1", "shutdown_request", "stop")
    assert cli("shutdown", "respond", flag).code == 0
    [answer] = unread("lead")
    assert (answer.metadata, answer.content) == (metadata, reason)


def test_shutdown_respond_needs_exactly_one_answer(cli) -> None:  # type: ignore[no-untyped-def]
    """Two answers at once (or none) is exit 2."""
    assert "exactly one" in one_line_error(cli("shutdown", "respond", "--accept", "--reject"))
    assert "exactly one" in one_line_error(cli("shutdown", "respond"))


def test_shutdown_respond_without_a_request_exits_1(cli) -> None:  # type: ignore[no-untyped-def]
    """With no request ever received, respond says so and exits 1; nothing is sent."""
    assert "nothing to answer" in one_line_error(cli("shutdown", "respond", "--accept"), 1)
    assert unread("lead") == []


def test_shutdown_request_wait_defer_then_accept_from_shell_commands(
    team: Team, children: Children
) -> None:
    """Shell style: the agent defers, is asked again, accepts; the request exits 0."""
    request = children.ralph(
        team.home, "shutdown", "request", "worker-1", "--wait", str(BOUND_S), "--retry", "0.1",
        "--team", "demo",
    )  # fmt: skip
    me = ("--team", "demo", "--agent", "worker-1")
    for answer in ("--defer", "--accept"):
        waited = children.ralph(
            team.home, "wait", "--type", "shutdown_request", "--timeout", str(BOUND_S), *me
        )
        assert waited.finish() == 0
        assert children.ralph(team.home, "shutdown", "respond", answer, *me).finish() == 0
    assert request.finish() == 0
    assert request.output.split("\t")[:2] == ["worker-1", "accepted"]


def test_shutdown_request_wait_exit_codes(team: Team, children: Children) -> None:
    """--wait exits 3 when one refused (even if another did not answer), 1 on no answer."""
    worker = MessageBus("demo", "worker-1")
    request = children.ralph(
        team.home, "shutdown", "request", "--all", "--wait", "1", "--team", "demo"
    )
    asked = worker.wait_for_message(MessageType.SHUTDOWN_REQUEST, timeout=BOUND_S)
    assert asked is not None
    worker.send("lead", "shutdown_response", "never", {"accepted": "false"}, reply_to=asked.id)
    assert request.finish() == 3
    assert request.output.splitlines() == [
        "worker-1\trefused\tnever",
        "worker-2\tno answer\tno answer by the deadline",
    ]
    silent = children.ralph(
        team.home, "shutdown", "request", "worker-2", "--wait", "0.2", "--team", "demo"
    )
    assert silent.finish() == 1


# -- lead --------------------------------------------------------------------------------


def test_lead_prints_one_plain_line_per_event_and_answers_malformed_status(
    team: Team, children: Children
) -> None:
    """Piped, lead prints a line per event; a status without state gets an error reply."""
    lead = children.ralph(team.home, "lead", "--team", "demo")
    worker = MessageBus("demo", "worker-1")
    # Written as another program would: the Gate refuses to send it.
    bad = worker._deliver(worker.envelope("lead", MessageType.STATUS_UPDATE, "no state here", None))
    worker.send("lead", MessageType.STATUS_UPDATE, "parsing", {"state": "working", "task": "T-1"})
    assert "worker-1 error status_update" in lead.expect("no metadata.state")
    assert lead.expect("worker-1 status").endswith("working T-1 parsing")
    error = worker.wait_for_message(MessageType.TEXT, timeout=BOUND_S)
    assert error is not None and error.reply_to == bad.id and "--state" in error.content


def test_lead_stops_cleanly_on_sigterm(team: Team, children: Children) -> None:
    """SIGTERM stops the lead with exit 0, 'lead stopped' and no traceback."""
    lead = children.ralph(team.home, "lead", "--team", "demo")
    MessageBus("demo", "worker-1").send("lead", "status_update", "up", {"state": "idle"})
    lead.expect("worker-1 status")  # the lead is in its loop
    lead.popen.send_signal(signal.SIGTERM)
    assert lead.finish() == 0
    assert lead.expect("lead stopped") and "Traceback" not in lead.stderr_text()


def test_lead_stops_cleanly_on_ctrl_c(team: Team, children: Children) -> None:
    """SIGINT (Ctrl-C) stops the lead with exit 0, without a traceback."""
    lead = children.ralph(team.home, "lead", "--team", "demo")
    MessageBus("demo", "worker-1").send("lead", "status_update", "up", {"state": "idle"})
    lead.expect("worker-1 status")
    lead.popen.send_signal(signal.SIGINT)
    assert lead.finish() == 0 and "Traceback" not in lead.stderr_text()


def _reviewing(team: Team, children: Children, review: str) -> tuple[Child, Child]:
    """A lead reviewing with ``review``, and worker-1 waiting for its plan's answer."""
    lead = children.ralph(team.home, "lead", "--team", "demo", "--review", review)
    waiter = children.ralph(
        team.home, "plan", "submit", "1. test", "--wait", str(BOUND_S),
        "--team", "demo", "--agent", "worker-1",
    )  # fmt: skip
    return lead, waiter


def test_a_stopped_lead_first_finishes_the_review_in_hand(
    team: Team, children: Children, tmp_path: Path
) -> None:
    """SIGTERM while a plan is being reviewed: the lead answers that plan, then stops
    (exit 0, 'lead stopped'); the stop is a flag the loop looks at, not an exception
    raised wherever the lead happens to be."""
    review, said, let_go = held_job(tmp_path, "ship it")
    try:
        lead, waiter = _reviewing(team, children, f"cmd:{review}")
        assert readable(said, BOUND_S)  # the review runs
        lead.popen.send_signal(signal.SIGTERM)
        os.write(let_go, b"go\n")
        assert waiter.finish() == 0 and waiter.output == "ship it"
        assert lead.finish() == 0
        assert lead.expect("lead stopped") and "Traceback" not in lead.stderr_text()
    finally:
        os.close(said)
        os.close(let_go)


def test_a_second_signal_stops_the_lead_at_once(
    team: Team, children: Children, tmp_path: Path
) -> None:
    """A second SIGTERM stops the lead in the middle of a review (exit 0): the plan stays
    unanswered, to be reviewed on the lead's next start."""
    review, said, let_go = held_job(tmp_path, "ship it")
    try:
        lead, waiter = _reviewing(team, children, f"cmd:{review}")
        assert readable(said, BOUND_S)  # the review runs, and is never let go
        assert signal_until_ended(lead.popen, signal.SIGTERM) == 0
        assert lead.finish() == 0 and "Traceback" not in lead.stderr_text()
        assert waiter.popen.poll() is None  # still waiting: no answer to the plan
    finally:
        os.close(said)
        os.close(let_go)


def test_a_stop_signal_sets_the_flag_first_and_raises_after() -> None:
    """`stopped_by_signals`: the first Ctrl-C or SIGTERM sets the flag and returns; a
    second raises KeyboardInterrupt, as does the first while ``now()`` is true; the
    handlers there were come back after the block."""
    from ralph_mail.cli.stopping import stopped_by_signals

    before = signal.getsignal(signal.SIGTERM)
    with stopped_by_signals() as stop:
        signal.raise_signal(signal.SIGTERM)
        assert stop.is_set()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before
    with stopped_by_signals(lambda: True) as stop, pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
    assert not stop.is_set()


def test_lead_json_prints_one_event_object_per_line(team: Team, children: Children) -> None:
    """lead --json prints each event as a JSON object naming kind, agent and message id."""
    lead = children.ralph(team.home, "lead", "--team", "demo", "--json")
    sent = MessageBus("demo", "worker-2").send("lead", "status_update", "x", {"state": "done"})
    event = orjson.loads(lead.expect('"kind":"status"'))
    assert (event["agent"], event["id"]) == ("worker-2", sent.id)


def test_lead_until_done_shuts_the_team_down(team: Team, children: Children) -> None:
    """lead --until-done asks everyone to stop once all are done; exit 0 when all accept."""
    workers = [
        children.program(team.home, "worker", "demo", name) for name in ("worker-1", "worker-2")
    ]
    lead = children.ralph(team.home, "lead", "--team", "demo", "--until-done")
    for name in ("worker-1", "worker-2"):
        MessageBus("demo", "lead").send(name, "task_assignment", "go", {"taskId": f"T-{name}"})
    assert lead.finish() == 0
    assert "shutdown: worker-1 accepted, worker-2 accepted" in lead.output
    assert all(worker.finish() == 0 for worker in workers)


def test_lead_until_done_times_out_with_exit_1(team: Team, children: Children) -> None:
    """lead --until-done --timeout exits 1 when the team is not done by then."""
    lead = children.ralph(team.home, "lead", "--team", "demo", "--until-done", "--timeout", "0.2")
    assert lead.finish() == 1 and "not done within 0.2s" in lead.output


def test_lead_restarted_answers_every_plan_exactly_once(team: Team, children: Children) -> None:
    """A `ralph-mail lead` killed -9 and restarted loses no plan and answers none twice."""
    worker = MessageBus("demo", "worker-1")
    plans = [worker.send("lead", "plan_submission", f"plan {n}") for n in range(100)]
    first = children.ralph(team.home, "lead", "--team", "demo")
    first.expect("plan_approved")
    first.popen.kill()
    first.popen.wait(timeout=BOUND_S)
    plans.append(worker.send("lead", "plan_submission", "after the crash"))
    second = children.ralph(team.home, "lead", "--team", "demo")

    def approvals() -> list[Message]:
        return of_type(inbox_messages(team.store.root, "worker-1"), MessageType.PLAN_APPROVAL)

    deadline = time.monotonic() + BOUND_S
    while len(approvals()) < len(plans):
        assert time.monotonic() < deadline, second.output
        worker.wait_for_messages(timeout=1.0)  # woken by each approval
    assert sorted(a.reply_to or "" for a in approvals()) == sorted(p.id for p in plans)


@pytest.mark.parametrize(
    "review, fragment",
    [
        ("prompt", "there is none"),
        ("maybe", "invalid --review 'maybe'"),
        ("cmd:", "invalid --review"),
    ],
)
def test_lead_refuses_a_review_policy_it_cannot_run(cli, review: str, fragment: str) -> None:  # type: ignore[no-untyped-def]
    """--review prompt without a terminal, or an unknown policy, is exit 2 before starting."""
    assert fragment in one_line_error(cli("lead", "--review", review))


def test_prompt_review_asks_and_uses_the_answers(capsys: pytest.CaptureFixture[str]) -> None:
    """The prompt policy shows the plan, approves on 'y' and passes the feedback on."""
    answers = iter(["n", "split step 2"])
    questions: list[str] = []

    def ask(question: str, default: str) -> str:
        questions.append(question)
        return next(answers)

    fake = Message("0123456789ab", "worker-1", "lead", MessageType.PLAN_SUBMISSION, "1. all")
    verdict = prompt_reviewer(ask)(Plan("worker-1", "1. all", "T-1", fake))
    assert verdict == (False, "split step 2")
    assert "plan from worker-1 for T-1:\n1. all" in capsys.readouterr().out
    assert questions == ["approve? (y/n)", "feedback"]


def test_protocol_commands_have_help_with_an_example(cli) -> None:  # type: ignore[no-untyped-def]
    """Each protocol command's --help ends with an example of that command."""
    commands = [
        ["status"], ["plan", "submit"], ["assign"], ["shutdown", "request"],
        ["shutdown", "respond"], ["lead"], ["demo"],
    ]  # fmt: skip
    for command in commands:
        result = cli(*command, "--help")
        example = result.out.rsplit("Example:", 1)[1]
        assert result.code == 0 and f"ralph-mail {' '.join(command)}" in example, command


def test_lead_shows_a_live_table_on_a_terminal(team: Team, children: Children) -> None:
    """On a terminal, lead draws a live table of the agents; SIGTERM still stops it with 0."""
    lead = Terminal(
        children,
        [sys.executable, "-m", "ralph_mail", "lead", "--team", "demo"],
        ralph_env(team.home),
    )
    MessageBus("demo", "worker-1").send("lead", "status_update", "parsing", {"state": "working"})
    lead.expect("parsing")
    lead.popen.send_signal(signal.SIGTERM)
    assert lead.finish() == 0
    assert "team demo: lead lead" in lead.screen and " agent " in lead.screen
    assert "worker-1" in lead.screen and "working" in lead.screen
    assert "lead stopped" in lead.screen and "Traceback" not in lead.screen


def test_lead_prompt_review_asks_the_person_at_the_terminal(team: Team, children: Children) -> None:
    """--review prompt shows the plan on the terminal; the answers decide and give feedback."""
    lead = Terminal(
        children,
        [sys.executable, "-m", "ralph_mail", "lead", "--team", "demo", "--review", "prompt"],
        ralph_env(team.home),
    )
    waiter = children.ralph(
        team.home, "plan", "submit", "1. rewrite everything", "--wait", str(BOUND_S),
        "--team", "demo", "--agent", "worker-1",
    )  # fmt: skip
    lead.expect("approve? (y/n)")
    assert "plan from worker-1:" in lead.screen and "1. rewrite everything" in lead.screen
    lead.type("n\r")
    lead.expect("feedback")
    lead.type("too big: split it\r")
    assert waiter.finish() == 3 and waiter.output == "too big: split it"
    lead.popen.send_signal(signal.SIGTERM)
    assert lead.finish() == 0


def test_the_live_table_fits_80_columns_with_every_column(team: Team) -> None:
    """At 80 columns the lead's table keeps every column, 'last' included, one line a row;
    events print above it, where they stay."""
    from rich.console import Console

    from ralph_mail.cli import lead as cli_lead
    from ralph_mail.orchestrator import AgentProgress, TeamOrchestrator

    orch = TeamOrchestrator("demo")
    for name in ("worker-1", "worker-2"):
        orch.progress[name] = AgentProgress(
            name, "working", "T-1", 0.5, "a long status text " * 5, "2026-11-23T10:00:00.000000Z",
            "rejected", "requested",
        )  # fmt: skip
    console = Console(width=80, record=True, force_terminal=True)
    console.print(cli_lead._render(orch, deque()))
    text = console.export_text()
    header = next(line for line in text.splitlines() if "agent" in line)
    assert all(name in header for name in ("state", "task", "progress", "plan", "last", "seen"))
    assert "a long status" in text  # "last" keeps room for what the agent said
    assert sum("worker-" in line for line in text.splitlines()) == 2
    assert max(len(line) for line in text.splitlines()) <= 80
    orch.close()
