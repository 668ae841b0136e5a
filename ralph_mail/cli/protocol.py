"""The team protocols' commands: status, plan submit, assign, shutdown, lead, demo.

Each command opens one library object (`MessageBus`, `TeamAgent`, `TeamOrchestrator`),
calls one method and prints the result; the exit codes are the contract's: 0 done,
1 no answer, 2 bad input, 3 the answer was no. Lead-side commands (assign, shutdown
request, lead) always act as the team's lead, whatever ``RALPH_AGENT`` says, so that a
shell that exported a worker's identity can still drive its team.
"""

from __future__ import annotations

import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated

from ralph_mail import protocols, settings
from ralph_mail.cli import EXIT_NO, EXIT_NOTHING, EXIT_OK, error_line, say
from ralph_mail.cli.app import Agent, Home, Json, JsonRecords, TeamName, app, command, identity
from ralph_mail.cli.command import Argument, Group, Option
from ralph_mail.cli.render import console, is_terminal, print_json_lines, print_messages, safe
from ralph_mail.cli.send import read_body
from ralph_mail.errors import InvalidMessage, MailError
from ralph_mail.message import Message, MessageType, encode

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.text import Text

    from ralph_mail.bus import MessageBus
    from ralph_mail.orchestrator import Event, Plan, PlanReviewer, ShutdownReport, TeamOrchestrator

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


def _seconds(value: float | None, option: str) -> float | None:
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
        body = read_body(text, settings.max_message_bytes())
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

        limit = _seconds(wait, "--wait")
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


def _orchestrator(
    home: str | None,
    team: str | None,
    review: PlanReviewer | None = None,
    on_event: Callable[[Event], None] | None = None,
    ack_overdue: float | None = settings.ACK_OVERDUE_S,
) -> TeamOrchestrator:
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
        with _orchestrator(home, team) as orch:
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
        limit = _seconds(wait, "--wait")
        if not retry > 0:
            raise MailError(f"invalid --retry {retry}: give a number of seconds > 0")
        with _orchestrator(home, team) as orch:
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
        return _report_code(report)

    command(action)


def _report_code(report: ShutdownReport) -> int:
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


# -- lead: the orchestrator's loop with a display ------------------------------------------


#: How many recent events the live table shows under it.
_LOG_LINES = 8


class _Display:
    """Where the lead's events go: a live table on a terminal, plain or JSON lines else."""

    def __init__(self, live: bool, json_out: bool) -> None:
        self.live = live and not json_out
        self.json_out = json_out
        self.orch: TeamOrchestrator | None = None
        self.recent: deque[Event] = deque(maxlen=_LOG_LINES)
        self._live: object | None = None

    def event(self, event: Event) -> None:
        self.recent.append(event)
        if self.json_out:
            message = event.message
            print_json_lines(
                [
                    {
                        "time": _iso(event.time),
                        "kind": event.kind.value,
                        "agent": event.agent,
                        "text": event.text,
                        "id": message.id if message is not None else None,
                    }
                ]
            )
        elif not self.live:
            text = safe(f"{event.agent} {event.kind.value} {event.text}", newlines=False)
            sys.stdout.write(f"{_clock(event.time)} {text}\n")
            sys.stdout.flush()
        else:
            # Events go above the live table, into the scrollback, where they stay (the
            # plan rejection the demo is about included); the table redraws below them.
            console().print(_event_line(event), highlight=False)
            self.refresh()

    def refresh(self) -> None:
        if self._live is not None and self.orch is not None:
            from rich.live import Live

            assert isinstance(self._live, Live)
            self._live.update(_render(self.orch, self.recent), refresh=True)

    @contextmanager
    def running(self) -> Iterator[None]:
        if not self.live or self.orch is None:
            yield
            return
        from rich.live import Live

        live = Live(
            _render(self.orch, self.recent),
            console=console(),
            auto_refresh=False,
            transient=False,
        )
        self._live = live
        with live:
            yield
        self._live = None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Stop redrawing while the person at the terminal answers a question."""
        from rich.live import Live

        live = self._live
        if not isinstance(live, Live):
            yield
            return
        live.stop()
        try:
            yield
        finally:
            live.start(refresh=True)

    def say(self, text: str) -> None:
        if self.json_out:
            return
        text = safe(text, newlines=False)
        if self.live:
            from rich.text import Text

            console().print(Text(text))
        else:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()


_STATE_STYLE = {
    "idle": "cyan",
    "working": "yellow",
    "blocked": "magenta",
    "done": "green",
    "failed": "red",
    "unknown": "dim",
}


def _iso(when: float) -> str:
    """A full UTC timestamp, as the messages' ts: scripts need the date too."""
    from ralph_mail.message import format_ts

    return format_ts(int(when * 1_000_000))


