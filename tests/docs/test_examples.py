"""Every example in examples/ runs to its end, in seconds, and leaves no process behind."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import REPO
from tests.helpers.protocol_helpers import (  # noqa: F401
    BOUND_S,
    Children,
    children_fixture,
    close_buses,
    ralph_env,
    session_processes,
)


def check_team_run(child_output: str) -> None:
    """The common story of both example teams, as the lead printed it."""
    assert "worker-2 plan_rejected: T-2: rejected: add a step that tests the result" in child_output
    for worker in ("worker-1", "worker-2", "worker-3"):
        assert f"{worker} plan_approved" in child_output
        assert f"{worker} status: done" in child_output
        assert f"{worker} shutdown_accepted" in child_output
    assert "accepted: worker-1, worker-2, worker-3; refused: -; no answer: -" in child_output


def run_example(command: str, tmp_path: Path, children: Children) -> str:
    """Run ``command`` as docs/lead.md shows it (from the clone, the venv first on PATH)."""
    env = ralph_env(tmp_path / "unused-home", TMPDIR=str(tmp_path))
    run = children.start(["bash", "-c", command], env, cwd=REPO)
    assert run.finish(timeout=BOUND_S) == 0, run.output + run.stderr_text()
    assert session_processes(run.popen.pid) == [], "a process of the team was left running"
    assert list(tmp_path.iterdir()) == [], "the launcher removes its mailbox home"
    return run.output


def test_shell_team_example(tmp_path: Path, children: Children) -> None:
    """examples/shell_team/run.sh: bash workers and the Python lead finish and leave nothing."""
    check_team_run(run_example("bash examples/shell_team/run.sh", tmp_path, children))


def test_python_team_example(tmp_path: Path, children: Children) -> None:
    """examples/python_team/run.py: TeamAgent workers and the lead finish and leave nothing."""
    check_team_run(run_example("python examples/python_team/run.py", tmp_path, children))


def test_docs_show_exactly_these_example_commands() -> None:
    """The example commands of docs/lead.md are the ones run here."""
    page = (REPO / "docs" / "lead.md").read_text()
    assert "bash examples/shell_team/run.sh\npython examples/python_team/run.py\n" in page
    assert "bash examples/conversation/run.sh\npython examples/conversation/team.py\n" in page
    assert "bash examples/llm_team/run.sh\n" in page


def test_conversation_examples(tmp_path: Path, children: Children) -> None:
    """examples/conversation: in bash and in Python, the coordinator's question is
    answered and its delegated draft comes back completed."""
    for command in ("bash examples/conversation/run.sh", "python examples/conversation/team.py"):
        out = run_example(command, tmp_path, children)
        assert "analyst says: Q4 revenue was $2.4M" in out
        assert "writer says: Saved as 'Q4 Blog Post Draft'" in out


def test_llm_team_example(tmp_path: Path, children: Children) -> None:
    """examples/llm_team: commands behind ralph-mail run answer a nested ask (the analyst
    asks the data agent first, chain coordinator), a delegation, and a standup post that
    mentions three of them, in turn, each seeing the answers before it; nothing is left."""
    out = run_example("bash examples/llm_team/run.sh", tmp_path, children)
    assert (
        "analyst says: Q4 revenue grew 14% to 2.4M (revenue Q4: 2.4M (Q3: 2.1M); chain coordinator)"
    ) in out
    assert "writer says: Draft saved: 'Draft the Q4 update' in 3 paragraphs" in out
    assert "T-1  Draft the Q4 update  writer  completed" in out
    standup = [line for line in out.splitlines() if "-> #standup" in line]
    assert [line.split()[1] for line in standup] == ["coordinator", "writer", "analyst", "data"]
    assert "drafting the Q4 update (after: no one)" in standup[1]
    assert "checking the Q4 numbers (after: writer)" in standup[2]
    assert "idle: ask me for numbers (after: writer, analyst)" in standup[3]


def test_two_hosts_example(tmp_path: Path, children: Children) -> None:
    """examples/two_hosts: two homes on two clustered nats-server nodes (started by the
    script), every agent with its own credentials and signing key: the lead's ask and
    delegation are answered by runners in the other home, signed both ways, and what the
    policy forbids is refused (exit 4), a login passing for the lead included."""
    out = run_example("bash examples/two_hosts/run.sh", tmp_path, children)
    assert "healthy" in out
    assert "analyst says: Q4 revenue: 2.4M (asked: How did Q4 go?)" in out
    assert 'writer says: draft of "the Q4 update" saved on' in out
    assert "T-1  the Q4 update  writer  completed" in out
    assert "lead -> analyst [request] How did Q4 go?" in out  # the history, unmarked:
    assert "analyst -> lead [reply] Q4 revenue" in out  # each line's signature verified
    assert "BAD-SIGNATURE" not in out and "unsigned" not in out
    assert "writer to analyst: exit 4" in out
    assert "writer as lead: exit 4" in out
