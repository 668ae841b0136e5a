"""`ralph-mail run`: a command answers as an agent; real runner processes, real children."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson

from ralph_mail import MessageBus, Team
from tests.helpers.processes import (
    BOUND_S,
    Processes,
    ask,
    cli_env,
    gone,
    held_job,
    ralph,
    runner,
    signal_until_ended,
    wait_until,
)
from tests.helpers.protocol_helpers import readable

#: A child that answers with what it was told: its stdin's last line and its environment.
ECHO = 'echo "$RALPH_PATTERN from $RALPH_FROM ($RALPH_CHAIN): $(tail -n 1)"'


def test_a_runner_answers_asks_and_delegations(team: Team, procs: Processes) -> None:
    """The child's stdout is the reply to an ask and the result of a delegation; it gets
    the pattern, the sender and the request; SIGTERM stops the runner, exit 0."""
    child = runner(procs, team.home, "worker-1", ECHO)
    done = ask(team.home, "worker-1", "what is 6x7?")
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"ask from lead (lead): what is 6x7?\n"
    delegated = ralph(team.home, "delegate", "worker-1", "summarise Q4", "--wait", "30",
                      "--team", "demo", "--agent", "lead")  # fmt: skip
    assert delegated.stdout == b"delegate from lead (): summarise Q4\n", delegated.stderr
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=BOUND_S) == 0


def test_an_idle_runner_sleeps_until_mail_or_a_signal(team: Team, procs: Processes) -> None:
    """An idle runner is woken by nothing but its safety poll (after 1 s, then 5 s: its
    stop flag is polled beside its doorbell, not looked at in slices), and a SIGTERM still
    ends it at once. Counted as the times its threads were woken (/proc), not timed."""
    from bench.hive import counters

    child = runner(procs, team.home, "worker-1", ECHO)
    assert ask(team.home, "worker-1", "awake?").returncode == 0  # settled: idle from here
    before = counters([child.pid])[child.pid].wakeups
    time.sleep(3.0)  # the window counted, not a synchronisation
    woke = counters([child.pid])[child.pid].wakeups - before
    assert woke <= 6, woke  # looking at a stop event in slices woke it about 15 times
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=BOUND_S) == 0


def test_stdin_holds_the_conversation_then_the_headed_request(
    team: Team, procs: Processes, tmp_path: Path
) -> None:
    """stdin: the DM so far (notes included: they start no run), then the request headed
    as the seeds show it, with its context."""
    seen = tmp_path / "stdin.txt"
    runner(procs, team.home, "worker-1", f"cat > {seen}; echo ok")
    with MessageBus("demo", "lead") as lead:
        lead.send("worker-1", "text", "a note first")
    assert ask(team.home, "worker-1", "Q4 revenue?", "--context", "investor update").returncode == 0
    text = seen.read_text()
    assert text.startswith("[Conversation history with lead]\n")
    assert "[lead] a note first\n" in text
    assert text.endswith(
        "[Agent Request from lead | Pattern: ask]\n\nContext: investor update\n\nQ4 revenue?\n"
    )


def test_a_failing_or_hanging_child_sends_the_error(team: Team, procs: Processes,
                                                    tmp_path: Path) -> None:  # fmt: skip
    """Exit status non-zero: the reply carries the error (ask exits 3); a child running
    past --timeout is killed with its process group, a daemon it forked included."""
    runner(procs, team.home, "worker-1", "echo broken >&2; exit 7")
    failed = ask(team.home, "worker-1", "anything?")
    assert failed.returncode == 3 and b"exited 7: broken" in failed.stderr
    pid_file = tmp_path / "daemon.pid"
    runner(procs, team.home, "worker-2", f"sleep 300 & echo $! > {pid_file}; sleep 300",
           "--timeout", "0.5")  # fmt: skip
    slow = ask(team.home, "worker-2", "too slow?")
    assert slow.returncode == 3 and b"ran past 0.5 s: killed" in slow.stderr
    daemon = int(pid_file.read_text())
    wait_until(lambda: gone(daemon), f"the daemon {daemon} the child forked to be killed")


def test_a_second_runner_for_one_agent_is_refused(team: Team, procs: Processes) -> None:
    """One runner per agent: a second exits 2, naming the first one's pid."""
    first = runner(procs, team.home, "worker-1", ECHO)
    second = ralph(team.home, "run", "--agent", "worker-1", "--team", "demo", "--", "true")
    assert second.returncode == 2 and str(first.pid).encode() in second.stderr


