"""Commands declared once, in their function signatures, and parsed by argparse.

Each command is a function whose parameters are annotated with `Option` or `Argument`
(``Annotated[str | None, Option("--team", envvar="RALPH_TEAM", help=...)]``); its
docstring is its help, ending with an example. `Group` collects commands and
sub-groups; `run` finds the command named by the arguments, builds an argparse parser
for that command alone from its signature, and calls it. So parsing, ``--help`` and
usage errors come from one declaration.

Why not typer, which the first release used: typer 0.29 imports pydantic to run any
command (about 150 ms), which made `read`, `wait`, `tail` and `status` 16x slower to
start than the interpreter itself; agents call those in loops. argparse is in the
standard library and costs a few milliseconds; the annotations keep typer's style.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import math
import os
import re
import sys
import textwrap
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: The largest number an option takes unless it says otherwise: a count (``-n``,
#: ``--history``) of at most a million, a number of seconds (``--timeout``, ``--wait``)
#: of at most a year. Past them a value is a slip (milliseconds for seconds, a digit too
#: many), and far past them it would overflow sqlite, datetime or a C timeout.
MAX_COUNT = 1_000_000
MAX_SECONDS = 365 * 86400


class Option:
    """A ``--flag`` of a command: its spellings, help, metavar, environment variable and,
    for a number, the largest value it takes (default `MAX_COUNT` or `MAX_SECONDS`)."""

    def __init__(
        self, *decls: str, help: str = "", metavar: str | None = None, envvar: str | None = None,
        most: float | None = None,
    ) -> None:  # fmt: skip
        self.decls, self.help, self.metavar, self.envvar = decls, help, metavar, envvar
        self.most = most


class Argument:
    """A positional argument of a command."""

    def __init__(self, help: str = "", metavar: str | None = None) -> None:
        self.help, self.metavar = help, metavar


class Exit(Exception):
    """Leave the command with ``code``."""

    def __init__(self, code: int = 0) -> None:
        super().__init__(code)
        self.code = code


class UsageError(Exception):
    """The arguments do not fit the command; ``where`` is the command's path."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.where = where


@dataclass
class Group:
    """Commands and sub-groups under one name (the root is ``ralph-mail``)."""

    help: str = ""
    commands: dict[str, Callable[..., Any]] = field(default_factory=dict)
    groups: dict[str, Group] = field(default_factory=dict)

    def command(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Register the decorated function as command ``name``."""

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.commands[name] = fn
            return fn

        return register

    def add_group(self, group: Group, name: str) -> None:
        """Make ``group`` a sub-group called ``name``."""
        self.groups[name] = group


def confirm(question: str) -> bool:
    """Ask a yes/no question on the terminal; the default is no."""
    sys.stdout.write(f"{question} [y/N]: ")
    sys.stdout.flush()
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def close_match(word: str, choices: Sequence[str]) -> str | None:
    """The choice ``word`` most likely misspells, if one is close enough."""
    import difflib

    found = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return found[0] if found else None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):  # a mistyped option: name the one it misspells
            for word in message[len(prefix) :].split():
                option = word.partition("=")[0]
                known = [o for o in self._option_string_actions if o.startswith("--")]
                match = close_match(option, known) if option.startswith("--") else None
                if match:
                    message = f"unknown option {option!r}: did you mean {match}?"
                    break
        raise UsageError(message, self.prog)


def _number(kind: type, name: str, most: float) -> Callable[[str], Any]:
    unit = " seconds" if kind is float else ""
    too_large = f"is too large: give at most {int(most):,}{unit}"

    def parse(text: str) -> Any:
        shown = text if len(text) <= 24 else text[:20] + "..."
        try:
            value = kind(text)
        except ValueError:
            if text.strip().lstrip("+-").isdigit():  # past int()'s 4,300 digits
                raise argparse.ArgumentTypeError(f"{shown} {too_large}") from None
            raise argparse.ArgumentTypeError(f"{shown!r} is not a number") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{shown!r} is not a finite number")
        if value > most:
            raise argparse.ArgumentTypeError(f"{shown} {too_large}")
        return value

    parse.__name__ = name
    return parse


class _Scalar(argparse.Action):
    """Stores an option's one value. argparse takes ``--opt=--`` as no value at all and
    hands over an empty list, which no command expects: a usage error instead."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:  # fmt: skip
        if isinstance(values, list):
            raise argparse.ArgumentError(self, "needs a value ('--' alone is not one)")
        setattr(namespace, self.dest, values)


#: The actions of a command's parser that only store what they are given: shell
#: completion may run them to know the options typed so far (``--team``, ``--home``).
STORING_ACTIONS = (_Scalar,)


def _unwrap(hint: Any) -> tuple[type, Any]:
    """``Annotated[T | None, marker]`` -> (T, marker)."""
    marker = None
    if typing.get_origin(hint) is typing.Annotated:
        hint, *extras = typing.get_args(hint)
        marker = extras[0] if extras else None
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, __import__("types").UnionType):
        hint = args[0]
    return hint, marker


