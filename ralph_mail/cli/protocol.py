"""The team protocols' commands: status, plan submit, assign, shutdown, demo (``lead``,
the orchestrator's loop with its display, is `ralph_mail.cli.lead`).

Each command opens one library object (`MessageBus`, `TeamAgent`, `TeamOrchestrator`),
calls one method and prints the result; the exit codes are the contract's: 0 done,
1 no answer, 2 bad input, 3 the answer was no. Lead-side commands (assign, shutdown
request, lead) always act as the team's lead, whatever ``RALPH_AGENT`` says, so that a
shell that exported a worker's identity can still drive its team.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

from ralph_mail import protocols, settings
from ralph_mail.cli import EXIT_NO, EXIT_NOTHING, EXIT_OK, error_line, say
from ralph_mail.cli.app import Agent, Home, Json, TeamName, app, command, identity
from ralph_mail.cli.command import Argument, Group, Option
from ralph_mail.cli.render import print_json_lines, print_messages, safe
from ralph_mail.cli.send import read_body
from ralph_mail.errors import InvalidMessage, MailError
from ralph_mail.message import Message, MessageType, encode

if TYPE_CHECKING:
    from ralph_mail.bus import MessageBus
    from ralph_mail.orchestrator import Event, PlanReviewer, ShutdownReport, TeamOrchestrator

plan_app = Group(
    help=(
        "Submit a plan to the lead and wait for its approval.\n\n"
        "\b\nExample:\n  ralph-mail plan submit '1. parse 2. test' --task T-1 --wait 60"
    ),
)
app.add_group(plan_app, "plan")

shutdown_app = Group(
    help=(
        "Ask teammates to shut down (the lead), or answer such a request (a teammate).\n\n"
        "\b\nExample:\n  ralph-mail shutdown request --all --wait 30\n"
        "  ralph-mail shutdown respond --accept --reason 'idle'"
    ),
)
app.add_group(shutdown_app, "shutdown")

Seconds = Annotated[
    float | None,
    Option("--wait", help="Wait up to S seconds for the answer.", metavar="S"),
]


def check_seconds(value: float | None, option: str) -> float | None:
    """``value``, if it is a number of seconds >= 0 (or None); `MailError` otherwise."""
    if value is not None and not value >= 0:  # also refuses nan
        raise MailError(f"invalid {option} {value}: give a number of seconds >= 0")
    return value


def _print_sent(messages: list[Message], json_out: bool) -> None:
    # The messages are delivered: an output that is gone must not make this fail.
    if json_out:
        say("".join(encode(message).decode() for message in messages))
    else:
        say("".join(f"{message.id}\n" for message in messages))


# -- a teammate's commands -----------------------------------------------------------------


@app.command("status")
def status(
    text: Annotated[str, Argument(help="What I am doing; '-': standard input.")],
    state: Annotated[
        str,
        Option("--state", "-s", help="idle, working, blocked, done or failed."),
    ] = "working",
    task: Annotated[str | None, Option("--task", help="The task it is about.")] = None,
    progress: Annotated[
        str | None,
        Option("--progress", "-p", help="How far: a fraction from 0 to 1.", metavar="P"),
    ] = None,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
    json: Json = False,
) -> None:
    """Send the lead a status update; prints its id.

    \b
    Example:
      ralph-mail status 'parsed half the logs' --state working --task T-1 --progress 0.5
    """

    def action() -> None:
        metadata = protocols.status_metadata(state, task, progress)
        body = read_body(text, settings.max_message_bytes(), empty_ok=True)
        bus = identity(home, team, agent).bus()
        try:
            message = bus.send(bus.team.lead, MessageType.STATUS_UPDATE, body, metadata)
        finally:
            bus.close()
        _print_sent([message], json)

    command(action)


@plan_app.command("submit")
def plan_submit(
    plan: Annotated[
        str | None,
        Argument(help="The plan; '-' or omitted with a pipe: standard input."),
    ] = None,
    task: Annotated[str | None, Option("--task", help="The task it is for.")] = None,
    wait: Seconds = None,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
    json: Json = False,
) -> None:
    """Submit a plan to the lead. With --wait, print the lead's feedback and exit 0 if
    approved, 3 if rejected, 1 if no answer came; without, print the plan's id.

    \b
    Example:
      ralph-mail plan submit '1. parse 2. run the tests' --task T-1 --wait 60
    """

    def action() -> int:
        from ralph_mail.agent import TeamAgent

        limit = check_seconds(wait, "--wait")
        body = read_body(plan, settings.max_message_bytes())
        if not body.strip():
            raise InvalidMessage("empty plan: give the steps you intend to take")
        who = identity(home, team, agent)
        with TeamAgent(who.need_team(), who.need_agent(), home) as teammate:
            decision = teammate.submit_plan(body, task=task, wait=limit or 0)
        if limit is None:
            _print_sent([decision.submission], json)
            return EXIT_OK
        if decision.answer is None:
            error_line(f"no answer to plan {decision.submission.id} within {limit:g}s")
            return EXIT_NOTHING
        if json:
            print_messages([decision.answer], json_out=True)
        else:
            sys.stdout.write(safe(decision.feedback) + "\n")
        return EXIT_OK if decision.approved else EXIT_NO

    command(action)


@shutdown_app.command("respond")
def shutdown_respond(
    accept: Annotated[bool, Option("--accept", help="I will stop.")] = False,
    reject: Annotated[bool, Option("--reject", help="I refuse, for good.")] = False,
    defer: Annotated[
        bool, Option("--defer", help="Not yet (busy): the lead asks again later.")
    ] = False,
    reason: Annotated[str | None, Option("--reason", "-r", help="Why.")] = None,
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
    json: Json = False,
) -> None:
    """Answer the newest shutdown request in my inbox, even one `read` already consumed.

    Prints the answer's id; exits 1 when no request ever came.

    \b
    Example:
      ralph-mail shutdown respond --accept --reason 'idle, shutting down'
      ralph-mail shutdown respond --defer --reason 'finishing current task'
    """

    def action() -> int:
        if accept + reject + defer != 1:
            raise MailError("say exactly one of --accept, --reject or --defer")
        bus = identity(home, team, agent).bus()
        try:
            request = _newest_request(bus)
            if request is None:
                error_line(f"no shutdown request in {bus.agent}'s inbox: nothing to answer")
                return EXIT_NOTHING
            content, metadata = protocols.shutdown_answer(accept, defer, reason)
            answer = bus.send(
                request.from_agent,
                MessageType.SHUTDOWN_RESPONSE,
                content,
                metadata,
                reply_to=request.id,
            )
        finally:
            bus.close()
        _print_sent([answer], json)
        return EXIT_OK

    command(action)


def _newest_request(bus: MessageBus) -> Message | None:
    """The newest shutdown request of my inbox: unread ones are consumed (they are being
    answered now); with none unread, the newest one already read, looked up from the end."""
    from ralph_mail.talk.history import History

    newest = None
    while (unread := bus.wait_for_message(MessageType.SHUTDOWN_REQUEST, timeout=0)) is not None:
        newest = unread
    if newest is not None:
        return newest
    view = History(bus.team.name, [bus.agent], bus.team.home)
    try:
        recent = view.last(settings.RESPOND_LOOKBACK_LINES)
    finally:
        view.close()
    requests = [m for m in recent if m.type == MessageType.SHUTDOWN_REQUEST]
    return requests[-1] if requests else None


# -- the lead's commands ---------------------------------------------------------------------


def open_orchestrator(
    home: str | None,
    team: str | None,
    review: PlanReviewer | None = None,
    on_event: Callable[[Event], None] | None = None,
    ack_overdue: float | None = settings.ACK_OVERDUE_S,
) -> TeamOrchestrator:
    """The team's lead (whatever ``RALPH_AGENT`` says), for a lead-side command."""
    from ralph_mail.orchestrator import TeamOrchestrator

    return TeamOrchestrator(identity(home, team, None).need_team(), home, review_plan=review,
                            on_event=on_event, ack_overdue=ack_overdue)  # fmt: skip


