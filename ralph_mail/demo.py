"""``ralph-mail demo``: a whole team at work, as real processes, in a temporary home.

The demo creates a team (a lead and three workers), gives each worker a task, then
starts ``ralph-mail lead`` (the live table on a terminal) and three worker processes
(`TeamAgent`, ``python -m ralph_mail.demo worker TEAM NAME DELAY``). Each worker plans,
waits for the lead's review, reports its progress and finishes; worker-2's first plan
has no test step, so the review (a ``cmd:`` policy: ``grep``) rejects it and worker-2
revises it. The workers also talk to each other: worker-2 asks worker-1 a question
(`MessageBus.ask`) and reports the reply; worker-3 delegates a subtask to worker-1
(`MessageBus.delegate`), which does it after its own, and reports the result that comes
back. The lead sees each finished task as a ``task_completed`` event. Once all are done
the lead asks everyone to shut down, they accept, and the demo exits with the lead's
exit code, leaving no process behind.

Example:
    >>> run_demo(None, delay=0.0)   # doctest: +SKIP
    0
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Final

from ralph_mail.settings import DEMO_TIMEOUT_S

if TYPE_CHECKING:
    from ralph_mail.agent import TeamAgent
    from ralph_mail.talk.tasks import Task

WORKERS: Final = (
    ("worker-1", "parses logs", "T-1", "parse the web server logs"),
    ("worker-2", "writes reports", "T-2", "write the weekly traffic report"),
    ("worker-3", "checks numbers", "T-3", "check the totals against the database"),
)
PLANS: Final = {
    "worker-1": "1. read the logs 2. parse each line 3. test the parser on broken lines",
    "worker-2": "1. collect the numbers 2. write the report",  # no test step: rejected
    "worker-3": "1. query the totals 2. compare them 3. test the edge cases",
}
#: The demo lead's review: a plan must say how it will be tested.
REVIEW: Final = (
    "cmd:grep -qi test && echo 'approved: it says how it is tested' "
    "|| { echo 'rejected: add a step that tests the result'; exit 1; }"
)
#: worker-2's question to worker-1, and worker-1's answer.
QUESTION: Final = ("worker-1", "how many log lines could not be parsed?")
ANSWER: Final = "3 of 2,000: truncated lines at the rotation boundary"
#: worker-3's subtask for worker-1, and worker-1's result.
SUBTASK: Final = ("worker-1", "T-3.1", "count the orders in the database dump")
SUBTASK_RESULT: Final = "1,204 orders"
#: Work steps per task; each reports progress.
STEPS: Final = 3
#: How long the demo waits for its workers to exit once the lead is done (s).
_EXIT_WAIT_S: Final = 15.0


def _say(out: IO[str], text: str) -> None:
    out.write(text + "\n")
    out.flush()


def _team_name(home: Path) -> str:
    from ralph_mail.team import list_teams

    taken = {team.name for team in list_teams(home)}
    name, number = "demo", 1
    while name in taken:
        number += 1
        name = f"demo-{number}"
    return name


def run_demo(home: str | os.PathLike[str] | None = None, delay: float = 0.6) -> int:
    """Run the demo team to its end; return the lead's exit code (0: all went well).

    ``home`` keeps the team's mail there (the team is called demo, or demo-2, ...);
    without it a temporary home is used and removed afterwards. ``delay`` is the length
    of one simulated work step in seconds.
    """
    from ralph_mail.orchestrator import TeamOrchestrator
    from ralph_mail.team import create_team

    out = sys.stdout
    temporary = home is None
    # SIGTERM or SIGHUP (a closed terminal) ends the demo as Ctrl-C does: through the
    # cleanup below, so no lead, worker or temporary home is left behind.
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    root = Path(tempfile.mkdtemp(prefix="ralph-demo-") if home is None else home).absolute()
    children: list[subprocess.Popen[bytes]] = []
    try:
        name = _team_name(root)
        create_team(name, [("lead", "runs the team")] + [w[:2] for w in WORKERS], root)
        _say(out, f"ralph-mail demo: team {name} in {root}: a lead and {len(WORKERS)} workers")
        with TeamOrchestrator(name, root) as orchestrator:
            for worker, _, task_id, task in WORKERS:
                orchestrator.assign(worker, task_id, task)
                _say(out, f"assigned {task_id} to {worker}: {task}")
        env = {k: v for k, v in os.environ.items() if not k.startswith("RALPH_")}
        env.update(RALPH_HOME=str(root), RALPH_TEAM=name)
        # The workers' stderr goes to a log beside the team: a failure is shown at the end,
        # and the live table on the terminal stays clean meanwhile.
        log_path = root / f".{name}-workers.log"
        with open(log_path, "wb") as log:
            lead = subprocess.Popen(
                [sys.executable, "-m", "ralph_mail", "lead", "--review", REVIEW,
                 "--until-done", "--timeout", f"{DEMO_TIMEOUT_S:g}"],
                env=env,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
            children.append(lead)
            for worker, *_ in WORKERS:
                children.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "ralph_mail.demo",
                            "worker",
                            name,
                            worker,
                            f"{delay:g}",
                        ],
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=log,
                    )
                )
            code = lead.wait(timeout=DEMO_TIMEOUT_S * 2)
            stuck = _reap(children[1:], _EXIT_WAIT_S)
        failed = [w[0] for w, child in zip(WORKERS, children[1:], strict=True) if child.returncode]
        if stuck or failed:
            _say(out, f"workers that failed: {', '.join(failed)}; their errors:")
            _say(out, log_path.read_text(errors="replace")[-4000:])
            code = code or 1
        if code == 0:
            _say(out, "the team's task tree (ralph-mail tasks):")
            out.write(_tree(root, name))
            _say(out, "demo done: every task approved and finished, every worker shut down")
        if not temporary:
            _say(
                out, f"the mail stays in {root}: ralph-mail tail --all --home {root} --team {name}"
            )
        return code
    except _Stopped as stopped:
        return 128 + stopped.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _reap(children, 0.0)  # only does something after an error, Ctrl-C or SIGTERM
        if temporary:
            shutil.rmtree(root, ignore_errors=True)


def _tree(home: Path, team: str) -> str:
    from ralph_mail.talk.tasks import draw, load
    from ralph_mail.team import load_team

    return draw(load(load_team(team, home).store)[0])


class _Stopped(Exception):
    """The demo was asked to stop by a signal (SIGTERM, SIGHUP)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop(signum: int, frame: object) -> None:
    raise _Stopped(signum)


