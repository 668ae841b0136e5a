"""Maintenance commands: doctor (is this home healthy?) and gc (drop consumed mail)."""

from __future__ import annotations

import sys
from typing import Annotated

from ralph_mail.cli import EXIT_NO
from ralph_mail.cli.app import Home, TeamName, app, command, identity
from ralph_mail.cli.command import Option
from ralph_mail.cli.render import print_json_lines, safe
from ralph_mail.errors import MailError

_MARKS = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}

Json = Annotated[bool, Option("--json", help="One JSON record per line, for scripts.")]


@app.command("doctor")
def doctor(
    strict: Annotated[
        bool, Option("--strict", help="Count warnings as problems too (exit 3).")
    ] = False,
    home: Home = None,
    team: TeamName = None,
    json: Json = False,
) -> None:
    """Check the home: file system, inotify, permissions, inboxes, cursors, dead letters,
    stuck locks and leftovers. Exit 0 when healthy, 3 when a check failed.

    \b
    Example:
      ralph-mail doctor --home /tmp/mail
      ralph-mail doctor --team demo --strict --json | jq -r .message
    """

    def action() -> int:
        from ralph_mail.maintenance import doctor as run_doctor

        report = run_doctor(home, team)
        if json:
            print_json_lines([finding.to_dict() for finding in report.findings])
        else:
            for finding in report.findings:
                message = safe(finding.message, newlines=False)  # it may quote a file
                sys.stdout.write(f"{_MARKS[finding.level]}  {message}\n")
            failures = sum(1 for f in report.findings if f.level == "fail")
            warnings = sum(1 for f in report.findings if f.level == "warn")
            verdict = "healthy" if report.healthy(strict) else "NOT healthy"
            pairs = ((failures, "failure"), (warnings, "warning"))
            counts = [f"{n} {word}{'s' if n != 1 else ''}" for n, word in pairs if n]
            detail = f" ({', '.join(counts)})" if counts else ""
            where = safe(str(report.where or report.home), newlines=False)
            sys.stdout.write(f"{where}: {verdict}{detail}\n")
        sys.stdout.flush()
        return 0 if report.healthy(strict) else EXIT_NO

    command(action)


@app.command("gc")
def gc(
    everyone: Annotated[
        bool, Option("--all", help="Every team in the home, not just --team.")
    ] = False,
    purge_before: Annotated[
        str | None,
        Option(
            "--purge-before",
            help="Also delete, for good, archived messages older than TIME (ISO-8601, or "
            "30d ago) from the audit trail and the search index.",
            metavar="TIME",
        ),
    ] = None,
    home: Home = None,
    team: TeamName = None,
    json: Json = False,
) -> None:
    """Drop the messages each member has consumed from the front of its inbox.

    Safe while the team sends and reads: unread mail and every cursor are kept. What is
    dropped goes to the team's archive first: search (and history) still find it, until
    --purge-before deletes it.

    \b
    Example:
      ralph-mail gc --team demo
      ralph-mail gc --all --home /tmp/mail --json
      ralph-mail gc --team demo --purge-before 90d
    """

    def action() -> None:
        from ralph_mail.maintenance import collect
        from ralph_mail.team import list_teams

        if everyone:
            names = [roster.name for roster in list_teams(home)]
        elif team is not None:
            names = [team]
        else:
            try:
                names = [identity(home, team, None).need_team()]
            except MailError:
                raise MailError(
                    "no team given: pass --team NAME, --all, or set RALPH_TEAM"
                ) from None
        from ralph_mail.cli.governance import since_ts

        drop_before = since_ts(purge_before, "--purge-before")
        for name in names:
            result = collect(name, home, drop_before=drop_before)
            if drop_before is not None:  # then what was archived before, and the index
                from ralph_mail.bus import MessageBus
                from ralph_mail.team import load_team

                bus = MessageBus(name, load_team(name, home).lead, home)
                try:
                    starts = bus.purge_archive(drop_before)
                finally:
                    bus.close()
                if not json:
                    for agent, start in starts.items():
                        line = safe(
                            f"{name}/{agent}: audit trail starts at {start}", newlines=False
                        )
                        sys.stdout.write(line + "\n")
            if json:
                print_json_lines(
                    [
                        {
                            "team": result.team,
                            "agent": c.agent,
                            "removed": c.removed,
                            "kept": c.kept,
                            "base": c.base,
                            "messages": c.messages,
                        }
                        for c in result.compactions
                    ]
                )
                continue
            for c in result.compactions:
                # What gc drops, tail can no longer show: say so in messages, not only bytes.
                line = (
                    f"{result.team}/{c.agent}: removed {c.messages} consumed message(s) "
                    f"({c.removed} bytes, archived: 'search' finds them), kept {c.kept} bytes"
                )
                sys.stdout.write(safe(line, newlines=False) + "\n")
            for path in result.removed_temp:
                line = safe(f"{result.team}: removed leftover {path}", newlines=False)
                sys.stdout.write(line + "\n")
        sys.stdout.flush()

    command(action)
