"""How messages and tables look: rich on a terminal, plain text in a pipe, JSON on request.

What is shown is escaped: a message is data from another process, and control
characters in it (clear screen, a window title, an OSC 52 clipboard write, a carriage
return that overwrites a line, a bidi override) must not reach the terminal raw, nor a
newline in metadata forge a second message line. ``--json`` stays the exact envelope.
"""

from __future__ import annotations

import io
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from ralph_mail.message import Message, encode
from ralph_mail.signing import seal

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


#: C0 and C1 controls but newline and tab, DEL, and the Unicode line separators and
#: bidi overrides that can make shown text lie about what it is.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def safe(text: str, *, newlines: bool = True) -> str:
    """``text`` with every control character shown as an escape (``\\x1b``); with
    ``newlines=False`` newlines and tabs too (for one-line fields such as metadata).

    >>> safe("a\x1b[2Jb"), safe("x\ny", newlines=False)
    ('a\\x1b[2Jb', 'x\\ny')
    """
    if text.isprintable():  # none of them (nor a newline or tab): the common case, fast
        return text
    text = _UNSAFE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256
                       else f"\\u{ord(m.group()):04x}", text)  # fmt: skip
    if not newlines:
        text = text.replace("\n", "\\n").replace("\t", "\\t")
    return text


def plain_line(message: Message) -> str:
    """One message as one line of text (continuation lines of the body are indented)."""
    kind = str(message.type)
    for shown in (message.priority != "normal" and message.priority,
                  message.visibility != "internal" and message.visibility,
                  message.ack and "ack", seal(message)):  # fmt: skip
        if shown:
            kind += f" {shown}"
    parts = [message.ts, message.from_agent, "->", message.to_agent, f"[{kind}]"]
    line = (
        safe(" ".join(parts), newlines=False) + " " + safe(message.content).replace("\n", "\n    ")
    )
    if message.metadata:
        pairs = ", ".join(f"{k}={v}" for k, v in message.metadata.items())
        line += " {" + safe(pairs, newlines=False) + "}"
    if message.reply_to:
        line += f" (re {safe(message.reply_to, newlines=False)})"
    return line + f" #{safe(message.id, newlines=False)}"


#: How a mailbox hands messages on (`Consuming.hand_on`): the messages and what writes one.
HandOn = Callable[[list[Message], Callable[[Message], object]], object]


def deliver(
    messages: Iterable[Message],
    json_out: bool = False,
    commit: Callable[[Message], object] | None = None,
    hand_on: HandOn | None = None,
) -> int:
    """Print ``messages`` one at a time, each written out before the next, and consume
    through the last one that went out: a reader that goes away (``| head``) or an
    output that fails (a full disk, a closed stdout) consumes only what it got.

    With ``hand_on`` (a mailbox's `hand_on`) they are consumed before the first is
    printed, so nothing is printed that is not consumed: a consuming that fails (a store
    out of reach) prints nothing, and an output that fails gives back what it did not
    write. Else ``commit`` (when given) follows the printing.

    Returns 0, or 141 when the reader went away.
    """
    shown = list(messages)
    written: list[Message] = []
    if hand_on is not None:  # consumed as they are handed on: nothing to commit after
        commit = None

    def write(message: Message) -> None:
        _write_out(message, json_out)
        written.append(message)

    from ralph_mail.errors import MailError

    try:
        if hand_on is not None:
            hand_on(shown, write)
        else:
            for message in shown:
                write(message)
    except BrokenPipeError:
        _commit(commit, written)
        from ralph_mail.cli import EXIT_BROKEN_PIPE, _silence_stdout

        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except MailError as exc:  # (before anything was written: consuming failed)
        raise MailError(f"could not consume the messages ({exc}): nothing was shown, they "
                        "stay unread") from None  # fmt: skip
    except (OSError, ValueError, AttributeError) as exc:
        _commit(commit, written)
        reason = getattr(exc, "strerror", None) or "it is closed"
        raise MailError(
            f"cannot write to standard output ({reason}): the messages not shown stay unread"
        ) from None
    _commit(commit, written)
    return 0


def _commit(commit: Callable[[Message], object] | None, written: list[Message]) -> None:
    if commit is not None and written:
        commit(written[-1])


def _write_out(message: Message, json_out: bool) -> None:
    if json_out or not is_terminal():
        data = encode(message) if json_out else (plain_line(message) + "\n").encode()
        try:
            fd = sys.stdout.fileno()
        except (AttributeError, ValueError, io.UnsupportedOperation):  # not a file (a test)
            sys.stdout.write(data.decode())
            sys.stdout.flush()
            return
        sys.stdout.flush()  # anything printed before goes first
        view = memoryview(data)
        while view:  # straight to the descriptor: what returned has left this process
            view = view[os.write(fd, view) :]
        return
    print_messages([message])
    sys.stdout.flush()


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
        text.append(safe(message.ts[11:23], newlines=False), style="dim")
        text.append(f" {safe(message.from_agent, newlines=False)}", style="bold cyan")
        text.append(" → ")
        text.append(safe(message.to_agent, newlines=False), style="bold")
        text.append(f" {safe(str(message.type), newlines=False)}", style="magenta")
        if seal(message):
            text.append(f" {seal(message)}", style="bold red")
        text.append(f"  {safe(message.content)}")
        if message.metadata:
            meta = " ".join(f"{k}={v}" for k, v in message.metadata.items())
            text.append(f"  {safe(meta, newlines=False)}", style="yellow")
        if message.reply_to:
            text.append(f"  re {safe(message.reply_to, newlines=False)}", style="dim")
        text.append(f"  #{safe(message.id, newlines=False)}", style="dim")
        console().print(text)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A table: rich on a terminal, tab-separated lines (no header) in a pipe.

    Every cell and the title are escaped (a tab or newline too, so a cell cannot forge a
    column or a row), and none is read as rich markup: they hold stored text (a member's
    description, a reason, a presence record) that another process wrote.
    """
    cells = [[safe(cell, newlines=False) for cell in row] for row in rows]
    if not is_terminal():
        for row in cells:
            sys.stdout.write("\t".join(row) + "\n")
        sys.stdout.flush()
        return
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(safe(title, newlines=False)), title_justify="left")
    for column in columns:
        table.add_column(column)
    for row in cells:
        table.add_row(*(Text(cell) for cell in row))
    console().print(table)


def print_json_lines(records: Iterable[object]) -> None:
    """One JSON document per line."""
    from ralph_mail import codec

    out = sys.stdout.buffer
    for record in records:
        out.write(codec.dumps_line(record))
    out.flush()
