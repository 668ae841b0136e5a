"""The typer app: the root command, the options every command shares, and `run`.

Commands live in modules by concern (`mail`, `protocol`, `maintenance`) and register
themselves on `app` when imported; `run` imports them all.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Annotated

import typer
from typer._click.exceptions import NoArgsIsHelpError

from ralph_mail.cli import EXIT_INTERRUPTED, EXIT_USAGE, error_line, guarded
from ralph_mail.cli.send import Identity

app = typer.Typer(
    name="ralph-mail",
    help=(
        "A file-based mailbox for teams of agents: send, read, wait for and follow "
        "messages, and run a team's lead.\n\n"
        "Identity comes from --home/--team/--agent or RALPH_HOME/RALPH_TEAM/RALPH_AGENT.\n\n"
        "\b\nExample:\n  ralph-mail team create demo --member lead --member worker-1\n"
        "  ralph-mail send lead 'parsing done' --team demo --agent worker-1"
    ),
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)

Home = Annotated[
    str | None,
    typer.Option("--home", envvar="RALPH_HOME", help="Mailbox home [default: ~/.ralph]."),
]
TeamName = Annotated[str | None, typer.Option("--team", envvar="RALPH_TEAM", help="The team.")]
Agent = Annotated[str | None, typer.Option("--agent", envvar="RALPH_AGENT", help="Who I am.")]
Json = Annotated[
    bool, typer.Option("--json", help="One message per line: the on-disk JSON envelope.")
]


def identity(home: str | None, team: str | None, agent: str | None) -> Identity:
    """Where and who, from the shared options (which already read the environment)."""
    return Identity(home, team, agent)


def command(action: Callable[[], int | None]) -> None:
    """Run a command body with the error mapping; leave with its exit code."""
    code = guarded(action)
    if code:
        raise typer.Exit(code)


def full_app() -> typer.Typer:
    """The app with every command registered (each command module registers on import)."""
    from ralph_mail.cli import mail, maintenance, protocol  # noqa: F401

    return app


def run(args: Sequence[str]) -> int:
    """Run the typer app on ``args``; usage errors become one line and exit code 2."""
    click_command = typer.main.get_command(full_app())
    try:
        result = click_command.main(args=list(args), prog_name="ralph-mail", standalone_mode=False)
    except NoArgsIsHelpError as exc:  # a bare group: show its help, as a usage error
        sys.stdout.write(exc.format_message() + "\n")
        return EXIT_USAGE
    except typer.TyperException as exc:  # usage errors: a missing argument, a bad value
        context = getattr(exc, "ctx", None)
        where = context.command_path if context is not None else "ralph-mail"
        error_line(f"{exc.format_message()} (see '{where} --help')")
        return EXIT_USAGE
    except typer.Abort:
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return result if isinstance(result, int) else 0
