"""``ralph-mail lead``: the orchestrator's loop with a display, and its review policies.

On a terminal the lead shows a live table of the agents with its events scrolling above
it; in a pipe it prints one line per event (one JSON object with --json). The review
policies are the library's (`ralph_mail.orchestrator.review`) and ``prompt``, which asks
the person at the terminal.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated

from ralph_mail import settings
from ralph_mail.cli import EXIT_NOTHING, EXIT_OK, error_line
from ralph_mail.cli.app import Home, JsonRecords, TeamName, app, command
from ralph_mail.cli.command import Option
from ralph_mail.cli.protocol import check_seconds, open_orchestrator, report_code
from ralph_mail.cli.render import console, is_terminal, print_json_lines, safe
from ralph_mail.cli.stopping import stopped_by_signals
from ralph_mail.errors import MailError
from ralph_mail.store.outage import patient

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.text import Text

    from ralph_mail.orchestrator import Event, Plan, PlanReviewer, TeamOrchestrator
    from ralph_mail.store.flag import Flag

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
        self.asking = False  # a question waits for the person at the terminal

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
        self.asking = True
        try:
            if not isinstance(live, Live):
                yield
                return
            live.stop()
            try:
                yield
            finally:
                live.start(refresh=True)
        finally:
            self.asking = False

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
    event (with --json, one JSON object). Ctrl-C or SIGTERM stops it cleanly (exit 0) once
    what it is handling is handled; a second one, or one during a question, at once.

    \b
    Example:
      ralph-mail lead --team demo --review 'cmd:grep -q test' --until-done
    """

    def action() -> int:
        for value, option in ((review_timeout, "--review-timeout"), (timeout, "--timeout")):
            check_seconds(value, option)
        check_seconds(shutdown_timeout, "--shutdown-timeout")
        check_seconds(ack_overdue, "--ack-overdue")
        display = _Display(is_terminal(), json)
        policy = _review_policy(review, review_timeout, display)
        with (
            open_orchestrator(home, team, policy, display.event, ack_overdue) as orch,
            stopped_by_signals(lambda: display.asking) as stop,
        ):
            display.orch = orch
            # A server that goes away (a network backend's) is waited for, said once.
            until = None if timeout is None else time.monotonic() + timeout
            code = EXIT_OK
            try:
                with display.running(), patient(stop, until=until, say=_note):
                    code = _lead_loop(orch, display, until_done, timeout, shutdown_timeout, stop)
            except KeyboardInterrupt:  # (a message handled halfway comes again next time)
                stop.set()
            if stop.is_set():
                display.say("lead stopped")
                return EXIT_OK
            return code

    command(action)


def _note(line: str) -> None:
    error_line(line, "note")


def _lead_loop(
    orch: TeamOrchestrator,
    display: _Display,
    until_done: bool,
    timeout: float | None,
    shutdown_timeout: float,
    stop: Flag,
) -> int:
    until = (lambda o: o.all_done()) if until_done else None
    finished = orch.run(until=until, timeout=timeout, stop=stop)
    if not until_done or stop.is_set():
        return EXIT_OK
    if not finished:
        display.say(f"the team was not done within {timeout:g}s")
        return EXIT_NOTHING
    display.say("every teammate is done: asking them to shut down")
    report = orch.request_shutdown(timeout=shutdown_timeout, stop=stop)
    if stop.is_set():
        return EXIT_OK
    display.refresh()
    words = {True: "accepted", False: "refused", None: "no answer"}
    display.say(
        "shutdown: " + ", ".join(f"{agent} {words[answer]}" for agent, answer in report.items())
    )
    return report_code(report)