def _clock(when: float, precise: bool = False) -> str:
    stamp = time.strftime("%H:%M:%S", time.gmtime(when))  # UTC, as the messages' ts
    return f"{stamp}.{int(when % 1 * 1000):03d}" if precise else stamp


def _bar(progress: float | None) -> str:
    if progress is None:
        return ""
    filled = round(progress * 5)
    return "█" * filled + "░" * (5 - filled) + f" {progress:4.0%}"


def _render(orch: TeamOrchestrator, recent: deque[Event]) -> RenderableType:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    del recent  # the events are printed above the table as they come
    rows = []
    for name in orch.teammates:
        item = orch.progress.get(name)
        if item is not None:
            cells = (name, item.state, item.task[:12], _bar(item.progress), item.plan,
                     item.shutdown, item.text, item.last_seen[11:19])  # fmt: skip
            rows.append(tuple(safe(cell, newlines=False) for cell in cells))
    columns = ("agent", "state", "task", "progress", "plan", "shutdown", "last", "seen")
    table = Table(
        title=f"team {orch.bus.team.name}: lead {orch.agent}",
        title_justify="left",
        expand=True,
        box=box.SIMPLE_HEAD,  # no vertical rules: their columns go to the text
        padding=(0, 0),
        pad_edge=False,
    )
    # Every column but "last" is as wide as its widest cell; "last" takes what is left
    # and ends in an ellipsis: the table fits an 80-column terminal with every column.
    for index, column in enumerate(columns):
        if column == "last":
            table.add_column(column, no_wrap=True, overflow="ellipsis", ratio=1)
        else:
            width = max([len(column), *(len(row[index]) for row in rows)])
            table.add_column(column, no_wrap=True, overflow="ellipsis", width=width)
    for name, state, task, bar, plan, shutdown, last, seen in rows:
        table.add_row(
            Text(name, style="bold"),
            Text(state, style=_STATE_STYLE.get(state, "")),
            Text(task),
            Text(bar),
            Text(plan, style="green" if plan == "approved" else "red"),
            Text(shutdown),
            Text(last),
            Text(seen),
        )
    return table


def _event_line(event: Event) -> Text:
    """One event as a line of the scrollback above the live table."""
    from rich.text import Text

    line = Text()
    line.append(f"{_clock(event.time)} ", style="dim")
    line.append(f"{safe(event.agent, newlines=False)} ", style="bold cyan")
    line.append(f"{event.kind.value} ", style="magenta")
    line.append(safe(event.text, newlines=False))
    return line


def _review_policy(spec: str, timeout: float, display: _Display) -> PlanReviewer:
    from ralph_mail.orchestrator import approve_all, command_reviewer, reject_all

    if spec == "auto":
        return approve_all
    if spec == "reject":
        return reject_all
    if spec == "prompt":
        if not sys.stdin.isatty():
            raise MailError("--review prompt asks at a terminal, and there is none: use cmd:")
        return prompt_reviewer(_ask_at_terminal, display)
    if spec.startswith("cmd:") and spec[4:].strip():
        return command_reviewer(spec[4:], timeout)
    raise MailError(f"invalid --review {spec!r}: use auto, reject, prompt or cmd:COMMAND")


def _ask_at_terminal(question: str, default: str) -> str:
    from rich.prompt import Prompt

    return Prompt.ask(question, default=default, console=console())


