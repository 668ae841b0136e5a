"""``ralph-mail run``: a command answers as an agent (see `ralph_mail.runner`)."""

from __future__ import annotations

from typing import Annotated

from ralph_mail.cli import error_line
from ralph_mail.cli.app import Agent, Home, TeamName, app, command, identity
from ralph_mail.cli.command import Argument, Option
from ralph_mail.cli.stopping import stopped_by_signals


@app.command("run")
def run(
    argv: Annotated[
        list[str], Argument(help="The command and its arguments, after '--'.", metavar="COMMAND")
    ],
    jobs: Annotated[
        int, Option("--jobs", help="Runs at once (at most 256).", metavar="N", most=256)
    ] = 4,
    timeout: Annotated[
        float,
        Option("--timeout", help="Kill a run (and all it started) after S seconds.", metavar="S"),
    ] = 120.0,
    history: Annotated[
        int,
        Option(
            "--history", help="Messages of the conversation given before a request.", metavar="N"
        ),
    ] = 20,
    format: Annotated[
        str,
        Option("--format", help="stdin: text (headed as the seeds show it) or json.", metavar="F"),
    ] = "text",
    home: Home = None,
    team: TeamName = None,
    agent: Agent = None,
) -> None:
    """Answer as AGENT with a command: each request, delegation and channel mention runs it
    once, with the conversation on its stdin; its stdout is the reply, the task's result or
    the answer in the channel (a non-zero exit or a timeout sends the error; a mention's
    turn passes). One line per job on stderr. Ctrl-C or SIGTERM: finish running jobs,
    go offline, exit 0; a second one stops at once (exit 130).

    \b
    Example:
      ralph-mail run --team demo --agent analyst -- claude -p
      ralph-mail run --team demo --agent writer --jobs 2 -- ./answer.sh
    """

    def action() -> int:
        from ralph_mail.runner import Runner

        who = identity(home, team, agent)
        with (
            stopped_by_signals() as stop,
            Runner(who.need_team(), who.need_agent(), argv or [], home, jobs=jobs,
                   timeout=timeout, history=history, format=format) as runner,
        ):  # fmt: skip

            def ready() -> None:
                error_line(f"{runner.bus.agent} answers with {argv[0]} (jobs {jobs}, "
                           f"timeout {timeout:g} s); Ctrl-C stops", "note")  # fmt: skip

            runner.serve(stop, ready)  # once stopped, running jobs finish, then it returns
        return 0

    command(action)
