"""Conversations and discovery from the command line, with real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson

from ralph_mail import MessageBus, Team, load_team
from tests.helpers.processes import BOUND_S, Processes, cli_env, ralph

LEAD = ("--team", "demo", "--agent", "lead")
W1 = ("--team", "demo", "--agent", "worker-1")

REPLIER = """
set -e
ralph-mail presence idle
echo ready
request=$(ralph-mail wait --type request --timeout 60 --json)
field() {
  printf '%s' "$request" | python3 -c "import json,sys; print(json.load(sys.stdin)['$1'])"
}
ralph-mail reply "$(field id)" "answer to $(field content)"
"""


def bash(home: Path, script: str, procs: Processes, agent: str) -> subprocess.Popen[bytes]:
    env = cli_env(home, RALPH_TEAM="demo", RALPH_AGENT=agent)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    proc = subprocess.Popen(
        ["bash", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    procs.started.append(proc)
    return proc


def test_ask_is_answered_by_a_shell_teammate(team: Team, procs: Processes) -> None:
    """ralph-mail ask blocks until a bash teammate (wait --type request, reply) answers;
    the answer is printed and the exit code is 0."""
    replier = bash(team.home, REPLIER, procs, "worker-1")
    assert replier.stdout is not None and replier.stdout.readline() == b"ready\n"
    done = ralph(team.home, "ask", "worker-1", "what is 6x7?", "--timeout", "60", *LEAD)
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"answer to what is 6x7?\n"
    assert replier.wait(timeout=BOUND_S) == 0


def test_ask_with_no_answer_exits_1_and_offline_exits_4(team: Team) -> None:
    """No reply in time: exit 1; an offline teammate: exit 4 (refused), nothing sent."""
    assert ralph(team.home, "ask", "worker-1", "anyone?", *LEAD).returncode == 4
    assert MessageBus("demo", "worker-1").store.size("worker-1") == 0
    MessageBus("demo", "worker-1").set_presence("working")
    done = ralph(team.home, "ask", "worker-1", "anyone?", "--timeout", "0.1", *LEAD)
    assert done.returncode == 1 and b"did not answer within 0.1 s" in done.stderr


def test_a_request_too_deep_exits_4(team: Team) -> None:
    """An ask from a process whose RALPH_CHAIN is already max_depth long: exit 4."""
    MessageBus("demo", "worker-1").set_presence("working")
    done = ralph(team.home, "ask", "worker-1", "deeper?", *LEAD, RALPH_CHAIN="a,b,c")
    assert done.returncode == 4 and b"maximum agent communication depth (3)" in done.stderr


def test_reply_with_error_makes_ask_exit_3(team: Team, procs: Processes) -> None:
    """A reply sent with --error makes the asker print the error and exit 3."""
    script = REPLIER.replace("ralph-mail reply ", "ralph-mail reply --error ")
    replier = bash(team.home, script, procs, "worker-1")
    assert replier.stdout is not None and replier.stdout.readline() == b"ready\n"
    done = ralph(team.home, "ask", "worker-1", "fail?", "--timeout", "60", *LEAD)
    assert done.returncode == 3 and b"reports an error" in done.stderr


def test_history_and_thread_from_the_command_line(team: Team) -> None:
    """history shows both directions oldest first; thread shows a request and its reply."""
    lead, worker = MessageBus("demo", "lead"), MessageBus("demo", "worker-1")
    question = lead.send("worker-1", "request", "why?")
    worker.reply(question, "because")
    out = ralph(team.home, "history", "worker-1", "--json", *LEAD).stdout
    assert [orjson.loads(line)["content"] for line in out.splitlines()] == ["why?", "because"]
    out = ralph(team.home, "thread", question.id, "--json", *LEAD).stdout
    assert [orjson.loads(line)["type"] for line in out.splitlines()] == ["request", "reply"]


def test_send_flags_ack_and_the_acks_watchdog(team: Team) -> None:
    """send --ack --priority high --visibility user_visible sets the keys; acks lists it
    and --overdue 0 exits 3 until the recipient acks it with 'ralph-mail ack'."""
    sent = ralph(team.home, "send", "lead", "confirm", "--ack", "--priority", "high",
                 "--visibility", "user_visible", "--json", *W1)  # fmt: skip
    envelope = orjson.loads(sent.stdout)
    assert (envelope["ack"], envelope["priority"], envelope["visibility"]) == (
        True, "high", "user_visible"
    )  # fmt: skip
    assert ralph(team.home, "acks", "--overdue", "0", *W1).returncode == 3
    assert ralph(team.home, "ack", envelope["id"], *LEAD).returncode == 0
    done = ralph(team.home, "acks", "--overdue", "0", *W1)
    assert done.returncode == 0 and done.stdout == b""


def test_bad_conversation_values_are_refused(team: Team) -> None:
    """Bad priority, visibility, thread id and chain names: one line, exit 2."""
    for args, env in (
        (("send", "lead", "x", "--priority", "asap"), {}),
        (("send", "lead", "x", "--visibility", "public"), {}),
        (("send", "lead", "x", "--thread", "nope"), {}),
        (("ask", "lead", "x"), {"RALPH_CHAIN": "../evil"}),
        (("presence", "napping"), {}),
    ):
        done = ralph(team.home, *args, *W1, **env)
        assert done.returncode == 2 and done.stderr.count(b"\n") == 1, (args, done.stderr)
    assert MessageBus("demo", "lead").peek() == []


def test_agents_presence_and_team_edits(team: Team) -> None:
    """team set and team config change the roster; agents and presence show the team."""
    assert ralph(team.home, "team", "set", "demo", "worker-1", "--agent", "lead",
                 "--manager", "lead", "--mode", "supervised").returncode == 0  # fmt: skip
    assert (
        ralph(team.home, "team", "config", "demo", "max_depth", "5", "--agent", "lead").returncode
        == 0
    )
    assert load_team("demo").config == {"max_depth": "5"}
    assert ralph(team.home, "presence", "working", *W1).returncode == 0
    out = ralph(team.home, "agents", "--json", *LEAD).stdout
    found = {r["name"]: r for r in map(orjson.loads, out.splitlines())}
    assert found["worker-1"]["presence"] == "working" and found["worker-1"]["manager"] == "lead"
    assert found["worker-2"]["presence"] == "offline"
    assert (
        ralph(
            team.home, "team", "set", "demo", "worker-1", "--mode", "chaos", "--agent", "lead"
        ).returncode
        == 2
    )


WORKER = """
set -e
ralph-mail presence idle
echo ready
assignment=$(ralph-mail wait --type task_assignment --timeout 60 --json)
task=$(printf '%s' "$assignment" |
  python3 -c "import json,sys; print(json.load(sys.stdin)['metadata']['taskId'])")
