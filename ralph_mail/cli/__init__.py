"""The ``ralph-mail`` command line: a thin shell over the library.

Every command is declared once (`ralph_mail.cli.command`) and parsed by argparse, which
starts in milliseconds, so the commands agents call in loops (send, read, wait, tail,
status) stay close to the interpreter's own start-up.

This package is the only place where a `MailError` becomes an exit code.
"""

# PYTHON_ARGCOMPLETE_OK: argcomplete's global completion completes a console script only
# when its module says this in its first kilobyte (see ralph_mail.cli.completion).

from __future__ import annotations

import os
import signal
import sys

# Ctrl-C from here until the imports are done is held, not raised (see `main`): orjson
# 3.13 can crash when KeyboardInterrupt lands inside its import (a command that needs it
# may import it early), and a half-imported module would dump a Python error report.
# Set before anything else is imported.
_held: list[int] = []


def _hold(signum: int, frame: object) -> None:
    _held.append(signum)


try:
    _previous = signal.signal(signal.SIGINT, _hold)
except ValueError:  # not the main thread (a test importing this): nothing to hold
    _previous = None

from collections.abc import Callable, Sequence  # noqa: E402


def hold_interrupts() -> None:
    """Hold Ctrl-C again, as from this module's import until `main` runs the command: a
    warm server's worker calls it before its client may pass one on, and `main` then
    exits 130, as the command would have without the server."""
    signal.signal(signal.SIGINT, _hold)


#: Exit codes (contract): done; nothing came; bad input or usage; the answer was no;
#: refused by the team's rules (depth, loop guard, offline target, policy).
EXIT_OK = 0
EXIT_NOTHING = 1
EXIT_USAGE = 2
EXIT_NO = 3
EXIT_REFUSED = 4
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141


def error_line(text: str, kind: str = "error") -> None:
    """Print one error line (or, with ``kind="note"``, a note) on stderr; nothing when
    stderr is closed. ``text`` is escaped as stored text is (it may quote a reason, a
    result or an error another process wrote), and stays one line."""
    if sys.stderr is None:
        return
    from ralph_mail.cli.render import safe

    try:
        sys.stderr.write(f"ralph-mail: {kind}: {safe(text, newlines=False)}\n")
        sys.stderr.flush()
    except OSError:
        pass


def say(text: str) -> None:
    """Print ``text`` after an action that is already done (a send delivered): when the
    output is gone (a closed stdout, a reader that left) the action still succeeded, so
    a retry loop must not repeat it. Nothing is raised."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except (OSError, ValueError):
        _silence_stdout()


def guarded(action: Callable[[], int | None]) -> int:
    """Run ``action``; turn the errors a user can cause into one line and an exit code."""
    from ralph_mail.errors import MailError, RefusedByRules

    try:
        return action() or EXIT_OK
    except RefusedByRules as exc:
        error_line(str(exc))
        return EXIT_REFUSED
    except MailError as exc:
        error_line(str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as exc:  # standard output or input closed or failing
        error_line(f"{exc.strerror or exc}: nothing more was done")
        return EXIT_USAGE


class _Closed:
    """Stands for a standard stream that was closed when the process started (``<&-``,
    ``>&-``): every use raises one clear `OSError` instead of an AttributeError."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _closed(self, *args: object) -> str:
        import errno

        raise OSError(errno.EBADF, f"standard {self.name} is closed")

    write = read = readline = fileno = _closed

    def flush(self) -> None:
        """Nothing is buffered: the interpreter's flush at exit must not fail."""

    def isatty(self) -> bool:
        return False

    @property
    def buffer(self) -> _Closed:
        return self


def _silence_stdout() -> None:
    # Python would complain again when flushing the closed pipe at exit.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, AttributeError, ValueError):
        pass


def main(argv: Sequence[str] | None = None, *, relay: bool = True) -> int:
    """Run ``ralph-mail`` with ``argv`` (default: the process's arguments); return the exit
    code. With ``relay``, a warm server, when one runs, runs the command (`relay`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if "_ARGCOMPLETE" in os.environ:  # the shell asks for completions (argcomplete)
            from ralph_mail.cli.completion import complete

            return complete()
        if relay:
            from ralph_mail.cli.relay import relay as to_server

            code = to_server(args, _held)
            if code is not None:
                return code
        if sys.stdout is None:
            sys.stdout = _Closed("output")
        if sys.stdin is None:
            sys.stdin = _Closed("input")
        import ralph_mail.bus  # noqa: F401 - what almost every command needs
        from ralph_mail.cli.app import app_for, run

        app_for(args)  # the modules of the command, imported while Ctrl-C is held
    finally:
        if _previous is not None:
            signal.signal(signal.SIGINT, _previous)
    if _held:  # Ctrl-C came while starting: an interrupt, quietly
        return EXIT_INTERRUPTED
    try:
        return run(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
