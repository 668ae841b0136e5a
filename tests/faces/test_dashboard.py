"""`ralph-mail top`: the dashboard, driven with Textual's Pilot; snapshots of its main
screens as text (times masked), compared with the ones kept in tests/faces/snapshots."""

from __future__ import annotations

import asyncio
import io
import os
import re
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from rich.console import Console
from textual.pilot import Pilot
from textual.widgets import DataTable, Static

from ralph_mail import MessageBus, create_team
from ralph_mail.dashboard import Dashboard, Help, doing, fold, layout_for
from ralph_mail.orchestrator.records import AgentProgress
from ralph_mail.talk.tasks import Task
from tests.helpers import REPO
from tests.helpers.processes import BOUND_S, cli_env, ralph

SNAPSHOTS = Path(__file__).with_name("snapshots")


def screen_text(app: Dashboard) -> str:
    """What the screen shows, as plain text."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), record=True)
    console.print(app.screen._compositor.render_update(
        full=True, screen_stack=app._background_screens))  # fmt: skip
    return console.export_text()


def studio(home: Path) -> None:
    """A small team with a channel, a task and both kinds of messages."""
    create_team("studio", ["lead", ("writer", "drafts posts"), "analyst"], home=home)
    lead, writer = MessageBus("studio", "lead", home), MessageBus("studio", "writer", home)
    writer.set_presence("working")
    lead.channels.create("standup", ["writer"])
    lead.send("writer", "text", "draft the Q4 post", visibility="user_visible")
    writer.send("lead", "text", "which numbers?")
    writer.send("lead", "text", "found them")
    writer.send("lead", "text", "the post is up", visibility="user_visible")
    lead.delegate("writer", "Write the Q4 post", id="T-1")
    lead.close()
    writer.close()


def drive(
    home: Path, size: tuple[int, int], body: Callable[[Dashboard, Pilot[None]], Awaitable[None]]
) -> None:
    async def main() -> None:
        app = Dashboard("studio", str(home))
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            await body(app, pilot)

    asyncio.run(main())


async def titled(pilot: Pilot[None], app: Dashboard, title: str) -> None:
    """Pause until the conversation pane's title is ``title`` (BOUND_S at most)."""
    deadline = time.monotonic() + BOUND_S
    while str(app.query_one("#title", Static).content).strip() != title:
        assert time.monotonic() < deadline, f"never titled {title!r}"
        await pilot.pause(0.02)


async def until(pilot: Pilot[None], app: Dashboard, seen: str) -> str:
    """Pause until the screen shows ``seen`` (BOUND_S at most); the screen."""
    deadline = time.monotonic() + BOUND_S
    while seen not in (shown := screen_text(app)):
        assert time.monotonic() < deadline, f"never showed {seen!r}:\n{shown}"
        await pilot.pause(0.02)
    return shown


def test_internal_messages_fold_between_user_visible_ones() -> None:
    """Runs of internal messages fold into their count; with internal, all show."""
    from ralph_mail.message import Message

    def message(n: int, visibility: str) -> Message:
        return Message(f"{n:012x}", "a", "b", "text", str(n), {}, "", None, "normal", False,
                       visibility, ())  # type: ignore[arg-type]  # fmt: skip

    messages = [message(0, "user_visible"), message(1, "internal"), message(2, "internal"),
                message(3, "user_redacted"), message(4, "internal")]  # fmt: skip
    assert [x if isinstance(x, int) else x.content for x in fold(messages, False)] == [
        "0", 2, "3", 1]  # fmt: skip
    assert fold(messages, True) == messages


