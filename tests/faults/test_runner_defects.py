"""`ralph-mail run`: answers held by a background job, requests it cannot answer, the
job's whole process tree, a missing command, clean stops and the history's size."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from ralph_mail import MessageBus, MessageType, Team, settings
from ralph_mail.message import Message
from ralph_mail.orchestrator import Plan, command_reviewer
from tests.helpers.processes import (
    BOUND_S,
    Processes,
    ask,
    cli_env,
    gone,
    ralph,
    runner,
    wait_until,
)

#: Tests that read /proc or start setsid daemons.
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
#: A daemon that leaves the job's session and writes its own pid to the file named $1.
DAEMON = "setsid sh -c 'echo $$ > {pid}; exec sleep 300' & "


def stop(child: subprocess.Popen[bytes]) -> list[str]:
    """SIGTERM a runner; return the rest of its stderr once it exited 0."""
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=BOUND_S)
    assert child.returncode == 0, err
    return err.decode().splitlines()


def test_an_answer_is_sent_though_a_background_job_holds_the_pipes(
    team: Team, procs: Processes
) -> None:
    """What the command printed by the time it exited is the reply, though a job it left
    in the background keeps its stdout open."""
    runner(procs, team.home, "worker-1", "cat >/dev/null; sleep 300 & echo answer")
    done = ask(team.home, "worker-1", "anyone?")
    assert done.returncode == 0 and done.stdout == b"answer\n", done.stderr


def test_a_review_command_with_a_background_job_decides_by_what_it_printed() -> None:
    """cmd: review: the verdict and feedback are the command's exit status and output,
    though a job it left in the background keeps its stdout open."""
    fake = Message("0123456789ab", "worker-1", "lead", MessageType.PLAN_SUBMISSION, "plan")
    review = command_reviewer("cat >/dev/null; sleep 300 & echo looks good", timeout=20)
    assert review(Plan("worker-1", "plan", "T-1", fake)) == (True, "looks good")


def _nul_task(bus: MessageBus, team: Team) -> None:
    bus.send("worker-1", MessageType.TASK_ASSIGNMENT, "do it", {"taskId": "a\x00b"})


def _loop_guarded(bus: MessageBus, team: Team) -> None:
    question = bus.send("worker-1", MessageType.REQUEST, "first question")
    with MessageBus("demo", "worker-2", team.home) as third:
        for n in range(19):
            third.send("lead", MessageType.TEXT, f"chatter {n}", thread=question.id)


def _rate_limited(bus: MessageBus, team: Team) -> None:
    bus.channels.create("standup", ["worker-1"])
    for n in range(11):  # the runner's answers mention the lead: 10 a minute
        bus.channel_post("standup", f"@worker-1 status {n}?")


def _long_channel(bus: MessageBus, team: Team) -> None:
    name = "c" * 60
    bus.channels.create(name, ["worker-1"])
    bus.channel_post(name, "@worker-1 hello")


@pytest.mark.parametrize(
    "poison", [_nul_task, _loop_guarded, _rate_limited, _long_channel],
    ids=["nul-task-id", "loop-guard", "rate-limited", "long-channel-name"],
)  # fmt: skip
def test_a_request_the_runner_cannot_answer_is_consumed_and_it_goes_on(
    team: Team, procs: Processes, poison: object
) -> None:
    """A request whose answer is refused (or that cannot run) is answered with an error
    where that is possible, else set aside; either way it is consumed, with one line on
    stderr, and the runner answers the next ask; started again, it runs nothing more."""
    with MessageBus("demo", "lead", team.home) as lead:
        poison(lead, team)  # type: ignore[operator]
    child = runner(procs, team.home, "worker-1", 'cat >/dev/null; echo "@lead noted"')
    done = ask(team.home, "worker-1", "still there?")
    assert done.returncode == 0 and done.stdout == b"@lead noted\n", done.stderr
    lines = stop(child)
    if poison is _long_channel:  # every valid name works: the mention is answered
        with MessageBus("demo", "lead", team.home) as lead:
            answers = lead.channel_history("c" * 60)
        assert [m.content for m in answers if m.from_agent == "worker-1"] == ["@lead noted"]
    else:
        assert any("could not answer" in line or "not run" in line for line in lines), lines
    assert not any("Traceback" in line for line in lines), lines
    with MessageBus("demo", "worker-1", team.home) as worker:
        assert worker.peek() == []  # consumed: a restart does not meet it again


@linux
def test_a_daemon_that_left_the_jobs_session_is_killed_when_the_job_ends(
    team: Team, procs: Processes, tmp_path: Path
) -> None:
    """A daemon the command starts with setsid is killed once the command has exited."""
    pid_file = tmp_path / "daemon.pid"
    script = DAEMON.format(pid=pid_file) + f"until [ -s {pid_file} ]; do :; done; echo done"
    runner(procs, team.home, "worker-1", script)
    done = ask(team.home, "worker-1", "start a daemon")
    assert done.returncode == 0 and done.stdout == b"done\n", done.stderr
    daemon = int(pid_file.read_text())
    wait_until(lambda: gone(daemon), f"the daemon {daemon} to be killed")


@linux
def test_a_daemon_of_a_job_still_running_is_killed_when_the_runner_stops(
    team: Team, procs: Processes, tmp_path: Path
) -> None:
    """A runner stopped while a job runs kills the job and a daemon it started with
    setsid (after the grace period), then exits 0."""
    pid_file = tmp_path / "daemon.pid"
    child = runner(procs, team.home, "worker-1", DAEMON.format(pid=pid_file) + "sleep 300")
    asker = subprocess.Popen(
        [sys.executable, "-m", "ralph_mail", "ask", "worker-1", "forever?", "--timeout", "60",
         "--team", "demo", "--agent", "lead"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(team.home),
    )  # fmt: skip
    procs.started.append(asker)
    wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), "the daemon")
    daemon = int(pid_file.read_text())
    stop(child)
    wait_until(lambda: gone(daemon), f"the daemon {daemon} to be killed")
    asker.communicate(timeout=BOUND_S)
    assert asker.returncode == 3  # the killed job's error is the reply


def test_a_command_that_cannot_be_found_is_refused_at_start(team: Team) -> None:
    """run -- MISSING: exit 2 with one line naming the command and the fix; the agent
    never went online."""
    done = ralph(team.home, "run", "--team", "demo", "--agent", "worker-1", "--",
                 "no-such-model-cli-xyz", "-p")  # fmt: skip
    assert done.returncode == 2
    (line,) = done.stderr.decode().splitlines()
    assert "no-such-model-cli-xyz" in line and "PATH" in line
    listed = ralph(team.home, "agents", "--json", "--team", "demo", "--agent", "lead")
    presence = {a["name"]: a["presence"] for a in map(orjson.loads, listed.stdout.splitlines())}
    assert presence["worker-1"] == "offline"


def test_each_job_is_logged_and_a_cleanly_stopped_runner_is_offline(
    team: Team, procs: Processes
) -> None:
    """One stderr line per job (pattern, sender, id, exit status, duration); after a
    clean stop an ask is refused at once as offline (exit 4), not waited out."""
    child = runner(procs, team.home, "worker-1", "cat >/dev/null; echo hi")
    done = ask(team.home, "worker-1", "hello?", "--id", "0123456789ab")
    assert done.returncode == 0, done.stderr
    lines = stop(child)
    (logged,) = [line for line in lines if "0123456789ab" in line]
    assert "ask from lead" in logged and "exit 0" in logged and " s" in logged, logged
    refused = ralph(team.home, "ask", "worker-1", "again?", "--timeout", "20", "--team",
                    "demo", "--agent", "lead")  # fmt: skip
    assert refused.returncode == 4 and b"offline" in refused.stderr, refused.stderr
    with MessageBus("demo", "worker-1", team.home) as worker:  # any activity: online again
        worker.peek()
        presence = {a.name: a.presence for a in worker.agents(include_self=True)}
        assert presence["worker-1"] == "idle"


def test_the_history_given_to_a_command_is_capped_in_bytes(
    team: Team, procs: Processes, tmp_path: Path
) -> None:
    """History past settings.RUN_HISTORY_MAX_BYTES: the oldest messages are left out, and the
    first line of stdin says how many."""
    seen = tmp_path / "stdin.txt"
    with MessageBus("demo", "lead", team.home) as lead:
        for n in range(19):
            lead.send("worker-1", MessageType.TEXT, f"note {n:02d} " + "x" * 8000)
    runner(procs, team.home, "worker-1", f"cat > {seen}; echo ok")
    assert ask(team.home, "worker-1", "read all that?").returncode == 0
    text = seen.read_text()
    first = text.splitlines()[0]
    assert first.startswith("[") and "left out" in first, first
    assert "note 18" in text and "note 00" not in text
    assert len(text.encode()) < settings.RUN_HISTORY_MAX_BYTES + 1024
    assert text.endswith("[Agent Request from lead | Pattern: ask]\n\nread all that?\n")


@linux
def test_the_runner_has_no_leftover_children(team: Team, procs: Processes) -> None:
    """After jobs that leave background work, the runner's own process has no child
    left but the keepers' fork server, which has no keeper left (nothing to reap grows
    with the jobs it ran)."""
    child = runner(procs, team.home, "worker-1", "cat >/dev/null; sleep 300 & echo x")
    for n in range(3):
        assert ask(team.home, "worker-1", f"q{n}").returncode == 0

    def children_of(parent: int) -> list[tuple[int, bytes]]:
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    stat = Path(f"/proc/{name}/stat").read_bytes()
                    line = Path(f"/proc/{name}/cmdline").read_bytes()
                except OSError:
                    continue
                if int(stat[stat.rindex(b")") + 2 :].split()[1]) == parent:
                    found.append((int(name), line))
        return found

    def childless() -> bool:
        # Only the keepers' fork server, and it has no keeper left.
        found = children_of(child.pid)
        return all(b"_keeper.py\0--serve" in line and not children_of(pid)
                   for pid, line in found) and len(found) <= 1  # fmt: skip

    wait_until(childless, "the runner's children to be gone")
    stop(child)


def test_a_cancel_after_its_run_ended_leaves_nothing_held(team: Team) -> None:
    """A task_canceled (or a lease renewal refused) that reaches the runner just after
    the run ended, its lease gone, marks nothing: a long-lived runner keeps no id per
    such race."""
    from ralph_mail.runner import Runner

    responder = Runner("demo", "worker-1", [sys.executable])
    try:
        responder._kill("0123456789ab", "canceled")
        assert responder._canceled == set()
    finally:
        responder.bus.close()