def test_a_runner_killed_mid_run_answers_once_when_started_again(
    team: Team, procs: Processes, tmp_path: Path
) -> None:
    """kill -9 of the runner while its child runs: the request is not consumed; a new
    runner answers it, and the asker gets exactly one reply."""
    started, pid_file = tmp_path / "started", tmp_path / "child.pid"
    script = (f"echo $$ > {pid_file}; touch {started}; [ -e {tmp_path}/go ] || sleep 300; "
              "echo answered")  # fmt: skip
    first = runner(procs, team.home, "worker-1", script)
    asker = subprocess.Popen(
        [sys.executable, "-m", "ralph_mail", "ask", "worker-1", "once?", "--timeout", "60",
         "--id", "0123456789ab", "--team", "demo", "--agent", "lead"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(team.home),
    )  # fmt: skip
    procs.started.append(asker)
    wait_until(started.exists, "the child to start")
    orphan = int(pid_file.read_text())
    first.kill()
    first.wait(timeout=BOUND_S)
    try:
        (tmp_path / "go").touch()
        runner(procs, team.home, "worker-1", script)
        out, err = asker.communicate(timeout=BOUND_S)
        assert asker.returncode == 0 and out == b"answered\n", err
        lines = (team.home / "teams/demo/mailbox/lead.jsonl").read_bytes().splitlines()
        replies = [orjson.loads(line) for line in lines]
        assert [r["content"] for r in replies if r["type"] == "reply"] == ["answered"]
    finally:  # the killed runner's child outlives it (its own session): end it here
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(orphan), signal.SIGKILL)


def _asking(procs: Processes, home: Path) -> subprocess.Popen[bytes]:
    asker = subprocess.Popen(
        [sys.executable, "-m", "ralph_mail", "ask", "worker-1", "now?", "--timeout", "60",
         "--team", "demo", "--agent", "lead"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(home),
    )  # fmt: skip
    procs.started.append(asker)
    return asker


def test_ctrl_c_lets_the_running_job_answer_then_stops(
    team: Team, procs: Processes, tmp_path: Path
) -> None:
    """Ctrl-C while a job runs: the job's answer is still sent, then the runner exits 0
    (the interrupt is a flag its loop looks at, not an exception raised mid-job)."""
    script, said, let_go = held_job(tmp_path, "answered")
    try:
        child = runner(procs, team.home, "worker-1", script)
        asker = _asking(procs, team.home)
        assert readable(said, BOUND_S)  # the job runs
        child.send_signal(signal.SIGINT)
        os.write(let_go, b"go\n")
        out, err = asker.communicate(timeout=BOUND_S)
        assert asker.returncode == 0 and out == b"answered\n", err
        assert child.wait(timeout=BOUND_S) == 0
    finally:
        os.close(said)
        os.close(let_go)


def test_a_second_ctrl_c_stops_the_runner_at_once(
    team: Team, procs: Processes, tmp_path: Path
) -> None:
    """A second Ctrl-C stops the runner with its job still running (exit 130): the
    request is not consumed, and the runner started again answers it."""
    script, said, let_go = held_job(tmp_path, "answered")
    try:
        child = runner(procs, team.home, "worker-1", script)
        asker = _asking(procs, team.home)
        assert readable(said, BOUND_S)  # the job runs, and is not let go yet
        assert signal_until_ended(child, signal.SIGINT) == 130 and asker.poll() is None
        os.read(said, 64)
        os.write(let_go, b"go\n")  # the first job ends; its answer has nobody to send it
        runner(procs, team.home, "worker-1", script)
        assert readable(said, BOUND_S)  # the new runner's job runs
        os.write(let_go, b"go\n")
        out, err = asker.communicate(timeout=BOUND_S)
        assert asker.returncode == 0 and out == b"answered\n", err
    finally:
        os.close(said)
        os.close(let_go)


def test_a_flooding_or_garbled_child_gives_one_bounded_message(
    team: Team, procs: Processes
) -> None:
    """A child writing 100 MiB: the reply is cut at the message limit, with a note, and
    the runner goes on; invalid UTF-8 is replaced, never an error."""
    runner(procs, team.home, "worker-1",
           "head -c 104857600 /dev/zero | tr '\\0' x; printf '\\377\\376 end'")  # fmt: skip
    done = ask(team.home, "worker-1", "everything?")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(b"xxxx")
    assert b"[output cut at " in done.stdout and len(done.stdout) < 1_100_000
    runner(procs, team.home, "worker-2", "printf 'caf\\351 \\377'")
    garbled = ask(team.home, "worker-2", "bytes?")
    assert garbled.returncode == 0 and garbled.stdout == "caf\ufffd \ufffd\n".encode()


def test_a_runner_signs_and_its_child_never_sees_the_key(
    team: Team, procs: Processes, tmp_path: Path
) -> None:
    """worker-1 has a key: the runner reads it itself and signs the reply (verified by
    the lead); the child's environment and stdin hold no part of the private key."""
    made = ralph(team.home, "keys", "create", "--team", "demo", "--agent", "worker-1")
    assert made.returncode == 0, made.stderr
    pem = (team.home / "keys" / "demo" / "worker-1.key").read_text()
    secret = "".join(pem.splitlines()[1:-1])  # the base64 body of the PEM
    seen = tmp_path / "seen.txt"
    runner(procs, team.home, "worker-1", f"{{ env; cat; }} > {seen}; echo signed answer")
    done = ask(team.home, "worker-1", "who are you?")
    assert done.stdout == b"signed answer\n", done.stderr
    exposed = seen.read_text()
    assert "RALPH_AGENT=worker-1" in exposed  # (what was dumped: the child's environment)
    assert secret not in exposed and secret[:16] not in exposed and "PRIVATE KEY" not in exposed
    with MessageBus("demo", "lead") as lead:
        (reply,) = [m for m in lead.history("worker-1") if m.type == "reply"]
        assert reply.verified is True and reply.content == "signed answer"