def test_keys_open_toggle_search_and_help(home: Path) -> None:
    """enter opens the selected row; i unfolds; tab moves focus; / searches; ? helps; q
    quits."""
    studio(home)

    async def body(app: Dashboard, pilot: Pilot[None]) -> None:
        shown = await until(pilot, app, "inbox of lead")
        assert "Internal agent messages (2)" in shown and "the post is up" in shown
        assert "which numbers?" not in shown
        await pilot.press("i")
        assert "which numbers?" in await until(pilot, app, "i: fold")
        await pilot.press("down", "enter")  # the writer's row
        await until(pilot, app, "inbox of writer")
        await pilot.press("down", "down", "down", "enter")  # the channel
        await titled(pilot, app, "#standup")
        focused = app.focused
        await pilot.press("tab")
        assert app.focused is not focused and app.focused is not None
        await pilot.press("enter")  # the task: its thread
        await until(pilot, app, "task thread T-1")
        await pilot.press("slash")
        await pilot.press(*"numbers", "enter")
        assert "which numbers?" in await until(pilot, app, "search: numbers")
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, Help) and "/        search" in screen_text(app)
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, Help)
        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running

    drive(home, (100, 30), body)


def test_it_follows_a_send_from_another_process_and_moves_no_cursor(home: Path) -> None:
    """A message sent by another process shows without a key pressed; the roster's
    unread count goes up; no cursor file changes while the dashboard runs."""
    studio(home)
    cursors = home / "teams" / "studio" / "cursors"
    before = {p.name: p.read_bytes() for p in cursors.iterdir()}

    async def body(app: Dashboard, pilot: Pilot[None]) -> None:
        await until(pilot, app, "inbox of lead")
        done = await asyncio.to_thread(ralph, home, "send", "lead", "live from outside",
                                       "--visibility", "user_visible", "--team", "studio",
                                       "--agent", "analyst")  # fmt: skip
        assert done.returncode == 0, done.stderr
        shown = await until(pilot, app, "live from outside")
        assert re.search(r"lead\s+\S+\s+0s\s+4\s", shown), shown  # 3 unread before, 4 now

    drive(home, (120, 30), body)
    assert {p.name: p.read_bytes() for p in cursors.iterdir()} == before


def masked(text: str) -> str:
    """The screen with what changes from run to run masked: digits, and the status line
    after the team's name (the home, a temporary path of varying length)."""
    return re.sub(r"(?m)^( studio · ).*$", r"\1HOME", re.sub(r"\d", "9", text))


def test_snapshots_of_the_main_screen(home: Path) -> None:
    """The main screen at 80x24 and 120x40 as tests/faces/snapshots keep it (times, ids and
    the home masked). RALPH_UPDATE_SNAPSHOTS=1 writes them again."""
    studio(home)
    for width, height in ((80, 24), (120, 40)):
        kept = SNAPSHOTS / f"top_{width}x{height}.txt"

        async def body(app: Dashboard, pilot: Pilot[None], kept: Path = kept) -> None:
            shown = await until(pilot, app, "inbox of lead")
            text = masked(shown)
            if os.environ.get("RALPH_UPDATE_SNAPSHOTS"):
                SNAPSHOTS.mkdir(exist_ok=True)
                kept.write_text(text)
            assert text == kept.read_text(), f"{kept} differs:\n{text}"

        drive(home, (width, height), body)


def test_without_the_tui_extra_one_line_says_how_to_install(home: Path, tmp_path: Path) -> None:
    """A Python without Textual: one line naming the extra, exit 2."""
    create_team("studio", ["lead"], home=home)
    hidden = tmp_path / "hide"
    (hidden / "textual").mkdir(parents=True)
    (hidden / "textual" / "__init__.py").write_text("raise ImportError('no textual here')\n")
    env = cli_env(home, PYTHONPATH=str(hidden))
    done = subprocess.run([sys.executable, "-m", "ralph_mail", "top", "--team", "studio"],
                          env=env, capture_output=True, timeout=BOUND_S)  # fmt: skip
    assert done.returncode == 2 and done.stderr.count(b"\n") == 1, done.stderr
    assert b"pip install 'ralph_mail[tui]'" in done.stderr


def test_the_readme_screenshot_is_made_by_its_script(tmp_path: Path) -> None:
    """docs/screenshot.py (which made docs/top.svg) still runs, in a home of its own."""
    script = REPO / "docs" / "screenshot.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                          timeout=BOUND_S, env=cli_env(tmp_path / "unused"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert b"T-1.1 Check the Q4 numbers" in done.stdout
    assert (tmp_path / "top.svg").read_text().startswith("<svg")


