"""A task's life with real processes: an assignee killed -9 (its lease lapses, the task
moves, one result comes), a cancel racing a completion, a 3-level tree of `ralph-mail
run` jobs canceled (every job and what it started killed, nothing left over), and a run
killed at its deadline."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ralph_mail import Message, MessageBus, Team, create_team
from ralph_mail.message import decode_lines
from ralph_mail.team import update_team
from tests.helpers.processes import BOUND_S, Processes, cli_env, gone, ralph, wait_until


def runner(procs: Processes, home: Path, team: str, agent: str, script: str,
           log: Path) -> subprocess.Popen[bytes]:  # fmt: skip
    """``ralph-mail run --agent AGENT -- sh -c SCRIPT`` (its notes in ``log``), once it
    is online."""
    env = cli_env(home, RALPH_TEAM=team)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    with open(log, "wb") as notes:
        child = subprocess.Popen(
            [sys.executable, "-m", "ralph_mail", "run", "--agent", agent, "--", "sh", "-c",
             script], stdout=subprocess.DEVNULL, stderr=notes, env=env,
        )  # fmt: skip
    procs.started.append(child)
    wait_until(lambda: b"answers with sh" in log.read_bytes(), f"{agent}'s runner to start")
    return child


def inbox(bus: MessageBus, agent: str) -> list[Message]:
    """Every message in ``agent``'s inbox, consumed or not."""
    found, offset = [], 0
    while True:
        data, offset = bus.store.read(agent, offset)
        if not data:
            return found
        found += [m for m in decode_lines(data.split(b"\n")[:-1])[0] if isinstance(m, Message)]
        offset += len(data)