ralph-mail task start "$task"
ralph-mail task VERB "$task" "RESULT"
"""


def test_delegate_wait_gets_the_result_from_a_shell_worker(team: Team, procs: Processes) -> None:
    """delegate --wait blocks until a bash worker runs 'task done'; it prints the result,
    exits 0, and the tree shows the task completed."""
    worker = bash(team.home, WORKER.replace("VERB", "done").replace("RESULT", "drafted"),
                  procs, "worker-1")  # fmt: skip
    assert worker.stdout is not None and worker.stdout.readline() == b"ready\n"
    done = ralph(
        team.home, "delegate", "worker-1", "draft it", "--id", "T-9", "--wait", "60", *LEAD
    )
    assert done.returncode == 0 and done.stdout == b"drafted\n", done.stderr
    assert worker.wait(timeout=BOUND_S) == 0
    tree = ralph(team.home, "tasks", *LEAD).stdout.decode()
    assert "T-9  draft it" in tree and "worker-1" in tree and "completed" in tree


def test_a_failed_task_makes_delegate_wait_exit_3(team: Team, procs: Processes) -> None:
    """'task fail' makes the delegator's delegate --wait print the error and exit 3."""
    worker = bash(team.home, WORKER.replace("VERB", "fail").replace("RESULT", "no data"),
                  procs, "worker-1")  # fmt: skip
    assert worker.stdout is not None and worker.stdout.readline() == b"ready\n"
    done = ralph(team.home, "delegate", "worker-1", "try", "--wait", "60", *LEAD)
    assert done.returncode == 3 and done.stdout == b"no data\n"


def test_delegating_to_an_offline_agent_exits_4(team: Team) -> None:
    """delegate to an agent that is offline: exit 4, no task recorded."""
    done = ralph(team.home, "delegate", "worker-2", "anyone?", *LEAD)
    assert done.returncode == 4 and b"offline" in done.stderr
    assert ralph(team.home, "tasks", "--json", *LEAD).stdout == b""


def test_the_lead_reports_an_overdue_ack_and_refuses_a_bad_ack_overdue(team: Team) -> None:
    """ralph-mail lead --ack-overdue 0 prints an ack_overdue line for a send --ack nobody
    acknowledged; --ack-overdue -1 is refused in one line, exit 2."""
    sent = ralph(team.home, "send", "worker-1", "confirm the deadline", "--ack", *LEAD)
    assert sent.returncode == 0, sent.stderr
    message_id = sent.stdout.decode().strip()
    done = ralph(team.home, "lead", "--ack-overdue", "0", "--timeout", "1.5", "--team", "demo")
    assert done.returncode == 0, done.stderr
    line = f"worker-1 ack_overdue {message_id} not acknowledged after 0 s: confirm the deadline"
    assert line in done.stdout.decode()
    bad = ralph(team.home, "lead", "--ack-overdue", "-1", "--team", "demo")
    assert bad.returncode == 2 and bad.stderr.decode().count("\n") == 1
    assert b"--ack-overdue -1" in bad.stderr


def test_delegating_to_a_sleeping_agent_says_the_task_is_held(team: Team) -> None:
    """delegate to a sleeping agent: exit 0, the task id on stdout, one note on stderr
    saying until when it is held; tasks shows it held."""
    MessageBus("demo", "worker-1").set_presence("sleeping", until="+10m")
    done = ralph(team.home, "delegate", "worker-1", "draft it", "--id", "T-5", *LEAD)
    assert done.returncode == 0 and done.stdout == b"T-5\n"
    note = done.stderr.decode()
    assert note.startswith("ralph-mail: note: worker-1 is sleeping: the task is held until ")
    assert note.count("\n") == 1
    tree = ralph(team.home, "tasks", *LEAD).stdout.decode()
    assert "T-5  draft it  worker-1  submitted  held until " in tree