@app.command("assign")
def assign(
    agent_name: Annotated[str, Argument(help="Who gets the task.", metavar="AGENT")],
    task_id: Annotated[str, Argument(help="The task's id, e.g. T-1.")],
    description: Annotated[
        str | None,
        Argument(help="What to do; '-' or omitted with a pipe: standard input."),
    ] = None,
    home: Home = None,
    team: TeamName = None,
    json: Json = False,
) -> None:
    """Send a teammate a task, from the team's lead; prints the assignment's id.

    \b
    Example:
      ralph-mail assign worker-1 T-1 'parse the logs in /var/log/app'
    """

    def action() -> None:
        body = read_body(description, settings.max_message_bytes())
        with open_orchestrator(home, team) as orch:
            message = orch.assign(agent_name, task_id, body)
        _print_sent([message], json)

    command(action)


@shutdown_app.command("request")
def shutdown_request(
    agents: Annotated[list[str] | None, Argument(help="Whom to ask.", metavar="[AGENT]...")] = None,
    everyone: Annotated[bool, Option("--all", help="Ask every teammate.")] = False,
    reason: Annotated[
        str, Option("--reason", "-r", help="Why (the request's content).")
    ] = "the work is done",
    wait: Seconds = None,
    retry: Annotated[
        float,
        Option("--retry", help="Ask an agent that deferred again after S seconds.", metavar="S"),
    ] = settings.SHUTDOWN_RETRY_S,
    home: Home = None,
    team: TeamName = None,
    json: Json = False,
) -> None:
    """Ask teammates to shut down, from the team's lead. With --wait, collect the answers
    (asking again those that defer) and exit 0 if all accepted, 3 if one refused, 1 if one
    did not answer; without, print the requests' ids.

    With --wait only shutdown responses are consumed from the lead's inbox: do not run it
    while a `ralph-mail lead` reads that inbox (the lead runs the protocol itself).

    \b
    Example:
      ralph-mail shutdown request --all --reason 'the release is out' --wait 30
      ralph-mail shutdown request worker-1 worker-2
    """

    def action() -> int:
        if bool(agents) == everyone:
            raise MailError("name the agents to ask, or pass --all (not both)")
        limit = check_seconds(wait, "--wait")
        if not retry > 0:
            raise MailError(f"invalid --retry {retry}: give a number of seconds > 0")
        with open_orchestrator(home, team) as orch:
            targets = list(orch.teammates) if everyone else list(agents or [])
            if limit is None:
                for name in targets:
                    orch.check_teammate(name)  # every name checked before anything is sent
                sent = [
                    orch.bus.send(name, MessageType.SHUTDOWN_REQUEST, reason) for name in targets
                ]
                _print_sent(sent, json)
                return EXIT_OK
            report = orch.request_shutdown(
                targets, reason, limit, retry_interval=retry, only_responses=True
            )
        _print_report(report, json)
        return report_code(report)

    command(action)