def _help_text(fn: Callable[..., Any]) -> str:
    doc = inspect.getdoc(fn) or ""
    return "\n".join(line for line in doc.splitlines() if line.strip() != "\b")


def terminal_columns() -> int:
    """The terminal's width as `shutil.get_terminal_size` finds it (``COLUMNS``, else
    stdout's terminal, else 80), without importing shutil (bz2 and lzma come with it)."""
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        columns = 0
    stdout = sys.__stdout__
    if columns <= 0 and stdout is not None:
        try:
            columns = os.get_terminal_size(stdout.fileno()).columns
        except (ValueError, OSError):  # closed, detached, or not a terminal
            columns = 0
    return columns or 80


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """argparse's formatter, told the width it would otherwise import shutil to find:
    argparse makes one per option added, so every command would pay that import."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None) -> None:  # fmt: skip
        width = terminal_columns() - 2 if width is None else width
        super().__init__(prog, indent_increment, max_help_position, width)


def build_parser(fn: Callable[..., Any], prog: str) -> argparse.ArgumentParser:
    """The argparse parser for command ``fn`` (named ``prog``), from its signature."""
    parser = _Parser(**parser_settings(fn, prog))
    add_arguments(parser, fn)
    return parser


def parser_settings(fn: Callable[..., Any], prog: str) -> dict[str, Any]:
    """What a parser for command ``fn`` is made with: its name, description and example."""
    description, example, rest = _help_text(fn).partition("Example:")
    return {
        "prog": prog,
        "description": description.rstrip(),
        "epilog": (example + rest).rstrip() or None,  # the example ends the help
        "formatter_class": _Formatter,
        "add_help": True,
        "allow_abbrev": False,
    }


@functools.cache
def parameters(fn: Callable[..., Any]) -> list[tuple[str, inspect.Parameter, Any, Any]]:
    """Each parameter of command ``fn``: its name, itself, its type and its `Option` or
    `Argument`. Read once per command: a warm server (`relay`) reads them all up front."""
    hints = typing.get_type_hints(fn, include_extras=True)
    return [(name, param, *_unwrap(hints[name]))
            for name, param in inspect.signature(fn).parameters.items()]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser, fn: Callable[..., Any]) -> None:
    """Add the options and arguments of command ``fn``'s signature to ``parser``."""
    for name, param, kind, marker in parameters(fn):
        default = None if param.default is inspect.Parameter.empty else param.default
        many = typing.get_origin(kind) is list
        if isinstance(marker, Argument):
            nargs = "*" if many else ("?" if param.default is not inspect.Parameter.empty else None)
            parser.add_argument(
                name, nargs=nargs, default=default, help=with_default(marker.help, default),
                metavar=marker.metavar or name.upper(),
            )  # fmt: skip
            continue
        assert isinstance(marker, Option), f"{fn.__name__}({name}) needs Option or Argument"
        help_text = marker.help if kind is bool else with_default(marker.help, default)
        if marker.envvar:
            help_text += f" [env: {marker.envvar}]"
            env = os.environ.get(marker.envvar)
            if env:
                default = env
        if kind is bool:
            parser.add_argument(
                *marker.decls, action="store_true", default=bool(default), dest=name,
                help=help_text,
            )  # fmt: skip
        elif many:
            parser.add_argument(
                *marker.decls, action="append", metavar=marker.metavar, dest=name,
                required=param.default is inspect.Parameter.empty, help=help_text,
            )  # fmt: skip
        else:
            convert: Callable[[str], Any] = str
            if kind in (int, float):
                most = marker.most or (MAX_COUNT if kind is int else MAX_SECONDS)
                convert = _number(kind, name, most)
            parser.add_argument(
                *marker.decls, type=convert, default=default, metavar=marker.metavar,
                dest=name, help=help_text, action=_Scalar,
            )  # fmt: skip


