"""The ``ralph-mail`` command line: a thin shell over the library.

`main` sends ``ralph-mail send ...`` through a fast path that imports neither typer nor
rich (typer alone costs 40-60 ms of start-up, against a few ms for the send itself), so a
shell loop of sends stays close to the interpreter's own start-up. Everything else, and
any ``send`` the fast path does not fully understand (``--help``, a typo), goes to the
typer app, which owns the help texts and usage errors.

This package is the only place where a `MailError` becomes an exit code.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from ralph_mail.errors import MailError

#: Exit codes (contract): done; nothing came; bad input or usage; the answer was no.
EXIT_OK = 0
EXIT_NOTHING = 1
EXIT_USAGE = 2
EXIT_NO = 3
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141


def error_line(text: str) -> None:
    """Print one error line on stderr."""
    sys.stderr.write(f"ralph-mail: error: {text}\n")
    sys.stderr.flush()


def guarded(action: Callable[[], int | None]) -> int:
    """Run ``action``; turn the errors a user can cause into one line and an exit code."""
    try:
        return action() or EXIT_OK
    except MailError as exc:
        error_line(str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE


def _silence_stdout() -> None:
    # Python would complain again when flushing the closed pipe at exit.
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ralph-mail`` with ``argv`` (default: the process's arguments); return the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "send":
        from ralph_mail.cli.send import parse_fast

        request = parse_fast(args[1:])
        if request is not None:
            return guarded(request.run)
    from ralph_mail.cli.app import run

    return run(args)