def report_code(report: ShutdownReport) -> int:
    """A shutdown's exit code: 3 if one refused, else 1 if one did not answer, else 0."""
    if report.refused:
        return EXIT_NO
    return EXIT_NOTHING if report.no_answer else EXIT_OK


def _print_report(report: ShutdownReport, json_out: bool) -> None:
    words = {True: "accepted", False: "refused", None: "no answer"}
    if json_out:
        print_json_lines(
            {"agent": agent, "answer": words[answer], "reason": report.reasons.get(agent, "")}
            for agent, answer in report.items()
        )
        return
    for agent, answer in report.items():
        reason = safe(report.reasons.get(agent, ""), newlines=False)
        sys.stdout.write(f"{safe(agent, newlines=False)}\t{words[answer]}\t{reason}\n")
    sys.stdout.flush()


# -- demo -----------------------------------------------------------------------------------


@app.command("demo")
def demo(
    home: Annotated[
        str | None,
        Option("--home", help="Keep the team's mail here [default: a temporary home]."),
    ] = None,
    delay: Annotated[
        float,
        Option("--delay", help="Seconds per simulated work step.", metavar="S"),
    ] = 0.6,
) -> None:
    """Watch a whole team work: a lead and three workers, as processes, in a temporary home.

    They take tasks, submit plans (one is rejected, revised and approved), report progress,
    and accept the shutdown; then it exits 0 and leaves no process behind.

    \b
    Example:
      ralph-mail demo
      ralph-mail demo --home /tmp/demo-mail --delay 0
    """

    def action() -> int:
        from ralph_mail.demo import run_demo

        check_seconds(delay, "--delay")
        return run_demo(home, delay)

    command(action)