def prompt_reviewer(
    ask: Callable[[str, str], str], display: _Display | None = None
) -> PlanReviewer:
    """The ``prompt`` review policy: show the plan and ask the person at the terminal.

    ``ask(question, default)`` returns the answer (rich's prompt on a terminal). The plan
    is approved on an answer starting with "y"; the second answer is the feedback.
    """

    def review(plan: Plan) -> tuple[bool, str]:
        pause = display.paused() if display is not None else _nothing()
        with pause:
            title = f"plan from {plan.agent}" + (f" for {plan.task}" if plan.task else "")
            sys.stdout.write(f"\n{safe(title, newlines=False)}:\n{safe(plan.text)}\n")
            sys.stdout.flush()
            approved = ask("approve? (y/n)", "y").strip().lower().startswith("y")
            feedback = ask("feedback", "approved" if approved else "revise the plan")
        return approved, feedback

    return review


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@app.command("lead")
def lead(
    review: Annotated[
        str,
        Option(
            "--review",
            help="Plan review: auto, reject, prompt (ask here) or cmd:COMMAND (the plan on "
            "its stdin; exit 0 approves; its output is the feedback).",
            metavar="POLICY",
        ),
    ] = "auto",
    review_timeout: Annotated[
        float,
        Option("--review-timeout", help="A cmd: review running longer rejects.", metavar="S"),
    ] = settings.PLAN_REVIEW_TIMEOUT_S,
    until_done: Annotated[
        bool,
        Option(
            "--until-done",
            help="Once every teammate reports done (or failed), ask all to shut down and "
            "exit: 0 all accepted, 3 one refused, 1 one did not answer.",
        ),
    ] = False,
    shutdown_timeout: Annotated[
        float,
        Option("--shutdown-timeout", help="How long a shutdown waits.", metavar="S"),
    ] = settings.SHUTDOWN_TIMEOUT_S,
    timeout: Annotated[
        float | None,
        Option("--timeout", help="Stop after S seconds (exit 1 if not done).", metavar="S"),
    ] = None,
    ack_overdue: Annotated[
        float,
        Option(
            "--ack-overdue",
            help="Report a message the lead sent with --ack and nobody acknowledged after S "
            "seconds as an ack_overdue event.",
            metavar="S",
        ),
    ] = settings.ACK_OVERDUE_S,
    home: Home = None,
    team: TeamName = None,
    json: JsonRecords = False,
) -> None:
    """Run the team's lead: handle status updates, review plans, answer shutdowns,
    report task results and overdue acknowledgements.

    On a terminal it shows a live table of the agents; in a pipe it prints one line per
    event (with --json, one JSON object). Ctrl-C or SIGTERM stops it cleanly (exit 0).

    \b
    Example:
      ralph-mail lead --team demo --review 'cmd:grep -q test' --until-done
    """

    def action() -> int:
        for value, option in ((review_timeout, "--review-timeout"), (timeout, "--timeout")):
            _seconds(value, option)
        _seconds(shutdown_timeout, "--shutdown-timeout")
        _seconds(ack_overdue, "--ack-overdue")
        display = _Display(is_terminal(), json)
        policy = _review_policy(review, review_timeout, display)
        with _orchestrator(home, team, policy, display.event, ack_overdue) as orch:
            display.orch = orch
            previous = signal.signal(signal.SIGTERM, _interrupt)
            try:
                with display.running():
                    return _lead_loop(orch, display, until_done, timeout, shutdown_timeout)
            except KeyboardInterrupt:
                display.say("lead stopped")
                return EXIT_OK
            finally:
                signal.signal(signal.SIGTERM, previous)

    command(action)


def _interrupt(signum: int, frame: object) -> None:
    # SIGTERM stops the lead as Ctrl-C does: a message handled halfway is redelivered and
    # its reply recognised on the next start, so stopping anywhere is safe.
    raise KeyboardInterrupt


def _lead_loop(
    orch: TeamOrchestrator,
    display: _Display,
    until_done: bool,
    timeout: float | None,
    shutdown_timeout: float,
) -> int:
    until = (lambda o: o.all_done()) if until_done else None
    finished = orch.run(until=until, timeout=timeout)
    if not until_done:
        return EXIT_OK
    if not finished:
        display.say(f"the team was not done within {timeout:g}s")
        return EXIT_NOTHING
    display.say("every teammate is done: asking them to shut down")
    report = orch.request_shutdown(timeout=shutdown_timeout)
    display.refresh()
    words = {True: "accepted", False: "refused", None: "no answer"}
    display.say(
        "shutdown: " + ", ".join(f"{agent} {words[answer]}" for agent, answer in report.items())
    )
    return _report_code(report)


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

        _seconds(delay, "--delay")
        return run_demo(home, delay)

    command(action)
