"""``ralph-mail usage``: what the team's agents cost, as ``ralph-mail run`` recorded it
(see `ralph_mail.usage`)."""

from __future__ import annotations

from typing import Annotated

from ralph_mail.cli.app import Home, JsonRecords, TeamName, app, command, identity
from ralph_mail.cli.command import Option
from ralph_mail.errors import MailError


@app.command("usage")
def usage_report(
    by: Annotated[str, Option("--by", help="Sum by agent or by task.", metavar="KEY")] = "agent",
    since: Annotated[
        str | None,
        Option("--since", help="Only jobs from TIME on: ISO-8601, or how long ago (2h, 7d).",
               metavar="TIME"),
    ] = None,
    home: Home = None,
    team: TeamName = None,
    json: JsonRecords = False,
) -> None:  # fmt: skip
    """What the team's agents cost, as 'ralph-mail run' recorded their jobs: jobs, tokens
    and US dollars by agent, or by task (with the cost of each task's whole subtree; '-'
    is the jobs of no task, asks and mentions). Nothing recorded: no output.

    \b
    Example:
      ralph-mail usage --team demo
      ralph-mail usage --by task --since 24h --team demo --json
    """

    def action() -> None:
        from ralph_mail import usage
        from ralph_mail.cli.governance import since_ts
        from ralph_mail.cli.render import print_json_lines, print_table
        from ralph_mail.team import load_team

        if by not in ("agent", "task"):
            raise MailError(f"invalid --by {by!r}: agent or task")
        start = since_ts(since, "--since")
        roster = load_team(identity(home, team, None).need_team(), home)
        records = usage.load(roster.store, start)
        totals = usage.rollup(records, by)
        if not totals:
            return
        subtree: dict[str, int] = {}
        if by == "task":
            from ralph_mail.talk.tasks import load

            parents = {t.id: t.parent for t in load(roster.store)[0].values()}
            subtree = usage.subtree_costs(usage.task_costs(records), parents)
        if json:
            rows = [t.to_dict(by) for t in totals]
            if by == "task":
                for row, total in zip(rows, totals, strict=True):
                    cost = subtree.get(total.key, total.micro_usd) / 1e6
                    row["subtree_cost_usd"] = cost if total.key else None
            print_json_lines(rows)
            return
        spent = sum(t.micro_usd for t in totals) / 1e6
        title = f"cost by {by}, {sum(t.jobs for t in totals)} jobs, ${usage.usd(spent)}"
        if by == "agent":
            print_table(title, ("agent", "jobs", "input", "output", "cost"),
                        [(t.key, str(t.jobs), str(t.input_tokens), str(t.output_tokens),
                          f"${usage.usd(t.cost_usd)}") for t in totals])  # fmt: skip
            return
        print_table(title, ("task", "agents", "jobs", "input", "output", "cost", "subtree"),
                    [(t.key or "-", ",".join(t.agents), str(t.jobs), str(t.input_tokens),
                      str(t.output_tokens), f"${usage.usd(t.cost_usd)}",
                      f"${usage.usd(subtree.get(t.key, t.micro_usd) / 1e6)}" if t.key else "")
                     for t in totals])  # fmt: skip

    command(action)