def pids(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def kill_all(found: list[int]) -> None:
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_an_assignee_killed_9_stalls_and_the_task_moves_with_one_result(
    team: Team, procs: Processes, tmp_path: Path
) -> None:
    """The runner of worker-1 is killed -9 mid-job: its lease lapses, the lead hears
    task_stalled and reassigns to worker-2, whose run completes it. The lead gets
    exactly one task_result, worker-2's; the orphaned job's late 'task done' is refused
    (exit 3)."""
    update_team("demo", config={"task_lease": "1"})
    first = (f"echo $$ > {tmp_path}/w1.pid; touch {tmp_path}/w1.started; "
             f"while [ ! -e {tmp_path}/go ]; do sleep 0.05; done; "
             f'ralph-mail task done "$RALPH_TASK" "from worker-1" > {tmp_path}/w1.out 2>&1; '
             f"echo $? > {tmp_path}/w1.rc")  # fmt: skip
    w1 = runner(procs, team.home, "demo", "worker-1", first, tmp_path / "w1.log")
    runner(procs, team.home, "demo", "worker-2", "echo from worker-2", tmp_path / "w2.log")
    lead = MessageBus("demo", "lead")
    since = lead.store.size("lead")
    task = lead.delegate("worker-1", "draft the post", id="T-1")
    wait_until((tmp_path / "w1.started").exists, "worker-1's job to start")
    orphan = int((tmp_path / "w1.pid").read_text())
    try:
        w1.kill()
        w1.wait(timeout=BOUND_S)
        notice = lead.wait_for_message("task_stalled", timeout=BOUND_S)
        assert notice is not None and notice.metadata["taskId"] == "T-1"
        lead.reassign("T-1", "worker-2")
        result = lead.wait_for_result(task, BOUND_S, since)
        assert result is not None and (result.from_agent, result.content) == (
            "worker-2", "from worker-2"
        )  # fmt: skip
        (tmp_path / "go").touch()  # the job of the dead runner finishes and reports late
        wait_until((tmp_path / "w1.rc").exists, "the orphaned job's 'task done'")
        assert (tmp_path / "w1.rc").read_text().strip() == "3"
        assert b"reassigned to worker-2" in (tmp_path / "w1.out").read_bytes()
        results = [m for m in inbox(lead, "lead") if m.type == "task_result"]
        assert [(m.from_agent, m.content) for m in results] == [("worker-2", "from worker-2")]
        assert next(t for t in lead.tasks() if t.id == "T-1").status == "completed"
    finally:
        kill_all([orphan])


RACER = """
import os, sys, time
import ralph_mail.bus
from ralph_mail.cli import main
go = sys.argv[1]
while not os.path.exists(go):
    time.sleep(0.001)
sys.exit(main(sys.argv[2:]))
"""


def test_a_cancel_racing_a_completion_has_one_outcome_every_time(
    team: Team, procs: Processes, tmp_path: Path
) -> None:
    """Two processes, one completing a task and one canceling it, let go at once, six
    times: each time one exits 0 and the other 3, the task log has that one outcome,
    and only its message went out (a result to the lead, or a notice to the worker)."""
    with MessageBus("demo", "worker-1") as worker:
        worker.set_presence("idle")
    lead = MessageBus("demo", "lead")
    env = cli_env(team.home, RALPH_TEAM="demo")
    for n in range(6):
        lead.delegate("worker-1", f"round {n}", id=f"T-{n}")
        go = tmp_path / f"go-{n}"
        racers = {
            "done": procs.python(RACER, str(go), "task", "done", f"T-{n}", "done",
                                 "--agent", "worker-1", env=env),
            "cancel": procs.python(RACER, str(go), "task", "cancel", f"T-{n}",
                                   "--agent", "lead", env=env),
        }  # fmt: skip
        time.sleep(0.3)  # both past their imports, polling for the file: a fairer race
        go.touch()
        codes = {name: proc.wait(timeout=BOUND_S) for name, proc in racers.items()}
        assert sorted(codes.values()) == [0, 3], codes
        winner = "done" if codes["done"] == 0 else "cancel"
        status = next(t for t in lead.tasks() if t.id == f"T-{n}").status
        assert status == ("completed" if winner == "done" else "canceled")
        results = [m for m in inbox(lead, "lead") if m.metadata.get("taskId") == f"T-{n}"]
        notices = [m for m in inbox(lead, "worker-1")
                   if m.type == "task_canceled" and m.metadata["taskId"] == f"T-{n}"]  # fmt: skip
        assert (len(results), len(notices)) == ((1, 0) if winner == "done" else (0, 1))


#: A job of the tree: it notes its pid and a sleeping child's, and (but the lowest)
#: delegates a subtask of its task to the next agent and waits for it, in the background.
TREE_JOB = """
echo $$ >> {tmp}/pids; sleep 600 & echo $! >> {tmp}/pids
case $RALPH_AGENT in a) next=b ;; b) next=c ;; *) next= ;; esac
if [ -n "$next" ]; then
  ralph-mail delegate $next "below $RALPH_TASK" --parent "$RALPH_TASK" --wait 600 \\
    > /dev/null 2>&1 &
  echo $! >> {tmp}/pids
fi
touch {tmp}/started.$RALPH_AGENT
wait
"""


def test_canceling_a_three_level_tree_of_runs_kills_every_job_and_leaves_nothing(
    home: Path, procs: Processes, tmp_path: Path
) -> None:
    """a's job delegates to b, b's to c, each run by `ralph-mail run`; the lead cancels
    the root: all three tasks are canceled, and every process the jobs started (the
    jobs, their children, the nested delegate) is gone, none left behind in /proc."""
    create_team("tree", ["lead", "a", "b", "c"], home=home)
    script = TREE_JOB.format(tmp=tmp_path)
    runners = [runner(procs, home, "tree", name, script, tmp_path / f"{name}.log")
               for name in "abc"]  # fmt: skip
    lead = MessageBus("tree", "lead")
    lead.delegate("a", "the whole report", id="T-1")
    started = [tmp_path / f"started.{name}" for name in "abc"]
    wait_until(lambda: all(path.exists() for path in started), "the three jobs to start")
    jobs = pids(tmp_path / "pids")
    assert len(jobs) == 8  # three jobs, their three sleeps, two nested delegates
    try:
        lead.cancel("T-1", reason="the brief changed")
        wait_until(lambda: all(gone(pid) for pid in jobs), "every job's process to end")
        states = sorted((t.parent or "", t.status, t.ended_by) for t in lead.tasks())
        assert [s[1:] for s in states] == [("canceled", "lead")] * 3
        left = [path.name for path in Path("/proc").iterdir() if path.name.isdigit()
                and _mentions(path, str(tmp_path))]  # fmt: skip
        assert sorted(int(pid) for pid in left) == sorted(r.pid for r in runners)
        for log in (tmp_path / f"{name}.log" for name in "abc"):  # each run ends unanswered
            wait_until(
                lambda log=log: b"its task canceled: no answer" in log.read_bytes(), log.name
            )
    finally:
        kill_all(jobs)


def _mentions(proc: Path, text: str) -> bool:
    """Whether the command line of process ``proc`` (a /proc entry) mentions ``text``."""
    try:
        return text.encode() in (proc / "cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return False


def test_a_run_past_its_deadline_is_killed_and_the_task_fails(
    team: Team, procs: Processes, tmp_path: Path
) -> None:
    """A job still running at its task's deadline is killed with what it started; the
    task fails ("deadline passed") and the delegator's 'delegate --wait' exits 3."""
    script = f"sleep 600 & echo $! >> {tmp_path}/pids; echo $$ >> {tmp_path}/pids; wait"
    runner(procs, team.home, "demo", "worker-1", script, tmp_path / "w1.log")
    done = ralph(team.home, "delegate", "worker-1", "draft it", "--id", "T-1", "--deadline",
                 "2s", "--wait", "60", "--team", "demo", "--agent", "lead")  # fmt: skip
    jobs = pids(tmp_path / "pids")
    try:
        assert done.returncode == 3, done.stderr
        assert b"deadline passed" in done.stdout + done.stderr
        assert len(jobs) == 2
        wait_until(lambda: all(gone(pid) for pid in jobs), "the job to be killed")
        with MessageBus("demo", "lead") as lead:
            task = lead.tasks()[0]
        assert (task.status, task.result) == ("failed", "deadline passed")
    finally:
        kill_all(jobs)
