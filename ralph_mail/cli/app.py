"""The root command, the options every command shares, and `run`.

Commands live in modules by concern (`mail`, `protocol`, `lead`, `maintenance`) and
register themselves on `app` when imported. `run` imports only the modules of the
command it is given (`MODULES`), so a one-message command does not pay for the other
forty; the root's help, and a word that names no command, import them all.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Annotated

from ralph_mail.cli import EXIT_INTERRUPTED, EXIT_USAGE, error_line, guarded
from ralph_mail.cli.command import Exit, Group, Option, UsageError
from ralph_mail.cli.command import run as run_command
from ralph_mail.cli.send import Identity

app = Group(
    help=(
        "A mailbox for teams of agents: send, read, wait for and follow messages, and "
        "run a team's lead.\n\n"
        "Identity comes from --home/--team/--agent or RALPH_HOME/RALPH_TEAM/RALPH_AGENT; "
        "--backend URL (or RALPH_BACKEND) on any command keeps the teams on a NATS "
        "server (nats://HOST:PORT) instead of files.\n\n"
        "Example:\n  ralph-mail team create demo --member lead --member worker-1\n"
        "  ralph-mail send lead 'parsing done' --team demo --agent worker-1"
    )
)

Home = Annotated[
    str | None,
    Option("--home", envvar="RALPH_HOME", help="Mailbox home [default: ~/.ralph].", metavar="DIR"),
]
TeamName = Annotated[
    str | None, Option("--team", envvar="RALPH_TEAM", help="The team.", metavar="TEAM")
]
Agent = Annotated[
    str | None, Option("--agent", envvar="RALPH_AGENT", help="Who I am.", metavar="AGENT")
]
Json = Annotated[bool, Option("--json", help="One message per line: the on-disk JSON envelope.")]
#: ``--json`` of the commands that print records other than messages (teams, events).
JsonRecords = Annotated[bool, Option("--json", help="One JSON record per line, for scripts.")]


def identity(home: str | None, team: str | None, agent: str | None) -> Identity:
    """Where and who, from the shared options (which already read the environment)."""
    return Identity(home, team, agent)


def command(action: Callable[[], int | None]) -> None:
    """Run a command body with the error mapping; leave with its exit code."""
    code = guarded(action)
    if code:
        raise Exit(code)


#: The modules that register each top-level command or group (``team`` spans two);
#: tests/cli/test_cli.py checks the table against a full registration.
MODULES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("send", "broadcast", "receipt", "read", "wait", "tail"), ("mail",)),
    "team": ("mail", "conversation"),
    **dict.fromkeys(("ask", "reply", "history", "thread", "ack", "acks"), ("conversation",)),
    **dict.fromkeys(("delegate", "task", "tasks"), ("tasks",)),
    **dict.fromkeys(("agents", "presence"), ("conversation",)),
    **dict.fromkeys(("status", "assign", "plan", "shutdown", "demo"), ("protocol",)),
    "lead": ("lead",),
    **dict.fromkeys(("approvals", "approve", "deny", "policy", "search"), ("governance",)),
    "channel": ("channels",),
    **dict.fromkeys(("mcp", "top", "serve"), ("faces",)),
    **dict.fromkeys(("doctor", "gc"), ("maintenance",)),
    "nats": ("natsauth",),
    "run": ("responder",),
    "usage": ("costs",),
    "completion": ("completion",),
    "keys": ("keys",),
    "warm": ("warm",),
}


def full_app() -> Group:
    """The app with every command registered (each command module registers on import)."""
    from ralph_mail.cli import (  # noqa: F401
        channels,
        completion,
        conversation,
        costs,
        faces,
        governance,
        keys,
        lead,
        mail,
        maintenance,
        natsauth,
        protocol,
        responder,
        tasks,
        warm,
    )

    return app


def app_for(args: Sequence[str]) -> Group:
    """The app with the command ``args`` names registered: only its modules when the
    first word is a known command, every module otherwise (help, a mistyped word)."""
    modules = MODULES.get(args[0]) if args else None
    if modules is None:
        return full_app()
    import importlib

    for module in modules:
        importlib.import_module(f"ralph_mail.cli.{module}")
    return app


def _backend_option(args: list[str]) -> list[str]:
    """``--backend URL`` (or ``--backend=URL``), taken on any command before ``--``: it
    sets ``RALPH_BACKEND`` for this process, which every entry point honours."""
    for index, arg in enumerate(args):
        if arg == "--":
            break
        if arg == "--backend" and index + 1 < len(args):
            os.environ["RALPH_BACKEND"] = args[index + 1]
            return args[:index] + args[index + 2 :]
        if arg.startswith("--backend="):
            os.environ["RALPH_BACKEND"] = arg.partition("=")[2]
            return args[:index] + args[index + 1 :]
    return args


def run(args: Sequence[str]) -> int:
    """Run the command ``args`` name; usage errors become one line and exit code 2."""
    if list(args[:1]) in (["--version"], ["-V"]):
        from importlib.metadata import version

        print(f"ralph-mail {version('ralph_mail')}")
        return 0
    for arg in args:  # bytes that are not UTF-8 reach Python as lone surrogates
        if any("\udc80" <= char <= "\udcff" for char in arg):
            shown = arg.encode("utf-8", "surrogateescape")[:40]
            error_line(f"argument {shown!r} is not UTF-8: pass names and text as UTF-8")
            return EXIT_USAGE
    try:
        args = _backend_option(list(args))
        return run_command(app_for(args), args)
    except UsageError as exc:
        error_line(f"{exc} (see '{exc.where} --help')")
        return EXIT_USAGE
    except Exit as exc:
        return exc.code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
