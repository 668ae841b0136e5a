"""A team lead on `TeamOrchestrator`, shared by both example teams.

It gives every teammate one task, reviews their plans (a plan must say how its result
is tested), follows their progress, and once everyone is done asks the team to shut
down. It prints one line per event and exits 0 when every teammate accepted.

Run by ``examples/shell_team/run.sh`` and ``examples/python_team/run.py``, which set
``RALPH_HOME`` and ``RALPH_TEAM``.
"""

from __future__ import annotations

import os

from ralph_mail import Event, TeamOrchestrator
from ralph_mail.orchestrator import Plan

TASKS = [
    "parse the logs and test the parser",
    "write the weekly report",  # a plan for this one rarely mentions tests: rejected once
    "check the totals and test the edge cases",
]


def review(plan: Plan) -> tuple[bool, str]:
    """Approve a plan that says how its result is tested."""
    if "test" in plan.text.lower():
        return True, "approved: go ahead"
    return False, "rejected: add a step that tests the result"


def show(event: Event) -> None:
    print(event, flush=True)


def main() -> int:
    with TeamOrchestrator(os.environ["RALPH_TEAM"], review_plan=review, on_event=show) as lead:
        for number, agent in enumerate(lead.teammates):
            lead.assign(agent, f"T-{number + 1}", TASKS[number % len(TASKS)])
        done = lead.run(until=lambda o: o.all_done(), timeout=60)
        if not done:
            print("the team did not finish in time: shutting it down anyway", flush=True)
        report = lead.request_shutdown(timeout=30, retry_interval=1.0)
    print(
        f"accepted: {', '.join(report.accepted) or '-'}; refused: "
        f"{', '.join(report.refused) or '-'}; no answer: {', '.join(report.no_answer) or '-'}",
        flush=True,
    )
    if not done or report.no_answer:
        return 1
    return 3 if report.refused else 0


if __name__ == "__main__":
    raise SystemExit(main())
