"""Shell completion: ``ralph-mail completion bash|zsh|fish`` prints the script a shell
sources, and `complete` answers the shell each time it asks.

The protocol is argcomplete's: the script runs ``ralph-mail`` with ``_ARGCOMPLETE`` set
and the line typed so far in ``COMP_LINE``; `ralph_mail.cli.main` sees the variable and
calls `complete`, which writes the candidates to file descriptor 8 (or the file named by
``_ARGCOMPLETE_STDOUT_FILENAME``) and exits. argcomplete costs about 11 ms to import,
so it is imported here only, inside those two functions: a normal command never loads it.

The commands are dispatched by hand (`ralph_mail.cli.command.run` builds one command's
parser at a time), while argcomplete walks a single argparse parser; `completion_parser`
builds that whole tree from the same declarations, with a completer on the values worth
completing: agents and teams (read from the home, bounded, silent on any error), message
types, priorities and modes.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import textwrap
from collections.abc import Callable, Iterable
from typing import Annotated, Any

from ralph_mail.cli.app import app, command, full_app
from ralph_mail.cli.command import (
    STORING_ACTIONS,
    Argument,
    Group,
    UsageError,
    add_arguments,
    parser_settings,
)

PROG = "ralph-mail"
SHELLS = ("bash", "zsh", "fish")

#: At most this many teams are read for one completion: a TAB must answer at once, even
#: in a home that holds thousands of teams.
MAX_TEAMS = 50


@app.command("completion")
def completion(
    shell: Annotated[str, Argument(help="bash, zsh or fish.", metavar="SHELL")],
) -> None:
    """Print the script that makes a shell complete ralph-mail's commands, options,
    agents, teams and message types; source it from the shell's start-up file.

    bash: in ~/.bashrc, eval "$(ralph-mail completion bash)".
    zsh: in ~/.zshrc, after 'autoload -U compinit && compinit',
    eval "$(ralph-mail completion zsh)".
    fish: in ~/.config/fish/config.fish, ralph-mail completion fish | source.

    Agents and teams are completed from the files under the home (--home or
    RALPH_HOME), not from a NATS server.

    Example:
      eval "$(ralph-mail completion bash)"
    """
    if shell not in SHELLS:
        raise UsageError(
            f"no completion for {shell!r}: give {', '.join(SHELLS)}", "ralph-mail completion"
        )

    def action() -> None:
        from argcomplete.shell_integration import shellcode

        sys.stdout.write(shellcode([PROG], shell=shell))

    command(action)  # a closed or broken output: one line and its exit code


def complete() -> int:
    """Answer the shell's request for completions (``_ARGCOMPLETE`` is set) and exit;
    1 when argcomplete is missing (the shell then falls back to file names)."""
    try:
        from argcomplete.finders import CompletionFinder, safe_actions
    except ImportError:
        return 1
    safe_actions.update(STORING_ACTIONS)
    # Options only once a '-' is typed: after 'send ' the agents are what is wanted.
    CompletionFinder()(completion_parser(), always_complete_options=False)  # exits
    return 1  # only when _ARGCOMPLETE is not set after all


def completion_parser() -> argparse.ArgumentParser:
    """Every command as one argparse parser with sub-parsers, for argcomplete."""
    root = argparse.ArgumentParser(prog=PROG, description=_summary(app.help))
    root.add_argument("--version", "-V", action="store_true", help="Print the version.")
    _add_group(root, full_app(), (PROG,))
    return root


def _add_group(parser: argparse.ArgumentParser, group: Group, path: tuple[str, ...]) -> None:
    sub = parser.add_subparsers(metavar="COMMAND")
    for name in sorted([*group.groups, *group.commands]):
        prog = " ".join((*path, name))
        if name in group.groups:
            child = group.groups[name]
            _add_group(
                sub.add_parser(name, help=_summary(child.help), prog=prog), child, (*path, name)
            )
            continue
        fn = group.commands[name]
        leaf = sub.add_parser(
            name, help=_summary(inspect.getdoc(fn) or ""), **parser_settings(fn, prog)
        )
        add_arguments(leaf, fn)
        # Taken on any command by `ralph_mail.cli.app`, outside the command's parser.
        if "--backend" not in leaf._option_string_actions:
            leaf.add_argument("--backend", metavar="URL", help="Keep the teams on this server.")
        for action in leaf._actions:
            completer = _completer(action, (*path, name)[1:])
            if completer is not None:
                action.completer = completer  # type: ignore[attr-defined]


def _summary(text: str) -> str:
    """The first paragraph of a help text, on one line (zsh and fish show it beside
    the name)."""
    paragraph = textwrap.dedent(text).strip().split("\n\n")[0]
    return " ".join(word for word in paragraph.split() if word != "\b")


def _completer(
    action: argparse.Action, path: tuple[str, ...]
) -> Callable[..., Iterable[str]] | None:
    """What completes ``action``'s value in command ``path`` (``("team", "show")``), if
    anything cheaper and better than file names does."""
    metavar = str(action.metavar or action.dest).strip("[].").upper()
    if action.dest == "type":
        return _choices(_message_types)
    if action.dest == "priority":
        return _choices(_priorities)
    if action.dest == "mode":
        return _choices(_modes)
    if action.dest == "shell":
        return _choices(lambda: SHELLS)
    if metavar in ("AGENT", "TO", "A"):
        return _agents
    if metavar == "TEAM" or (
        path[:1] == ("team",) and action.dest == "name" and path != ("team", "create")
    ):
        return _teams
    return None


def _choices(values: Callable[[], Iterable[str]]) -> Callable[..., Iterable[str]]:
    def complete(**_: Any) -> Iterable[str]:
        return list(values())

    return complete


def _message_types() -> list[str]:
    from ralph_mail.message import MessageType

    return [kind.value for kind in MessageType]


def _priorities() -> tuple[str, ...]:
    from ralph_mail.message import PRIORITIES

    return PRIORITIES


def _modes() -> tuple[str, ...]:
    from ralph_mail.team import MODES

    return MODES


def _agents(parsed_args: argparse.Namespace | None = None, **_: Any) -> list[str]:
    """The members of the team given so far (--team or RALPH_TEAM), else of every team."""
    home, team = _where(parsed_args)
    if home is None:
        return []
    from ralph_mail.team import load_team

    names: set[str] = set()
    for name in [team] if team else _team_names(home):
        try:
            names.update(load_team(name, home, backend="").names)
        except Exception:  # a TAB never fails loudly: no team, a bad roster, no access
            continue
    return sorted(names)


def _teams(parsed_args: argparse.Namespace | None = None, **_: Any) -> list[str]:
    """The teams under the home given so far (--home or RALPH_HOME)."""
    home, _team = _where(parsed_args)
    return [] if home is None else _team_names(home)


def _where(parsed_args: argparse.Namespace | None) -> tuple[str | None, str | None]:
    """The home and team typed so far; no home when the teams are on a server (a TAB
    must not wait for the network)."""
    from ralph_mail import settings

    backend = getattr(parsed_args, "backend", None)
    if settings.backend(backend) not in ("", "file"):
        return None, None
    home = getattr(parsed_args, "home", None)
    return str(settings.home(home)), getattr(parsed_args, "team", None)


def _team_names(home: str) -> list[str]:
    from pathlib import Path

    from ralph_mail.store import backend

    try:
        return backend(Path(home), "").team_names()[:MAX_TEAMS]
    except Exception:  # an unreadable home completes nothing rather than an error
        return []