def test_a_roster_change_shows_without_a_restart(home: Path) -> None:
    """A member's new description (team set, from anywhere) shows within the second."""
    from ralph_mail.team import update_team

    studio(home)

    async def body(app: Dashboard, pilot: Pilot[None]) -> None:
        await until(pilot, app, "drafts posts")
        await asyncio.to_thread(update_team, "studio", home, member="analyst",
                                description="reads the numbers")  # fmt: skip
        await until(pilot, app, "reads the numbers")

    drive(home, (120, 30), body)


def finished_work(home: Path) -> None:
    """The studio with no lead running: the analyst completed T-2, the writer has T-1
    submitted."""
    studio(home)
    lead, analyst = MessageBus("studio", "lead", home), MessageBus("studio", "analyst", home)
    analyst.set_presence("idle")
    lead.delegate("analyst", "Check the numbers", id="T-2")
    analyst.poll()
    analyst.complete("T-2", "revenue up 14%")
    lead.close()
    analyst.close()


def whole(table: DataTable[object]) -> None:
    """Every column of ``table`` in view (no sideways scrolling), each header and cell no
    wider than its column."""
    assert table.virtual_size.width <= table.size.width, (table.id, table.virtual_size)
    for key, column in table.columns.items():
        assert len(column.label.plain) <= column.width, (table.id, column.label)
        for cell in table.get_column(key):
            assert len(str(cell)) <= column.width, (table.id, column.label, cell)


def test_at_80x24_every_column_and_status_is_whole(home: Path) -> None:
    """At 80x24 no table scrolls sideways; every header and the statuses "completed" and
    "submitted" show whole, in the task tree and the roster."""
    finished_work(home)

    async def body(app: Dashboard, pilot: Pilot[None]) -> None:
        shown = await until(pilot, app, "completed")
        roster, tree = app.query_one("#roster", DataTable), app.query_one("#tasks", DataTable)
        whole(roster)
        whole(tree)
        assert [str(c.label) for c in roster.columns.values()] == [
            "agent", "presence", "state", "task", "prog", "seen", "unread", "does"]  # fmt: skip
        assert [str(c.label) for c in tree.columns.values()] == ["task", "status", "assignee"]
        assert tree.get_row("task:T-1")[1:] == ["submitted", "writer"]
        assert tree.get_row("task:T-2")[1:] == ["completed", "analyst"]
        assert roster.get_row("agent:analyst")[2:5] == ["completed", "T-2", "████"]
        header = next(line for line in shown.splitlines() if "presence" in line)
        assert header.split() == ["agent", "presence", "state", "task", "prog", "seen",
                                  "unread", "does"]  # fmt: skip
        assert re.search(r"T-2 Check the numbers\s+completed\s+analyst", shown), shown

    drive(home, (80, 24), body)


def test_from_120_columns_the_layout_widens(home: Path) -> None:
    """Grown from 80 to 120x40: wider names, tasks and descriptions, a 10-cell progress
    bar, and the time each task finished."""
    finished_work(home)

    async def body(app: Dashboard, pilot: Pilot[None]) -> None:
        await until(pilot, app, "completed")
        narrow = dict(app._layout.roster)
        await pilot.resize_terminal(120, 40)
        shown = await until(pilot, app, "progress")
        roster, tree = app.query_one("#roster", DataTable), app.query_one("#tasks", DataTable)
        whole(roster)
        whole(tree)
        wide = {str(c.label): c.width for c in roster.columns.values()}
        assert wide["does"] > narrow["does"] and wide["task"] > narrow["task"]
        assert wide["agent"] > narrow["agent"] and wide["progress"] == 10
        assert roster.get_row("agent:analyst")[4] == "█" * 10
        assert [str(c.label) for c in tree.columns.values()][-2:] == ["done", "cost"]
        assert re.search(r"T-2 Check the numbers\s+completed\s+analyst\s+\d\d:\d\d", shown)

    drive(home, (80, 24), body)