def with_default(help_text: str, default: Any) -> str:
    """``help_text`` ending with ``[default: X]`` when there is a real default (not None,
    not empty) and the text does not already say its own."""
    if default is None or default == "" or default == [] or "[default" in help_text:
        return help_text
    shown = f"{default:g}" if isinstance(default, float) else str(default)
    return f"{help_text} [default: {shown}]".lstrip()


def group_help(group: Group, path: str) -> str:
    """The help of a group: its text, then its commands, one line each."""
    lines = [f"usage: {path} COMMAND [ARGS]...", "", _strip_b(group.help), "", "commands:"]
    entries = [(name, summary(_strip_b(sub.help))) for name, sub in group.groups.items()]
    entries += [(name, summary(_help_text(fn))) for name, fn in group.commands.items()]
    for name, first in sorted(entries):
        # a summary too long for one line goes on under itself, never cut
        lines += textwrap.wrap(
            first, 100, initial_indent=f"  {name:<10}  ", subsequent_indent=" " * 14
        )
    lines.append("")
    lines.append(f"Run '{path} COMMAND --help' for a command's options and an example.")
    return "\n".join(lines) + "\n"


_SENTENCE = re.compile(r"(.*?[.!?])(?=\s|$)", re.S)


def summary(text: str) -> str:
    """The one-line summary of a help ``text``: the first sentence of its first
    paragraph, whole (a docstring's first line may stop mid-sentence)."""
    paragraph = " ".join(text.strip().split("\n\n")[0].split())
    found = _SENTENCE.match(paragraph)
    return found.group(1) if found else paragraph


def _strip_b(text: str) -> str:
    return "\n".join(line for line in textwrap.dedent(text).splitlines() if line.strip() != "\b")


def paths(group: Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command's path, e.g. ``("team", "create")``."""
    found = [(*prefix, name) for name in group.commands]
    for name, sub in group.groups.items():
        found += paths(sub, (*prefix, name))
    return found


def run(root: Group, args: Sequence[str], prog: str = "ralph-mail") -> int:
    """Find the command ``args`` name, parse the rest for it and call it; return its code.

    Raises `UsageError` for arguments that fit no command; --help exits 0.
    """
    group, path, index = root, [prog], 0
    while index < len(args) and args[index] in group.groups:
        group = group.groups[args[index]]
        path.append(args[index])
        index += 1
    word = args[index] if index < len(args) else None
    if word is None or word in ("-h", "--help"):
        sys.stdout.write(group_help(group, " ".join(path)))
        return 0 if word else 2  # a bare group: its help, as a usage error
    fn = group.commands.get(word)
    if fn is None:
        names = sorted([*group.commands, *group.groups])
        match = close_match(word, names)
        if match:
            message = f"unknown command {word!r}: did you mean {match!r}?"
        else:
            message = f"no command {word!r} (commands: {', '.join(names)})"
        raise UsageError(message, " ".join(path))
    path.append(word)
    parser = build_parser(fn, " ".join(path))
    try:
        namespace = parser.parse_args(list(args[index + 1 :]))
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    result = fn(**vars(namespace))
    return result if isinstance(result, int) else 0
