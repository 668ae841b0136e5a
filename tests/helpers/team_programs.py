"""Small lead and worker programs that the protocol tests run as real processes.

Usage: ``python team_programs.py ROLE TEAM [ARGS...]`` with RALPH_HOME set. Each program
prints one line per thing it did, flushed, so a test can follow it.
"""

from __future__ import annotations

import sys

from ralph_mail import MessageType, TeamAgent, TeamOrchestrator
from ralph_mail.orchestrator import Plan


def _say(*words: object) -> None:
    print(*words, flush=True)


def lead(team: str, review: str = "approve", timeout: str = "60") -> int:
    """Run the lead loop; approve plans (or reject those without the word 'test')."""

    def policy(plan: Plan) -> tuple[bool, str]:
        if review == "approve" or "test" in plan.text:
            return True, f"approved: {plan.text}"
        return False, "add a test step"

    with TeamOrchestrator(team, review_plan=policy, on_event=_say) as orch:
        _say("ready")
        orch.run(timeout=float(timeout))
    return 0


def lead_shutdown(team: str, timeout: str, retry: str, *agents: str) -> int:
    """Ask ``agents`` (default all) to shut down; print the report; exit 0/3/1."""
    with TeamOrchestrator(team, on_event=_say) as orch:
        report = orch.request_shutdown(
            list(agents) or None, timeout=float(timeout), retry_interval=float(retry)
        )
    _say("report", dict(report))
    return 0 if report.ok else 3 if report.refused else 1


def worker(team: str, name: str, steps: str = "0") -> int:
    """A TeamAgent worker: plan (revised once if rejected), progress, done; then stop."""
    with TeamAgent(team, name) as agent:
        _say("ready")
        while (task := agent.next_task(timeout=60)) is not None:
            plan = f"plan for {task.id}"
            decision = agent.submit_plan(plan, wait=30)
            if decision.approved is False:
                _say("rejected", decision.feedback)
                decision = agent.submit_plan(plan + " with a test step", wait=30)
            _say("decision", decision.approved, decision.feedback)
            for step in range(int(steps)):
                # A step is where a real agent works; it answers its inbox in between.
                agent.report_status(f"step {step}", progress=(step + 1) / (int(steps) + 1))
                agent.wait_for_messages(timeout=0.2)
            agent.finish_task(f"finished {task.id}")
            _say("finished", task.id)
        _say("stopping", agent.stopping)
    return 0


def busy_worker(team: str, name: str) -> int:
    """Hold a task, deferring shutdowns, until a text says 'finish'; then accept one."""
    with TeamAgent(team, name) as agent:
        agent.start_task("T-busy", "a long job")
        _say("ready")
        while "finish" not in [message.content for message in agent.context]:
            if not agent.wait_for_messages(timeout=60):
                return 1
        agent.finish_task("done at last")
        _say("finished")
        while not agent.stopping:
            if not agent.wait_for_messages(timeout=60):
                return 1
        _say("stopping")
    return 0


def refuser(team: str, name: str) -> int:
    """Refuse the first shutdown request for good."""
    with TeamAgent(team, name, auto_shutdown=False) as agent:
        _say("ready")
        while agent.shutdown_request is None:
            agent.wait_for_messages(timeout=60)
        agent.refuse_shutdown("I am the last line of defence")
        _say("refused")
    return 0


def text_sink(team: str, name: str) -> int:
    """Print each text message received (types are kept apart from the rest)."""
    with TeamAgent(team, name) as agent:
        _say("ready")
        while True:
            for message in agent.wait_for_messages(timeout=60):
                if message.type == MessageType.TEXT:
                    _say("text", message.content)


PROGRAMS = {
    "lead": lead,
    "lead-shutdown": lead_shutdown,
    "worker": worker,
    "busy-worker": busy_worker,
    "refuser": refuser,
    "text-sink": text_sink,
}

if __name__ == "__main__":
    raise SystemExit(PROGRAMS[sys.argv[1]](*sys.argv[2:]))