def _reap(children: list[subprocess.Popen[bytes]], grace: float) -> bool:
    """Wait up to ``grace`` s for each child, then stop it (TERM, then KILL); True if any
    had to be stopped."""
    stopped = False
    for child in children:
        if child.poll() is not None:
            continue
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=grace)
            continue
        stopped = True
        child.terminate()  # the lead stops cleanly on SIGTERM; a worker just ends
        try:
            child.wait(timeout=_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    return stopped


def worker(team: str, name: str, delay: float) -> int:
    """One demo worker: plan (revise on rejection), work in steps, finish; stop when asked."""
    from ralph_mail.agent import TeamAgent

    with TeamAgent(team, name, answer=lambda request: ANSWER) as agent:
        while (task := agent.next_task(timeout=DEMO_TIMEOUT_S)) is not None:
            agent.report_status(f"read {task.id}: {task.description}", progress=0)
            if task.message is not None and task.message.from_agent != agent.lead:
                # A teammate's subtask: no plan to review, just the work and its result.
                agent.wait_for_messages(timeout=delay)
                agent.finish_task(SUBTASK_RESULT)
                continue
            plan = PLANS.get(name, "1. do the task 2. test the result")
            decision = agent.submit_plan(plan, wait=DEMO_TIMEOUT_S)
            if decision.approved is False:
                agent.report_status(f"revising the plan: {decision.feedback}")
                plan += f" {plan.count('. ') + 1}. test the result"
                decision = agent.submit_plan(plan, wait=DEMO_TIMEOUT_S)
            if not decision.approved:
                agent.finish_task(f"no approved plan: {decision.feedback}", state="failed")
                continue
            subtask = None
            for step in range(1, STEPS + 1):
                # One step of simulated work; the inbox is answered meanwhile.
                agent.wait_for_messages(timeout=delay)
                agent.report_status(f"step {step} of {STEPS}", progress=step / (STEPS + 1))
                if step == 1:
                    subtask = _talk(agent)
            if subtask is not None:
                since, delegated = subtask
                result = agent.bus.wait_for_result(delegated, DEMO_TIMEOUT_S, since)
                came = result.content if result is not None else "nothing came back in time"
                agent.report_status(f"{delegated.id} came back from {delegated.assignee}: {came}")
            agent.finish_task(f"{task.id} finished")
    return 0


def _talk(agent: TeamAgent) -> tuple[int, Task] | None:
    """worker-2 asks worker-1 its question; worker-3 delegates its subtask to worker-1
    and returns it with where its inbox ended before (to wait for the result)."""
    if agent.name == "worker-2":
        to, question = QUESTION
        _until_online(agent, to)
        reply = agent.bus.ask(to, question, timeout=DEMO_TIMEOUT_S)
        agent.report_status(f"asked {to} {question!r}: {reply.content}")
    elif agent.name == "worker-3":
        to, task_id, description = SUBTASK
        _until_online(agent, to)
        since = agent.bus.store.size(agent.name)
        delegated = agent.bus.delegate(to, description, id=task_id, parent=agent.task.id
                                       if agent.task else None)  # fmt: skip
        agent.report_status(f"delegated {task_id} to {to}: {description}")
        return since, delegated
    return None


def _until_online(agent: TeamAgent, teammate: str) -> None:
    """Handle the inbox until ``teammate`` is online (it may still be starting): an ask
    or a delegation to an agent that is offline is refused."""
    deadline = time.monotonic() + DEMO_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(a.name == teammate and a.presence != "offline" for a in agent.bus.agents()):
            return
        agent.wait_for_messages(timeout=0.05)


def main(argv: list[str]) -> int:
    """``python -m ralph_mail.demo worker TEAM NAME DELAY``."""
    if len(argv) != 4 or argv[0] != "worker":
        sys.stderr.write("usage: python -m ralph_mail.demo worker TEAM NAME DELAY\n")
        return 2
    try:
        return worker(argv[1], argv[2], float(argv[3]))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
