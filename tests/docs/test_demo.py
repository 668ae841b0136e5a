"""`ralph-mail demo`, the README's first command: a whole team, start to end, in seconds."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from ralph_mail import MessageType, list_teams
from ralph_mail.store.files import FileStore
from tests.helpers.protocol_helpers import (  # noqa: F401
    BOUND_S,
    Child,
    Children,
    children_fixture,
    close_buses,
    ralph_env,
    session_processes,
)


def start_demo(children: Children, tmp_path: Path, *args: str) -> Child:
    """`ralph-mail demo ARGS`, piped, with its temporary home under tmp_path."""
    env = ralph_env(tmp_path / "unused-home", TMPDIR=str(tmp_path))
    script = Path(sys.executable).parent / "ralph-mail"  # the installed console script
    return children.start([str(script), "demo", *args], env)


def test_demo_runs_the_whole_story_and_exits_0(tmp_path: Path, children: Children) -> None:
    """demo: tasks, one plan rejected then approved, progress, shutdown accepted; exit 0."""
    demo = start_demo(children, tmp_path)
    assert demo.finish(timeout=BOUND_S) == 0, demo.stderr_text()
    out = demo.output
    assert "worker-2 plan_rejected T-2: rejected: add a step that tests the result" in out
    assert out.index("worker-2 plan_rejected") < out.index("worker-2 plan_approved")
    for worker in ("worker-1", "worker-2", "worker-3"):
        assert f"{worker} status working" in out and "50%" in out
        assert f"{worker} status done" in out
        assert f"{worker} shutdown_accepted" in out
    assert "shutdown: worker-1 accepted, worker-2 accepted, worker-3 accepted" in out
    assert out.endswith("demo done: every task approved and finished, every worker shut down")


def test_demo_shows_an_ask_and_a_delegation_coming_back(tmp_path: Path, children: Children) -> None:
    """demo: worker-2 asks worker-1 and reports the reply; worker-3 delegates T-3.1 to
    worker-1 and reports its result; the lead sees task_completed; the tree is drawn."""
    demo = start_demo(children, tmp_path, "--delay", "0")
    assert demo.finish(timeout=BOUND_S) == 0, demo.stderr_text()
    out = demo.output
    assert (
        "worker-2 status working T-2 25% asked worker-1 'how many log lines could not be "
        "parsed?': 3 of 2,000: truncated lines at the rotation boundary"
    ) in out
    assert "worker-3 status working T-3 25% delegated T-3.1 to worker-1" in out
    assert "worker-1 status done T-3.1 100% 1,204 orders" in out
    assert "T-3.1 came back from worker-1: 1,204 orders" in out
    assert out.index("delegated T-3.1") < out.index("came back from worker-1")
    for task in ("T-1", "T-2", "T-3"):
        assert f"task_completed {task}: {task} finished" in out
    tree = out[out.index("the team's task tree") :].splitlines()
    assert tree[1].startswith("T-1  parse the web server logs")
    assert tree[4].startswith("└── T-3.1  count the orders in the database dump")
    assert all(line.split()[-2] == "completed" for line in tree[1:5])


def test_demo_leaves_no_process_and_no_files(tmp_path: Path, children: Children) -> None:
    """After the demo, no process of its session is left and its temporary home is gone."""
    demo = start_demo(children, tmp_path, "--delay", "0")
    assert demo.finish(timeout=BOUND_S) == 0, demo.stderr_text()
    assert session_processes(demo.popen.pid) == []
    assert list(tmp_path.iterdir()) == []


def test_demo_with_home_keeps_the_mail_under_a_free_name(
    tmp_path: Path, children: Children
) -> None:
    """demo --home keeps the team's mail there; a second run picks demo-2."""
    home = tmp_path / "mail"
    for _ in range(2):
        demo = start_demo(children, tmp_path, "--home", str(home), "--delay", "0")
        assert demo.finish(timeout=BOUND_S) == 0, demo.stderr_text()
    assert f"ralph-mail tail --all --home {home} --team demo-2" in demo.output
    assert [team.name for team in list_teams(home)] == ["demo", "demo-2"]
    files = FileStore(home, "demo")
    try:
        lines, _ = files.read_tail("worker-2", 100)
    finally:
        files.close()
    assert any(MessageType.PLAN_APPROVAL.value.encode() in line for line in lines)


def test_demo_stops_cleanly_on_ctrl_c(tmp_path: Path, children: Children) -> None:
    """Ctrl-C (SIGINT to the whole group) mid-run: exit 130, no process, no files left."""
    demo = start_demo(children, tmp_path, "--delay", "30")
    demo.expect("status working")  # the lead is running and a worker is working
    os.killpg(demo.popen.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
    assert demo.finish(timeout=BOUND_S) == 130
    assert "Traceback" not in demo.stderr_text()
    assert session_processes(demo.popen.pid) == []
    assert list(tmp_path.iterdir()) == []


def test_demo_sent_sigterm_leaves_nothing_behind(tmp_path: Path, children: Children) -> None:
    """SIGTERM to the demo alone (not its group) mid-run: it stops its lead and workers,
    removes its temporary home and exits 143; no process of it is left."""
    demo = start_demo(children, tmp_path, "--delay", "30")
    demo.expect("status working")
    demo.popen.send_signal(signal.SIGTERM)
    assert demo.finish(timeout=BOUND_S) == 143
    assert "Traceback" not in demo.stderr_text()
    assert session_processes(demo.popen.pid) == []
    assert list(tmp_path.iterdir()) == []
