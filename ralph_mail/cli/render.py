"""How messages and tables look: rich on a terminal, plain text in a pipe, JSON on request."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ralph_mail.message import Message, encode

if TYPE_CHECKING:
    from rich.console import Console

_console: Console | None = None


def is_terminal() -> bool:
    """Whether standard output is a terminal (then output is rich, else plain)."""
    return sys.stdout.isatty()


def console() -> Console:
    """The rich console for standard output (rich is imported only when it is needed)."""
    global _console
    if _console is None:
        from rich.console import Console

        _console = Console(highlight=False)
    return _console


def plain_line(message: Message) -> str:
    """One message as one line of text (continuation lines of the body are indented)."""
    parts = [message.ts, message.from_agent, "->", message.to_agent, f"[{message.type}]"]
    line = " ".join(parts) + " " + message.content.replace("\n", "\n    ")
    if message.metadata:
        line += " {" + ", ".join(f"{k}={v}" for k, v in message.metadata.items()) + "}"
    if message.reply_to:
        line += f" (re {message.reply_to})"
    return line + f" #{message.id}"


def print_messages(messages: Iterable[Message], json_out: bool = False) -> None:
    """Print messages: the on-disk envelope with ``json_out``, else rich or plain lines."""
    if json_out:
        out = sys.stdout.buffer
        for message in messages:
            out.write(encode(message))
        out.flush()
        return
    if not is_terminal():
        for message in messages:
            sys.stdout.write(plain_line(message) + "\n")
        sys.stdout.flush()
        return
    from rich.text import Text

    for message in messages:
        text = Text()
        text.append(message.ts[11:23], style="dim")
        text.append(f" {message.from_agent}", style="bold cyan")
        text.append(" → ")
        text.append(message.to_agent, style="bold")
        text.append(f" {message.type}", style="magenta")
        text.append(f"  {message.content}")
        if message.metadata:
            meta = " ".join(f"{k}={v}" for k, v in message.metadata.items())
            text.append(f"  {meta}", style="yellow")
        if message.reply_to:
            text.append(f"  re {message.reply_to}", style="dim")
        text.append(f"  #{message.id}", style="dim")
        console().print(text)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A table: rich on a terminal, tab-separated lines (no header) in a pipe."""
    if not is_terminal():
        for row in rows:
            sys.stdout.write("\t".join(row) + "\n")
        sys.stdout.flush()
        return
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    console().print(table)


def print_json_lines(records: Iterable[object]) -> None:
    """One JSON document per line."""
    import orjson

    out = sys.stdout.buffer
    for record in records:
        out.write(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))
    out.flush()
