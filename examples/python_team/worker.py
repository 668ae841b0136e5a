"""A teammate written with `TeamAgent`: the Python twin of ``shell_team/worker.sh``.

It takes tasks, submits a plan (revised once if the lead rejects it), reports progress
in steps and finishes; `TeamAgent` answers a shutdown request with "not yet" while a
task is in hand and accepts it when idle. Identity comes from the environment:
``RALPH_HOME``, ``RALPH_TEAM`` and ``RALPH_AGENT``.
"""

from __future__ import annotations

import os

from ralph_mail import TeamAgent

STEPS = 2


def main() -> int:
    with TeamAgent(os.environ["RALPH_TEAM"], os.environ["RALPH_AGENT"]) as agent:
        while not agent.stopping:
            task = agent.next_task(timeout=120)
            if task is None:
                if agent.stopping:
                    break
                return 1  # two minutes without work or a shutdown: the lead is gone
            context = agent.take_context()  # text from the team, for a real agent's prompt
            agent.report_status(f"starting {task.id}: {task.description}", progress=0)
            plan = f"1. read the input 2. {task.description}"
            decision = agent.submit_plan(plan, wait=30)
            if decision.approved is False:  # revise the plan with the lead's feedback
                agent.report_status(f"revising the plan: {decision.feedback}")
                decision = agent.submit_plan(plan + " 3. test the result", wait=30)
            if not decision.approved:
                agent.finish_task(f"no approved plan: {decision.feedback}", state="failed")
                continue
            for step in range(1, STEPS + 1):
                # A real agent works here, with `context`; meanwhile it answers its inbox.
                agent.process_pending_messages()
                agent.report_status(f"step {step} of {STEPS}", progress=step / (STEPS + 1))
            del context
            agent.finish_task(f"{task.id} finished")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