def test_without_a_lead_the_roster_shows_each_members_task(home: Path) -> None:
    """No lead has run: state, task and progress come from the team's task log (the
    analyst completed T-2, the writer has T-1 submitted), presence from presence."""
    finished_work(home)

    async def body(app: Dashboard, pilot: Pilot[None]) -> None:
        shown = await until(pilot, app, "completed")
        assert re.search(r"analyst\s+\w+\s+completed\s+T-2\s+████", shown), shown
        assert re.search(r"writer\s+working\s+submitted\s+T-1\s+░░░░", shown), shown

    drive(home, (80, 24), body)


def test_the_leads_record_wins_when_it_heard_later() -> None:
    """A status the lead recorded after the task last changed is shown; an older one is
    not."""
    task = Task("T-1", "d", "lead", "w", None, "normal", "working", "", "2025-01-01T00:00:00Z",
                "2025-01-01T00:00:05Z", "m")  # fmt: skip
    later = AgentProgress("w", "blocked", "T-1", 0.5, last_seen="2025-01-01T00:00:09Z")
    earlier = AgentProgress("w", "working", "T-0", 0.1, last_seen="2025-01-01T00:00:01Z")
    assert doing(task, later, {}) == ("blocked", "T-1", 0.5)
    assert doing(task, earlier, {}) == ("working", "T-1", None)
    assert doing(None, None, {}) == ("", "", None)


def test_a_folded_conversation_says_how_to_unfold_it(home: Path) -> None:
    """With internal messages folded, a line under the conversation says how many and
    that i shows them; unfolded, it goes."""
    studio(home)
    hint = "2 internal messages folded: press i to show"

    async def body(app: Dashboard, pilot: Pilot[None]) -> None:
        await until(pilot, app, hint)
        await pilot.press("i")
        assert hint not in await until(pilot, app, "which numbers?")

    drive(home, (120, 30), body)
    assert layout_for(80).tasks_pane + 20 <= 80  # the hint's pane keeps some width at 80


def test_top_shows_what_each_subtree_cost_and_follows_new_costs(home: Path) -> None:
    """From 120 columns the task tree has a cost column: each task's subtree; a job
    recorded while top runs shows without a key pressed."""
    from ralph_mail import usage

    studio(home)
    lead = MessageBus("studio", "lead", home)
    part = lead.delegate("writer", "Find the numbers", parent="T-1")

    def job(task: str, cost: float) -> None:
        entry = usage.Record(usage.now_ts(), "writer", usage.Usage(cost_usd=cost), "delegate",
                             task=task)  # fmt: skip
        usage.record(lead.store, entry)

    job("T-1", 0.5)
    job(part.id, 0.25)

    async def body(app: Dashboard, pilot: Pilot[None]) -> None:
        await until(pilot, app, "$0.75")
        tree = app.query_one("#tasks", DataTable)
        assert tree.get_row(f"task:{part.id}")[-1] == "$0.25"
        job(part.id, 0.25)
        await until(pilot, app, "$1.00")
        assert tree.get_row("task:T-1")[-1] == "$1.00"
        assert tree.get_row(f"task:{part.id}")[-1] == "$0.50"

    drive(home, (120, 40), body)
    lead.close()


def test_a_bad_signature_is_marked_in_the_conversation(home: Path) -> None:
    """writer signs; its line edited on disk shows BAD-SIGNATURE beside its type in the
    pane, its untouched one no mark."""
    from ralph_mail.govern import keys

    create_team("studio", ["lead", "writer"], home=home)
    with MessageBus("studio", "writer", home) as writer:
        keys.create(writer)
        writer.send("lead", "text", "pay 10", visibility="user_visible")
        writer.send("lead", "text", "all good", visibility="user_visible")
    inbox = home / "teams" / "studio" / "mailbox" / "lead.jsonl"
    inbox.write_bytes(inbox.read_bytes().replace(b"pay 10", b"pay 99"))

    async def body(app: Dashboard, pilot: Pilot[None]) -> None:
        shown = await until(pilot, app, "all good")
        assert "pay 99" in shown  # of the two signed lines, only the edited one is marked
        assert shown.count("BAD-SIGNATURE") == 1 and "unsigned" not in shown, shown

    drive(home, (120, 30), body)
